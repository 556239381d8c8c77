"""The controller against a real chDB store: isolation of a raising detector, schedules on an
injected clock, incident events in otel_logs/otel_traces, and plugin validation.

One chDB store per test module (a process hosts one store path at a time); each test uses its
own fleet cluster, so the trackers of different tests never see each other's incidents.
"""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from ridethrough.detectors.contract import EntityType, Finding, FindingKind, Severity, Window
from ridethrough.detectors.controller import Controller, PluginError, default_detectors, validate
from ridethrough.detectors.incident_events import IncidentEmitter, root_span_id
from ridethrough.detectors.incidents import IncidentTracker, TransitionKind
from ridethrough.exporters.gateway_metrics import GatewayMetrics
from ridethrough.exporters.store import Store
from tests.conftest import wait_for

S = 1_000_000_000
T0 = 1_700_000_000 * S


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    s = Store(f"chdb://{tmp_path_factory.mktemp('controller') / 'store'}")
    s.init_schema()
    yield s
    s.close()


@dataclass
class Scripted:
    """A detector that finds the given entities (or raises), and remembers its windows."""

    name: str
    interval_s: float = 10.0
    window_s: float = 60.0
    entities: list[str] = field(default_factory=list)
    error: Exception | None = None
    windows: list[Window] = field(default_factory=list)

    def detect(self, window: Window) -> list[Finding]:
        self.windows.append(window)
        if self.error is not None:
            raise self.error
        window.query("SELECT 1", {})  # the store is readable through the window
        return [Finding(detector=self.name, kind=FindingKind.LINK_DOWN, entity_type=EntityType.LINK, entity=e,
                        severity=Severity.ERROR, confidence=1.0, summary=f"{e} down", observed_at_ns=window.end_ns)
                for e in self.entities]


def controller(store: Store, cluster: str, *detectors: Scripted, emit: IncidentEmitter | None = None) -> Controller:
    tracker = IncidentTracker(store, quiet_s=30, reopen_hysteresis_s=120, clock=lambda: T0, cluster=cluster)
    return Controller(store=store, detectors=list(detectors), tracker=tracker, clock=lambda: T0, emit=emit,
                      cluster=cluster, interval_floor_s=1.0)


def sample(c: Controller, name: str, **labels: str) -> float:
    value = c.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_a_raising_detector_is_isolated_and_counted(store: Store) -> None:
    good = Scripted("good", entities=["l1"])
    bad = Scripted("bad", error=RuntimeError("boom"))
    c = controller(store, "iso", bad, good)
    [opened] = c.tick(T0)
    assert opened.kind is TransitionKind.OPENED and opened.incident.entity == "l1"
    assert opened.incident.cluster == "iso"  # the controller's cluster stamped on the finding
    assert sample(c, "ridethrough_controller_detector_errors_total", detector="bad") == 1
    assert sample(c, "ridethrough_controller_detector_errors_total", detector="good") == 0
    assert sample(c, "ridethrough_controller_detector_runs_total", detector="good") == 1
    assert sample(c, "ridethrough_controller_findings_total", kind="link_down") == 1
    assert sample(c, "ridethrough_controller_incidents_open") == 1
    _, rows = store.query("SELECT count() FROM incidents FINAL WHERE Cluster = 'iso' AND State = 'open'")
    assert rows == [(1,)]


def test_detectors_run_on_their_own_intervals(store: Store) -> None:
    fast = Scripted("fast", interval_s=5)
    slow = Scripted("slow", interval_s=20, window_s=120)
    c = controller(store, "sched", fast, slow)
    for second in range(0, 41):
        c.tick(T0 + second * S)
    assert [(w.end_ns - T0) // S for w in fast.windows] == [0, 5, 10, 15, 20, 25, 30, 35, 40]
    assert [(w.end_ns - T0) // S for w in slow.windows] == [0, 20, 40]
    assert all(w.seconds == 120 for w in slow.windows) and all(w.cluster == "sched" for w in slow.windows)
    assert c.seconds_to_next(T0 + 41 * S) == 4


def test_interval_floor_holds_back_a_detector_that_asks_too_often(store: Store) -> None:
    eager = Scripted("eager", interval_s=0.1)
    c = controller(store, "floor", eager)
    for tenth in range(0, 30):
        c.tick(T0 + tenth * S // 10)
    assert len(eager.windows) == 3


def test_window_query_is_read_only(store: Store) -> None:
    seen: list[Exception] = []

    class Writer(Scripted):
        def detect(self, window: Window) -> list[Finding]:
            try:
                window.query("DROP TABLE incidents", {})
            except Exception as exc:
                seen.append(exc)
                raise
            return []

    c = controller(store, "ro", Writer("writer"))
    c.tick(T0)
    assert seen and "only" in str(seen[0])
    assert sample(c, "ridethrough_controller_detector_errors_total", detector="writer") == 1
    assert store.query("EXISTS TABLE incidents")[1] == [(1,)]


def test_a_failing_detector_does_not_resolve_its_incidents(store: Store) -> None:
    flaky = Scripted("flaky", entities=["l9"])
    c = controller(store, "fail", flaky)
    c.tick(T0)
    flaky.error = RuntimeError("store query failed")
    assert c.tick(T0 + 60 * S) == []
    flaky.error, flaky.entities = None, []
    assert [t.kind for t in c.tick(T0 + 70 * S)] == [TransitionKind.RESOLVED]


def test_transitions_become_log_records_and_spans_in_one_trace(store: Store) -> None:
    det = Scripted("events", entities=["l5"])
    c = controller(store, "otel", det, emit=IncidentEmitter(store=store, metrics=GatewayMetrics.create()))
    [opened] = c.tick(T0)
    det.entities = []
    [resolved] = c.tick(T0 + 40 * S)
    trace = opened.incident.trace_id
    _, logs = store.query("SELECT Body, ServiceName, LogAttributes['incident.transition'] FROM otel_logs "
                          "WHERE TraceId = {t:String} ORDER BY Timestamp", parameters={"t": trace})
    assert [(r[1], r[2]) for r in logs] == [("ridethrough-controller", "opened"),
                                            ("ridethrough-controller", "resolved")]
    assert "l5 down" in logs[0][0]
    _, spans = store.query("SELECT SpanName, SpanId, ParentSpanId FROM otel_traces WHERE TraceId = {t:String} "
                           "ORDER BY Timestamp", parameters={"t": trace})
    root = root_span_id(trace).hex()
    assert [(s[0], s[2]) for s in spans] == [("incident", ""), ("incident.resolved", root)]
    assert spans[0][1] == root and resolved.incident.incident_id == opened.incident.incident_id


def test_a_raising_emitter_is_counted_and_the_incident_still_stored(store: Store) -> None:
    def broken(_: object) -> None:
        raise OSError("collector away")

    c = controller(store, "emit", Scripted("e", entities=["l7"]))
    c._emit = broken  # the emit seam, as ServerRuntime would wire it
    assert len(c.tick(T0)) == 1
    assert sample(c, "ridethrough_controller_emit_errors_total") == 1


def test_a_restarted_controller_does_not_reopen(store: Store) -> None:
    first = controller(store, "restart", Scripted("d", entities=["l3"]))
    [opened] = first.tick(T0)
    second = controller(store, "restart", Scripted("d", entities=["l3"]))
    [again] = second.tick(T0 + 5 * S)
    assert again.kind is TransitionKind.UPDATED and again.incident.incident_id == opened.incident.incident_id


# -- plugins --------------------------------------------------------------------------------


def plugin(monkeypatch: pytest.MonkeyPatch, name: str, **attrs: object) -> str:
    module = types.ModuleType(name)
    for key, value in attrs.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)
    return name


@dataclass
class Slow(Scripted):
    """A scheduled detector that holds its run until released (a long tomography)."""

    running: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def detect(self, window: Window) -> list[Finding]:
        self.running.set()
        self.release.wait(30)
        return super().detect(window)


@dataclass
class Triggered(Scripted):
    """A detector the live feed can wake."""

    triggers: dict[str, Any] = field(default_factory=lambda: {"ridethrough.nic.up": lambda v: v != 1.0})


def test_a_woken_live_detector_does_not_wait_for_a_slow_scheduled_one(store: Store) -> None:
    slow, fast = Slow("slow"), Triggered("fast", interval_s=60.0, entities=["cut"])
    c = controller(store, "lanes", slow, fast)
    assert c.lanes == {"live": frozenset({"fast"}), "scheduled": frozenset({"slow"})}
    c.start()
    try:
        assert slow.running.wait(10), "the scheduled lane is busy"
        runs = len(fast.windows)
        c.wake(["fast"])
        wait_for(lambda: len(fast.windows) > runs, timeout_s=10, what="the woken detector run")
        wait_for(lambda: store.query("SELECT count() FROM incidents FINAL WHERE Cluster = 'lanes'")[1][0][0] == 1,
                 timeout_s=10, what="its incident opened")
        assert not slow.windows, "while the slow one is still in its first run"
    finally:
        slow.release.set()
        c.stop()


def test_plugins_load_through_build_or_detectors(monkeypatch: pytest.MonkeyPatch) -> None:
    a = plugin(monkeypatch, "rt_plugin_a", build=lambda cfg: [Scripted("a", interval_s=cfg)])
    b = plugin(monkeypatch, "rt_plugin_b", DETECTORS=[Scripted("b")])
    found = default_detectors(7.0, modules=(a, b, "rt_plugin_not_installed"))
    assert [(d.name, d.interval_s) for d in found] == [("a", 7.0), ("b", 10.0)]


@pytest.mark.parametrize(("attrs", "message"), [
    ({"DETECTORS": [object()]}, "is not a Detector (missing name, interval_s, window_s, detect)"),
    ({"DETECTORS": [Scripted("neg", interval_s=-1)]}, "interval_s=-1"),
    ({"DETECTORS": [Scripted("")]}, "has no name"),
    ({"build": lambda cfg: Scripted("x")}, "expected a list of detectors"),
    ({}, "exposes neither build(cfg) nor DETECTORS"),
    ({"DETECTORS": [Scripted("twice"), Scripted("twice")]}, "'twice' is used by more than one detector"),
])
def test_plugin_errors_name_the_plugin(monkeypatch: pytest.MonkeyPatch, attrs: dict[str, object],
                                       message: str) -> None:
    name = plugin(monkeypatch, "rt_plugin_bad", **attrs)
    with pytest.raises(PluginError) as info:
        default_detectors(None, modules=(name,))
    assert message in str(info.value)
    if "more than one" not in message:
        assert "rt_plugin_bad" in str(info.value)


def test_a_plugin_that_fails_to_import_is_an_error_not_a_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_import(name: str) -> types.ModuleType:
        raise ModuleNotFoundError("No module named 'numpyy'", name="numpyy")

    monkeypatch.setattr("importlib.import_module", broken_import)
    with pytest.raises(PluginError, match=r"detector plugin ridethrough\.detectors\.link: import failed"):
        default_detectors(None)


def test_validate_accepts_a_scripted_detector() -> None:
    d = Scripted("ok")
    assert validate(d, plugin="p") is d
