"""The three OTLP signals the gateway takes, and what each needs: messages, service, converter."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

from google.protobuf.message import Message
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2 as logs_pb
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as metrics_pb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as trace_pb

from ridethrough.exporters.convert_metrics import convert_metrics
from ridethrough.exporters.convert_spans_logs import convert_logs, convert_traces
from ridethrough.exporters.rows import Limits, Rejections, Rows

Converter = Callable[[Any, Limits, Rows, Rejections], None]


class Signal(enum.Enum):
    """metrics, traces or logs."""

    METRICS = (1, "opentelemetry.proto.collector.metrics.v1.MetricsService",
               metrics_pb.ExportMetricsServiceRequest, metrics_pb.ExportMetricsServiceResponse, convert_metrics)
    TRACES = (2, "opentelemetry.proto.collector.trace.v1.TraceService",
              trace_pb.ExportTraceServiceRequest, trace_pb.ExportTraceServiceResponse, convert_traces)
    LOGS = (3, "opentelemetry.proto.collector.logs.v1.LogsService",
            logs_pb.ExportLogsServiceRequest, logs_pb.ExportLogsServiceResponse, convert_logs)

    def __init__(self, code: int, service: str, request: type[Message], response: type[Message],
                 converter: Converter) -> None:
        self.code = code
        self.service = service
        self.request_type = request
        self.response_type = response
        self.converter = converter

    @classmethod
    def from_code(cls, code: int) -> Signal:
        """The signal stored under ``code`` in a spool file."""
        for signal in cls:
            if signal.code == code:
                return signal
        raise ValueError(f"unknown signal code {code}")

    def convert(self, raw: bytes, limits: Limits, rows: Rows, rej: Rejections) -> int:
        """Parse ``raw`` and append its valid items to ``rows``; returns the items it held."""
        request = self.request_type.FromString(raw)
        before = rows.total + rej.count
        self.converter(request, limits, rows, rej)
        return rows.total + rej.count - before

    def partial_success(self, rejected: int, message: str) -> bytes:
        """The serialized Export response, with partial_success when anything was rejected."""
        response = self.response_type()
        if rejected:
            ps = response.partial_success
            field = {Signal.METRICS: "rejected_data_points", Signal.TRACES: "rejected_spans",
                     Signal.LOGS: "rejected_log_records"}[self]
            setattr(ps, field, rejected)
            ps.error_message = message
        return bytes(response.SerializeToString())
