"""The fabric map's NIC cabling, and link findings named by the cable instead of the port."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from ridethrough.detectors import link
from ridethrough.detectors.contract import EntityType, Finding, FindingKind, Severity
from ridethrough.detectors.fabric_map import RouteMap
from ridethrough.lab.topology import Topology, TopologySpec


def nic_finding(entity: str, severity: Severity = Severity.CRITICAL, kind: FindingKind = FindingKind.LINK_DOWN,
                at: int = 1) -> Finding:
    return Finding(detector="link_down", kind=kind, entity_type=EntityType.NIC, entity=entity, severity=severity,
                   confidence=0.9, summary=f"{entity} down", observed_at_ns=at, evidence={"device": entity})


def fabric() -> RouteMap:
    return RouteMap.from_fabric(Topology(TopologySpec(hosts=4, racks=2, rails=2, spines=2)),
                                aliases=lambda r: (f"mlx5_{r}",))


def test_from_fabric_cables_every_nic_and_its_alias() -> None:
    fmap = fabric()
    assert fmap.link_of("h0/nic1") == "h0-leaf0r1" == fmap.link_of("h0/mlx5_1")
    assert fmap.link_of("h3/nic0") == "h3-leaf1r0"
    assert fmap.link_of("h9/nic0") is None
    again = RouteMap.parse(json.loads(json.dumps(fmap.to_json())))
    assert again.link_of("h2/mlx5_0") == fmap.link_of("h2/mlx5_0") and len(again) == len(fmap)


def test_from_fabric_cables_every_switch_port_by_its_interface_name() -> None:
    fmap = fabric()
    assert fmap.link_of("leaf0r0/spine1") == "leaf0r0-spine1" == fmap.link_of("spine1/leaf0r0")
    assert fmap.link_of("leaf1r1/h3") == "h3-leaf1r1" == fmap.link_of("h3/nic1")
    assert fmap.link_of("leaf0r0/spine9") is None and fmap.link_of("spine0/leaf0r1") == "leaf0r1-spine0"
    assert fmap.ports("leaf1r0-spine0") == ["leaf1r0/spine0", "spine0/leaf1r0"]
    assert fmap.ports("h0-leaf0r1") == ["h0/mlx5_1", "h0/nic1", "leaf0r1/h0"]
    assert fmap.ports("h9-leaf0r0") == []
    again = RouteMap.parse(json.loads(json.dumps(fmap.to_json())))
    assert again.ports("leaf1r0-spine0") == fmap.ports("leaf1r0-spine0")
    # host ports and their aliases, leaf downlinks, both ends of the leaf-spine links
    assert len(fmap.to_json()["nics"]) == 4 * 2 * 2 + 4 * 2 + 4 * 2 * 2
    assert fmap.without("leaf1r0-spine0").ports("leaf1r0-spine0") == fmap.ports("leaf1r0-spine0")  # cabling stays


@pytest.mark.parametrize("bad", [
    {"routes": {}, "nics": {"h0": "h0-leaf0r0"}},            # not HOST/NIC
    {"routes": {}, "nics": {"h0/nic0": ""}},                # no link
    {"routes": {}, "nics": ["h0/nic0"]},                    # not a mapping
    {"routes": {}, "cabling": {}},                          # unknown key
])
def test_bad_cabling_is_refused_with_a_reason(bad: object) -> None:
    with pytest.raises(ValueError, match="route map"):
        RouteMap.parse(bad)


def test_the_ib_port_and_netdev_of_one_cable_fold_into_one_link_finding() -> None:
    found = link.to_links([nic_finding("h1/mlx5_1", Severity.CRITICAL, at=5),
                           nic_finding("h1/nic1", Severity.ERROR, at=9),
                           nic_finding("h1/nic0", kind=FindingKind.LINK_FLAP),
                           nic_finding("x9/eth0")], fabric)
    by_key = {f.key: f for f in found}
    down = by_key["link_down:link:h1-leaf0r1"]
    assert down.severity is Severity.CRITICAL and down.observed_at_ns == 9
    assert down.evidence["nics"] == ["h1/mlx5_1", "h1/nic1"]
    assert down.summary.startswith("h1-leaf0r1: ")
    assert "link_flap:link:h1-leaf0r0" in by_key
    assert by_key["link_down:nic:x9/eth0"].entity_type is EntityType.NIC  # the map does not know it
    assert len(found) == 3


def test_a_switch_port_finding_is_named_by_its_cable() -> None:
    [f] = link.to_links([nic_finding("spine0/leaf1r0", Severity.WARNING, FindingKind.LINK_DEGRADING)], fabric)
    assert (f.key, f.evidence["nics"]) == ("link_degrading:link:leaf1r0-spine0", ["spine0/leaf1r0"])


def test_without_a_map_findings_keep_their_nic() -> None:
    f = nic_finding("h2/nic1")
    assert link.to_links([f], None) == [f]


def test_build_reads_the_fabric_map_file(tmp_path: Path) -> None:
    path = tmp_path / "fabric.json"
    path.write_text(json.dumps(fabric().to_json()))
    detectors = link.build(SimpleNamespace(fabric_map_file=str(path)))
    assert all(d.fabric is not None and d.fabric().link_of("h1/nic0") == "h1-leaf0r0"  # type: ignore[attr-defined]
               for d in detectors)
    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"fabric\.json"):
        link.build(SimpleNamespace(fabric_map_file=str(path)))
