"""Fabric: the topology coloured by health, one-way delays src x dst, per-link error rates, a link's history.

Without a fabric map (``fabric_map_file``) there is no topology to draw and errors are per NIC;
clicking a NIC's bar still shows its history.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go
from dash import Dash, Input, Output, State, dcc, html
from dash import ctx as callback_ctx
from plotly.subplots import make_subplots

from ridethrough.dashboards import queries, queries_incidents
from ridethrough.dashboards.pages_common import (
    Context,
    empty_figure,
    graph,
    guarded,
    natural_key,
    status,
    styled,
    timestamps,
)
from ridethrough.dashboards.pages_fabric_graph import Topology, figure, link_states, topology
from ridethrough.detectors.contract import Severity
from ridethrough.detectors.fabric_map import RouteMap
from ridethrough.detectors.incidents import Incident
from ridethrough.exporters.store import StoreError, StoreUnavailable

PATH = "/fabric"
TITLE = "Fabric"
TOP_LINKS = 25


def layout(ctx: Context, arg: str = "") -> html.Div:
    """The page's skeleton; `register`'s callbacks fill it."""
    return html.Div([
        html.H2(TITLE), html.Div(id="fabric-status"),
        graph("fabric-topology"),
        html.Div([html.Span("one-way delay direction: "), dcc.RadioItems(
            id="fabric-direction", options=[{"label": "forward (src→dst)", "value": "forward"},
                                            {"label": "reverse (dst→src)", "value": "reverse"}],
            value="forward", inline=True)]),
        graph("fabric-owd"), graph("fabric-errors"),
        dcc.Store(id="fabric-link"), graph("fabric-link-history"),
    ])


def owd_figure(found: Sequence[dict[str, Any]], direction: str) -> go.Figure:
    """Median p50 one-way delay per (src, dst) in µs; blank where the pair is not probed."""
    if not found:
        return empty_figure("no one-way delays in this range")
    srcs = sorted({r["src"] for r in found}, key=natural_key)
    dsts = sorted({r["dst"] for r in found}, key=natural_key)
    index = {(r["src"], r["dst"]): float(r["owd_s"]) * 1e6 for r in found}
    z = [[index.get((s, d)) for d in dsts] for s in srcs]
    fig = go.Figure(go.Heatmap(z=z, x=dsts, y=srcs, colorscale="Viridis", colorbar={"title": {"text": "µs"}},
                               hovertemplate="%{y} → %{x}: %{z:.1f} µs<extra></extra>", hoverongaps=False))
    fig.update_xaxes(type="category", title="destination")
    fig.update_yaxes(type="category", title="source (prober)", autorange="reversed")
    return styled(fig, title=f"One-way delay p50, {direction}", height=520)


def errors_figure(rates: Mapping[str, float], levels: Mapping[str, int]) -> go.Figure:
    """The links (or NICs) with the highest error rates."""
    top = sorted(((r, n) for n, r in rates.items() if r > 0), reverse=True)[:TOP_LINKS]
    if not top:
        return empty_figure("no link errors in this range")
    colours = ["#c62828" if levels.get(n, 0) >= 2 else "#f9a825" if levels.get(n, 0) else "#90a4ae" for _, n in top]
    names = [n for _, n in top]
    fig = go.Figure(go.Bar(x=[r for r, _ in top], y=names, orientation="h", customdata=names,
                           marker={"color": colours}, hovertemplate="%{y}: %{x:.3g} errors/s<extra></extra>"))
    fig.update_yaxes(autorange="reversed", type="category")
    fig.update_xaxes(title="errors per second")
    return styled(fig, title=f"Error rates, top {len(top)} (click a bar for its history)",
                  height=120 + 18 * len(top))


def incident_levels(found: Sequence[Incident], topo: Topology | None) -> tuple[dict[str, int], dict[str, int]]:
    """(link → level, host → level) from open incidents: error and critical ones are red, others amber."""
    links: dict[str, int] = {}
    hosts: dict[str, int] = {}
    for i in found:
        level = 2 if i.severity >= Severity.ERROR else 1
        entity = topo.nic_link.get(i.entity, i.entity) if topo is not None else i.entity
        if i.entity_type in ("link", "nic"):
            links[entity] = max(links.get(entity, 0), level)
        elif i.entity_type in ("host", "gpu", "clock"):
            host = i.entity.partition("/")[0]
            hosts[host] = max(hosts.get(host, 0), level)
    return links, hosts


def history_figure(ctx: Context, rng: queries.TimeRange, link: str, nics: Sequence[str]) -> go.Figure:
    """A link's (or NIC's) error rate and up state over the range, per NIC."""
    nodes = sorted({n.partition("/")[0] for n in nics})
    names = sorted({n.partition("/")[2] for n in nics})
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, subplot_titles=("errors per second", "up (1) / down (0)"))
    counters = (("system.network.errors", "network.interface.name"), ("ridethrough.ib.port.errors", "ib.device"))
    for metric, key in counters:
        found = queries.series(ctx.store, rng, metric, kind="counter", keys=(key,), match={key: names}, nodes=nodes,
                               cluster=ctx.cfg.cluster)
        for (node, nic), (times, values) in found.items():
            fig.add_trace(go.Scatter(x=timestamps(times), y=values, mode="lines", name=f"{node}/{nic} errors"),
                          row=1, col=1)
    up = queries.series(ctx.store, rng, "ridethrough.nic.up", keys=("network.interface.name",), agg="min",
                        match={"network.interface.name": names}, nodes=nodes, cluster=ctx.cfg.cluster)
    for (node, nic), (times, values) in up.items():
        fig.add_trace(go.Scatter(x=timestamps(times), y=values, mode="lines", line={"shape": "hv"},
                                 name=f"{node}/{nic} up"), row=2, col=1)
    if not fig.data:
        return empty_figure(f"{link}: no data for its NICs ({', '.join(nics)}) in this range")
    return styled(fig, title=f"History of {link}", height=420)


def register(app: Dash, ctx: Context) -> None:
    """The page's callbacks: the three overview figures, and the history of the clicked link."""
    cache: dict[str, tuple[RouteMap, Topology]] = {}

    def current_topology() -> Topology | None:
        if ctx.fabric is None:
            return None
        fmap = ctx.fabric()
        if "map" not in cache or cache["map"][0] is not fmap:  # re-derived only when the file changed
            cache["map"] = (fmap, topology(fmap))
        return cache["map"][1]

    @app.callback(Output("fabric-topology", "figure"), Output("fabric-owd", "figure"),
                  Output("fabric-errors", "figure"), Output("fabric-status", "children"),
                  Input("fabric-direction", "value"), Input("refresh", "n_intervals"), Input("range", "value"))
    @guarded(empty_figure("store unavailable"), empty_figure("store unavailable"), empty_figure("store unavailable"))
    def update(direction: str, _tick: int | None, choice: str | None) -> tuple[Any, ...]:
        rng = ctx.range(choice)
        topo = current_topology()
        nics = queries.nic_state(ctx.store, rng, cluster=ctx.cfg.cluster)
        open_now = queries_incidents.incidents(ctx.store, cluster=ctx.cfg.cluster, open_only=True, limit=1000)
        bad_links, bad_hosts = incident_levels(open_now, topo)
        seconds = (rng.end_ns - rng.start_ns) / 1e9
        if topo is not None:
            levels, texts, rates = link_states(topo, nics, seconds=seconds, bad_links=bad_links)
            topo_fig = figure(topo, link_level=levels, link_text=texts, node_level=bad_hosts)
        else:
            levels = {n: 2 if s.get("up", 1.0) != 1.0 else 0 for n, s in nics.items()}
            rates = {n: s.get("errors", 0.0) / seconds for n, s in nics.items()}
            topo_fig = empty_figure("no fabric map configured (dashboard.fabric_map_file): errors are per NIC")
        owd = queries.owd_matrix(ctx.store, rng, direction=direction or "forward", cluster=ctx.cfg.cluster)
        down = sorted((n for n, lv in levels.items() if lv >= 2), key=natural_key)
        return (topo_fig, owd_figure(owd, direction or "forward"), errors_figure(rates, levels),
                status(f"{len(levels)} links, {len(down)} red: {', '.join(down[:8]) or 'none'}"))

    @app.callback(Output("fabric-link", "data"), Input("fabric-topology", "clickData"),
                  Input("fabric-errors", "clickData"), State("fabric-link", "data"), prevent_initial_call=True)
    def select(topo_click: dict[str, Any] | None, bar_click: dict[str, Any] | None, current: str | None) -> str | None:
        click = topo_click if callback_ctx.triggered_id == "fabric-topology" else bar_click
        points = (click or {}).get("points") or [{}]
        picked = points[0].get("customdata")
        return picked if isinstance(picked, str) and picked else current

    @app.callback(Output("fabric-link-history", "figure"), Input("fabric-link", "data"),
                  Input("refresh", "n_intervals"), Input("range", "value"))
    def history(link: str | None, _tick: int | None, choice: str | None) -> go.Figure:
        if not link:
            return empty_figure("click a link in the topology or a bar above to see its history", height=160)
        topo = current_topology()
        nics = list(topo.link_nics.get(link, ())) if topo is not None else []
        if not nics and "/" not in link:
            return empty_figure(f"{link}: no NIC reports on it (a switch, or a link between switches)", height=160)
        try:
            return history_figure(ctx, ctx.range(choice), link, nics or [link])
        except (StoreUnavailable, StoreError) as exc:
            return empty_figure(f"{link}: {exc}", height=160)
