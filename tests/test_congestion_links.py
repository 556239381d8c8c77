"""Congested paths folded into the link whose queue explains them, ties broken by the ports' transmit wait.

Synthetic rows in the detector tests' store, over the lab's design map of 4 hosts (h0, h1 in rack 0;
h2, h3 in rack 1), 2 rails and 2 spines: a queue on leaf1r1's uplink to spine0 makes every rail-1
direction from rack 1 to rack 0 queue, while their reverse directions and rail 0 stay flat.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from ridethrough.detectors import congestion_ports
from ridethrough.detectors.congestion import Congestion
from ridethrough.detectors.congestion_links import XMIT_WAIT
from ridethrough.detectors.congestion_ports import PortCongestion
from ridethrough.detectors.contract import EntityType, FindingKind
from ridethrough.detectors.fabric_map import RouteMap
from ridethrough.exporters import schema
from ridethrough.exporters.store import Store
from ridethrough.lab.topology import Topology, TopologySpec
from tests import test_detectors as td
from tests.test_detectors_clock_congestion import US, late, path_rows, queue, write

store = td.store
pytestmark = pytest.mark.integration
FMAP = RouteMap.from_fabric(Topology(TopologySpec(hosts=4, racks=2, rails=2, spines=2, gpus=0)))
UP = [("h2", "h0"), ("h2", "h1"), ("h3", "h0"), ("h3", "h1")]
"""Rack 1 → rack 0 on rail 1: up through leaf1r1, over a spine, down through leaf0r1."""


def scene(c: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for src, dst in UP:
        rows += queue(c, src, dst, "nic1")  # the prober's forward direction queues, its reverse stays flat
        flat = late(20 * US, 0.0)
        rows += path_rows(c, src, "nic0", dst, fwd=flat, rev=flat, rtt=late(40 * US, 0.0))  # rail 0 untouched
    return rows


def waits(c: str, node: str, port: str, per_step: float) -> list[dict[str, Any]]:
    return td.series(c, node, XMIT_WAIT, {"ib.device": port, "ib.port": "1"},
                     [per_step * i for i in range(td.N)])


def test_a_queue_on_one_uplink_is_one_finding_on_that_link(store: Store) -> None:
    c = "congestion-link"
    write(store, scene(c))
    td.insert(store, schema.SUM, waits(c, "leaf1r1", "spine0", 400.0) + waits(c, "spine0", "leaf0r1", 0.0)
              + waits(c, "leaf1r1", "spine1", 0.0))
    [f] = td.run(store, Congestion(fabric=lambda: FMAP), c)
    assert (f.kind, f.entity_type, f.entity) == (FindingKind.CONGESTION, EntityType.LINK, "leaf1r1-spine0")
    assert sorted(f.evidence["paths"]) == sorted(f"{s}/nic1->{d}/nic1" for s, d in UP)
    assert "leaf0r1-spine0" in f.evidence["candidates"] and f.evidence["port_xmit_wait"]["leaf1r1-spine0"] > 0
    assert f.confidence == 1.0 and "waited" in f.summary


def test_without_transmit_wait_the_link_is_named_among_the_candidates(store: Store) -> None:
    c = "congestion-link-tie"
    write(store, scene(c))
    [f] = td.run(store, Congestion(fabric=lambda: FMAP), c)
    assert f.entity_type is EntityType.LINK and len(f.evidence["candidates"]) > 1
    assert f.entity in f.evidence["candidates"] and f.confidence < 1.0
    assert "cannot tell it from" in f.summary


def test_one_queueing_path_no_link_explains_stays_a_path_finding(store: Store) -> None:
    c = "congestion-link-single"
    write(store, queue(c, "h2", "h0", "nic1"))
    [f] = td.run(store, Congestion(fabric=lambda: FMAP), c)
    assert (f.entity_type, f.entity) == (EntityType.PATH, "h2/nic1->h0/nic1")
    assert f.evidence["path"] == "h2/nic1->h0/nic1:forward"


def test_without_a_fabric_map_every_direction_is_its_own_finding(store: Store) -> None:
    c = "congestion-link-nomap"
    write(store, scene(c))
    found = td.run(store, Congestion(), c)
    assert {f.entity for f in found} == {f"{s}/nic1->{d}/nic1" for s, d in UP}


def test_one_queueing_path_goes_to_the_one_waiting_link_on_its_routes(store: Store) -> None:
    c = "congestion-link-single-wait"
    write(store, queue(c, "h2", "h0", "nic1"))
    td.insert(store, schema.SUM, waits(c, "leaf1r1", "spine0", 400.0) + waits(c, "leaf1r1", "spine1", 0.0))
    [f] = td.run(store, Congestion(fabric=lambda: FMAP), c)
    assert (f.entity_type, f.entity) == (EntityType.LINK, "leaf1r1-spine0")
    assert f.evidence["paths"] == ["h2/nic1->h0/nic1"] and f.evidence["port_xmit_wait"]["leaf1r1-spine0"] > 0
    assert "waited" in f.summary and "next to none" not in f.summary


def test_a_queueing_path_with_two_waiting_links_on_its_routes_stays_a_path_finding(store: Store) -> None:
    c = "congestion-link-single-two-waits"
    write(store, queue(c, "h2", "h0", "nic1"))
    td.insert(store, schema.SUM, waits(c, "leaf1r1", "spine0", 400.0) + waits(c, "leaf1r1", "spine1", 300.0))
    [f] = td.run(store, Congestion(fabric=lambda: FMAP), c)
    assert (f.entity_type, f.entity) == (EntityType.PATH, "h2/nic1->h0/nic1")


def test_port_congestion_names_the_link_of_a_port_that_keeps_waiting(store: Store) -> None:
    c = "congestion-port"
    td.insert(store, schema.SUM, waits(c, "leaf1r1", "spine0", 4000.0) + waits(c, "leaf1r1", "spine1", 0.0)
              + waits(c, "spine0", "leaf0r1", 20.0))  # 4/s: a port that waits now and then is not congested
    found = td.run(store, PortCongestion(fabric=lambda: FMAP), c)
    assert [(f.kind, f.entity_type, f.entity) for f in found] == [
        (FindingKind.CONGESTION, EntityType.LINK, "leaf1r1-spine0")]
    assert found[0].evidence["nics"] == ["leaf1r1/spine0"] and found[0].evidence["xmit_wait_per_s"] == 800.0
    assert [f.entity for f in td.run(store, PortCongestion(), c)] == ["leaf1r1/spine0"], "no map: the port"


def test_port_congestion_wants_a_sustained_wait_not_one_burst(store: Store) -> None:
    c = "congestion-port-burst"
    burst = [0.0] * (td.N - 2) + [50_000.0, 50_000.0]
    td.insert(store, schema.SUM, td.series(c, "leaf1r1", XMIT_WAIT, {"ib.device": "spine0", "ib.port": "1"}, burst))
    assert td.run(store, PortCongestion(fabric=lambda: FMAP), c) == []
    with pytest.raises(ValueError, match="recent_s"):
        PortCongestion(recent_s=0)
    [det] = congestion_ports.build(SimpleNamespace(port_congestion_min_rate_per_s=5.0))
    assert det.name == "port_congestion" and det.min_rate_per_s == 5.0


@pytest.mark.parametrize("case", ["reset", "duplicated", "gap"])
def test_port_congestion_is_not_made_by_bad_telemetry(store: Store, case: str) -> None:
    """A counter that restarts (an exporter restarted), rows written twice, or a silent stretch: a port waiting
    4 times a second stays below the threshold, and one waiting 800 times a second stays found once."""
    c = f"congestion-port-{case}"
    quiet, busy = [4.0 * 5 * i for i in range(td.N)], [4000.0 * i for i in range(td.N)]
    if case == "reset":
        quiet = [v if i < td.N - 6 else v - quiet[td.N - 6] for i, v in enumerate(quiet)]
    rows = (td.series(c, "leaf1r1", XMIT_WAIT, {"ib.device": "spine1", "ib.port": "1"}, quiet)
            + td.series(c, "leaf1r1", XMIT_WAIT, {"ib.device": "spine0", "ib.port": "1"}, busy))
    if case == "gap":
        rows = [r for r in rows if not td.END - 40 * td.S < r["TimeUnix"] < td.END - 15 * td.S]
    for _ in range(2 if case == "duplicated" else 1):
        td.insert(store, schema.SUM, rows)
    assert [f.entity for f in td.run(store, PortCongestion(fabric=lambda: FMAP), c)] == ["leaf1r1-spine0"]
