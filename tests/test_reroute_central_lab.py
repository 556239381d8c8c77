"""The central reroute on the real kernel: the runner, the ``reroute`` plugin, signed commands, real agents.

One small lab (2 racks of one host, 2 rails, 2 spines) with its agents' control planes on (the lab
makes their key and the targets file; the reflex and the server's controller are off, so every
route change here is the central one). The test process is the controller: it signs with the
lab's key (`supervisor.controller_env`) and runs the real `Runner` against its own chDB store.
Needs root and network namespaces.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ridethrough.actuators.actions import Status
from ridethrough.actuators.contract import Deadline, FleetState, Plan, Result
from ridethrough.actuators.control_client import (
    AgentTargets,
    ControlCallError,
    ControlClient,
    ControlClientConfig,
    build_control_client,
)
from ridethrough.actuators.policy import RunnerPolicy
from ridethrough.actuators.reroute_plugin import CENTRAL_METRIC, RerouteConfig, ReroutePlugin
from ridethrough.actuators.routes import RTPROT_RIDETHROUGH_CENTRAL
from ridethrough.actuators.runner import Runner
from ridethrough.controller_wiring import fleet_from_map
from ridethrough.detectors.contract import Severity
from ridethrough.detectors.fabric_map import RouteFile
from ridethrough.detectors.incidents import Incident, State, new_trace_id
from ridethrough.exporters.store import Store
from ridethrough.lab import netns
from ridethrough.lab.fabric import Lab
from ridethrough.lab.supervisor import REFLEX_PEERS_FILE, controller_env
from ridethrough.lab.topology import TopologySpec
from tests.conftest import wait_for
from tests.test_reroute_lab import echo_flows_ok

REASON = netns.unavailable_reason()
pytestmark = [pytest.mark.integration, pytest.mark.skipif(REASON is not None, reason=REASON or "")]
QUIET = {"RIDETHROUGH_CONTROLLER_ENABLED": "false", "RIDETHROUGH_AGENT_REFLEX": "false"}
LINK = "leaf0r1-spine0"


@contextlib.contextmanager
def quiet_lab(prefix: str, **up: Any) -> Iterator[Lab]:
    """Two racks of one host each, with neither the controller nor the reflex acting on their own."""
    with pytest.MonkeyPatch.context() as env:  # the supervisor, hence the server and the agents, inherit it
        for k, v in QUIET.items():
            env.setenv(k, v)
        with Lab.up(TopologySpec(hosts=2, racks=2, rails=2, spines=2, gpus=0),
                    name=f"{prefix}{os.getpid() % 100000}", **up) as running:
            yield running


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with quiet_lab("trc") as running:
        yield running


def controller(lab: Lab) -> tuple[ControlClient, AgentTargets]:
    """The lab's controller side: a client signing with the lab's key, and where each agent listens."""
    env = controller_env(lab.dir)
    return (build_control_client(ControlClientConfig.from_environ(env), environ=env),
            AgentTargets(file=env["RIDETHROUGH_CONTROL_TARGETS_FILE"]))


def agents_answer(client: ControlClient, targets: AgentTargets, hosts: list[str]) -> bool:
    try:
        return all(client.call(target=targets(h), node=h, command="ping", key=f"ping-{h}-{time.time_ns()}",
                               timeout_s=2).ok for h in hosts)
    except ControlCallError:
        return False


def central_routes(lab: Lab, host: str) -> dict[str, tuple[int, list[str]]]:
    """The controller's routes on a host, read from the kernel: destination → (metric, interfaces)."""
    h = lab.handle(host)
    names = h.names_by_index()
    out: dict[str, tuple[int, list[str]]] = {}
    for r in h.ipr.get_routes(family=2, table=254, proto=RTPROT_RIDETHROUGH_CENTRAL):
        hops = r.get_attr("RTA_MULTIPATH") or [{"oif": r.get_attr("RTA_OIF")}]
        out[f"{r.get_attr('RTA_DST')}/{r['dst_len']}"] = (int(r.get_attr("RTA_PRIORITY") or 0),
                                                          sorted(str(names[nh["oif"]]) for nh in hops))
    return out


def moved(lab: Lab) -> bool:
    h0, h1 = (f"{lab.topology.stable_ip(h)}/32" for h in ("h0", "h1"))
    want = (CENTRAL_METRIC, ["nic0"])
    return central_routes(lab, "h0") == {h1: want} and central_routes(lab, "h1") == {h0: want}


def link_incident(kind: str) -> Incident:
    opened = time.time_ns() - 60 * 10**9
    return Incident(f"inc-{kind}-{time.time_ns()}", f"{kind}:link:{LINK}", kind, "link", LINK, "lab", "link",
                    Severity.ERROR, State.OPEN, opened, opened, 0, opened, 1, 0, f"{LINK}: {kind}", "{}",
                    new_trace_id(), 1)


class VerifyFails:
    """The real plugin, whose verify is overruled: the runner must then roll back (through the agents)."""

    name = "reroute"

    def __init__(self, real: ReroutePlugin) -> None:
        self.real = real

    def plan(self, incident: Incident, fleet_state: FleetState) -> Plan | None:
        return self.real.plan(incident, fleet_state)

    def apply(self, plan: Plan, deadline: Deadline) -> Result:
        return self.real.apply(plan, deadline)

    def verify(self, plan: Plan, deadline: Deadline) -> Result:
        checked = self.real.verify(plan, deadline)
        return Result.failure(f"overruled by the test after: {checked.detail}")

    def rollback(self, plan: Plan, deadline: Deadline) -> Result:
        return self.real.rollback(plan, deadline)


@pytest.fixture
def parts(lab: Lab, tmp_path: Path) -> Iterator[dict[str, Any]]:
    client, targets = controller(lab)
    wait_for(lambda: agents_answer(client, targets, ["h0", "h1"]), timeout_s=120, interval_s=0.5,
             what="both agents' control planes to answer signed pings")
    plugin = ReroutePlugin(client, target=targets, config=RerouteConfig(
        fabric_map_file=str(lab.dir / "fabric.json"), addresses_file=str(lab.dir / REFLEX_PEERS_FILE)))
    store = Store(f"chdb://{tmp_path / 'store'}")
    store.init_schema()
    fleet = fleet_from_map(RouteFile(lab.dir / "fabric.json"), NoIncidents())  # type: ignore[arg-type]
    yield {"client": client, "plugin": plugin, "store": store, "fleet": fleet}
    client.close()
    store.close()


class NoIncidents:
    """The tracker `fleet_from_map` asks for open incidents (the test hands the runner its incident)."""

    def open(self) -> list[Incident]:
        return []


def run(store: Store, plugin: Any, incident: Incident, fleet: Callable[[], FleetState]) -> tuple[str, str, str]:
    """The runner's decision on ``incident`` carried out; its final (status, reason, detail)."""
    policy = RunnerPolicy(dry_run=False, hysteresis_s=0.0, cooldown_s=0.0, max_path_share=1.0,
                          apply_timeout_s=120.0, verify_timeout_s=120.0, rollback_timeout_s=120.0)
    runner = Runner(store=store, plugins=[plugin], policy=policy, fleet=fleet)
    [decision] = runner.consider([incident])
    assert decision.status is Status.APPLYING, decision.reason
    assert runner.wait_idle(300)
    _, rows = store.query("SELECT argMax(Status, Version), argMax(Reason, Version), argMax(Detail, Version) "
                          "FROM actions WHERE ActionId = {a:String}", parameters={"a": decision.action_id})
    return rows[0]


def test_a_cut_spine_link_is_routed_around_by_the_controller_and_undone(lab: Lab, parts: dict[str, Any]) -> None:
    lab.set_link(LINK, up=False, end="spine0")
    try:
        incident = link_incident("link_down")
        status, reason, detail = run(parts["store"], parts["plugin"], incident, parts["fleet"])
        assert status == Status.SUCCEEDED.value, f"{reason}: {detail}"
        assert moved(lab), "h0 and h1 send each other's traffic out of nic0 only"
        assert all(echo_flows_ok(lab)), "every flow between the stable addresses gets through the cut"
        plan = parts["plugin"].plan(incident, FleetState(taken_at_ns=time.time_ns()))
        undone = parts["plugin"].rollback(plan, Deadline.after(60))
        assert undone.ok, undone.detail
        assert central_routes(lab, "h0") == {} and central_routes(lab, "h1") == {}, "the routes returned"
    finally:
        lab.set_link(LINK, up=True)
    assert all(echo_flows_ok(lab, flows=4)), "both rails carry traffic again"


def test_a_failed_verify_makes_the_runner_roll_back_through_the_agents(lab: Lab, parts: dict[str, Any]) -> None:
    lab.degrade_link(LINK, rate_mbit=1.0)
    try:
        status, reason, detail = run(parts["store"], VerifyFails(parts["plugin"]), link_incident("link_degrading"),
                                     parts["fleet"])
        assert status == Status.ROLLED_BACK.value, f"{reason}: {detail}"
        assert "none leaves through" in detail, "the real verify found the routes right before it was overruled"
        assert "routes restored" in detail
        assert central_routes(lab, "h0") == {} and central_routes(lab, "h1") == {}
    finally:
        lab.restore_link(LINK)
