"""Build OTLP requests and send them as raw bytes, the way a misbehaving client could."""

from __future__ import annotations

import time

import grpc
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)

from ridethrough.exporters.rows import kv

METRICS_EXPORT = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"


def gauge_request(n: int, *, service: str = "test", name: str = "test.gauge", start_seq: int = 0,
                  values: list[float] | None = None, attrs_per_point: int = 1) -> ExportMetricsServiceRequest:
    """``n`` gauge points, each with a unique ``seq`` attribute."""
    req = ExportMetricsServiceRequest()
    rm = req.resource_metrics.add()
    rm.resource.attributes.extend([kv("service.name", service), kv("host.name", "test-host")])
    metric = rm.scope_metrics.add().metrics.add(name=name, unit="1")
    now = time.time_ns()
    for i in range(n):
        p = metric.gauge.data_points.add(time_unix_nano=now + i, as_double=values[i] if values else float(i))
        p.attributes.append(kv("seq", str(start_seq + i)))
        p.attributes.extend(kv(f"k{j}", "v") for j in range(attrs_per_point - 1))
    return req


def grpc_export(target: str, request: ExportMetricsServiceRequest | bytes, *, timeout_s: float = 30.0,
                compression: grpc.Compression | None = None) -> tuple[str, object]:
    """Send one metrics Export; returns (status code name, response or details)."""
    raw = request if isinstance(request, bytes) else request.SerializeToString()
    with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        call = channel.unary_unary(METRICS_EXPORT, request_serializer=None,
                                   response_deserializer=ExportMetricsServiceResponse.FromString)
        try:
            return "OK", call(raw, timeout=timeout_s, compression=compression)
        except grpc.RpcError as err:
            return err.code().name, (err.details(), err.trailing_metadata())
