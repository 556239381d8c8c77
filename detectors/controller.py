"""The controller: runs every detector on its own schedule against the store, and tracks incidents.

Each `tick` runs the detectors that are due over a window ``[now - window_s, now]`` whose
``query`` reads the store (read-only statements only), folds their findings into incidents
(`IncidentTracker`) and hands the transitions to ``emit`` (OTel log records and spans in
`ridethrough.detectors.incident_events`). A detector that raises is logged, counted and
skipped; the others keep running, and its incidents do not resolve while it fails.

Started, it runs two lanes, each a thread: the live lane runs the detectors the live feed can wake
(those with ``triggers``: a port gone down) or fills (``live``: the silence detector beside a
gateway), the scheduled lane all others. A woken link detector then waits for no tomography or
trend query to finish, only for the store's next free turn; the lanes share the incident tracker,
one fold at a time.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ridethrough.detectors.contract import Detector, Finding, Window
from ridethrough.detectors.incidents import IncidentTracker, Transition
from ridethrough.detectors.live import runs_live
from ridethrough.exporters.store import Store
from ridethrough.query import check_read_only

log = logging.getLogger(__name__)

PLUGINS = ("ridethrough.detectors.link", "ridethrough.detectors.link_mtu", "ridethrough.detectors.gpu",
           "ridethrough.detectors.straggler",
           "ridethrough.detectors.silent", "ridethrough.detectors.tomography", "ridethrough.detectors.clock",
           "ridethrough.detectors.congestion", "ridethrough.detectors.congestion_ports")
"""The detector modules `default_detectors` loads when they are installed."""

Emit = Callable[[Sequence[Transition]], None]


class PluginError(ValueError):
    """A detector plugin that cannot be used; the message names the plugin and what is wrong."""


@dataclass(frozen=True)
class ControllerMetrics:
    """The controller's own health on /metrics."""

    registry: CollectorRegistry
    runs: Counter
    errors: Counter
    run_seconds: Histogram
    findings: Counter
    transitions: Counter
    incidents_open: Gauge
    emit_errors: Counter
    wakes: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> ControllerMetrics:
        """Metrics in ``registry`` (a fresh one by default: no global state)."""
        reg = registry if registry is not None else CollectorRegistry()
        return cls(
            registry=reg,
            runs=Counter("ridethrough_controller_detector_runs", "Detector runs", ["detector"], registry=reg),
            errors=Counter("ridethrough_controller_detector_errors", "Detector runs that raised (skipped)",
                           ["detector"], registry=reg),
            run_seconds=Histogram("ridethrough_controller_detector_run_seconds", "Time one detector run took",
                                  ["detector"], registry=reg,
                                  buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)),
            findings=Counter("ridethrough_controller_findings", "Findings by kind", ["kind"], registry=reg),
            transitions=Counter("ridethrough_controller_incident_transitions", "Incident transitions by kind",
                                ["transition"], registry=reg),
            incidents_open=Gauge("ridethrough_controller_incidents_open", "Incidents open now", registry=reg),
            emit_errors=Counter("ridethrough_controller_emit_errors",
                                "Rounds whose incident events could not be emitted", registry=reg),
            wakes=Counter("ridethrough_controller_detector_wakes",
                          "Detector runs brought forward by the live feed", ["detector"], registry=reg),
        )


def validate(detector: object, *, plugin: str) -> Detector:
    """``detector`` if it honours the `Detector` contract, else `PluginError` naming ``plugin``."""
    what = f"detector plugin {plugin}: {detector!r}"
    if not isinstance(detector, Detector):
        missing = [a for a in ("name", "interval_s", "window_s", "detect") if not hasattr(detector, a)]
        raise PluginError(f"{what} is not a Detector (missing {', '.join(missing)})")
    if not isinstance(detector.name, str) or not detector.name:
        raise PluginError(f"{what} has no name (a non-empty string)")
    for attr in ("interval_s", "window_s"):
        value = getattr(detector, attr)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise PluginError(f"{what} ({detector.name}) has {attr}={value!r}; expected a number > 0")
    if not callable(detector.detect):
        raise PluginError(f"{what} ({detector.name}).detect is not callable")
    return detector


def plugin_detectors(module: ModuleType, cfg: Any) -> list[Detector]:
    """The validated detectors of one plugin module: ``build(cfg)`` if it has one, else ``DETECTORS``."""
    plugin = module.__name__
    build = getattr(module, "build", None)
    if callable(build):
        found = build(cfg)
    elif hasattr(module, "DETECTORS"):
        found = module.DETECTORS
    else:
        raise PluginError(f"detector plugin {plugin}: exposes neither build(cfg) nor DETECTORS")
    if not isinstance(found, list | tuple):
        raise PluginError(f"detector plugin {plugin}: expected a list of detectors, got {type(found).__name__}")
    return [validate(d, plugin=plugin) for d in found]


def default_detectors(cfg: Any, *, modules: Iterable[str] = PLUGINS) -> list[Detector]:
    """Every detector of the plugin ``modules`` that are installed; names must be unique.

    A module that does not exist is skipped (logged); one that exists but fails to import,
    or yields something that is not a detector, stops the start with a `PluginError`.
    """
    out: list[Detector] = []
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise PluginError(f"detector plugin {name}: import failed: {exc}") from exc
            log.info("detector plugin %s is not installed; skipped", name)
            continue
        out += plugin_detectors(module, cfg)
    seen: set[str] = set()
    for d in out:
        if d.name in seen:
            raise PluginError(f"detector name {d.name!r} is used by more than one detector")
        seen.add(d.name)
    return out


def read_only_query(store: Store) -> Callable[[str, Mapping[str, Any]], tuple[list[str], list[tuple[Any, ...]]]]:
    """A `Window.query` over ``store`` that refuses anything but one read-only statement."""
    def query(sql: str, parameters: Mapping[str, Any]) -> tuple[list[str], list[tuple[Any, ...]]]:
        check_read_only(sql)
        return store.query(sql, parameters=dict(parameters))
    return query


class Controller:
    """Runs detectors on their schedules, tracks incidents, emits transitions (see the module docstring)."""

    def __init__(self, *, store: Store, detectors: Sequence[Detector], tracker: IncidentTracker,
                 clock: Callable[[], int] = time.time_ns, metrics: ControllerMetrics | None = None,
                 emit: Emit | None = None, cluster: str = "", interval_floor_s: float = 1.0) -> None:
        self._detectors = list(detectors)
        self._tracker = tracker
        self._clock = clock
        self.metrics = metrics if metrics is not None else ControllerMetrics.create()
        self._emit = emit
        self._cluster = cluster
        self._floor_s = interval_floor_s
        self._query = read_only_query(store)
        self._next_ns = {d.name: 0 for d in self._detectors}
        self._due_lock = threading.Lock()
        self._fold_lock = threading.Lock()  # the lanes fold into one tracker, one at a time
        self._stop = threading.Event()
        self._woken = {lane: threading.Event() for lane in ("live", "scheduled")}
        self._threads: list[threading.Thread] = []

    def tick(self, now_ns: int | None = None, *, lane: str | None = None) -> list[Transition]:
        """Run the detectors due at ``now_ns`` (default: the clock; those of one ``lane``, default all), fold and
        emit; returns the transitions.

        Until the tracker has loaded the store's incidents nothing runs (it would duplicate them).
        """
        now = self._clock() if now_ns is None else now_ns
        among = self.lanes[lane] if lane is not None else frozenset(self._next_ns)
        with self._fold_lock:
            if not self._tracker.loaded:
                self._tracker.load()
        out: list[Transition] = []
        # One detector at a time, its findings folded at once: a slow detector does not hold back
        # another's incident, and one the live feed wakes meanwhile runs next, not after the round.
        while (d := self._take_due(now, among)) is not None:
            at = now if now_ns is not None else self._clock()  # a fresh window for a run late in the round
            result = self._run(d, at)
            if result is None:
                continue
            with self._fold_lock:
                transitions = self._tracker.observe(result, at, ran={d.name})
                for t in transitions:
                    self.metrics.transitions.labels(transition=t.kind.value).inc()
                self.metrics.incidents_open.set(len(self._tracker.open()))
                self._emit_safely(transitions)
            out += transitions
        return out

    def _take_due(self, now: int, among: frozenset[str]) -> Detector | None:
        """The next detector of ``among`` to run at ``now`` (a woken one first), marked as run; None when none
        is due."""
        with self._due_lock:
            due = [d for d in self._detectors if d.name in among and self._next_ns[d.name] <= now]
            if not due:
                return None
            d = min(due, key=lambda x: self._next_ns[x.name])  # woken ones are at 0; else in list order
            self._next_ns[d.name] = now + round(max(d.interval_s, self._floor_s) * 1e9)
            return d

    def _run(self, d: Detector, now: int) -> list[Finding] | None:
        window = Window(start_ns=now - round(d.window_s * 1e9), end_ns=now, query=self._query, cluster=self._cluster)
        self.metrics.runs.labels(detector=d.name).inc()
        started = time.perf_counter()
        try:
            found = list(d.detect(window))
        except Exception:  # a detector's bug or a failed query must not stop the others
            self.metrics.errors.labels(detector=d.name).inc()
            log.exception("detector %s raised; skipped this run", d.name)
            return None
        finally:
            self.metrics.run_seconds.labels(detector=d.name).observe(time.perf_counter() - started)
        for f in found:
            self.metrics.findings.labels(kind=f.kind.value).inc()
        if self._cluster:
            found = [f if f.cluster else dataclasses.replace(f, cluster=self._cluster) for f in found]
        return found

    def _emit_safely(self, transitions: Sequence[Transition]) -> None:
        if not transitions or self._emit is None:
            return
        try:
            self._emit(transitions)
        except Exception:  # incidents are already stored; losing their events must not stop detection
            self.metrics.emit_errors.inc()
            log.exception("emitting %d incident transition(s) failed", len(transitions))

    @property
    def detectors(self) -> tuple[Detector, ...]:
        """The detectors this controller runs."""
        return tuple(self._detectors)

    @property
    def lanes(self) -> Mapping[str, frozenset[str]]:
        """Detector names by lane: ``live`` (those the live feed can wake or feeds, `runs_live`) and ``scheduled``.

        Asked afresh each time: a detector joins the live lane when a feed is attached to it, after this
        controller was built (the feed is built from its detectors)."""
        live = frozenset(d.name for d in self._detectors if runs_live(d))
        return {"live": live, "scheduled": frozenset(self._next_ns) - live}

    def wake(self, names: Sequence[str]) -> None:
        """Make the named detectors due now and wake their lanes (the live feed's hook; thread-safe)."""
        with self._due_lock:
            for name in names:
                if name in self._next_ns:
                    self._next_ns[name] = 0
                    self.metrics.wakes.labels(detector=name).inc()
        for lane, members in self.lanes.items():
            if members.intersection(names):
                self._woken[lane].set()

    def seconds_to_next(self, now_ns: int, *, lane: str | None = None) -> float:
        """Seconds until the next detector (of ``lane``, default any) is due (0 when one is due now)."""
        among = self.lanes[lane] if lane is not None else self._next_ns.keys()
        with self._due_lock:
            due = [self._next_ns[n] for n in among]
        if not due:
            return self._floor_s
        return max(0.0, (min(due) - now_ns) / 1e9)

    def start(self) -> None:
        """Tick in a thread per lane until `stop`."""
        if not self._threads:
            self._threads = [threading.Thread(target=self._loop, args=(lane,), name=f"controller-{lane}", daemon=True)
                             for lane, members in self.lanes.items() if members]
            for t in self._threads:
                t.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop after the ticks in progress."""
        self._stop.set()
        for woken in self._woken.values():
            woken.set()
        for t in self._threads:
            t.join(timeout_s)

    def _loop(self, lane: str) -> None:
        wait_s = 0.0
        woken = self._woken[lane]
        while not self._stop.is_set():
            woken.wait(wait_s)
            woken.clear()
            if self._stop.is_set():
                return
            try:
                self.tick(lane=lane)
                wait_s = min(max(self.seconds_to_next(self._clock(), lane=lane), 0.05), self._floor_s)
            except Exception:  # store away or a tracker bug: log it, try again after a pause
                log.exception("controller tick failed")
                wait_s = self._floor_s
