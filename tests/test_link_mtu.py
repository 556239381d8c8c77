"""Known answers for the MTU check: the ends of a cable paired through the fabric map, on synthetic rows in the
detector tests' store."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ridethrough.detectors import controller, link_mtu
from ridethrough.detectors.contract import EntityType, FindingKind
from ridethrough.detectors.fabric_map import RouteMap
from ridethrough.detectors.link_mtu import METRIC, MtuMismatch
from ridethrough.exporters import schema
from ridethrough.exporters.store import Store
from ridethrough.lab.topology import Topology, TopologySpec
from tests import test_detectors as td

store = td.store  # the module-scoped chDB store of the detector tests
pytestmark = pytest.mark.integration

ROUTES = RouteMap.from_fabric(Topology(TopologySpec(hosts=8, racks=2, rails=2, spines=2)))
PORTS = {"h0": ["nic0", "nic1"], "leaf0r0": ["h0", "spine0", "spine1"], "spine1": ["leaf0r0", "leaf1r0"],
         "spine0": ["leaf0r0"]}


def mtus(cluster: str, changed: dict[tuple[str, str], float] | None = None, *, from_i: int = 0) -> list[dict]:
    """Every port of ``PORTS`` reporting 1500 every 5 s, except ``changed`` ones from sample ``from_i`` on."""
    rows = []
    for node, ifaces in PORTS.items():
        for iface in ifaces:
            values = [(changed or {}).get((node, iface), 1500.0) if i >= from_i else 1500.0
                      for i in range(len(td.TIMES))]
            rows += td.series(cluster, node, METRIC, {"network.interface.name": iface}, values)
    return rows


def test_matching_ends_find_nothing_and_no_map_finds_nothing(store: Store) -> None:
    c = "mtu-healthy"
    td.insert(store, schema.GAUGE, mtus(c))
    assert td.run(store, MtuMismatch(fabric=lambda: ROUTES), c) == []
    td.insert(store, schema.GAUGE, mtus("mtu-nomap", {("spine1", "leaf0r0"): 1400.0}))
    assert td.run(store, MtuMismatch(), "mtu-nomap") == []


def test_a_cable_whose_ends_disagree_is_named_with_both_mtus(store: Store) -> None:
    c = "mtu-mismatch"
    td.insert(store, schema.GAUGE, mtus(c, {("spine1", "leaf0r0"): 1400.0, ("h0", "nic1"): 9000.0}, from_i=50))
    found = {f.entity: f for f in td.run(store, MtuMismatch(fabric=lambda: ROUTES), c)}
    assert set(found) == {"leaf0r0-spine1"}, "h0's nic1 is 9000 but its leaf port is not reported: no pair to judge"
    f = found["leaf0r0-spine1"]
    assert f.kind is FindingKind.LINK_DEGRADING and f.entity_type is EntityType.LINK and f.confidence == 1.0
    assert f.evidence["mtu"] == {"spine1/leaf0r0": 1400.0, "leaf0r0/spine1": 1500.0}
    assert "frames over 1400 bytes" in f.summary


def test_a_mismatch_put_right_clears(store: Store) -> None:
    c = "mtu-fixed"
    rows = mtus(c, {("leaf0r0", "h0"): 1400.0})
    td.insert(store, schema.GAUGE, [r for r in rows if r["TimeUnix"] < td.END - 30 * td.S])
    assert [f.entity for f in td.run(store, MtuMismatch(fabric=lambda: ROUTES), c, td.END - 30 * td.S)] == [
        "h0-leaf0r0"], "the host end (nic0) and the leaf's port towards h0 are one cable"
    fixed = [r for r in mtus(c) if r["TimeUnix"] >= td.END - 30 * td.S]
    td.insert(store, schema.GAUGE, fixed)
    assert td.run(store, MtuMismatch(fabric=lambda: ROUTES), c) == [], "the newest MTUs agree"


def test_build_needs_a_fabric_map_and_is_a_default_plugin(tmp_path) -> None:
    assert link_mtu.build(SimpleNamespace()) == []
    path = tmp_path / "map.json"
    path.write_text('{"routes": {}}')
    [det] = link_mtu.build(SimpleNamespace(fabric_map_file=str(path), mtu_mismatch_interval_s=2.0))
    assert det.name == "mtu_mismatch" and det.interval_s == 2.0
    assert "ridethrough.detectors.link_mtu" in controller.PLUGINS
