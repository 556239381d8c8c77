"""The controller's composition: listeners isolated from each other, the fleet snapshot from the fabric
map, a finding that becomes an incident, a stored event and a page through the built parts, an action
that becomes a PagerDuty change event, and a start that finishes an action a killed controller left."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from ridethrough.actuators.actions import ActionLog, ActionRecord, Status
from ridethrough.actuators.contract import Deadline, FleetState, Plan, Result
from ridethrough.controller_wiring import build_controller, fan_out, fleet_from_map
from ridethrough.detectors.contract import EntityType, Finding, FindingKind, Severity, Window
from ridethrough.detectors.controller import ControllerMetrics
from ridethrough.detectors.fabric_map import RouteMap
from ridethrough.detectors.incidents import Incident, IncidentTracker, Transition
from ridethrough.exporters.gateway_metrics import GatewayMetrics
from ridethrough.exporters.pagerduty_config import PagerDutyConfig
from ridethrough.exporters.store import Store
from ridethrough.lab.topology import Topology, TopologySpec
from ridethrough.settings import ActuatorConfig, ControllerConfig
from tests.conftest import wait_for
from tests.pagerduty_server import PagerDutyServer

KEY = "0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    s = Store(f"chdb://{tmp_path_factory.mktemp('wiring') / 'store'}")
    s.init_schema()
    yield s
    s.close()


def test_fan_out_calls_every_listener_and_reports_the_failed_ones() -> None:
    heard: list[str] = []

    def broken(_: Sequence[Transition]) -> None:
        raise RuntimeError("down")

    emit = fan_out([("first", lambda t: heard.append("first")), ("broken", broken),
                    ("last", lambda t: heard.append("last"))])
    with pytest.raises(RuntimeError, match="broken"):
        emit([])
    assert heard == ["first", "last"]  # the page still went out after the failed listener


def test_fleet_snapshot_lists_hosts_and_each_nodes_paths(store: Store) -> None:
    fmap = RouteMap.from_fabric(Topology(TopologySpec(hosts=4, racks=2, rails=2, spines=2)))
    tracker = IncidentTracker(store, cluster="fleet")
    tracker.load()
    snap = fleet_from_map(lambda: fmap, tracker, clock=lambda: 7)()
    assert snap.taken_at_ns == 7 and snap.hosts == {"h0", "h1", "h2", "h3"}
    # counted by route: a cross-rack path has one route over each spine
    assert "h0/nic0->h2/nic0:forward#1" in snap.paths["spine1"] and "h0/nic0->h2/nic0:forward#0" in snap.paths["spine0"]
    assert "h0/nic0->h2/nic0:forward#0" not in snap.paths["spine1"]
    assert all(rid.startswith("h1/") or "->h1/" in rid for rid in snap.paths["h1"])
    empty = fleet_from_map(None, tracker)()
    assert empty.hosts == frozenset() and empty.paths == {}


class Finds:
    """A detector that reports one link down."""

    name = "finds"
    interval_s = 3600.0
    window_s = 60.0

    def detect(self, window: Window) -> list[Finding]:
        return [Finding(detector=self.name, kind=FindingKind.LINK_DOWN, entity_type=EntityType.LINK,
                        entity="h1-leaf0r0", severity=Severity.CRITICAL, confidence=1.0, summary="h1-leaf0r0 down",
                        observed_at_ns=window.end_ns)]


def test_a_finding_pages_through_the_built_parts(store: Store, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PD_KEY", KEY)
    monkeypatch.setattr("ridethrough.controller_wiring.default_detectors", lambda cfg: [Finds()])
    fabric = tmp_path / "fabric.json"
    fabric.write_text(json.dumps(RouteMap.from_fabric(Topology(TopologySpec(hosts=4))).to_json()))
    with PagerDutyServer(routing_keys={KEY}) as pd:
        pager = PagerDutyConfig(enabled=True, events_url=pd.events_url, change_url=pd.change_url,
                                routing_keys={"*": "env:PD_KEY"}, outbox=str(tmp_path / "outbox.sqlite3"),
                                initial_backoff_s=0.01)
        parts = build_controller(ControllerConfig(cluster="paged", fabric_map_file=str(fabric)), store=store,
                                 metrics=ControllerMetrics.create(), event_metrics=GatewayMetrics.create(),
                                 actuators=ActuatorConfig(enabled=True), pager=pager)
        assert parts.runner is not None and parts.pager is not None
        parts.start()
        try:
            events = wait_for(lambda: pd.events_for("ridethrough:paged:link_down:link:h1-leaf0r0"), timeout_s=30,
                              what="the page")
        finally:
            parts.stop()
    assert events[0]["event_action"] == "trigger" and events[0]["payload"]["severity"] == "critical"
    _, rows = store.query("SELECT count() FROM otel_logs WHERE LogAttributes['incident.key'] = "
                          "'link_down:link:h1-leaf0r0'")
    assert rows[0][0] >= 1  # the incident events listener ran too


class Fixes:
    """An actuator that fixes any link_down incident (its verify answers as told)."""

    name = "fixes"

    def __init__(self, *, verify_ok: bool = True) -> None:
        self.verify_ok = verify_ok
        self.calls: list[str] = []

    def plan(self, incident: Incident, fleet_state: FleetState) -> Plan | None:
        if incident.kind != "link_down":
            return None
        return Plan.for_incident(self.name, incident, summary=f"route around {incident.entity}",
                                 steps=("move routes",), params={"avoid": incident.entity})

    def apply(self, plan: Plan, deadline: Deadline) -> Result:
        self.calls.append("apply")
        return Result.success("moved")

    def verify(self, plan: Plan, deadline: Deadline) -> Result:
        self.calls.append("verify")
        return Result(self.verify_ok, "loss 0%" if self.verify_ok else "loss still 30%")

    def rollback(self, plan: Plan, deadline: Deadline) -> Result:
        self.calls.append("rollback")
        return Result.success("restored")


def _pager(pd: PagerDutyServer, tmp_path: Path) -> PagerDutyConfig:
    return PagerDutyConfig(enabled=True, events_url=pd.events_url, change_url=pd.change_url,
                           routing_keys={"*": "env:PD_KEY"}, outbox=str(tmp_path / "outbox.sqlite3"),
                           initial_backoff_s=0.01, dashboard_url="https://dash.example/")


def test_an_action_taken_becomes_a_change_event_on_the_incidents_service(store: Store, tmp_path: Path,
                                                                         monkeypatch) -> None:
    monkeypatch.setenv("PD_KEY", KEY)
    monkeypatch.setattr("ridethrough.controller_wiring.default_detectors", lambda cfg: [Finds()])
    plugin = Fixes(verify_ok=False)
    monkeypatch.setattr("ridethrough.controller_wiring.load_plugins", lambda: [plugin])
    with PagerDutyServer(routing_keys={KEY}) as pd:
        parts = build_controller(ControllerConfig(cluster="changed"), store=store,
                                 metrics=ControllerMetrics.create(), event_metrics=GatewayMetrics.create(),
                                 actuators=ActuatorConfig(enabled=True, dry_run=False, hysteresis_s=0.0),
                                 pager=_pager(pd, tmp_path))
        parts.start()
        try:
            [change] = wait_for(lambda: pd.changes, timeout_s=30, what="the change event")
            [page] = pd.events_for("ridethrough:changed:link_down:link:h1-leaf0r0")
        finally:
            parts.stop()
    assert plugin.calls == ["apply", "verify", "rollback"]
    payload = change["payload"]
    assert payload["summary"] == ("ridethrough fixes on h1-leaf0r0: rolled back (verify failed: loss still 30%); "
                                  "route around h1-leaf0r0")
    details = payload["custom_details"]
    assert details["outcome"] == "rolled_back" and details["plugin"] == "fixes"
    assert details["incident_key"] == "link_down:link:h1-leaf0r0" and details["steps"] == ["move routes"]
    incident_id, trace_id = page["payload"]["custom_details"]["incident_id"], details["trace_id"]
    assert details["incident_id"] == incident_id and trace_id == page["payload"]["custom_details"]["trace_id"]
    assert payload["source"] == "h1-leaf0r0" and payload["timestamp"].endswith("+00:00")
    assert change["links"] == [
        {"href": f"https://dash.example/incidents/{incident_id}", "text": "Incident in ridethrough"},
        {"href": f"https://dash.example/traces/{trace_id}", "text": "Incident trace"}]


def test_start_finishes_an_action_a_killed_controller_left_and_reports_it(store: Store, tmp_path: Path,
                                                                          monkeypatch) -> None:
    monkeypatch.setenv("PD_KEY", KEY)
    monkeypatch.setattr("ridethrough.controller_wiring.default_detectors", lambda cfg: [])
    plugin = Fixes()
    monkeypatch.setattr("ridethrough.controller_wiring.load_plugins", lambda: [plugin])
    tracker = IncidentTracker(store, cluster="killed")
    tracker.load()
    finding = Finds().detect(Window(start_ns=0, end_ns=time.time_ns(), cluster="killed",
                                    query=lambda sql, params: ([], [])))[0]
    [opened] = tracker.observe([dataclasses.replace(finding, cluster="killed")], time.time_ns())
    plan = plugin.plan(opened.incident, FleetState(taken_at_ns=0))
    assert plan is not None
    inc, now = opened.incident, time.time_ns()
    ActionLog(store).write(ActionRecord("killed-mid-apply", plan.idempotency_key, inc.incident_id, inc.key,
                                        inc.trace_id, inc.cluster, plan.plugin, inc.entity, Status.APPLYING, "accepted",
                                        False, plan.summary, plan.steps, (), (), {}, "", now, now,
                                        params=dict(plan.params)))
    with PagerDutyServer(routing_keys={KEY}) as pd:
        parts = build_controller(ControllerConfig(cluster="killed"), store=store,
                                 metrics=ControllerMetrics.create(), event_metrics=GatewayMetrics.create(),
                                 actuators=ActuatorConfig(enabled=True, dry_run=False, hysteresis_s=0.0),
                                 pager=_pager(pd, tmp_path))
        parts.start()  # no detector runs: the takeover must not wait for an incident to change
        try:
            [change] = wait_for(lambda: pd.changes, timeout_s=30, what="the change event")
        finally:
            parts.stop()
    assert plugin.calls == ["verify"]  # completed by checking it, never applied again
    assert change["payload"]["custom_details"]["outcome"] == "succeeded"
    assert change["payload"]["custom_details"]["takeovers"] == 1
    assert change["payload"]["custom_details"]["reason"] == "verified after a runner restart"
