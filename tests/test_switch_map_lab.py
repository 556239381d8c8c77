"""The lab's switch map, leaf control targets and controller environment, and how the switch agent fails
without its namespaces (no lab is brought up here)."""

from __future__ import annotations

import ipaddress
import json
import os
from pathlib import Path
from typing import Any

import pytest

from ridethrough.actuators.control_client import AgentTargets
from ridethrough.actuators.reroute_netlink import NetlinkRouteOps
from ridethrough.actuators.switch_map import SwitchMap
from ridethrough.lab import netns
from ridethrough.lab.control import LabError
from ridethrough.lab.routing import plan
from ridethrough.lab.state import StateFile
from ridethrough.lab.supervisor import CONTROL_PORT, Supervisor, controller_env, write_control
from ridethrough.lab.switch_agent import (
    SWITCH_CONTROL_PORT_BASE,
    lab_topology,
    serve,
    switch_map,
    switch_port,
    switch_targets,
)
from ridethrough.lab.topology import Topology, TopologySpec

MGMT = "198.18.42.0/24"


def topology(**spec: int) -> Topology:
    return Topology(TopologySpec(**spec), name="swmap", mgmt_subnet=MGMT)


def test_default_lab_map_names_each_leafs_rack_block_and_rail_block() -> None:
    doc = switch_map(topology())
    assert doc["leaf0r0"] == {"prefixes": ["10.200.0.0/24", "10.64.0.0/24"],
                              "ports": {"leaf0r0-spine0": "spine0", "leaf0r0-spine1": "spine1"}}
    assert doc["leaf1r1"] == {"prefixes": ["10.200.1.0/24", "10.65.1.0/24"],
                              "ports": {"leaf1r1-spine0": "spine0", "leaf1r1-spine1": "spine1"}}
    assert sorted(doc) == ["leaf0r0", "leaf0r1", "leaf1r0", "leaf1r1"]


@pytest.mark.parametrize("spec", [{}, {"hosts": 12, "racks": 3, "rails": 4, "spines": 3, "gpus": 0}])
def test_prefixes_hold_exactly_the_leafs_hosts_and_ports_are_its_uplinks(spec: dict[str, int]) -> None:
    topo = topology(**spec)
    doc = switch_map(topo)
    assert set(doc) == set(topo.leaves)
    for leaf, entry in doc.items():
        rack, rail = topo.leaf_position(leaf)
        nets = [ipaddress.IPv4Network(p) for p in entry["prefixes"]]
        for host in topo.hosts:
            stable = ipaddress.IPv4Address(topo.stable_ip(host))
            nic = ipaddress.IPv4Address(topo.nic_ip(host, rail))
            mine = topo.rack_of(host) == rack
            assert any(stable in n for n in nets) is mine, (leaf, host)
            assert any(nic in n for n in nets) is mine, (leaf, host)
        leaf_ifs = {a.ifname for a in plan(topo, leaf).addresses}
        assert set(entry["ports"]) == {f"{leaf}-{s}" for s in topo.spines}
        assert set(entry["ports"].values()) <= leaf_ifs
        for link, ifname in entry["ports"].items():
            assert topo.link(link).ifname(leaf) == ifname
    assert set(SwitchMap.parse(json.loads(json.dumps(doc))).leaves) == set(topo.leaves)  # what the controller reads


def test_each_leaf_has_its_own_port_on_the_server_address() -> None:
    topo = topology(hosts=16, racks=4, rails=4, spines=2, gpus=0)
    targets = switch_targets(topo)
    assert targets["leaf0r0"] == f"{topo.server_ip}:{SWITCH_CONTROL_PORT_BASE}"
    assert topo.server_ip == "198.18.42.1"
    ports = [switch_port(topo, leaf) for leaf in topo.leaves]
    assert len(set(ports)) == len(topo.leaves) == 16
    assert CONTROL_PORT not in ports
    assert all(t == f"{topo.server_ip}:{switch_port(topo, leaf)}" for leaf, t in targets.items())


def test_targets_file_lists_hosts_and_leaves(tmp_path: Path) -> None:
    topo = topology()
    hosts = {"h0": {"mgmt_ip": "198.18.42.10"}, "h1": {"mgmt_ip": "198.18.42.11"}}
    keys, targets_file = write_control(tmp_path, hosts, switch_targets(topo))
    assert keys.stat().st_mode & 0o777 == 0o600
    targets = AgentTargets(file=str(targets_file))
    assert targets("h1") == f"198.18.42.11:{CONTROL_PORT}"
    assert targets("leaf1r0") == f"198.18.42.1:{SWITCH_CONTROL_PORT_BASE + 2}"
    write_control(tmp_path, hosts)  # without switches: hosts only, the key kept
    assert set(json.loads(targets_file.read_text())) == {"h0", "h1"}
    assert controller_env(tmp_path)["RIDETHROUGH_REROUTE_SWITCHES_FILE"] == str(tmp_path / "switches.json")


def _state(tmp_path: Path, mode: str) -> dict[str, Any]:
    return {"name": "swmap", "mode": mode, "dir": str(tmp_path / "swmap"), "mgmt_subnet": MGMT,
            "spec": {"hosts": 4, "racks": 2, "rails": 2, "spines": 2, "gpus": 0}, "hosts": {}}


def test_supervisor_writes_the_map_of_a_namespace_lab_and_an_empty_one_for_loopback(tmp_path: Path) -> None:
    sf = StateFile(tmp_path, "swmap")
    sf.create(_state(tmp_path, "netns"))
    path = Supervisor(sf).write_switch_map()
    assert path == tmp_path / "swmap" / "switches.json"
    assert json.loads(path.read_text()) == switch_map(topology(hosts=4))
    assert not path.with_suffix(".tmp").exists()
    sf.remove()
    sf.create(_state(tmp_path, "loopback"))
    sup = Supervisor(sf)
    assert json.loads(sup.write_switch_map().read_text()) == {}
    assert sup.switch_targets() == {}
    with pytest.raises(LabError, match="no switches"):
        lab_topology(sf.read())


def test_a_netlink_socket_for_a_namespace_that_is_not_there_fails_and_makes_none() -> None:
    name = f"rt-absent{os.getpid()}-leaf0r0"
    ops = NetlinkRouteOps(netns=name)
    with pytest.raises(OSError):
        ops.open()
    assert not netns.ns_path(name).exists()


def test_the_switch_agent_refuses_to_start_without_the_leaves_namespaces(tmp_path: Path) -> None:
    state = {**_state(tmp_path, "netns"), "name": f"absent{os.getpid()}", "server_ip": "198.18.42.1",
             "otlp_port": 4317}
    with pytest.raises(OSError, match=f"namespace rt-absent{os.getpid()}-leaf0r0 of leaf0r0 does not exist"):
        serve(state, keys=tmp_path / "keys")
