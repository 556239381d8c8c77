"""The node agent: run sources on their intervals, export what they see over OTLP.

Each source's latest samples are kept in a snapshot; the OpenTelemetry SDK's observable
instruments read that snapshot when the periodic reader collects, and the OTLP exporter
ships it to the gateway. Events (start, stop, a source failing) go out as OTel log
records. A source that raises is logged, counted and skipped for that tick.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from opentelemetry._logs import SeverityNumber

# The OTLP log exporter's documented import path also carries a leading underscore.
from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.metrics import CallbackOptions, Observation

# The logs SDK is still published under a leading underscore; it is the documented entry point.
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource

from ridethrough.collector.export import BufferingMetricExporter
from ridethrough.collector.sample import BackgroundSource, Event, MetricKind, Sample, Source

log = logging.getLogger(__name__)

SCOPE = "ridethrough.collector"
SELF_METRICS: tuple[tuple[str, MetricKind, str], ...] = (
    ("ridethrough.agent.source.errors", MetricKind.COUNTER, "{error}"),
    ("ridethrough.agent.export.dropped", MetricKind.COUNTER, "{point}"),
    ("ridethrough.agent.export.buffered", MetricKind.GAUGE, "{batch}"),
)
"""What the agent reports about itself: (name, kind, unit), as catalogued."""
Clock = Callable[[], int]


@dataclass(frozen=True, slots=True)
class AgentIdentity:
    """Who this agent is: the resource attributes every signal carries."""

    node_id: str
    host_name: str
    cluster: str
    rack: str = ""
    pod: str = ""
    labels: Mapping[str, str] | None = None

    def resource(self) -> Resource:
        """The OTel resource for this node."""
        attrs = {"service.name": "ridethrough-agent", "host.name": self.host_name,
                 "ridethrough.node.id": self.node_id, "ridethrough.cluster": self.cluster}
        if self.rack:
            attrs["ridethrough.rack"] = self.rack
        if self.pod:
            attrs["ridethrough.pod"] = self.pod
        attrs.update(self.labels or {})
        return Resource.create(attrs)


class Snapshot:
    """The latest samples per metric name, shared by the collect thread and the reader."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_source: dict[str, dict[str, list[Sample]]] = {}

    def replace(self, source: str, samples: Iterable[Sample]) -> set[str]:
        """Make ``samples`` the source's current view; returns the metric names it holds."""
        by_name: dict[str, list[Sample]] = {}
        for s in samples:
            by_name.setdefault(s.name, []).append(s)
        with self._lock:
            self._by_source[source] = by_name
        return set(by_name)

    def first(self, name: str) -> Sample | None:
        """Any one current sample of ``name`` (its kind and unit stand for the metric's)."""
        with self._lock:
            return next((v[0] for by_name in self._by_source.values() if (v := by_name.get(name))), None)

    def observe(self, name: str) -> list[Observation]:
        """Observations of one metric across all sources."""
        with self._lock:
            return [Observation(s.value, dict(s.attributes))
                    for by_name in self._by_source.values() for s in by_name.get(name, ())]


class Agent:
    """Sources → snapshot → OTel SDK → OTLP/gRPC → gateway."""

    def __init__(self, *, identity: AgentIdentity, sources: Sequence[Source], gateway: str,
                 export_interval_s: float = 1.0, export_timeout_s: float = 5.0,
                 buffer_max_batches: int = 300, clock: Clock = time.time_ns) -> None:
        self._sources = list(sources)
        self._clock = clock
        self._snapshot = Snapshot()
        self._instruments: dict[str, object] = {}
        self._stop = threading.Event()
        self.source_errors: dict[str, int] = {s.name: 0 for s in self._sources}
        self.collections = 0
        resource = identity.resource()
        self.exporter = BufferingMetricExporter(
            OTLPMetricExporter(endpoint=gateway, insecure=True, timeout=export_timeout_s),
            max_batches=buffer_max_batches)
        self._reader = PeriodicExportingMetricReader(
            self.exporter, export_interval_millis=export_interval_s * 1000,
            export_timeout_millis=export_timeout_s * 1000 * 2)
        self._meters = MeterProvider(resource=resource, metric_readers=[self._reader])
        self._meter = self._meters.get_meter(SCOPE)
        self._logs = LoggerProvider(resource=resource)
        self._logs.add_log_record_processor(BatchLogRecordProcessor(
            OTLPLogExporter(endpoint=gateway, insecure=True, timeout=export_timeout_s)))
        self._events = self._logs.get_logger(SCOPE)
        self._register_self_metrics()
        self._thread = threading.Thread(target=self._run, name="rt-agent-collect", daemon=True)

    def start(self) -> None:
        """Start collecting (and every background source's watcher); returns at once."""
        self.event("agent.started", f"agent started with sources {[s.name for s in self._sources]}")
        for source in self._sources:
            if isinstance(source, BackgroundSource):
                self._guard(source.name, functools.partial(source.start, emit=self.emit))
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop collecting, export what is left, shut the SDK down."""
        self._stop.set()
        self._thread.join(timeout_s)
        for source in self._sources:
            if isinstance(source, BackgroundSource):
                self._guard(source.name, functools.partial(source.stop, timeout_s=timeout_s))
        self.event("agent.stopped", "agent stopped")
        self._meters.shutdown(timeout_millis=timeout_s * 1000)
        self._logs.shutdown()

    def event(self, name: str, body: str, *, severity: SeverityNumber = SeverityNumber.INFO,
              attributes: Mapping[str, str] | None = None) -> None:
        """Emit one of the agent's own events as an OTel log record."""
        self.emit(Event(name, body, self._clock(), severity.name, dict(attributes or {})))

    def emit(self, event: Event) -> None:
        """A background source's event → an OTel log record (never raises)."""
        try:
            severity = SeverityNumber[event.severity] if event.severity in SeverityNumber.__members__ \
                else SeverityNumber.INFO
            self._events.emit(timestamp=event.time_ns, observed_timestamp=time.time_ns(), body=event.body,
                              severity_number=severity, severity_text=severity.name, event_name=event.name,
                              attributes={"event.name": event.name, **event.attributes})
        except Exception:  # an event that cannot be exported must not kill the watcher thread
            log.exception("dropping event %s", event.name)

    def _guard(self, source: str, action: Callable[[], None]) -> None:
        try:
            action()
        except Exception as exc:  # a watcher that fails to start or stop is counted, not fatal
            self.source_errors[source] = self.source_errors.get(source, 0) + 1
            log.warning("source %s: background start/stop failed: %s", source, exc)

    def _collect_source(self, source: Source, now_ns: int) -> None:
        try:
            names = self._snapshot.replace(source.name, list(source.collect(now_ns)))
        except Exception as exc:  # telemetry never takes down its host
            self.source_errors[source.name] = self.source_errors.get(source.name, 0) + 1
            log.warning("source %s failed this tick: %s", source.name, exc, exc_info=log.isEnabledFor(logging.DEBUG))
            if self.source_errors[source.name] in (1, 10, 100, 1000):
                self.event("agent.source_failed", f"source {source.name} failed: {exc}",
                           severity=SeverityNumber.WARN, attributes={"source": source.name})
            return
        for name in names - self._instruments.keys():
            self._instruments[name] = self._create_instrument(name)

    def _create_instrument(self, name: str) -> object:
        sample = self._snapshot.first(name)
        def callback(_: CallbackOptions) -> Iterable[Observation]:
            return self._snapshot.observe(name)
        if sample is not None and sample.kind is MetricKind.COUNTER:
            return self._meter.create_observable_counter(name, [callback], unit=sample.unit)
        return self._meter.create_observable_gauge(name, [callback], unit=sample.unit if sample else "")

    def _register_self_metrics(self) -> None:
        readings: dict[str, Callable[[], list[Observation]]] = {
            "ridethrough.agent.source.errors":
                lambda: [Observation(n, {"source": s}) for s, n in self.source_errors.items()],
            "ridethrough.agent.export.dropped": lambda: [Observation(self.exporter.dropped_points)],
            "ridethrough.agent.export.buffered": lambda: [Observation(self.exporter.buffered_batches)],
        }
        for name, kind, unit in SELF_METRICS:
            read = readings[name]
            def callback(_: CallbackOptions, read: Callable[[], list[Observation]] = read) -> list[Observation]:
                return read()
            if kind is MetricKind.COUNTER:
                self._meter.create_observable_counter(name, [callback], unit=unit)
            else:
                self._meter.create_observable_gauge(name, [callback], unit=unit)

    def _run(self) -> None:
        intervals = {s.name: max(0.01, s.interval_s) for s in self._sources}
        due = dict.fromkeys(intervals, 0.0)
        while not self._stop.is_set():
            now = time.monotonic()
            stamp = self._clock()
            for source in self._sources:
                if now >= due[source.name]:
                    self._collect_source(source, stamp)
                    due[source.name] = now + intervals[source.name]
            self.collections += 1
            self._stop.wait(max(0.0, min(due.values()) - time.monotonic()))
