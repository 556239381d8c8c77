"""The lab's switch agent on the real kernel: each leaf answers signed commands like a host agent.

One small lab (2 racks of one host, 2 rails, 2 spines; the controller and the reflex off) with its
agents; the test process is the controller: the real control client, signing with the lab's key
and finding the leaves in the lab's targets file (`supervisor.controller_env`). A route set on
``leaf0r0`` must change what its namespace's kernel forwards, and its restore must undo it.
Needs root and network namespaces.
"""

from __future__ import annotations

import os
import secrets
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from ridethrough.actuators.commands import parse_hops
from ridethrough.actuators.control_client import AgentTargets, ControlCallError, ControlClient, Reply
from ridethrough.actuators.routes import RTPROT_RIDETHROUGH_CENTRAL
from ridethrough.actuators.switch_map import SwitchMap
from ridethrough.exporters.store import Store
from ridethrough.lab import netns
from ridethrough.lab.fabric import Lab
from ridethrough.lab.switch_agent import SWITCH_CONTROL_PORT_BASE, SWITCHES_FILE
from tests.conftest import wait_for
from tests.test_reroute_central_lab import agents_answer, controller, quiet_lab
from tests.test_reroute_lab import echo_flows_ok

REASON = netns.unavailable_reason()
pytestmark = [pytest.mark.integration, pytest.mark.skipif(REASON is not None, reason=REASON or "")]
LEAF = "leaf0r0"
PREFIX = "10.200.1.0/24"  # rack 1's stable addresses, behind leaf1r0 and leaf1r1
METRIC = 100
FLOWS = 32  # L4-hashed flows: both spines carry some of 32 unless a route pins them (chance 2**-31)


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with quiet_lab("tsw") as running:
        yield running
        stopped_gently(running)
    assert not [n for n in netns.list_names() if n.startswith(f"rt-{running.name}-")]


def stopped_gently(lab: Lab) -> None:
    """SIGTERM makes the switch agent stop its planes, flush and exit 0 (the supervisor records the exit)."""
    rec = lab.state()["processes"]["switches"]
    os.kill(int(rec["pid"]), signal.SIGTERM)
    wait_for(lambda: "switches" in lab.state().get("exits", {}), timeout_s=60, what="the switch agent to exit")
    assert lab.state()["exits"]["switches"] == 0, (lab.dir / "logs" / "switches.log").read_text()


@pytest.fixture(scope="module")
def ctl(lab: Lab) -> Iterator[tuple[ControlClient, AgentTargets]]:
    client, targets = controller(lab)
    wait_for(lambda: agents_answer(client, targets, lab.topology.leaves), timeout_s=120, interval_s=0.5,
             what="every leaf's control plane to answer signed pings")
    yield client, targets
    client.close()


def call(ctl: tuple[ControlClient, AgentTargets], command: str, *, node: str = LEAF, key: str = "",
         traceparent: str | None = None, **args: Any) -> Reply:
    client, targets = ctl
    return client.call(target=targets(LEAF), node=node, command=command, args=args, timeout_s=30,
                       key=key or f"t-{command}-{time.time_ns()}", traceparent=traceparent)


def exits(lab: Lab, dst: str) -> set[str]:
    """The interfaces ``leaf0r0`` forwards h0's packets to ``dst`` out of, over `FLOWS` UDP flows."""
    h = lab.handle(LEAF)
    names = h.names_by_index()
    src, iif = lab.topology.stable_ip("h0"), h.index("h0")
    return {str(names[h.route_get(dst, src=src, iif=iif, ip_proto=17, sport=40000 + i, dport=9).get_attr("RTA_OIF")])
            for i in range(FLOWS)}


def central_routes(lab: Lab) -> list[tuple[str, int, list[tuple[str, str]]]]:
    """Protocol-115 routes in leaf0r0's main table: (destination, metric, [(interface, gateway)])."""
    h = lab.handle(LEAF)
    names = h.names_by_index()
    out = []
    for r in h.ipr.get_routes(family=2, table=254, proto=RTPROT_RIDETHROUGH_CENTRAL):
        multipath = r.get_attr("RTA_MULTIPATH")
        hops = ([(str(names[nh["oif"]]), str(dict(nh.get("attrs", [])).get("RTA_GATEWAY"))) for nh in multipath]
                if multipath else [(str(names[r.get_attr("RTA_OIF")]), str(r.get_attr("RTA_GATEWAY")))])
        out.append((f"{r.get_attr('RTA_DST')}/{r['dst_len']}", int(r.get_attr("RTA_PRIORITY") or 0), hops))
    return out


def test_a_leaf_answers_a_ping_with_its_node_id_at_its_port_on_the_server_address(
        lab: Lab, ctl: tuple[ControlClient, AgentTargets]) -> None:
    assert ctl[1](LEAF) == f"{lab.info['server_ip']}:{SWITCH_CONTROL_PORT_BASE}"
    reply = call(ctl, "ping")
    assert reply.ok and reply.node == LEAF and reply.data["node"] == LEAF
    assert abs(int(reply.data["time_unix_nano"]) - time.time_ns()) < 60 * 10**9


def test_route_set_pins_a_prefix_to_one_spine_in_the_leafs_kernel_and_restore_undoes_it(
        lab: Lab, ctl: tuple[ControlClient, AgentTargets]) -> None:
    dst = "10.200.1.1"  # h1's stable address
    assert exits(lab, dst) == {"spine0", "spine1"}, "the leaf's own /16 spreads flows over both spines"
    got = call(ctl, "route.get", destination=PREFIX)
    assert got.ok and got.data["present"] is False
    base = dict(parse_hops(str(got.data["base"])))  # the leaf's own route, as the reroute plugin plans from it
    gateway = lab.topology.link(f"{LEAF}-spine1").upper_ip
    assert base == {"spine0": lab.topology.link(f"{LEAF}-spine0").upper_ip, "spine1": gateway}
    trace_id = secrets.token_hex(16)
    key = f"t-set-{time.time_ns()}"
    try:
        reply = call(ctl, "route.set", key=key, traceparent=f"00-{trace_id}-{secrets.token_hex(8)}-01",
                     destination=PREFIX, dev="spine1", via=gateway, metric=METRIC)
        assert reply.ok and reply.data["previous_absent"] is True, reply
        assert central_routes(lab) == [(PREFIX, METRIC, [("spine1", gateway)])]
        assert exits(lab, dst) == {"spine1"}
        assert all(echo_flows_ok(lab)), "h0 still reaches h1 through the pinned spine"
        again = call(ctl, "route.set", key=key, destination=PREFIX, dev="spine1", via=gateway, metric=METRIC)
        assert again.duplicate and again.ok
        got = call(ctl, "route.get", destination=PREFIX)
        assert (got.data["present"], got.data["dev"], got.data["metric"], got.data["lookup"]) == \
            (True, "spine1", METRIC, "spine1")
        assert_span_in_store(lab, trace_id)
    finally:
        restored = call(ctl, "route.restore", destination=PREFIX)
    assert restored.ok, restored
    assert central_routes(lab) == []
    assert exits(lab, dst) == {"spine0", "spine1"}


def assert_span_in_store(lab: Lab, trace_id: str) -> None:
    """The leaf's ``agent.route.set`` span reached the lab's store, its resource naming the leaf."""
    store = Store(lab.server["store_http"], timeout_s=30.0)
    sql = ("SELECT SpanName, ResourceAttributes['ridethrough.node.id'], ResourceAttributes['ridethrough.cluster'], "
           f"SpanAttributes['command.outcome'] FROM otel_traces WHERE TraceId = '{trace_id}'")

    def rows() -> list[tuple[Any, ...]]:
        try:
            found: list[tuple[Any, ...]] = store.query(sql)[1]
        except Exception:  # the server's store may be busy: not there yet
            return []
        return found
    try:
        found = wait_for(rows, timeout_s=120, interval_s=1.0, what="the leaf's command span in the store")
    finally:
        store.close()
    assert found == [("agent.route.set", LEAF, lab.name, "ok")]


def test_a_command_signed_for_another_leaf_is_refused(ctl: tuple[ControlClient, AgentTargets]) -> None:
    with pytest.raises(ControlCallError) as refused:
        call(ctl, "ping", node="leaf0r1")
    assert (refused.value.code, refused.value.reason) == ("PERMISSION_DENIED", "wrong_node")


def test_the_switches_file_names_every_leaf_with_its_prefixes_and_ports(lab: Lab) -> None:
    switches = SwitchMap.load(lab.dir / SWITCHES_FILE)
    assert sorted(switches.leaves) == sorted(lab.topology.leaves)
    leaf = switches.leaves[LEAF]
    assert leaf.prefixes == ("10.200.0.0/24", "10.64.0.0/24")
    assert dict(leaf.ports) == {f"{LEAF}-spine0": "spine0", f"{LEAF}-spine1": "spine1"}
    assert switches.leaves["leaf1r1"].prefixes == ("10.200.1.0/24", "10.65.1.0/24")
    names = set(lab.handle(LEAF).names_by_index().values())
    assert set(leaf.ports.values()) <= names, "each port is an interface of the leaf's namespace"
