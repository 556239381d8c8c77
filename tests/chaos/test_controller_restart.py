"""Restart the controller while an action is half applied: it is completed or rolled back, never applied twice.

A real ``ridethrough server`` (gateway, controller with the actuator runner, chDB store) loads a
test actuator plugin through a real ``ridethrough.actuators`` entry point (a ``.dist-info`` on
``PYTHONPATH``). Telemetry says two NICs of one node went down; the link detector opens an
incident for each and the runner acts on both. The plugin's apply writes its effects to files,
then blocks, as a slow switch would: on ``eth0`` it stops after step 1 of 2 (half applied), on
``eth1`` after both steps (applied, not yet reported). The server is SIGKILLed mid-apply and
started again on the same store. The new controller must take both actions over at start:
verify ``eth1`` and complete it, verify ``eth0``, find it half done and roll it back; it must
never call apply again, and each NIC keeps the one incident it had. PagerDuty (a local server
holding the Events API v2 contract) gets one page per incident and one change event per action.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import clickhouse_connect
import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

from ridethrough.actuators.contract import Deadline, FleetState, Plan, Result
from ridethrough.detectors.incidents import Incident
from ridethrough.exporters.rows import kv
from tests.conftest import Proc, read_ready, wait_for
from tests.otlp_util import grpc_export
from tests.pagerduty_server import PagerDutyServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NODE = "chaosnode"
HALF, WHOLE = f"{NODE}/eth0", f"{NODE}/eth1"
"""Apply is cut short after step 1 on HALF, after both steps on WHOLE."""
PLUGIN = "chaos-restart"
EFFECTS_ENV = "RT_CHAOS_EFFECTS_DIR"
PD_KEY = "0123456789abcdef0123456789abcdef"


class RestartPlugin:
    """A tiny actuator whose effects are files: ``<nic>.state`` holds the steps applied, ``journal`` every call.

    It acts on link_down incidents of `NODE`'s NICs only. Apply writes its steps, then blocks until
    its deadline (the test kills the process long before); verify is ok when both steps are there;
    rollback removes them. The directory comes from the environment of the process that loads it.
    """

    name = PLUGIN

    def __init__(self) -> None:
        self.dir = Path(os.environ[EFFECTS_ENV])

    def _journal(self, line: str) -> None:
        with open(self.dir / "journal", "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def _state(self, nic: str) -> Path:
        return self.dir / f"{nic.replace('/', '_')}.state"

    def plan(self, incident: Incident, fleet_state: FleetState) -> Plan | None:
        if incident.kind != "link_down" or not incident.entity.startswith(f"{NODE}/"):
            return None
        return Plan.for_incident(self.name, incident, summary=f"move traffic off {incident.entity}",
                                 steps=("step1: drain the port", "step2: move the routes"),
                                 params={"nic": incident.entity})

    def apply(self, plan: Plan, deadline: Deadline) -> Result:
        nic = plan.params["nic"]
        self._journal(f"apply {nic}")
        for n in (1, 2) if nic == WHOLE else (1,):
            with open(self._state(nic), "a") as f:
                f.write(f"step{n}\n")
                f.flush()
                os.fsync(f.fileno())
        self._journal(f"blocked {nic}")
        time.sleep(deadline.remaining_s())  # a switch that never answers: the test kills us meanwhile
        return Result.failure("apply outlived its deadline")

    def verify(self, plan: Plan, deadline: Deadline) -> Result:
        nic = plan.params["nic"]
        state = self._state(nic)
        steps = state.read_text().split() if state.exists() else []
        ok = steps == ["step1", "step2"]
        self._journal(f"verify {nic} {'ok' if ok else 'half'}")
        return Result(ok, "both steps in place" if ok else f"only {steps} in place")

    def rollback(self, plan: Plan, deadline: Deadline) -> Result:
        nic = plan.params["nic"]
        self._state(nic).unlink(missing_ok=True)
        self._journal(f"rollback {nic}")
        return Result.success("steps removed")


def _nic_down(now_ns: int) -> ExportMetricsServiceRequest:
    """Both NICs up 4 s ago, down 2 s ago: the link detector's "went down" evidence (sent twice, it also
    looks like a flap: another kind of incident, which the plugin leaves alone)."""
    req = ExportMetricsServiceRequest()
    rm = req.resource_metrics.add()
    rm.resource.attributes.extend([kv("service.name", "ridethrough-agent"), kv("host.name", NODE),
                                   kv("ridethrough.node.id", NODE)])
    metric = rm.scope_metrics.add().metrics.add(name="ridethrough.nic.up", unit="1")
    for nic in (HALF, WHOLE):
        for ago_s, value in ((4, 1.0), (2, 0.0)):
            p = metric.gauge.data_points.add(time_unix_nano=now_ns - ago_s * 10**9, as_double=value)
            p.attributes.append(kv("network.interface.name", nic.split("/", 1)[1]))
    return req


def _install_plugin(site: Path) -> None:
    """Register `RestartPlugin` as an installed distribution's ``ridethrough.actuators`` entry point."""
    dist = site / "rt_chaos_restart-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: rt-chaos-restart\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        f"[ridethrough.actuators]\n{PLUGIN} = tests.chaos.test_controller_restart:RestartPlugin\n")


class Server:
    """``ridethrough server`` processes on one config and store; `start` again after a kill."""

    def __init__(self, spawn: Callable[..., Proc], tmp_path: Path, env: dict[str, str], pd: PagerDutyServer) -> None:
        self.spawn, self.tmp, self.env = spawn, tmp_path, {**env, "RT_CHAOS_PD_KEY": PD_KEY}
        self.config = tmp_path / "rt.yaml"
        # Never resolve while the test runs (the evidence ages out of the detector's window), act at
        # once, and let apply block far longer than the test lasts.
        self.config.write_text("controller:\n  quiet_s: 900\n"
                               "actuators:\n  enabled: true\n  dry_run: false\n  hysteresis_s: 0\n"
                               "  cooldown_s: 900\n  apply_timeout_s: 600\n  verify_timeout_s: 60\n"
                               f"pagerduty:\n  enabled: true\n  events_url: {pd.events_url}\n"
                               f"  change_url: {pd.change_url}\n  routing_keys: {{'*': 'env:RT_CHAOS_PD_KEY'}}\n"
                               f"  outbox: {tmp_path / 'outbox.sqlite3'}\n  initial_backoff_s: 0.05\n"
                               "  dashboard_url: https://dash.example\n")
        self.proc: Proc | None = None

    def start(self) -> dict[str, str]:
        ready = self.tmp / "ready.json"
        ready.unlink(missing_ok=True)
        self.proc = self.spawn("server", "--config", str(self.config), "--store", f"chdb://{self.tmp}/store",
                               "--spool", str(self.tmp / "spool"), "--otlp-listen", "127.0.0.1:0",
                               "--store-http-listen", "127.0.0.1:0", "--ready-file", str(ready),
                               env=self.env, name="server")
        return read_ready(ready, self.proc, timeout_s=120)


def _reader(addresses: dict[str, str]) -> Any:
    host, port = addresses["store_http"].removeprefix("http://").rsplit(":", 1)
    return clickhouse_connect.get_client(host=host, port=int(port))


_ACTIONS = """
SELECT argMax(Entity, Version) AS entity, argMax(Status, Version) AS status, argMax(Reason, Version) AS reason,
       argMax(Recoveries, Version) AS takeovers, ActionId
FROM actions WHERE Plugin = {plugin:String} GROUP BY ActionId ORDER BY entity, status
"""


def _actions(db: Any) -> list[tuple[str, str, str, int, str]]:
    return [tuple(r) for r in db.query(_ACTIONS, parameters={"plugin": PLUGIN}).result_rows]


def test_a_controller_killed_mid_apply_completes_or_rolls_back_each_action_once(
        spawn, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    effects, site = tmp_path / "effects", tmp_path / "site"
    effects.mkdir()
    _install_plugin(site)
    env = {EFFECTS_ENV: str(effects), "PYTHONPATH": os.pathsep.join(filter(None, [str(site),
                                                                                  os.environ.get("PYTHONPATH")]))}
    pd = PagerDutyServer(routing_keys={PD_KEY}).__enter__()
    request.addfinalizer(lambda: pd.__exit__(None, None, None))
    server = Server(spawn, tmp_path, env, pd)
    first = server.start()
    assert grpc_export(first["otlp"], _nic_down(time.time_ns()))[0] == "OK"
    journal = effects / "journal"

    def both_blocked() -> bool:
        text = journal.read_text() if journal.exists() else ""
        return f"blocked {HALF}" in text and f"blocked {WHOLE}" in text
    wait_for(both_blocked, timeout_s=90, what="both applies to be under way")
    db = _reader(first)
    in_flight = wait_for(lambda: [a for a in _actions(db) if a[1] == "applying"] if len(_actions(db)) == 2 else [],
                         timeout_s=30, what="the journal to say both are applying")
    assert sorted(a[0] for a in in_flight) == [HALF, WHOLE]
    assert server.proc is not None
    server.proc.kill()  # SIGKILL: no shutdown, no final rows, apply never returns

    second = server.start()
    db = _reader(second)
    # Fresh evidence, so the new controller meets the incidents again however long its start took.
    assert grpc_export(second["otlp"], _nic_down(time.time_ns()))[0] == "OK"

    def finished() -> list[tuple[str, str, str, int, str]]:
        acted = [a for a in _actions(db) if a[1] != "refused"]
        return acted if all(a[1] in ("succeeded", "rolled_back") for a in acted) else []
    acted = wait_for(finished, timeout_s=120, what="both actions to be finished by the new controller")
    assert [(a[0], a[1], a[3]) for a in acted] == [(HALF, "rolled_back", 1), (WHOLE, "succeeded", 1)]
    assert acted[0][2] == "verify failed after a runner restart: only ['step1'] in place"
    assert acted[1][2] == "verified after a runner restart"

    # The new controller meets the same incidents again and does not act twice: it refuses the plan as
    # already decided (this also proves its detectors saw the evidence after the restart).
    def refused_again() -> list[str]:
        found = db.query("SELECT Entity, Reason FROM actions FINAL WHERE Plugin = {p:String} AND Status = 'refused'",
                         parameters={"p": PLUGIN}).result_rows
        entities = sorted({e for e, reason in found if reason.startswith("duplicate:")})
        return entities if entities == [HALF, WHOLE] else []
    wait_for(refused_again, timeout_s=60, what="the restarted runner to refuse both plans as duplicates")
    lines = journal.read_text().splitlines()
    assert lines.count(f"apply {HALF}") == 1 and lines.count(f"apply {WHOLE}") == 1
    assert [ln for ln in lines if ln.endswith(HALF) or f" {HALF} " in ln] == [
        f"apply {HALF}", f"blocked {HALF}", f"verify {HALF} half", f"rollback {HALF}"]
    assert [ln for ln in lines if ln.endswith(WHOLE) or f" {WHOLE} " in ln] == [
        f"apply {WHOLE}", f"blocked {WHOLE}", f"verify {WHOLE} ok"]
    assert not (effects / "chaosnode_eth0.state").exists()  # rolled back: nothing half done is left
    assert (effects / "chaosnode_eth1.state").read_text().split() == ["step1", "step2"]
    incidents = db.query("SELECT Entity, uniqExact(IncidentId), argMax(State, Version) FROM incidents "
                         "WHERE Kind = 'link_down' AND Entity LIKE {n:String} GROUP BY Entity ORDER BY Entity",
                         parameters={"n": f"{NODE}/%"}).result_rows
    assert [tuple(r) for r in incidents] == [(HALF, 1, "open"), (WHOLE, 1, "open")]
    # PagerDuty: one page per incident (the restart re-paged nothing), one change event per action.
    changes = wait_for(lambda: pd.changes if len(pd.changes) >= 2 else [], timeout_s=60, what="two change events")
    outcomes = sorted((c["payload"]["custom_details"]["entity"], c["payload"]["custom_details"]["outcome"],
                       c["payload"]["custom_details"]["takeovers"]) for c in changes)
    assert outcomes == [(HALF, "rolled_back", 1), (WHOLE, "succeeded", 1)]
    assert all(c["links"][0]["href"].startswith("https://dash.example/incidents/") for c in changes)
    for nic in (HALF, WHOLE):  # a trigger resent after the kill folds into its alert, as in PagerDuty
        alerts = [a for a in pd.alerts if a.dedup_key == f"ridethrough:link_down:nic:{nic}"]
        assert len(alerts) == 1 and alerts[0].state == "triggered", alerts
