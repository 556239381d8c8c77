"""Congested paths folded into the link whose queue explains them, ties broken by the ports' transmit wait.

Synthetic rows in the detector tests' store, over the lab's design map of 4 hosts (h0, h1 in rack 0;
h2, h3 in rack 1), 2 rails and 2 spines: a queue on leaf1r1's uplink to spine0 makes every rail-1
direction from rack 1 to rack 0 queue, while their reverse directions and rail 0 stay flat.
"""

from __future__ import annotations

from typing import Any

import pytest

from ridethrough.detectors.congestion import Congestion
from ridethrough.detectors.congestion_links import XMIT_WAIT
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
