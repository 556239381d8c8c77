"""Tomography: the set cover on lab topologies with known bad links, the route map, and a store-backed run.

Exact routes stand in for walked ones: each direction of each probe path takes one of the
design's ECMP members, picked by a hash of the path id (as the fabric's hash picks one per flow).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Collection, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ridethrough.detectors import tomography
from ridethrough.detectors.contract import EntityType, FindingKind, Window
from ridethrough.detectors.tomography import Observation, RouteFile, RouteMap, Tomography, localise
from ridethrough.exporters import schema
from ridethrough.exporters.store import Store
from ridethrough.lab.topology import Topology, TopologySpec
from tests import test_detectors as td

store = td.store  # the module-scoped chDB store of the detector tests

TWO_RACKS = Topology(TopologySpec(hosts=8, racks=2, rails=2, spines=2))
THREE_RACKS = Topology(TopologySpec(hosts=9, racks=3, rails=2, spines=2))


def exact(topo: Topology) -> RouteMap:
    """One ECMP member per path direction, as a walk of the running fabric would find."""
    design = RouteMap.from_fabric(topo).to_json()["routes"]
    def pick(pid: str) -> int:  # not a CRC: its linearity would tie a path's two directions to each other
        return int.from_bytes(hashlib.sha256(pid.encode()).digest()[:4], "big")
    return RouteMap({pid: [routes[pick(pid) % len(routes)]] for pid, routes in design.items()})


def observe(routes: RouteMap, bad_links: Collection[str], *, spurious: Sequence[str] = ()) -> list[Observation]:
    """Every path direction: bad if each route it may take crosses a bad link, or if listed as spurious."""
    out = []
    for pid in routes.to_json()["routes"]:
        alts = routes.routes(pid)
        bad = pid in spurious or all(set(r) & set(bad_links) for r in alts)
        out.append(Observation(pid, alts, bad, 0.1 if bad else 0.0))
    return out


def test_route_map_from_the_lab_design() -> None:
    routes = RouteMap.from_fabric(TWO_RACKS)
    assert len(routes) == 8 * 7 * 2 * 2  # ordered host pairs x rails x directions
    assert routes.routes("h0/nic0->h1/nic0:forward") == (("h0-leaf0r0", "h1-leaf0r0"),)
    assert routes.routes("h0/nic1->h5/nic1:reverse") == (
        ("h5-leaf1r1", "leaf1r1-spine0", "leaf0r1-spine0", "h0-leaf0r1"),
        ("h5-leaf1r1", "leaf1r1-spine1", "leaf0r1-spine1", "h0-leaf0r1"))
    assert routes.routes("h0/nic0->h99/nic0:forward") == ()
    assert RouteMap.parse(json.loads(json.dumps(routes.to_json()))).to_json() == routes.to_json()


@pytest.mark.parametrize(("data", "why"), [
    ([], "expected"),
    ({"routes": {}, "extra": 1}, "expected"),
    ({"routes": {"h0-h1": [["a"]]}}, "h0-h1"),
    ({"routes": {"h0/nic0->h1/nic0:sideways": [["a"]]}}, "sideways"),
    ({"routes": {"h0/nic0->h1/nic0:forward": []}}, "non-empty"),
    ({"routes": {"h0/nic0->h1/nic0:forward": ["h0-leaf0r0"]}}, "non-empty"),
    ({"routes": {"h0/nic0->h1/nic0:forward": [["h0-leaf0r0", ""]]}}, "non-empty"),
])
def test_route_map_rejects_bad_input(data: Any, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        RouteMap.parse(data)


def test_route_file_reloads_and_keeps_the_last_good_map(tmp_path: Path) -> None:
    path = tmp_path / "routes.json"
    with pytest.raises(ValueError, match=re.escape(str(path))):
        RouteFile(path)
    path.write_text(json.dumps({"routes": {"h0/nic0->h1/nic0:forward": [["h0-leaf0r0", "h1-leaf0r0"]]}}))
    source = RouteFile(path)
    assert len(source()) == 1
    path.write_text(json.dumps(exact(TWO_RACKS).to_json()))
    os.utime(path, ns=(1, 10**18))  # a new mtime even on a coarse clock
    assert len(source()) == 224
    path.write_text("{half written")
    os.utime(path, ns=(1, 2 * 10**18))
    assert len(source()) == 224
    path.unlink()
    assert len(source()) == 224


def _blamed(found: list[tomography.Blame]) -> list[str]:
    return [b.link for b in found]


@pytest.mark.parametrize("link", ["h3-leaf1r0", "h0-leaf0r1", "h8-leaf2r1"])
def test_a_bad_host_link_is_found_alone(link: str) -> None:
    routes = exact(THREE_RACKS)
    [blame] = localise(observe(routes, {link}))
    assert blame.link == link and blame.candidates == (link,) and blame.confidence == 1.0
    assert blame.contradicting == ()
    assert {o.path for o in observe(routes, {link}) if o.bad} == set(blame.explained)


@pytest.mark.parametrize("link", ["leaf1r0-spine1", "leaf0r1-spine0", "leaf2r0-spine0"])
def test_a_bad_leaf_spine_link_is_not_blamed_on_the_hosts_below_it(link: str) -> None:
    [blame] = localise(observe(exact(THREE_RACKS), {link}))
    assert blame.link == link and blame.candidates == (link,)
    assert blame.confidence == 1.0


def test_every_single_bad_link_is_localised() -> None:
    routes = exact(THREE_RACKS)
    for link in (lk.name for lk in THREE_RACKS.links):
        found = localise(observe(routes, {link}))
        assert len(found) == 1 and link in found[0].candidates, link


def test_two_bad_links_are_both_found() -> None:
    bad = {"h3-leaf1r0", "leaf0r1-spine0"}
    found = localise(observe(exact(THREE_RACKS), bad))
    assert sorted(_blamed(found)) == sorted(bad)
    assert all(b.confidence == 1.0 for b in found)


def test_two_racks_cannot_tell_the_two_ends_of_a_spine_apart() -> None:
    # with two racks every path through leaf0r0-spine1 also crosses leaf1r0-spine1, and back
    [blame] = localise(observe(exact(TWO_RACKS), {"leaf0r0-spine1"}))
    assert set(blame.candidates) == {"leaf0r0-spine1", "leaf1r0-spine1"}
    assert blame.confidence == 0.5


def test_the_design_map_names_candidates_for_a_leaf_spine_link() -> None:
    design, walked = RouteMap.from_fabric(THREE_RACKS), exact(THREE_RACKS)
    truth = observe(walked, {"leaf0r0-spine1"})  # what the paths really saw
    seen = [Observation(o.path, design.routes(o.path), o.bad, o.loss) for o in truth]
    [blame] = localise(seen)
    assert "leaf0r0-spine1" in blame.candidates and blame.confidence <= 0.5


def test_one_spurious_bad_path_blames_nothing() -> None:
    routes = exact(THREE_RACKS)
    assert localise(observe(routes, set(), spurious=["h0/nic0->h4/nic0:forward"])) == []
    both = ["h0/nic0->h4/nic0:forward", "h0/nic0->h4/nic0:reverse"]
    assert localise(observe(routes, set(), spurious=both)) == []


def test_noise_beside_a_real_fault_adds_no_link() -> None:
    found = localise(observe(exact(THREE_RACKS), {"h3-leaf1r0"}, spurious=["h6/nic1->h1/nic1:forward"]))
    assert _blamed(found) == ["h3-leaf1r0"]


# -- store-backed -------------------------------------------------------------------------

PROBES_PER_STEP = 20  # 2 pairs/s over 5 s between collections
SUMS = {"ridethrough.probe.sent", "ridethrough.probe.lost"}
UNJUDGED = {"ridethrough.probe.unknown", "ridethrough.probe.stalled"}


def _cum(step: int, n: int) -> list[float]:
    return [float(step * (i + 1)) for i in range(n)]


def _path_rows(c: str, src: str, nic: str, dst: str, loss: tuple[float, float], *, rtt_s: Sequence[float] = (),
               suspended: bool = False) -> list[dict[str, Any]]:
    attrs = {"probe.src.node": src, "probe.src.nic": nic, "probe.dst.node": dst, "probe.dst.nic": nic}
    n = td.N
    lost_fwd = round(PROBES_PER_STEP * loss[0])
    lost_rev = round((PROBES_PER_STEP - lost_fwd) * loss[1])
    rows = (td.series(c, src, "ridethrough.probe.sent", attrs, _cum(PROBES_PER_STEP, n))
            + td.series(c, src, "ridethrough.probe.lost", {**attrs, "probe.direction": "forward"}, _cum(lost_fwd, n))
            + td.series(c, src, "ridethrough.probe.lost", {**attrs, "probe.direction": "reverse"}, _cum(lost_rev, n))
            + td.series(c, src, "ridethrough.probe.path.suspended", attrs, [float(suspended)] * n))
    if rtt_s:
        rows += td.series(c, src, "ridethrough.probe.rtt", {**attrs, "probe.quantile": "p50"}, rtt_s)
    return rows


def fabric_rows(c: str, topo: Topology, routes: RouteMap, bad: dict[str, float], *,
                congested: Collection[str] = ()) -> list[dict[str, Any]]:
    """Every host probes every other over each rail; a direction loses ``bad[link]`` on a bad link.

    Paths crossing a ``congested`` link see their RTT rise over the last 20 s (a queue).
    """
    rows: list[dict[str, Any]] = []
    for src in topo.hosts:
        for dst in (h for h in topo.hosts if h != src):
            for r in range(topo.spec.rails):
                nic = f"nic{r}"
                fwd, rev = (routes.routes(tomography.path_id(src, nic, dst, nic, d))[0] for d in ("forward", "reverse"))
                loss = tuple(max((bad.get(link, 0.0) for link in route), default=0.0) for route in (fwd, rev))
                queue = bool(set(fwd + rev) & set(congested))
                rtt = [50e-6 + (2e-3 if queue and t >= td.END - 20 * td.S else 0.0) for t in td.TIMES]
                rows += _path_rows(c, src, nic, dst, (loss[0], loss[1]), rtt_s=rtt,
                                   suspended=loss[0] >= 1.0 or loss[1] >= 1.0)
    return rows


def write(store: Store, rows: Sequence[dict[str, Any]], *, twice: bool = False) -> None:
    for _ in range(2 if twice else 1):
        td.insert(store, schema.GAUGE, [r for r in rows if r["MetricName"] not in SUMS])
        td.insert(store, schema.SUM, [r for r in rows if r["MetricName"] in SUMS])


@pytest.fixture(scope="module")
def walked() -> RouteMap:
    return exact(TWO_RACKS)


@pytest.mark.integration
@pytest.mark.parametrize("twice", [False, True])
def test_store_a_lossy_host_link_is_degrading(store: Store, walked: RouteMap, twice: bool) -> None:
    c = f"tomo-lossy-{twice}"
    write(store, fabric_rows(c, TWO_RACKS, walked, {"h3-leaf0r1": 0.1}), twice=twice)
    [f] = td.run(store, Tomography(routes=walked), c)
    assert (f.kind, f.entity_type, f.entity) == (FindingKind.LINK_DEGRADING, EntityType.LINK, "h3-leaf0r1")
    assert f.evidence["explained"] == 7 * 2 * 2  # both directions of h3's nic1 paths and of theirs to h3
    assert f.evidence["median_loss"] == pytest.approx(0.1, rel=0.15)
    assert td.T0 <= f.observed_at_ns <= td.END


@pytest.mark.integration
def test_store_a_cut_leaf_spine_link_is_down(store: Store, walked: RouteMap) -> None:
    c = "tomo-down"
    write(store, fabric_rows(c, TWO_RACKS, walked, {"leaf1r1-spine0": 1.0}))
    [f] = td.run(store, Tomography(routes=walked), c)
    assert f.kind is FindingKind.LINK_DOWN and f.entity in {"leaf1r1-spine0", "leaf0r1-spine0"}
    assert set(f.evidence["candidates"]) == {"leaf1r1-spine0", "leaf0r1-spine0"}
    assert all(p.endswith(":both") for p in f.evidence["bad_paths"])


def _reset(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every counter restarts from zero half-way (the path left the probed set and came back)."""
    half = td.T0 + 270 * td.S
    first = {(r["MetricName"], tuple(sorted(r["Attributes"].items()))): r["Value"] for r in rows
             if r["TimeUnix"] == half and r["MetricName"] in SUMS}
    return [{**r, "Value": r["Value"] - first[(r["MetricName"], tuple(sorted(r["Attributes"].items())))]}
            if r["MetricName"] in SUMS and r["TimeUnix"] > half else r for r in rows]


@pytest.mark.integration
@pytest.mark.parametrize("case", ["healthy", "duplicated", "gap", "counter_reset", "clock_jump", "congested"])
def test_store_no_fault_no_finding(store: Store, walked: RouteMap, case: str) -> None:
    c = f"tomo-quiet-{case}"
    rows = fabric_rows(c, TWO_RACKS, walked, {})
    if case == "gap":
        rows = [r for r in rows if not td.T0 + 250 * td.S < r["TimeUnix"] < td.T0 + 290 * td.S]
    elif case == "counter_reset":
        rows = _reset(rows)
    elif case == "clock_jump":
        rows = td._jump(rows, after=td.T0 + 270 * td.S)
    elif case == "congested":  # a queue that drops: lossy paths whose RTT grew are left out of the vote
        rows = fabric_rows(c, TWO_RACKS, walked, {"h2-leaf0r0": 0.05}, congested={"h2-leaf0r0"})
    write(store, rows, twice=case == "duplicated")
    assert td.run(store, Tomography(routes=walked), c) == []
    if case == "congested":  # the control: blind to queues, the same rows blame the link
        blind = Tomography(routes=walked, queue_factor=1e9)
        assert [f.entity for f in td.run(store, blind, c)] == ["h2-leaf0r0"]


def test_build_needs_a_route_file(tmp_path: Path) -> None:
    assert tomography.build(SimpleNamespace()) == []
    path = tmp_path / "routes.json"
    path.write_text(json.dumps(exact(TWO_RACKS).to_json()))
    [det] = tomography.build(SimpleNamespace(fabric_map_file=str(path), tomography_window_s=90.0))
    assert det.name == "tomography" and det.window_s == 90.0
    path.write_text("[]")
    os.utime(path, ns=(1, 10**18))
    with pytest.raises(ValueError, match="route map"):
        tomography.build(SimpleNamespace(fabric_map_file=str(path)))


def _burst(rows: list[dict[str, Any]], host: str, *, at: int, lost: float) -> list[dict[str, Any]]:
    """Every path from or to ``host`` loses ``lost`` probes each way at once at ``at`` (its agent was not
    answering yet, a route settling), and none before or after."""
    def hit(r: dict[str, Any]) -> bool:
        a = r["Attributes"]
        return (r["MetricName"] == "ridethrough.probe.lost" and host in (a["probe.src.node"], a["probe.dst.node"])
                and r["TimeUnix"] >= at)
    return [{**r, "Value": r["Value"] + lost} if hit(r) else r for r in rows]


@pytest.mark.integration
def test_store_a_one_off_burst_of_loss_blames_nothing(store: Store, walked: RouteMap) -> None:
    c = "tomo-burst"
    write(store, _burst(fabric_rows(c, TWO_RACKS, walked, {}), "h5", at=td.T0 + 285 * td.S, lost=40))
    assert td.run(store, Tomography(routes=walked), c) == []
    # the control: counting a single burst as loss (and loss since made up for), the same rows blame h5's links
    blamed = {f.entity for f in td.run(store, Tomography(routes=walked, min_loss_rises=1, healed_alpha=1e-12), c)}
    assert blamed & {"h5-leaf1r0", "h5-leaf1r1"}


def _dies_at_the_end(c: str, topo: Topology, routes: RouteMap, link: str, *,
                     silent: Collection[str] = ()) -> list[dict[str, Any]]:
    """Healthy rows up to END, then three more collections 1 s apart in which every probe over ``link`` is lost
    (and none from the ``silent`` hosts, whose agents stopped)."""
    rows = fabric_rows(c, topo, routes, {})
    last = {(r["MetricName"], tuple(sorted(r["Attributes"].items()))): r for r in rows if r["TimeUnix"] == td.END}
    extra: list[dict[str, Any]] = []
    for r in last.values():
        a = r["Attributes"]
        if r["MetricName"] not in SUMS or a["probe.src.node"] in silent:
            continue
        path = tomography.path_id(a["probe.src.node"], a["probe.src.nic"], a["probe.dst.node"], a["probe.dst.nic"],
                                  "forward")
        dead = any(link in route for route in routes.routes(path))
        per_s = 4.0 if r["MetricName"] == "ridethrough.probe.sent" or (
            dead and a.get("probe.direction") == "forward") else 0.0
        extra += [{**r, "TimeUnix": td.END + k * td.S, "Value": r["Value"] + per_s * k} for k in (1, 2, 3)]
    return rows + extra


@pytest.mark.integration
def test_store_a_path_dead_for_the_last_seconds_is_down_at_once(store: Store, walked: RouteMap) -> None:
    """Seconds after a cut the window's loss is still small: the last seconds say the link is down."""
    c = "tomo-dead-now"
    write(store, _dies_at_the_end(c, TWO_RACKS, walked, "h3-leaf0r1"))
    [f] = td.run(store, Tomography(routes=walked), c, end_ns=td.END + 3 * td.S)
    assert (f.kind, f.entity) == (FindingKind.LINK_DOWN, "h3-leaf0r1")


@pytest.mark.integration
def test_store_paths_to_a_silent_host_do_not_blame_links(store: Store, walked: RouteMap) -> None:
    """h3 froze 15 s ago: its prober stopped, and every probe to it dies (the paths are suspended); that is a
    host, not its links nor the spine links above them."""
    c = "tomo-frozen-peer"
    design = RouteMap.from_fabric(TWO_RACKS)  # ECMP: good paths clear no spine link for certain
    dead = fabric_rows(c, TWO_RACKS, walked, {"h3-leaf0r0": 1.0, "h3-leaf0r1": 1.0})
    rows = [r for r in fabric_rows(c, TWO_RACKS, walked, {}) if r["Attributes"]["probe.dst.node"] != "h3"
            and not (r["Attributes"]["probe.src.node"] == "h3" and r["TimeUnix"] > td.END - 15 * td.S)]
    rows += [r for r in dead if r["Attributes"]["probe.dst.node"] == "h3"]
    write(store, rows)
    assert td.run(store, Tomography(routes=design, min_paths=2), c) == []
    # the control: taking paths to a quiet node as evidence, the same rows blame spine links
    assert td.run(store, Tomography(routes=design, min_paths=2, quiet_s=1e9), c)


@pytest.mark.integration
@pytest.mark.parametrize("away_s", [25, 70])
def test_store_paths_to_and_from_a_host_back_from_a_freeze_do_not_blame_links(store: Store, walked: RouteMap,
                                                                              away_s: int) -> None:
    """h3 froze and is back (25 s: the gap is in the window; 70 s: longer than the window, h3 is heard only at its
    end). Every probe to it died meanwhile and its peers' paths to it are still suspended (their backoff has not
    run out); its own in-flight probes timed out when it thawed. The window holds the host's absence, not its
    links'."""
    c = f"tomo-thawed-{away_s}"
    back = td.END - 15 * td.S if away_s == 25 else td.END
    away = back - away_s * td.S
    dead = {(r["MetricName"], tuple(sorted(r["Attributes"].items())), r["TimeUnix"]): r["Value"]
            for r in fabric_rows(c, TWO_RACKS, walked, {"h3-leaf0r0": 1.0, "h3-leaf0r1": 1.0})}
    rows = []
    for r in fabric_rows(c, TWO_RACKS, walked, {}):
        a, t = r["Attributes"], r["TimeUnix"]
        if a["probe.src.node"] == "h3":
            if away < t < back:
                continue  # frozen: its agent sent nothing
            if t >= back and a.get("probe.direction") == "forward":
                r = {**r, "Value": r["Value"] + 8}  # the pair or so in flight on each round, timed out at the thaw
        elif a["probe.dst.node"] == "h3" and t > away:
            key = (r["MetricName"], tuple(sorted(a.items())))
            since = dead[(*key, t)] - dead[(*key, max(away, td.TIMES[0]))] if r["MetricName"] in SUMS else 1.0
            r = {**r, "Value": r["Value"] + since if r["MetricName"] in SUMS else since}
        rows.append(r)
    write(store, rows)
    assert td.run(store, Tomography(routes=walked), c) == []
    # the control: with the absence taken as evidence, the same rows blame h3's links
    blamed = {f.entity for f in td.run(store, Tomography(routes=walked, quiet_s=1e9), c)}
    assert {"h3-leaf0r0", "h3-leaf0r1"} <= blamed, blamed


@pytest.mark.integration
def test_store_a_link_back_up_seconds_ago_is_not_degrading(store: Store, walked: RouteMap) -> None:
    """h3-leaf0r1 lost 20 % for the whole window, then came back 8 s ago: every path over it has had 32 probes
    through since its last loss (at 20 % loss that happens one time in 1,300), so the window's losses are the past."""
    c = "tomo-back-up"
    rows = fabric_rows(c, TWO_RACKS, walked, {"h3-leaf0r1": 0.2})
    last = [r for r in rows if r["TimeUnix"] == td.END and r["MetricName"] in SUMS]
    rows += [{**r, "TimeUnix": td.END + k * td.S, "Value": r["Value"] + (4.0 * k if r["MetricName"] ==
             "ridethrough.probe.sent" else 0.0)} for r in last for k in range(1, 9)]
    write(store, rows)
    assert td.run(store, Tomography(routes=walked), c, end_ns=td.END + 8 * td.S) == []
    # the control: with the test off, the same rows call the link degrading
    [f] = td.run(store, Tomography(routes=walked, healed_alpha=1e-12), c, end_ns=td.END + 8 * td.S)
    assert (f.kind, f.entity) == (FindingKind.LINK_DEGRADING, "h3-leaf0r1")


@pytest.mark.integration
def test_store_a_cut_link_probed_again_is_neither_down_nor_degrading(store: Store, walked: RouteMap,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """h3-leaf0r1 was cut for 15 s (every probe over it lost, its paths suspended), and its paths have been probed,
    clean, for the last 3 s: the window's losses are the outage, already reported as down, not a lossy link."""
    c = "tomo-outage-over"
    cut, back = td.END - 15 * td.S, td.END
    rows = []
    for r in fabric_rows(c, TWO_RACKS, walked, {}):
        a, t = r["Attributes"], r["TimeUnix"]
        path = tomography.path_id(a["probe.src.node"], a["probe.src.nic"], a["probe.dst.node"], a["probe.dst.nic"],
                                  "forward")
        over = any("h3-leaf0r1" in route for route in walked.routes(path))
        if over and t >= cut and r["MetricName"] == "ridethrough.probe.lost" and a["probe.direction"] == "forward":
            r = {**r, "Value": r["Value"] + PROBES_PER_STEP * ((min(t, back - 5 * td.S) - cut) // (5 * td.S) + 1)}
        elif over and cut <= t < back and r["MetricName"] == "ridethrough.probe.path.suspended":
            r = {**r, "Value": 1.0}
        rows.append(r)
    last = [r for r in rows if r["TimeUnix"] == td.END and r["MetricName"] in SUMS]
    rows += [{**r, "TimeUnix": td.END + k * td.S, "Value": r["Value"] + (4.0 * k if r["MetricName"] ==
             "ridethrough.probe.sent" else 0.0)} for r in last for k in (1, 2, 3)]
    write(store, rows)
    tomo = Tomography(routes=walked, healed_alpha=1e-12)  # the outage alone, not the probes-since test
    assert td.run(store, tomo, c, end_ns=td.END + 3 * td.S) == []
    monkeypatch.setattr(Tomography, "_outage_over", lambda *_: False)  # the control: the same rows call it degrading
    assert [(f.kind, f.entity) for f in td.run(store, tomo, c, end_ns=td.END + 3 * td.S)] == [
        (FindingKind.LINK_DEGRADING, "h3-leaf0r1")]


@pytest.mark.integration
def test_store_loss_that_stopped_blames_nothing(store: Store, walked: RouteMap) -> None:
    """h3-leaf0r1 lost 10 % until 30 s ago and nothing since (it was reseated): the window still holds the
    loss, but the link is not losing packets now."""
    c = "tomo-healed"
    stop = td.END - 30 * td.S
    rows = fabric_rows(c, TWO_RACKS, walked, {"h3-leaf0r1": 0.1})
    frozen = {(tuple(sorted(r["Attributes"].items()))): r["Value"] for r in rows
              if r["MetricName"] == "ridethrough.probe.lost" and r["TimeUnix"] == stop}
    rows = [{**r, "Value": frozen[tuple(sorted(r["Attributes"].items()))]}
            if r["MetricName"] == "ridethrough.probe.lost" and r["TimeUnix"] > stop else r for r in rows]
    write(store, rows)
    assert td.run(store, Tomography(routes=walked), c) == []
    # the control: with a longer memory for loss (and no test of the probes since), the same rows blame the link
    assert [f.entity for f in td.run(store, Tomography(routes=walked, recent_s=50.0, healed_alpha=1e-12), c)
            ] == ["h3-leaf0r1"]


def test_a_link_whose_paths_die_one_by_one_is_down_not_degrading() -> None:
    """Seconds after a cut, a third of the paths it explains are dead and the rest show the loss so far."""
    det = Tomography(routes=RouteMap({}))
    paths = [f"p{i}" for i in range(9)]
    blame = tomography.Blame("h2-leaf0r1", tuple(paths), (), 9.0, ("h2-leaf0r1",), 1.0)
    window = Window(0, 1, lambda sql, params: ([], []))
    cut = det._finding(blame, {p: 1.0 if i < 3 else 0.12 for i, p in enumerate(paths)}, dict.fromkeys(paths, 1),
                       window)
    lossy = det._finding(blame, {p: 1.0 if i < 2 else 0.12 for i, p in enumerate(paths)}, dict.fromkeys(paths, 1),
                         window)
    assert (cut.kind, lossy.kind) == (FindingKind.LINK_DOWN, FindingKind.LINK_DEGRADING)


@pytest.mark.integration
def test_store_a_flapping_host_link_is_blamed_though_every_reverse_looks_clean(store: Store) -> None:
    """A link down a second at a time loses probes both ways, but a probe that got through while it was up is
    answered while it is up: every prober's forward loses ~10 %, every reverse nothing. Seen in the lab (the
    link_flap scenario): the clean reverses cleared the host link and a spine link took the blame."""
    c = "tomo-flap"
    design = RouteMap.from_fabric(TWO_RACKS)
    rows: list[dict[str, Any]] = []
    for src in TWO_RACKS.hosts:
        for dst in (h for h in TWO_RACKS.hosts if h != src):
            crosses = "h5" in (src, dst)
            rows += _path_rows(c, src, "nic1", dst, (0.1 if crosses else 0.0, 0.0))
    write(store, rows)
    [f] = td.run(store, Tomography(routes=design), c)
    assert (f.kind, f.entity) == (FindingKind.LINK_DEGRADING, "h5-leaf1r1")
    assert f.evidence["explained"] == 14 and f.evidence["contradicting"] == 0


def _silent_host_rows(c: str, host: str, *, stalled: bool) -> list[dict[str, Any]]:
    """Healthy fabric, but ``host`` answered none of its peers' probes and none of its own came back: its peers'
    probers and its own could not judge them (``unknown``). With ``stalled``, the host says its probe threads
    were held off the CPU all along."""
    rows = fabric_rows(c, TWO_RACKS, exact(TWO_RACKS), {})
    rows = [r for r in rows if not (r["MetricName"] == "ridethrough.probe.lost" and host in (
        r["Attributes"]["probe.src.node"], r["Attributes"]["probe.dst.node"]))]
    for r in [r for r in rows if r["MetricName"] == "ridethrough.probe.sent"
              and host in (r["Attributes"]["probe.src.node"], r["Attributes"]["probe.dst.node"])]:
        rows.append({**r, "MetricName": "ridethrough.probe.unknown"})
        for d in ("forward", "reverse"):
            rows.append({**r, "MetricName": "ridethrough.probe.lost", "Value": 0.0,
                         "Attributes": {**r["Attributes"], "probe.direction": d}})
    if stalled:
        rows += td.series(c, host, "ridethrough.probe.stalled", {"probe.role": "responder"}, _cum(5, td.N))
    return rows


@pytest.mark.integration
@pytest.mark.parametrize("stalled", [False, True])
def test_store_probes_a_silent_host_left_unjudged_are_loss_unless_it_stalled(store: Store, walked: RouteMap,
                                                                          stalled: bool) -> None:
    c = f"tomo-unknown-{stalled}"
    rows = _silent_host_rows(c, "h3", stalled=stalled)
    td.insert(store, schema.GAUGE, [r for r in rows if r["MetricName"] not in SUMS | UNJUDGED])
    td.insert(store, schema.SUM, [r for r in rows if r["MetricName"] in SUMS | UNJUDGED])
    found = td.run(store, Tomography(routes=walked), c)
    if stalled:  # a host held off the CPU, its links fine
        assert found == [], found
    else:  # silence on every rail from a host that ran: its links
        assert found and all(f.entity.startswith("h3-") for f in found), found
