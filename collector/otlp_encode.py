"""OTLP encoding of the agent's metrics that reuses what does not change between exports.

The SDK's encoder rebuilds every attribute of every point at every export. An agent
sends the same series each second (1,400 of them on an 8-GPU, 8-NIC node, with up to a
dozen attributes each), so that was most of its CPU. `CachingMetricsEncoder` encodes a
point's attribute set once, keeps the bytes, and writes each later point as those bytes
and its fixed-width time and value fields. For the
sums and gauges of number points the agent exports its output equals the SDK's
``encode_metrics`` (the tests hold it to that); anything else is left to the SDK's encoder.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, InstrumentationScope, KeyValue
from opentelemetry.proto.metrics.v1 import metrics_pb2 as pb
from opentelemetry.proto.resource.v1.resource_pb2 import Resource as PbResource
from opentelemetry.sdk.metrics.export import Gauge, Metric, MetricsData, NumberDataPoint, Sum
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope as SdkScope

# A NumberDataPoint's fixed-width fields, as protobuf writes them: tag byte, then 8 bytes
# little-endian (start_time_unix_nano = 2 and time_unix_nano = 3 are fixed64, as_double = 4
# a double, as_int = 6 an sfixed64). The data_points of a Sum or a Gauge are field 1.
_TIMES = struct.Struct("<BQBQ")
_TIME = struct.Struct("<BQ")
_DOUBLE = struct.Struct("<Bd")
_INT = struct.Struct("<Bq")
_START_TAG, _TIME_TAG, _DOUBLE_TAG, _INT_TAG = 0x11, 0x19, 0x21, 0x31
_DATA_POINTS_TAG = b"\x0a"


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


class _NotNumbers(Exception):
    """The batch holds something besides sums and gauges of plain number points."""


def any_value(value: Any) -> AnyValue:
    """An attribute value as OTLP writes it."""
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, str):
        return AnyValue(string_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    if isinstance(value, bytes):
        return AnyValue(bytes_value=value)
    if isinstance(value, Sequence):
        return AnyValue(array_value=ArrayValue(values=[any_value(v) for v in value]))
    raise TypeError(f"attribute value {value!r} has unsupported type {type(value).__name__}")


def key_values(attributes: Mapping[str, Any] | None) -> list[KeyValue]:
    """Attributes as OTLP key-values, in their order."""
    return [KeyValue(key=k, value=any_value(v)) for k, v in (attributes or {}).items()]


class CachingMetricsEncoder:
    """`MetricsData` → ``ExportMetricsServiceRequest``, reusing each attribute set's encoding.

    At most ``max_entries`` attribute sets are kept; past that the cache starts afresh.
    """

    def __init__(self, *, max_entries: int = 200_000) -> None:
        self._max = max_entries
        self._attrs: dict[tuple[int, tuple[tuple[str, Any], ...]], bytes] = {}
        self._resources: dict[int, tuple[Resource, PbResource]] = {}

    def encode(self, data: MetricsData) -> ExportMetricsServiceRequest:
        """The request the SDK's ``encode_metrics`` would build, built faster."""
        try:
            return self._encode(data)
        except (_NotNumbers, TypeError, struct.error):  # exemplars, histograms, odd values
            return encode_metrics(data)

    def _encode(self, data: MetricsData) -> ExportMetricsServiceRequest:
        request = ExportMetricsServiceRequest()
        for rm in data.resource_metrics:
            out = request.resource_metrics.add(schema_url=rm.resource.schema_url or "")
            out.resource.CopyFrom(self._resource(rm.resource))
            for sm in rm.scope_metrics:
                scope = out.scope_metrics.add(schema_url=sm.scope.schema_url or "")
                scope.scope.CopyFrom(_scope(sm.scope))
                for metric in sm.metrics:
                    self._metric(metric, scope.metrics.add(name=metric.name, description=metric.description,
                                                           unit=metric.unit))
        return request

    def _resource(self, resource: Resource) -> PbResource:
        cached = self._resources.get(id(resource))
        if cached is None or cached[0] is not resource:
            cached = self._resources[id(resource)] = (resource, PbResource(attributes=key_values(resource.attributes)))
        return cached[1]

    def _metric(self, metric: Metric, out: pb.Metric) -> None:
        data = metric.data
        if isinstance(data, Sum):
            if data.data_points:
                out.sum.aggregation_temporality = data.aggregation_temporality  # type: ignore[assignment]
                out.sum.is_monotonic = data.is_monotonic
                out.sum.MergeFromString(self._points(data.data_points, start=True))
        elif isinstance(data, Gauge):
            if data.data_points:
                out.gauge.MergeFromString(self._points(data.data_points, start=False))
        else:
            raise _NotNumbers(metric.name)

    def _points(self, points: Sequence[Any], *, start: bool) -> bytes:
        """The points as the serialized ``data_points`` of a Sum or Gauge.

        Written by hand, not field by field through the protobuf API: each point is its cached
        head (tag, length, attributes) and 27 (18 without a start time) bytes of fixed-width
        fields, and the container parses the whole run in C at once.
        """
        chunks: list[bytes] = []
        fixed = 27 if start else 18
        for point in points:
            if not isinstance(point, NumberDataPoint) or point.exemplars:
                raise _NotNumbers()
            value = point.value
            if start:
                times = _TIMES.pack(_START_TAG, point.start_time_unix_nano, _TIME_TAG, point.time_unix_nano)
            else:
                times = _TIME.pack(_TIME_TAG, point.time_unix_nano)
            if isinstance(value, int):
                number = _INT.pack(_INT_TAG, value)
            else:
                number = _DOUBLE.pack(_DOUBLE_TAG, value)
            chunks += (self._head(point.attributes, fixed), times, number)
        return b"".join(chunks)

    def _head(self, attributes: Mapping[str, Any] | None, fixed: int) -> bytes:
        """A data point's tag, length and encoded attributes, for points of ``fixed`` more bytes."""
        key = (fixed, tuple((attributes or {}).items()))
        head = self._attrs.get(key)  # a TypeError here (a list value) goes to the SDK's encoder
        if head is None:
            if len(self._attrs) >= self._max:
                self._attrs.clear()
            encoded = pb.NumberDataPoint(attributes=key_values(attributes)).SerializeToString()
            head = self._attrs[key] = _DATA_POINTS_TAG + _varint(len(encoded) + fixed) + encoded
        return head


def _scope(scope: SdkScope) -> InstrumentationScope:
    return InstrumentationScope(name=scope.name, version=scope.version or "", attributes=key_values(scope.attributes))


class CachingOTLPMetricExporter(OTLPMetricExporter):
    """The SDK's OTLP/gRPC metric exporter (channel, retries, timeouts) with `CachingMetricsEncoder`."""

    def __init__(self, *, endpoint: str, insecure: bool, timeout_s: float,
                 encoder: CachingMetricsEncoder | None = None) -> None:
        super().__init__(endpoint=endpoint, insecure=insecure, timeout=timeout_s)
        self.encoder = encoder or CachingMetricsEncoder()

    # The SDK's hook from its data model to the request (a protected method: if a release
    # renames it, this override goes unused and the SDK's own encoder runs, slower but right;
    # tests/test_otlp_encode.py notices).
    def _translate_data(self, data: MetricsData) -> ExportMetricsServiceRequest:
        return self.encoder.encode(data)
