"""The Fabric page's topology: hosts, NICs, switches and links from the fabric map, laid out in tiers.

Links are named ``{lower}-{upper}`` (``h3-leaf1r0``, ``leaf1r0-spine1``: the lab's convention, and
the one a fleet's cabling records are written in), so each link's two ends come from its name;
a link whose name does not split that way is listed on the page but not drawn. Each NIC is drawn
as a small node between its host and its link's switch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import plotly.graph_objects as go

from ridethrough.dashboards.pages_common import LEVEL_COLOURS, natural_key, styled
from ridethrough.detectors.fabric_map import RouteMap, parse_path_id

ERROR_RATE_WARN = 1e-3
"""Errors per second on a link's NICs above which the link is amber (a few an hour is background)."""


@dataclass(frozen=True, slots=True)
class Topology:
    """Node positions (x, tier) and kinds; each link's drawn ends; each NIC's link; NICs per link."""

    nodes: Mapping[str, tuple[float, int, str]]
    links: Mapping[str, tuple[str, str]]
    nic_link: Mapping[str, str]
    link_nics: Mapping[str, tuple[str, ...]]


def _ends(link: str) -> tuple[str, str] | None:
    lower, sep, upper = link.partition("-")
    return (lower, upper) if sep and lower and upper and "-" not in upper else None


def topology(fmap: RouteMap) -> Topology:
    """The drawable topology of a fabric map (tier 0 hosts, 1 NICs, 2 the switches NICs are cabled to, 3+ above).

    The map cables switch ports too (``leaf0r0/spine0``): the hosts are the ends of its path ids (the
    nodes that probe), and a link's ports, host or switch, all count towards its state.
    """
    doc = fmap.to_json()
    nic_link: dict[str, str] = doc.get("nics", {})
    hosts = ({node for pid in doc["routes"] for node in parse_path_id(pid)[0:3:2]}  # sources and destinations
             or {nic.partition("/")[0] for nic in nic_link})
    cabled = {link for nic, link in nic_link.items() if nic.partition("/")[0] in hosts}
    fabric_links = {link for routes in doc["routes"].values() for route in routes for link in route} - cabled
    tier: dict[str, int] = {}
    kind: dict[str, str] = {}
    links: dict[str, tuple[str, str]] = {}
    link_nics: dict[str, list[str]] = {}
    # A host's RDMA alias (mlx5_0) and its netdev (nic0) are one port: draw the first name of each link.
    for nic, link in sorted(nic_link.items(), key=lambda kv: natural_key(kv[0])):
        link_nics.setdefault(link, []).append(nic)
        ends = _ends(link)
        host = nic.partition("/")[0]
        if ends is None or host not in hosts or link in links:
            continue
        switch = ends[1] if ends[0] == host else ends[0]
        tier[host], kind[host] = 0, "host"
        tier[nic], kind[nic] = 1, "nic"
        tier.setdefault(switch, 2)
        kind[switch] = "switch"
        links[link] = (nic, switch)
    pending = {link: ends for link in fabric_links if (ends := _ends(link)) is not None}
    for _ in range(8):  # tiers above the leaves: each pass lifts the switches one hop further up
        for link, (a, b) in list(pending.items()):
            if a in tier or b in tier:
                low, high = (a, b) if a in tier else (b, a)
                tier.setdefault(high, tier[low] + 1)
                kind.setdefault(high, "switch")
                links[link] = (a, b)
                del pending[link]
    return Topology(_positions(tier, kind, links), links, nic_link,
                    {k: tuple(v) for k, v in link_nics.items()})


def _positions(tier: Mapping[str, int], kind: Mapping[str, str],
               links: Mapping[str, tuple[str, str]]) -> dict[str, tuple[float, int, str]]:
    hosts = sorted((n for n, t in tier.items() if t == 0), key=natural_key)
    x = {h: float(i) for i, h in enumerate(hosts)}
    for nic in (n for n, t in tier.items() if t == 1):
        host = nic.partition("/")[0]
        rails = sorted((n for n, t in tier.items() if t == 1 and n.startswith(host + "/")), key=natural_key)
        x[nic] = x.get(host, 0.0) + (rails.index(nic) - (len(rails) - 1) / 2) * 0.3
    width = max(1.0, len(hosts) - 1.0)
    below: dict[str, list[float]] = {}
    for a, b in links.values():  # the switches NICs are cabled to sit above their NICs
        if tier.get(a) == 1 and tier.get(b) == 2:
            below.setdefault(b, []).append(x[a])
    for level in sorted({t for t in tier.values() if t >= 2}):
        names = sorted((n for n, t in tier.items() if t == level), key=natural_key)
        for i, name in enumerate(names):  # above their NICs, else evenly across the width in name order
            under = below.get(name)
            x[name] = sum(under) / len(under) if level == 2 and under else width * (i + 0.5) / len(names)
    return {n: (x.get(n, 0.0), t, kind.get(n, "switch")) for n, t in tier.items()}


def figure(topo: Topology, *, link_level: Mapping[str, int], link_text: Mapping[str, str],
           node_level: Mapping[str, int]) -> go.Figure:
    """Links coloured by ``link_level`` (0 ok, 1 warning, 2 bad), nodes by ``node_level``; a click on a link's
    midpoint marker names the link (``customdata``)."""
    fig = go.Figure()
    attach: list[float | None] = []
    attach_y: list[float | None] = []
    for nic in (n for n, v in topo.nodes.items() if v[2] == "nic"):
        host = topo.nodes.get(nic.partition("/")[0])
        if host is not None:
            attach += [host[0], topo.nodes[nic][0], None]
            attach_y += [host[1], topo.nodes[nic][1], None]
    fig.add_trace(go.Scatter(x=attach, y=attach_y, mode="lines", hoverinfo="skip", showlegend=False,
                             line={"color": "#bdbdbd", "width": 1}))
    for level in (0, 1, 2):
        xs: list[float | None] = []
        ys: list[float | None] = []
        for link, (a, b) in topo.links.items():
            if link_level.get(link, 0) == level:
                xs += [topo.nodes[a][0], topo.nodes[b][0], None]
                ys += [topo.nodes[a][1], topo.nodes[b][1], None]
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", hoverinfo="skip", showlegend=False,
                                 line={"color": LEVEL_COLOURS[level], "width": 1 + level}))
    names = list(topo.links)
    mids = [((topo.nodes[a][0] + topo.nodes[b][0]) / 2, (topo.nodes[a][1] + topo.nodes[b][1]) / 2)
            for a, b in topo.links.values()]
    fig.add_trace(go.Scatter(
        x=[m[0] for m in mids], y=[m[1] for m in mids], mode="markers", customdata=names, name="links",
        text=[link_text.get(n, n) for n in names], hoverinfo="text", showlegend=False,
        marker={"size": 7, "opacity": 0.5, "color": [LEVEL_COLOURS[link_level.get(n, 0)] for n in names]}))
    for kind, size, symbol in (("host", 9, "square"), ("nic", 5, "circle"), ("switch", 13, "diamond")):
        members = [n for n, v in topo.nodes.items() if v[2] == kind]
        fig.add_trace(go.Scatter(
            x=[topo.nodes[n][0] for n in members], y=[topo.nodes[n][1] for n in members], mode="markers",
            name=kind, text=members, hoverinfo="text", customdata=members,
            marker={"size": size, "symbol": symbol, "line": {"width": 1, "color": "#333"},
                    "color": [LEVEL_COLOURS[node_level.get(n, 0)] if kind != "switch" else "#90a4ae"
                              for n in members]}))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(tickvals=[0, 1, 2, 3], ticktext=["hosts", "NICs", "leaves", "spines"], range=[-0.4, _top(topo)])
    return styled(fig, title="Topology (click a link for its history)", height=420)


def _top(topo: Topology) -> float:
    return max((v[1] for v in topo.nodes.values()), default=3) + 0.4


def link_states(topo: Topology, nics: Mapping[str, Mapping[str, float]], *, seconds: float,
                bad_links: Mapping[str, int]) -> tuple[dict[str, int], dict[str, str], dict[str, float]]:
    """Per link: level (down now or an open incident on it: 2; errors above `ERROR_RATE_WARN` or a warning
    incident: 1), hover text and error rate (errors per second over ``seconds``), from `queries.nic_state`
    rows of its NICs."""
    levels: dict[str, int] = {}
    texts: dict[str, str] = {}
    rates: dict[str, float] = {}
    for link in set(topo.link_nics) | set(topo.links):
        states: list[Any] = [nics[n] for n in topo.link_nics.get(link, ()) if n in nics]
        errors = sum(float(s.get("errors", 0.0)) for s in states)
        down = any(s.get("up", 1.0) != 1.0 for s in states)
        rates[link] = errors / seconds if seconds > 0 else 0.0
        level = 2 if down else 1 if rates[link] > ERROR_RATE_WARN else 0
        levels[link] = max(level, bad_links.get(link, 0))
        texts[link] = f"{link}: {'DOWN, ' if down else ''}{errors:g} errors ({rates[link]:.3g}/s)"
    return levels, texts, rates
