"""The controller's composition: listeners isolated from each other, the fleet snapshot from the fabric
map, and a finding that becomes an incident, a stored event and a page through the built parts."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from ridethrough.controller_wiring import build_controller, fan_out, fleet_from_map
from ridethrough.detectors.contract import EntityType, Finding, FindingKind, Severity, Window
from ridethrough.detectors.controller import ControllerMetrics
from ridethrough.detectors.fabric_map import RouteMap
from ridethrough.detectors.incidents import IncidentTracker, Transition
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
    assert "h0/nic0->h2/nic0:forward" in snap.paths["spine1"]  # a cross-rack path may cross either spine
    assert all(pid.startswith("h1/") or "->h1/" in pid for pid in snap.paths["h1"])
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
