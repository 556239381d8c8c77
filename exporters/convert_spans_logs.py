"""OTLP traces and logs → rows of otel_traces and otel_logs.

Spans need a 16-byte trace id, an 8-byte span id, a name and an end not before their
start; log records need a timestamp (the observed time stands in for a missing one, as
upstream does). Invalid items are rejected one by one; the rest is kept.
"""

from __future__ import annotations

from typing import Any

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from ridethrough.exporters import schema
from ridethrough.exporters.rows import (
    RESOURCE_LIMITS,
    InvalidItem,
    Limits,
    Rejections,
    Rows,
    any_value_str,
    attributes,
    check_time,
    hex_id,
)

# The upstream Collector's names (pdata's SpanKind.String() and StatusCode.String()).
_SPAN_KINDS = {
    Span.SPAN_KIND_UNSPECIFIED: "Unspecified", Span.SPAN_KIND_INTERNAL: "Internal",
    Span.SPAN_KIND_SERVER: "Server", Span.SPAN_KIND_CLIENT: "Client",
    Span.SPAN_KIND_PRODUCER: "Producer", Span.SPAN_KIND_CONSUMER: "Consumer",
}
_STATUS = {Status.STATUS_CODE_UNSET: "Unset", Status.STATUS_CODE_OK: "Ok", Status.STATUS_CODE_ERROR: "Error"}


def convert_traces(req: ExportTraceServiceRequest, limits: Limits, rows: Rows, rej: Rejections) -> None:
    """Append every valid span of ``req`` to ``rows``; count the others in ``rej``."""
    for rs in req.resource_spans:
        for ss in rs.scope_spans:
            try:
                res = attributes(rs.resource.attributes, len(rs.resource.attributes), RESOURCE_LIMITS)
            except InvalidItem as exc:
                rej.add(f"spans of a resource with {exc}", len(ss.spans))
                continue
            head = (res.get("service.name", ""), res, ss.scope.name, ss.scope.version)
            _spans(ss.spans, head, limits, rows, rej)


def _spans(spans: Any, head: tuple[Any, ...], limits: Limits, rows: Rows, rej: Rejections) -> None:
    for span in spans:
        try:
            rows.append_row(schema.TRACES, _span(span, head, limits))
        except InvalidItem as exc:
            rej.add(f"spans: {exc}")


def _span(s: Span, head: tuple[Any, ...], limits: Limits) -> tuple[Any, ...]:
    service, res, scope_name, scope_version = head
    if not s.name:
        raise InvalidItem("missing name")
    if s.end_time_unix_nano < s.start_time_unix_nano or not s.start_time_unix_nano:
        raise InvalidItem("missing start time or end before start")
    check_time(s.end_time_unix_nano, "end_time_unix_nano")
    events = list(s.events)
    links = list(s.links)
    return (
        s.start_time_unix_nano, hex_id(s.trace_id, 16, "trace_id", required=True),
        hex_id(s.span_id, 8, "span_id", required=True),
        hex_id(s.parent_span_id, 8, "parent_span_id", required=False), s.trace_state, s.name,
        _SPAN_KINDS.get(s.kind, "Unspecified"), service, res, scope_name, scope_version,
        attributes(s.attributes, len(s.attributes), limits), s.end_time_unix_nano - s.start_time_unix_nano,
        _STATUS.get(s.status.code, "Unset"), s.status.message,
        [check_time(e.time_unix_nano, "event time_unix_nano") for e in events], [e.name for e in events],
        [attributes(e.attributes, len(e.attributes), limits) for e in events],
        [hex_id(x.trace_id, 16, "link trace_id", required=True) for x in links],
        [hex_id(x.span_id, 8, "link span_id", required=True) for x in links],
        [x.trace_state for x in links], [attributes(x.attributes, len(x.attributes), limits) for x in links],
    )


def convert_logs(req: ExportLogsServiceRequest, limits: Limits, rows: Rows, rej: Rejections) -> None:
    """Append every valid log record of ``req`` to ``rows``; count the others in ``rej``."""
    for rl in req.resource_logs:
        for sl in rl.scope_logs:
            try:
                res = attributes(rl.resource.attributes, len(rl.resource.attributes), RESOURCE_LIMITS)
                scope_attrs = attributes(sl.scope.attributes, len(sl.scope.attributes), RESOURCE_LIMITS)
            except InvalidItem as exc:
                rej.add(f"log records of a resource or scope with {exc}", len(sl.log_records))
                continue
            head = (res.get("service.name", ""), rl.schema_url, res, sl.schema_url, sl.scope.name,
                    sl.scope.version, scope_attrs)
            for record in sl.log_records:
                try:
                    rows.append_row(schema.LOGS, _log(record, head, limits))
                except InvalidItem as exc:
                    rej.add(f"log records: {exc}")


def _log(r: LogRecord, head: tuple[Any, ...], limits: Limits) -> tuple[Any, ...]:
    service, res_url, res, scope_url, scope_name, scope_version, scope_attrs = head
    ts = r.time_unix_nano or r.observed_time_unix_nano
    if not ts:
        raise InvalidItem("missing time_unix_nano and observed_time_unix_nano")
    return (
        check_time(ts, "time_unix_nano"), hex_id(r.trace_id, 16, "trace_id", required=False),
        hex_id(r.span_id, 8, "span_id", required=False),
        r.flags & 0xFF, r.severity_text, r.severity_number, service, any_value_str(r.body), res_url, res,
        scope_url, scope_name, scope_version, scope_attrs, attributes(r.attributes, len(r.attributes), limits),
    )
