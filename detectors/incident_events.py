"""Incident transitions as OpenTelemetry: a log record each, and spans in the incident's trace.

Every incident has one trace (``Incident.trace_id``). Opening it writes the trace's root span
``incident`` (its span id derives from the trace id, so later steps, such as actuators or
a restarted controller, can parent to it without asking); every later transition writes a
child span ``incident.<transition>``. Rows go into ``otel_logs`` and ``otel_traces`` through
the gateway's columnar write path, exactly as OTLP from an agent would.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from google.protobuf.message import Message
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import KeyValue
from opentelemetry.proto.logs.v1.logs_pb2 import SeverityNumber
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from ridethrough.detectors.contract import Severity
from ridethrough.detectors.incidents import Transition, TransitionKind
from ridethrough.exporters.gateway_metrics import GatewayMetrics
from ridethrough.exporters.pipeline import write_requests
from ridethrough.exporters.rows import Limits, kv, strict
from ridethrough.exporters.signals import Signal
from ridethrough.exporters.store import Store

SERVICE = "ridethrough-controller"
SCOPE = "ridethrough.incidents"
_LIMITS = Limits(max_attribute_value_bytes=65536)  # the evidence JSON rides along as one attribute
_LOG_SEVERITY = {Severity.INFO: SeverityNumber.SEVERITY_NUMBER_INFO,
                 Severity.WARNING: SeverityNumber.SEVERITY_NUMBER_WARN,
                 Severity.ERROR: SeverityNumber.SEVERITY_NUMBER_ERROR,
                 Severity.CRITICAL: SeverityNumber.SEVERITY_NUMBER_FATAL}


def root_span_id(trace_id: str) -> bytes:
    """The 8-byte span id of an incident's root span, derived from its trace id."""
    return hashlib.sha256(b"incident-root:" + bytes.fromhex(trace_id)).digest()[:8]


def _span_id(t: Transition) -> bytes:
    i = t.incident
    return hashlib.sha256(f"{i.incident_id}:{i.version}".encode()).digest()[:8]


def _attributes(t: Transition) -> list[KeyValue]:
    i = t.incident
    return [kv("incident.id", i.incident_id), kv("incident.key", i.key), kv("incident.kind", i.kind),
            kv("incident.state", i.state.value), kv("incident.transition", t.kind.value),
            kv("incident.severity", i.severity.name.lower()), kv("incident.version", i.version),
            kv("incident.findings", i.findings), kv("entity.type", i.entity_type), kv("entity.name", i.entity),
            kv("cluster", i.cluster), kv("detector", i.detector)]


def logs_request(transitions: Sequence[Transition]) -> ExportLogsServiceRequest:
    """One log record per transition, in the incident's trace."""
    req = ExportLogsServiceRequest()
    rl = req.resource_logs.add()
    rl.resource.attributes.append(kv("service.name", SERVICE))
    sl = rl.scope_logs.add()
    sl.scope.name = SCOPE
    for t in transitions:
        i = t.incident
        record = sl.log_records.add()
        record.time_unix_nano = record.observed_time_unix_nano = i.updated_at_ns
        record.severity_number = _LOG_SEVERITY[i.severity]
        record.severity_text = i.severity.name
        record.body.string_value = f"incident {t.kind.value}: {i.summary} [{i.key}]"
        record.trace_id = bytes.fromhex(i.trace_id)
        record.span_id = root_span_id(i.trace_id) if t.kind is TransitionKind.OPENED else _span_id(t)
        record.attributes.extend(_attributes(t))
        record.attributes.append(kv("incident.evidence", i.evidence))
    return req


def traces_request(transitions: Sequence[Transition]) -> ExportTraceServiceRequest:
    """The root span of each opened incident; a child span of it for every other transition."""
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.append(kv("service.name", SERVICE))
    ss = rs.scope_spans.add()
    ss.scope.name = SCOPE
    for t in transitions:
        i = t.incident
        span = ss.spans.add()
        span.trace_id = bytes.fromhex(i.trace_id)
        root = root_span_id(i.trace_id)
        if t.kind is TransitionKind.OPENED:
            span.span_id, span.name = root, "incident"
        else:
            span.span_id, span.parent_span_id, span.name = _span_id(t), root, f"incident.{t.kind.value}"
        span.kind = Span.SPAN_KIND_INTERNAL
        span.start_time_unix_nano = span.end_time_unix_nano = i.updated_at_ns
        span.attributes.extend(_attributes(t))
        if i.severity >= Severity.ERROR and t.kind is not TransitionKind.RESOLVED:
            span.status.code = Status.STATUS_CODE_ERROR
            span.status.message = i.summary
    return req


class IncidentEmitter:
    """``emit`` for the `Controller`: writes the transitions' log records and spans into the store."""

    def __init__(self, *, store: Store, metrics: GatewayMetrics, spans: bool = True) -> None:
        self._store = store
        self._metrics = metrics
        self._spans = spans

    def __call__(self, transitions: Sequence[Transition]) -> None:
        """Write one batch: a log record per transition (and spans); a retry writes nothing twice."""
        if not transitions:
            return
        requests: list[tuple[Signal, Message]] = [(Signal.LOGS, logs_request(transitions))]
        if self._spans:
            requests.append((Signal.TRACES, traces_request(transitions)))
        token = "incident-events:" + ",".join(sorted(f"{t.incident.incident_id}:{t.incident.version}"
                                                     for t in transitions))
        write_requests(self._store, requests, token=hashlib.sha256(token.encode()).hexdigest(),
                       metrics=self._metrics, limits=_LIMITS, check=strict("incident events"))
