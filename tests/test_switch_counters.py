"""Switch port counters from the lab's faults (loss rules, tbf caps): which port counts what, monotonic across
rule changes, and exported over real OTLP with the contract the detectors read."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from ridethrough.lab.control import LabError
from ridethrough.lab.switch_counters import (
    COUNTER,
    METRIC,
    XMIT_WAIT,
    PortCounters,
    faulted_links,
    meter_providers,
    tbf_overlimits,
)
from ridethrough.lab.topology import Topology, TopologySpec
from tests.ns_fakes import PerNamespace
from tests.otlp_sink import export_once

TOPO = Topology(TopologySpec(hosts=4, racks=2, rails=1, spines=2, gpus=0), name="t")


@pytest.fixture
def rig() -> Iterator[tuple[PortCounters, PerNamespace[float], set[str], list[float]]]:
    rules, lossy, now = PerNamespace[float]("nft"), set(), [0.0]

    def clock() -> float:
        now[0] += 2.0  # every read is fresh
        return now[0]
    yield PortCounters(TOPO, lambda: lossy, read=rules, clock=clock), rules, lossy, now


def test_a_lossy_uplink_counts_at_the_receiving_port_of_each_end(rig) -> None:
    counters, rules, lossy, _ = rig
    assert counters.ports("leaf0r0") == {"h0": 0.0, "h1": 0.0, "spine0": 0.0, "spine1": 0.0}
    assert rules.reads == 0, "nothing lossy: no nft at all"
    lossy.add("leaf0r0-spine0")
    rules.answers = {TOPO.namespace("spine0"): {"leaf0r0": 40.0}, TOPO.namespace("leaf0r0"): {"spine0": 7.0}}
    assert counters.ports("leaf0r0")["spine0"] == 40.0, "what spine0 dropped towards leaf0r0 never arrived there"
    assert counters.ports("spine0")["leaf0r0"] == 7.0
    assert counters.ports("leaf1r0") == {"h2": 0.0, "h3": 0.0, "spine0": 0.0, "spine1": 0.0}
    assert sorted(counters.switches) == ["leaf0r0", "leaf1r0", "spine0", "spine1"]


def test_counts_stay_monotonic_when_a_rule_is_replaced_removed_or_unreadable(rig) -> None:
    counters, rules, lossy, _ = rig
    lossy.add("leaf0r0-spine0")
    spine = TOPO.namespace("spine0")
    rules.answers = {spine: {"leaf0r0": 40.0}}
    assert counters.ports("leaf0r0")["spine0"] == 40.0
    rules.answers = {spine: {"leaf0r0": 5.0}}  # the rule was set again: its counter restarted
    assert counters.ports("leaf0r0")["spine0"] == 45.0
    rules.broken.add(spine)
    assert counters.ports("leaf0r0")["spine0"] == 45.0, "an unreadable namespace keeps the count"
    rules.broken.clear()
    rules.answers = {spine: {"leaf0r0": 9.0}}
    assert counters.ports("leaf0r0")["spine0"] == 49.0, "no double count after the unreadable round"
    lossy.clear()
    rules.answers = {}
    assert counters.ports("leaf0r0")["spine0"] == 49.0, "the link restored: what was counted stays counted"


def test_a_lossy_host_link_is_left_to_the_hosts_agent_and_an_unknown_link_is_ignored(rig) -> None:
    counters, rules, lossy, _ = rig
    lossy.update({"h0-leaf0r0", "no-such-link"})
    rules.answers = {TOPO.namespace("h0"): {"nic0": 3.0}, TOPO.namespace("leaf0r0"): {"h0": 4.0}}
    assert counters.ports("leaf0r0")["h0"] == 3.0, "the leaf's port towards h0 receives what h0's cable lost"
    assert rules.reads == 1, "only h0's namespace is read: the host's own port is its agent's"


def test_every_switch_exports_its_ports_over_otlp_as_ib_port_errors(rig) -> None:
    counters, rules, lossy, _ = rig
    lossy.add("leaf0r0-spine0")
    rules.answers = {TOPO.namespace("spine0"): {"leaf0r0": 40.0}}
    waits = PerNamespace[float]("nft")
    waits.answers = {TOPO.namespace("leaf1r0"): {"spine1": 12.0}}
    xmit = PortCounters(TOPO, lambda: {"leaf1r0-spine1"}, read=waits, at_receiver=False)
    requests = export_once(lambda gateway: meter_providers(counters, gateway=gateway, cluster="t", xmit_wait=xmit,
                                                            interval_s=3600))
    seen: dict[tuple[str, str], float] = {}
    waited: dict[tuple[str, str], float] = {}
    for req in requests:
        for rm in req.resource_metrics:
            res = {kv.key: kv.value.string_value for kv in rm.resource.attributes}
            assert res["ridethrough.cluster"] == "t" and res["service.name"] == "ridethrough-switch"
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    assert m.name in (METRIC, XMIT_WAIT) and m.sum.is_monotonic
                    for dp in m.sum.data_points:
                        attrs = {kv.key: kv.value.string_value for kv in dp.attributes}
                        assert attrs["ib.port"] == "1"
                        if m.name == METRIC:
                            assert attrs["ib.counter"] == COUNTER
                        into = seen if m.name == METRIC else waited
                        into[(res["ridethrough.node.id"], attrs["ib.device"])] = dp.as_int or dp.as_double
    assert seen[("leaf0r0", "spine0")] == 40.0 and seen[("spine1", "leaf1r0")] == 0.0
    assert {node for node, _ in seen} == {"leaf0r0", "leaf1r0", "spine0", "spine1"}
    assert waited[("leaf1r0", "spine1")] == 12.0 and waited[("spine1", "leaf1r0")] == 0.0


def test_the_faulted_links_come_from_the_labs_state_and_a_missing_state_reads_as_none(tmp_path) -> None:
    from ridethrough.lab.state import StateFile

    sf = StateFile(tmp_path, "t")
    lossy, capped = faulted_links(sf, "loss"), faulted_links(sf, "degrade")
    assert lossy() == [] and capped() == []
    sf.create({"name": "t", "faults": {"link:leaf0r0-spine0/loss": "loss 10% both", "link:h0-leaf0r0/degrade": "x",
                                       "gpu:h0/0": "ecc"}})
    assert lossy() == ["leaf0r0-spine0"] and capped() == ["h0-leaf0r0"]


def test_a_capped_uplink_counts_its_wait_at_the_sending_port_itself(rig) -> None:
    _, rules, _, _ = rig
    rules.answers = {TOPO.namespace("leaf1r0"): {"spine0": 30.0}, TOPO.namespace("h2"): {"nic0": 9.0}}
    xmit = PortCounters(TOPO, lambda: {"leaf1r0-spine0", "h2-leaf1r0"}, read=rules, at_receiver=False)
    assert xmit.ports("leaf1r0") == {"h2": 0.0, "h3": 0.0, "spine0": 30.0, "spine1": 0.0}, "h2's wait: its agent's"
    assert xmit.ports("spine0")["leaf1r0"] == 0.0


def test_tbf_overlimits_reads_a_real_qdisc_in_a_namespace() -> None:
    import subprocess

    from ridethrough.lab import netns

    if netns.unavailable_reason() is not None:
        pytest.skip(netns.unavailable_reason() or "")
    name = f"rt-tbf-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        for cmd in (["link", "add", "v0", "type", "veth", "peer", "name", "v1"], ["link", "set", "v0", "up"],
                    ["link", "set", "v1", "up"]):
            subprocess.run(["ip", "-n", name, *cmd], check=True)
        assert tbf_overlimits(name) == {}, "no tbf: nothing counted"
        subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "replace", "dev", "v0", "root", "handle", "1:",
                        "tbf", "rate", "1mbit", "burst", "32kbit", "latency", "20ms"], check=True)
        assert tbf_overlimits(name) == {"v0": 0.0}
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)
    with pytest.raises(LabError, match="tc in"):
        tbf_overlimits(name)
