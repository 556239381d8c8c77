"""An agent SIGKILLed in the middle of a reroute: the host stays reachable, no route is lost, and the agent
started again carries on from the routes the kernel kept.

One small lab (2 racks of one host, 2 rails, 2 spines) whose agents run both the reflex (watching every
peer, hold-down 1 s) and the control plane; the server's controller is off (the test is the controller,
signing with the lab's key). A spine link is cut, then h1's agent is killed:

* reflex: after it moved h1's traffic off the rail; the kernel keeps the override, traffic flows, and
  the restarted agent adopts the override (keeps it while the link is cut, returns it after);
* central: between the controller's apply and its verify; the kernel keeps the controller's route, the
  verify waits for the restarted agent and reads the route back from it, and the rollback restores the
  route with what ``route.set`` returned (the new agent's journal is empty).

Needs root and network namespaces.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ridethrough.actuators.contract import Deadline, FleetState, Result
from ridethrough.actuators.reroute_plugin import RerouteConfig, ReroutePlugin
from ridethrough.actuators.tracing import ActionTrace, activate
from ridethrough.lab import netns, procs
from ridethrough.lab.fabric import Lab
from ridethrough.lab.procs import ProcRef
from ridethrough.lab.supervisor import CONTROL_PORT, REFLEX_PEERS_FILE, agent_env
from ridethrough.lab.topology import TopologySpec
from tests.conftest import wait_for
from tests.test_reroute_central_lab import (
    LINK,
    agents_answer,
    central_routes,
    controller,
    link_incident,
    moved,
)
from tests.test_reroute_lab import echo_flows_ok, overrides

REASON = netns.unavailable_reason()
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=REASON or "")]
TUNING = {"RIDETHROUGH_AGENT_REFLEX": "true", "RIDETHROUGH_AGENT_REFLEX_WATCH": "all",
          "RIDETHROUGH_AGENT_REFLEX_HOLDDOWN_S": "1", "RIDETHROUGH_AGENT_REFLEX_HOLDDOWN_MAX_S": "1",
          "RIDETHROUGH_CONTROLLER_ENABLED": "false"}


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with pytest.MonkeyPatch.context() as env:  # the supervisor, hence the agents, inherit it
        for k, v in TUNING.items():
            env.setenv(k, v)
        with Lab.up(TopologySpec(hosts=2, racks=2, rails=2, spines=2, gpus=0),
                    name=f"trk{os.getpid() % 100000}") as running:
            yield running


class AgentOf:
    """One lab host's agent: SIGKILL it (whichever process it is now) and start it again as the lab would."""

    def __init__(self, lab: Lab, host: str, logs: Path) -> None:
        self.lab, self.host, self.logs = lab, host, logs
        self.started: list[Any] = []

    def kill(self) -> None:
        if self.started:
            self.started[-1].send_signal(signal.SIGKILL)
            self.started[-1].wait(30)
            return
        ref = ProcRef.from_json(self.lab.state()["processes"][f"agent:{self.host}"])
        os.kill(ref.pid, signal.SIGKILL)
        wait_for(lambda: not procs.alive(ref), timeout_s=30, what=f"{self.host}'s agent to die")

    def start(self) -> None:
        info, state = self.lab.host_info(self.host), self.lab.state()
        d = Path(info["dir"])
        env = agent_env(d, self.lab.dir / "peers.json", control_listen=f"{info['mgmt_ip']}:{CONTROL_PORT}",
                        control_keys=self.lab.dir / "control" / "keys")
        argv = [sys.executable, "-m", "ridethrough", "agent", "--node-id", self.host, "--cluster", state["name"],
                "--gateway", f"{state['server_ip']}:{state['otlp_port']}", "--sysfs-root", str(d / "sysfs"),
                "--clock-script", str(d / "clock.json")]
        with open(self.logs / f"agent-{self.host}-{len(self.started)}.log", "ab") as out:
            self.started.append(self.lab.exec(self.host, argv, env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
                                              stdout=out, stderr=out))

    def stop(self) -> None:
        for p in self.started:
            if p.poll() is None:
                p.kill()
                p.wait(10)


@pytest.fixture(scope="module")
def h1_agent(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentOf]:
    """h1's agent, whichever process it is: the lab's first, then the ones the tests start."""
    agent = AgentOf(lab, "h1", tmp_path_factory.mktemp("agents"))
    yield agent
    agent.stop()


def test_a_killed_agent_leaves_its_reflex_override_and_the_restarted_one_adopts_it(lab: Lab, h1_agent) -> None:
    h0, h1 = (lab.topology.stable_ip(h) for h in ("h0", "h1"))
    lab.set_link(LINK, up=False, end="spine0")
    try:
        wait_for(lambda: overrides(lab, "h1").get(h0) == ["nic0"] and overrides(lab, "h0").get(h1) == ["nic0"],
                 timeout_s=60, what="both reflexes to move off nic1")
        h1_agent.kill()
        assert overrides(lab, "h1").get(h0) == ["nic0"], "the override outlives the agent"
        assert all(echo_flows_ok(lab)), "h0 and h1 reach each other with h1's agent dead"
        h1_agent.start()
        client, targets = controller(lab)
        wait_for(lambda: agents_answer(client, targets, ["h1"]), timeout_s=120, interval_s=0.5,
                 what="the restarted agent's control plane")
        client.close()
        time.sleep(3.0)  # several hold-downs' worth: an agent that dropped the override would have by now
        assert overrides(lab, "h1").get(h0) == ["nic0"], "the restarted agent keeps it while the link is cut"
        assert all(echo_flows_ok(lab, flows=8))
    finally:
        lab.set_link(LINK, up=True)
    wait_for(lambda: h0 not in overrides(lab, "h1"), timeout_s=60, what="the restarted agent to return the traffic")


def test_a_killed_agent_mid_action_keeps_the_controllers_route_and_the_restarted_one_is_read_and_restored(
        lab: Lab, h1_agent) -> None:
    client, targets = controller(lab)
    wait_for(lambda: agents_answer(client, targets, ["h0", "h1"]), timeout_s=120, interval_s=0.5,
             what="both control planes")
    plugin = ReroutePlugin(client, target=targets, config=RerouteConfig(
        fabric_map_file=str(lab.dir / "fabric.json"), addresses_file=str(lab.dir / REFLEX_PEERS_FILE)))
    lab.set_link(LINK, up=False, end="spine0")
    try:
        plan = plugin.plan(link_incident("link_down"), FleetState(taken_at_ns=time.time_ns()))
        assert plan is not None
        trace = ActionTrace(trace_id=link_incident("link_down").trace_id, action_id="chaos", clock=time.time_ns)
        with activate(trace, trace.start("action.apply"), []):
            applied = plugin.apply(plan, Deadline.after(60))
        assert applied.ok, applied.detail
        assert moved(lab)
        h1_agent.kill()
        assert moved(lab), "no route lost with the agent"
        assert all(echo_flows_ok(lab)), "h1 stays reachable"
        verified: list[Result] = []
        verifying = threading.Thread(target=lambda: verified.append(plugin.verify(plan, Deadline.after(120))))
        verifying.start()  # its calls to h1 wait for an agent to answer
        time.sleep(1.0)
        h1_agent.start()
        verifying.join(150)
        assert verified and verified[0].ok, verified
        undone = plugin.rollback(plan, Deadline.after(60))
        assert undone.ok, undone.detail
        assert central_routes(lab, "h0") == {} and central_routes(lab, "h1") == {}, \
            "the restarted agent restored what the controller passed back"
    finally:
        lab.set_link(LINK, up=True)
        client.close()
