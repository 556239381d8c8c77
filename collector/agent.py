"""The node agent: run sources on their intervals, export what they see over OTLP.

Each source's latest samples are kept in a `Snapshot`. Every export interval the agent
turns the snapshot and its own metrics into one OTLP batch (OpenTelemetry SDK data
model, monotonic sums and gauges, cumulative since the agent started) and the SDK's
OTLP/gRPC exporter ships it to the gateway, buffering while the gateway is away. Where
asked, a Prometheus ``/metrics`` endpoint reads the same snapshot at each scrape
(`ridethrough.collector.prometheus`). The snapshot holds at most ``max_series`` series;
new ones beyond are dropped and counted. Events (start, stop, a source failing, and the
background sources' job steps and XIDs) go out as OTel log records, buffered the same way
(`ridethrough.collector.export_logs`). A source that raises is logged, counted and skipped for that tick.

Why not the SDK's observable instruments: their callbacks, measurement objects and
per-point aggregation cost more CPU than everything else the agent does, to
reproduce values the snapshot already holds (see bench/agent_overhead.py).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from opentelemetry._logs import SeverityNumber

# The OTLP log exporter's documented import path also carries a leading underscore.
from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter

# The logs SDK is still published under a leading underscore; it is the documented entry point.
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    Metric,
    MetricExportResult,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from ridethrough.collector.export import BufferingMetricExporter, MergeEncoded, OTLPBytesExporter
from ridethrough.collector.export_logs import BufferingLogExporter
from ridethrough.collector.identity import AgentIdentity
from ridethrough.collector.link_watch import LinkWatch
from ridethrough.collector.otlp_encode import EncodedMetrics, SampleEncoder
from ridethrough.collector.prometheus import MetricsEndpoint, SnapshotCollector
from ridethrough.collector.sample import BackgroundSource, Event, MetricKind, Sample, Source
from ridethrough.collector.snapshot import Snapshot, group_by_name

log = logging.getLogger(__name__)

SCOPE = "ridethrough.collector"
SELF_METRICS: tuple[tuple[str, MetricKind, str], ...] = (
    ("ridethrough.agent.source.errors", MetricKind.COUNTER, "{error}"),
    ("ridethrough.agent.export.dropped", MetricKind.COUNTER, "{point}"),
    ("ridethrough.agent.export.buffered", MetricKind.GAUGE, "{batch}"),
    ("ridethrough.agent.series.dropped", MetricKind.COUNTER, "{series}"),
    ("ridethrough.agent.events.dropped", MetricKind.COUNTER, "{event}"),
    ("ridethrough.agent.events.buffered", MetricKind.GAUGE, "{batch}"),
)
"""What the agent reports about itself: (name, kind, unit), as catalogued."""
Clock = Callable[[], int]
Reading = list[tuple[float, dict[str, str]]]
"""One self-metric's current points: (value, attributes)."""


class Service(Protocol):
    """A server the agent runs beside its sources (its control plane): started and stopped with it."""

    def start(self) -> str:
        """Serve; returns the bound ``HOST:PORT``."""
        ...

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving, waiting up to ``timeout_s`` for calls in flight."""
        ...


class Agent:
    """Sources → snapshot → OTLP/gRPC → gateway (and, if asked, Prometheus ``/metrics``).

    ``max_series`` caps the distinct series the snapshot holds (see `Snapshot`);
    ``prometheus_listen`` (``HOST:PORT``, port 0 for any) also serves the snapshot at
    ``/metrics`` from `start` on; ``descriptions`` (metric name → text) become the OTLP
    metric descriptions and the Prometheus HELP lines; ``services`` (name → server, e.g.
    ``{"control": ControlPlaneServer}``) start with the agent, their addresses in `addresses`;
    ``on_link_change`` names the sources read (and exported) at once when the kernel reports a
    link change (`ridethrough.collector.link_watch`), e.g. ``("netdev",)``.
    """

    def __init__(self, *, identity: AgentIdentity, sources: Sequence[Source], gateway: str,
                 export_interval_s: float = 1.0, export_timeout_s: float = 5.0,
                 buffer_max_batches: int = 300, clock: Clock = time.time_ns, max_series: int = 100_000,
                 prometheus_listen: str = "", descriptions: Mapping[str, str] | None = None,
                 headers: Sequence[tuple[str, str]] = (), services: Mapping[str, Service] | None = None,
                 on_link_change: Sequence[str] = ()) -> None:
        self._sources = list(sources)
        self._services = dict(services or {})
        self._clock = clock
        self._snapshot = Snapshot(max_series=max_series)
        self._descriptions = dict(descriptions or {})
        self._export_interval_s = export_interval_s
        self._export_timeout_s = export_timeout_s
        self._stop = threading.Event()
        self._collected = threading.Event()
        self._wake = threading.Event()  # the collect loop's sleep: ends early for `collect_now` and `stop`
        self._now_lock = threading.Lock()
        self._now: set[str] = set()  # sources asked for by `collect_now`, not yet read
        self._urgent = False  # the next collection round exports at once, whatever the interval
        known = {s.name for s in self._sources}
        self._link_sources = [n for n in on_link_change if n in known]
        self.links = LinkWatch(functools.partial(self.collect_now, self._link_sources)) if self._link_sources \
            else None
        """Hears the kernel's link changes and reads ``on_link_change`` sources at once (None: polling only)."""
        self.source_errors: dict[str, int] = {s.name: 0 for s in self._sources}
        self._source_attributes: dict[str, dict[str, str]] = {}
        self.collections = 0
        self.exports = 0
        self.addresses: dict[str, str] = {}
        """What the agent serves once started: ``{"prometheus": "HOST:PORT", "control": ...}`` when asked to."""
        self._resource = identity.resource()
        self._scope = InstrumentationScope(SCOPE)
        self._start_ns = time.time_ns()
        self._prometheus = MetricsEndpoint(listen=prometheus_listen, collector=SnapshotCollector(
            read=self.samples, resource=self._resource.attributes, scope=SCOPE,
            descriptions=self._descriptions)) if prometheus_listen else None
        self._encoder = SampleEncoder(resource=self._resource, scope=SCOPE, descriptions=self._descriptions)
        # ``headers``: call metadata for every export, e.g. the ingest bearer token
        self.exporter = BufferingMetricExporter(
            OTLPBytesExporter(endpoint=gateway, timeout_s=export_timeout_s, headers=headers),
            max_batches=buffer_max_batches, merge=MergeEncoded())
        self._logs = LoggerProvider(resource=self._resource)
        # events wait out a gateway that is away as metrics do (the SDK's processor drops what fails)
        self.event_exporter = BufferingLogExporter(
            OTLPLogExporter(endpoint=gateway, insecure=True, timeout=export_timeout_s, headers=dict(headers)),
            max_batches=buffer_max_batches)
        self._logs.add_log_record_processor(BatchLogRecordProcessor(self.event_exporter))
        self._events = self._logs.get_logger(SCOPE)
        self._thread = threading.Thread(target=self._run, name="rt-agent-collect", daemon=True)
        self._exporting = threading.Thread(target=self._export_loop, name="rt-agent-export", daemon=True)

    def start(self) -> None:
        """Start collecting (and every background source's watcher, and ``/metrics``); returns at once."""
        if self._prometheus is not None:
            self.addresses["prometheus"] = self._prometheus.start()
            log.info("serving Prometheus /metrics on %s", self.addresses["prometheus"])
        for name, service in self._services.items():  # a port that cannot be bound stops the start (OSError)
            self.addresses[name] = service.start()
        self.event("agent.started", f"agent started with sources {[s.name for s in self._sources]}")
        for source in self._sources:
            if isinstance(source, BackgroundSource):
                self._guard(source.name, functools.partial(source.start, emit=self.emit))
        self._thread.start()
        self._exporting.start()
        if self.links is not None and not self.links.start():
            self.links = None

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop collecting, export what is left, shut the exporters down."""
        self._stop.set()
        self._collected.set()
        self._wake.set()
        if self.links is not None:
            self.links.stop(timeout_s)
        for thread in (self._thread, self._exporting):
            if thread.is_alive():
                thread.join(timeout_s)
        for source in self._sources:
            if isinstance(source, BackgroundSource):
                self._guard(source.name, functools.partial(source.stop, timeout_s=timeout_s))
        self.event("agent.stopped", "agent stopped")
        for service in self._services.values():
            service.stop(timeout_s)
        if self._prometheus is not None:
            self._prometheus.stop(timeout_s)
        self.export()
        self.exporter.shutdown(timeout_millis=timeout_s * 1000)
        self._logs.shutdown()

    def samples(self) -> list[Sample]:
        """Everything the agent reports now: its sources' current samples, then its own metrics."""
        return self._snapshot.samples() + self.self_samples()

    def self_samples(self) -> list[Sample]:
        """The agent's own metrics (`SELF_METRICS`), read now."""
        readings = self._self_readings()
        return [Sample(name, value, kind, unit, attrs)
                for name, kind, unit in SELF_METRICS for value, attrs in readings[name]()]

    def encoded(self, now_ns: int | None = None) -> EncodedMetrics:
        """`samples` as the serialised OTLP request `export` sends: `metrics_data`, encoded."""
        now = time.time_ns() if now_ns is None else now_ns
        groups = self._snapshot.by_name()
        for name, samples in group_by_name(self.self_samples()).items():
            groups[name] = groups[name] + samples if name in groups else samples
        return self._encoder.encode(groups.items(), start_ns=self._start_ns, now_ns=now)

    def metrics_data(self, now_ns: int | None = None) -> MetricsData:
        """`samples` as one OTLP batch in the SDK's data model: counters as cumulative monotonic sums, the rest
        as gauges (what `encoded` writes directly)."""
        now = time.time_ns() if now_ns is None else now_ns
        by_name: dict[str, list[Sample]] = {}
        for sample in self.samples():
            by_name.setdefault(sample.name, []).append(sample)
        metrics = [self._metric(name, samples, now) for name, samples in by_name.items()]
        return MetricsData([ResourceMetrics(self._resource, [ScopeMetrics(self._scope, metrics, "")], "")])

    def _metric(self, name: str, samples: list[Sample], now_ns: int) -> Metric:
        first = samples[0]  # its kind and unit stand for the metric's
        data: Sum | Gauge
        if first.kind is MetricKind.COUNTER:
            data = Sum([NumberDataPoint(s.attributes, self._start_ns, now_ns, s.value) for s in samples],
                       AggregationTemporality.CUMULATIVE, True)
        else:
            data = Gauge([NumberDataPoint(s.attributes, 0, now_ns, s.value) for s in samples])
        return Metric(name, self._descriptions.get(name, ""), first.unit, data)

    def export(self) -> bool:
        """Export the current snapshot once (buffered while the gateway is away); never raises."""
        try:
            result = self.exporter.export(self.encoded(), timeout_millis=self._export_timeout_s * 1000)
        except Exception:  # telemetry never takes down its host: log, and try again next interval
            log.exception("metric export failed")
            return False
        self.exports += 1
        return result is MetricExportResult.SUCCESS

    def _retry_events(self) -> None:
        try:
            self.event_exporter.retry()
        except Exception:  # telemetry never takes down its host
            log.exception("event export retry failed")

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
            self._snapshot.replace(source.name, list(source.collect(now_ns)))
        except Exception as exc:  # telemetry never takes down its host
            self.source_errors[source.name] = self.source_errors.get(source.name, 0) + 1
            log.warning("source %s failed this tick: %s", source.name, exc, exc_info=log.isEnabledFor(logging.DEBUG))
            if self.source_errors[source.name] in (1, 10, 100, 1000):
                self.event("agent.source_failed", f"source {source.name} failed: {exc}",
                           severity=SeverityNumber.WARN, attributes={"source": source.name})

    def _self_readings(self) -> dict[str, Callable[[], Reading]]:
        on = self._on_source
        return {
            "ridethrough.agent.source.errors": lambda: [(n, on(s)) for s, n in self.source_errors.items()],
            "ridethrough.agent.export.dropped": lambda: [(self.exporter.dropped_points, {})],
            "ridethrough.agent.export.buffered": lambda: [(self.exporter.buffered_batches, {})],
            "ridethrough.agent.series.dropped": lambda: [(self._snapshot.dropped.get(s.name, 0), on(s.name))
                                                         for s in self._sources],
            "ridethrough.agent.events.dropped": lambda: [(self.event_exporter.dropped_records, {})],
            "ridethrough.agent.events.buffered": lambda: [(self.event_exporter.buffered_batches, {})],
        }

    def _on_source(self, source: str) -> dict[str, str]:
        """``{"source": source}``, one dict per source for every reading (samples share attribute dicts)."""
        found = self._source_attributes.get(source)
        if found is None:
            found = self._source_attributes[source] = {"source": source}
        return found

    def collect_now(self, names: Sequence[str]) -> None:
        """Read the named sources at once and export right after them (a link changed); thread-safe."""
        with self._now_lock:
            self._now.update(names)
        self._wake.set()

    def _run(self) -> None:
        intervals = {s.name: max(0.01, s.interval_s) for s in self._sources}
        due = dict.fromkeys(intervals, 0.0)
        while not self._stop.is_set():
            self._wake.clear()
            with self._now_lock:
                asked, self._now = self._now, set()
            for name in asked & due.keys():
                due[name] = 0.0
            now = time.monotonic()
            stamp = self._clock()
            collected = False
            for source in self._sources:
                if now >= due[source.name]:
                    self._collect_source(source, stamp)
                    due[source.name] = now + intervals[source.name]
                    collected = True
            if collected:
                if asked:  # set once read, so that the export this wakes carries the fresh readings
                    self._urgent = True
                self._collected.set()  # fresh readings: the export loop may send them now
            self.collections += 1
            self._wake.wait(max(0.0, min(due.values(), default=now + 1.0) - time.monotonic()))

    def _export_loop(self) -> None:
        """Export about once per interval, right after a collection round: readings leave as soon as
        they are read (a port that just went down reaches the detectors a collection sooner), at the
        same number of exports. Without collections, export anyway after one and a half intervals. A round that
        `collect_now` asked for is exported at once, however soon after the last export."""
        interval = max(0.01, self._export_interval_s)
        last = time.monotonic()
        while not self._stop.is_set():
            fresh = self._collected.wait(max(0.0, last + 1.5 * interval - time.monotonic()))
            if self._stop.is_set():
                return
            self._collected.clear()
            now = time.monotonic()
            urgent, self._urgent = self._urgent, False
            if fresh and now - last < 0.9 * interval and not urgent:
                continue  # read sooner than an interval after the last export: these go with the next round
            self.export()
            self._retry_events()
            last = now
