"""An audit's result as an OpenTelemetry log record, sent to a gateway: how an audit is recorded where the store
has one writer (a lab's, or any fleet whose store only the gateway writes).

The gateway stores the record in ``otel_logs`` like any other (so the upstream Collector could carry it
too): service ``ridethrough-audit``, ``event.name`` ``audit.completed``, the counts the dashboard lists as
attributes, and the whole JSON result as the body::

    SELECT LogAttributes['audit.id'], LogAttributes['audit.status'] FROM otel_logs
    WHERE ServiceName = 'ridethrough-audit' AND LogAttributes['event.name'] = 'audit.completed'

The dashboard reads these beside the ``audits`` table (`ridethrough.audit_store`) and renders the HTML
report from the body (`result_from_json` gives back the `AuditResult`, `render_html` the same page).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.logs.v1.logs_pb2 import SeverityNumber

from ridethrough.audit_model import Anomaly, AuditResult, PhaseRecord, Status, Symptom
from ridethrough.audit_store import summary
from ridethrough.exporters.rows import kv

SERVICE = "ridethrough-audit"
SCOPE = "ridethrough.audit"
EVENT = "audit.completed"
EXPORT = "/opentelemetry.proto.collector.logs.v1.LogsService/Export"
_RETRYABLE = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED")
_SEVERITY = {Status.PASS: SeverityNumber.SEVERITY_NUMBER_INFO, Status.PARTIAL: SeverityNumber.SEVERITY_NUMBER_WARN,
             Status.FAIL: SeverityNumber.SEVERITY_NUMBER_ERROR}


class RecordError(Exception):
    """The gateway did not take a record (the message says why)."""


def logs_request(result: AuditResult) -> ExportLogsServiceRequest:
    """One log record at the audit's start: the counts as attributes, the JSON result as the body."""
    req = ExportLogsServiceRequest()
    rl = req.resource_logs.add()
    rl.resource.attributes.extend([kv("service.name", SERVICE), kv("ridethrough.cluster", result.cluster)])
    sl = rl.scope_logs.add()
    sl.scope.name = SCOPE
    record = sl.log_records.add()
    record.time_unix_nano = result.started_ns
    record.observed_time_unix_nano = result.ended_ns
    record.severity_number = _SEVERITY.get(result.status, SeverityNumber.SEVERITY_NUMBER_WARN)
    record.severity_text = result.status.value
    record.body.string_value = result.dumps()
    fails = {k: sum(s is Status.FAIL for s in v.values()) for k, v in (("hosts", result.hosts),
                                                                       ("links", result.links))}
    record.attributes.extend([
        kv("event.name", EVENT), kv("audit.id", result.audit_id), kv("cluster", result.cluster),
        kv("audit.status", result.status.value), kv("audit.ended_ns", result.ended_ns),
        kv("audit.budget_s", f"{result.budget_s:g}"), kv("audit.hosts", len(result.hosts)),
        kv("audit.hosts_failed", fails["hosts"]), kv("audit.links", len(result.links)),
        kv("audit.links_failed", fails["links"]), kv("audit.anomalies", len(result.anomalies)),
        kv("audit.not_covered", len(result.not_covered())), kv("audit.summary", summary(result)[:1000])])
    return req


def send_audit(endpoint: str, result: AuditResult, *, timeout_s: float = 30.0,
               headers: Sequence[tuple[str, str]] = (), attempts: int = 4) -> None:
    """Send the audit's record to the OTLP/gRPC gateway at ``endpoint`` (``HOST:PORT``, plaintext) and wait
    for it to be stored; retries what OTLP says is worth retrying. `RecordError` when it is not stored."""
    rejected, message = export_logs(endpoint, logs_request(result).SerializeToString(), what="the audit",
                                    timeout_s=timeout_s, headers=headers, attempts=attempts)
    if rejected:
        raise RecordError(f"the gateway at {endpoint} rejected the audit record ({message or 'no reason'})")


def export_logs(endpoint: str, payload: bytes, *, what: str, timeout_s: float = 30.0,
                headers: Sequence[tuple[str, str]] = (), attempts: int = 4) -> tuple[int, str]:
    """One serialised OTLP logs Export to the gateway at ``endpoint``, retried as OTLP says: (records the
    gateway rejected, its message). `RecordError` naming ``what`` when the call never succeeds."""
    import grpc
    from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceResponse

    deadline = time.monotonic() + timeout_s
    last = ""
    with grpc.insecure_channel(endpoint) as channel:
        call = channel.unary_unary(EXPORT, request_serializer=lambda b: b,
                                   response_deserializer=ExportLogsServiceResponse.FromString)
        for attempt in range(max(1, attempts)):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                answer = call(payload, timeout=left, metadata=tuple(headers))
                return answer.partial_success.rejected_log_records, answer.partial_success.error_message
            except grpc.RpcError as err:
                code = err.code() if isinstance(err, grpc.Call) else None
                last = f"{getattr(code, 'name', 'error')}: {err.details() if isinstance(err, grpc.Call) else err}"
                if code is None or code.name not in _RETRYABLE:
                    break
                time.sleep(min(0.5 * 2 ** attempt, max(0.0, deadline - time.monotonic())))
    raise RecordError(f"the gateway at {endpoint} did not store {what} ({last or 'timed out'})")


def result_from_json(doc: Mapping[str, Any]) -> AuditResult:
    """The `AuditResult` a ``to_json`` document describes (ValueError for a document that is not one)."""
    try:
        anomalies = tuple(Anomaly(a["entity_type"], a["entity"], a["kind"], a["summary"], a["action"],
                                  tuple(Symptom(**s) for s in a["symptoms"]), tuple(a.get("candidates", ())))
                          for a in doc["anomalies"])
        phases = tuple(PhaseRecord(p["name"], p["started_s"], p["ended_s"], tuple(p.get("covered", ())),
                                   dict(p.get("not_covered", {})), p.get("note", "")) for p in doc["phases"])
        return AuditResult(str(doc["audit_id"]), str(doc.get("cluster", "")), int(doc["started_ns"]),
                           int(doc["ended_ns"]), float(doc["budget_s"]),
                           {k: Status(v) for k, v in doc["hosts"].items()},
                           {k: Status(v) for k, v in doc["links"].items()}, anomalies, phases,
                           dict(doc.get("facts", {})))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"not an audit result: {type(exc).__name__}: {exc}") from None
