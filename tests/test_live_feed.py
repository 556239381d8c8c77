"""The live feed: edge-triggered wake-ups from written batches, and a woken controller runs at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from ridethrough.detectors.contract import EntityType, Finding, FindingKind, Severity, Window
from ridethrough.detectors.controller import Controller
from ridethrough.detectors.incidents import IncidentTracker
from ridethrough.detectors.link import LinkDown
from ridethrough.detectors.live import LiveFeed, triggers_of
from ridethrough.exporters.convert_metrics import convert_metrics
from ridethrough.exporters.gateway_metrics import GatewayMetrics
from ridethrough.exporters.pipeline import BatchPolicy, Pipeline
from ridethrough.exporters.rows import Limits, Rejections, Rows
from ridethrough.exporters.schema import GAUGE
from ridethrough.exporters.signals import Signal
from ridethrough.exporters.spool import Spool
from ridethrough.exporters.store import Store
from tests.otlp_util import gauge_request


def batch(*points: tuple[str, str, str, float]) -> Rows:
    """Gauge rows of (metric, node, interface, value); the other columns are left at defaults."""
    rows = Rows()
    for metric, node, iface, value in points:
        cols = rows.table(GAUGE)
        n = len(cols["MetricName"])
        for values in cols.values():
            values.append(None)
        cols["MetricName"][n] = metric
        cols["Value"][n] = value
        cols["ResourceAttributes"][n] = {"ridethrough.node.id": node}
        cols["Attributes"][n] = {"network.interface.name": iface}
    return rows


@dataclass
class Watcher:
    name: str = "watch"
    interval_s: float = 3600.0
    window_s: float = 60.0
    triggers: dict[str, object] = field(default_factory=lambda: {"ridethrough.nic.up": lambda v: v != 1.0})
    runs: list[Window] = field(default_factory=list)

    def detect(self, window: Window) -> list[Finding]:
        self.runs.append(window)
        return []


def test_wakes_only_when_a_series_turns_bad() -> None:
    woken: list[list[str]] = []
    now = [0.0]
    feed = LiveFeed([Watcher()], wake=lambda names: woken.append(list(names)), min_gap_s=0.0, clock=lambda: now[0])
    feed(batch(("ridethrough.nic.up", "h1", "nic0", 1.0)))
    assert woken == []  # healthy: nothing to do
    feed(batch(("ridethrough.nic.up", "h1", "nic0", 0.0)))
    assert woken == [["watch"]]
    feed(batch(("ridethrough.nic.up", "h1", "nic0", 0.0)))
    assert woken == [["watch"]]  # still down: edge-triggered, no second wake
    feed(batch(("ridethrough.nic.up", "h2", "nic0", 0.0)))  # another series turns bad
    assert woken == [["watch"], ["watch"]]
    feed(batch(("ridethrough.nic.up", "h1", "nic0", 1.0), ("ridethrough.nic.up", "h1", "nic0", 0.0)))
    assert woken[-1] == ["watch"] and len(woken) == 3  # up then down again within one batch


def test_ignores_other_metrics_and_tables_and_rate_limits() -> None:
    woken: list[list[str]] = []
    now = [10.0]
    feed = LiveFeed([Watcher()], wake=lambda names: woken.append(list(names)), min_gap_s=1.0, clock=lambda: now[0])
    feed(batch(("system.network.io", "h1", "nic0", 0.0)))
    feed(Rows())
    assert woken == []
    feed(batch(("ridethrough.nic.up", "h1", "nic0", 0.0)))
    feed(batch(("ridethrough.nic.up", "h2", "nic0", 0.0)))
    assert woken == [["watch"]]  # the second edge came within min_gap_s
    now[0] += 1.5
    feed(batch(("ridethrough.nic.up", "h3", "nic0", 0.0)))
    assert woken == [["watch"], ["watch"]]


def test_link_down_declares_triggers_for_port_state() -> None:
    triggers = triggers_of(LinkDown())
    assert triggers["ridethrough.nic.up"](0.0) and not triggers["ridethrough.nic.up"](1.0)
    assert triggers["ridethrough.ib.port.state"](1.0) and not triggers["ridethrough.ib.port.state"](4.0)
    assert triggers_of(object()) == {}  # type: ignore[arg-type]


@pytest.fixture
def store(tmp_path) -> Iterator[Store]:
    s = Store(f"chdb://{tmp_path / 'store'}")
    s.init_schema()
    yield s
    s.close()


def test_the_pipeline_shows_written_batches_to_observers_and_survives_a_raising_one(store: Store, tmp_path) -> None:
    seen: list[Rows] = []

    def broken(rows: Rows) -> None:
        raise RuntimeError("watcher bug")

    spool = Spool(tmp_path / "spool", max_bytes=1 << 20)
    pipeline = Pipeline(store=store, spool=spool, limits=Limits(),
                        policy=BatchPolicy(max_age_s=0.01), metrics=GatewayMetrics.create())
    pipeline.observe(broken)
    pipeline.observe(seen.append)
    pipeline.start()
    try:
        req = gauge_request(1, name="ridethrough.nic.up", values=[0.0])
        rows = Rows()
        convert_metrics(req, Limits(), rows, Rejections())
        ticket = pipeline.submit(Signal.METRICS, req.SerializeToString(), rows)
        assert ticket.wait(10) and ticket.error is None  # written, not spooled, despite the broken watcher
    finally:
        pipeline.shutdown()
    assert len(seen) == 1 and seen[0].columns[GAUGE.name]["MetricName"] == ["ridethrough.nic.up"]
    assert spool.pending() == []


def test_a_woken_controller_runs_the_detector_before_its_interval(store: Store) -> None:
    w = Watcher()
    tracker = IncidentTracker(store, quiet_s=30, reopen_hysteresis_s=120)
    c = Controller(store=store, detectors=[w], tracker=tracker, interval_floor_s=1.0)
    c.start()
    try:
        deadline = time.monotonic() + 10
        while not w.runs and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(w.runs) == 1  # the first run; the next is an hour away
        done = threading.Event()
        started = time.monotonic()
        feed = LiveFeed(c.detectors, wake=lambda names: (c.wake(names), done.set()))
        feed(batch(("ridethrough.nic.up", "h1", "nic0", 0.0)))
        assert done.is_set()
        while len(w.runs) < 2 and time.monotonic() - started < 10:
            time.sleep(0.01)
        assert len(w.runs) == 2
        assert c.metrics.registry.get_sample_value("ridethrough_controller_detector_wakes_total",
                                                   {"detector": "watch"}) == 1
    finally:
        c.stop()


@dataclass
class Slow:
    """A scheduled detector that takes a while (the costliest query of a round), finding nothing."""

    name: str = "slow"
    interval_s: float = 3600.0
    window_s: float = 60.0
    started: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def detect(self, window: Window) -> list[Finding]:
        self.started.set()
        assert self.release.wait(30), "the test never released the slow detector"
        return []


@dataclass
class Finder(Watcher):
    """A woken detector that finds one link down."""

    name: str = "finder"

    def detect(self, window: Window) -> list[Finding]:
        self.runs.append(window)
        if len(self.runs) < 2:
            return []
        return [Finding(detector=self.name, kind=FindingKind.LINK_DOWN, entity_type=EntityType.LINK, entity="h1-l0",
                        severity=Severity.CRITICAL, confidence=1.0, summary="down", observed_at_ns=window.end_ns)]


def test_a_detector_woken_during_a_slow_round_runs_next_and_opens_its_incident_at_once(store: Store) -> None:
    """The round's slow detector is still running: the woken one runs as soon as it returns, its
    incident is opened before the round's remaining detectors, and its window ends when it runs."""
    slow, finder, after = Slow(), Finder(), Watcher(name="after")
    tracker = IncidentTracker(store, quiet_s=30, reopen_hysteresis_s=120)
    opened: list[tuple[str, int]] = []
    c = Controller(store=store, detectors=[slow, finder, after], tracker=tracker, interval_floor_s=1.0,
                   emit=lambda ts: opened.extend((t.incident.entity, len(after.runs)) for t in ts))
    c.start()
    try:
        # round 1 runs slow, finder, after; round 2 is an hour away for all of them
        slow.release.set()
        deadline = time.monotonic() + 10
        # the round runs its detectors in turn: "after" may still be running when finder has returned
        while not (finder.runs and after.runs) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(finder.runs) == 1 and len(after.runs) == 1
        slow.release.clear()
        slow.started.clear()
        c.wake(["slow"])  # a slow run in progress ...
        assert slow.started.wait(10)
        woken_at = time.time_ns()
        c.wake(["finder", "after"])  # ... when the live feed wakes two more
        slow.release.set()
        while len(finder.runs) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        while len(after.runs) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert finder.runs[1].end_ns >= woken_at  # a fresh window, not the round's start
        # opened as soon as finder returned, while "after" had not run its second time yet
        assert opened and opened[0] == ("h1-l0", 1)
    finally:
        slow.release.set()
        c.stop()
