"""OTLP encoding of the agent's samples, straight to the bytes that go on the wire.

The SDK's path builds a data-model object per point (``NumberDataPoint``), then a protobuf
message per point with every attribute re-encoded, then serialises the whole request. An
agent sends the same series every second (about 1,500 on an 8-GPU, 8-NIC node, with up to
a dozen attributes each), so that was most of its CPU. `SampleEncoder` writes the
``ExportMetricsServiceRequest`` by hand instead: each series' attribute set is encoded once
and kept as bytes, each point is those bytes and its fixed-width time and value fields, and
the request is one join of the pieces. The result is the request the SDK would build from
the same samples (`ridethrough.collector.agent.Agent.metrics_data` and ``encode_metrics``;
tests/test_otlp_encode.py holds the two to each other).

Wire format reminders (protobuf): a length-delimited field is its tag byte, a varint length
and the bytes; fields may come in any order and a parser reads them all, so each point's
cached attributes can come before its times. A metric's points are kept as the pieces
between their times (``[head 1, value 1 + head 2, ..., value n]``), so that a metric whose
samples did not change since the last export is written by one ``times.join(pieces)``.
"""

from __future__ import annotations

import logging
import operator
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, InstrumentationScope, KeyValue
from opentelemetry.proto.metrics.v1 import metrics_pb2 as pb
from opentelemetry.proto.resource.v1.resource_pb2 import Resource as PbResource
from opentelemetry.sdk.resources import Resource

from ridethrough.collector.sample import MetricKind, Sample

log = logging.getLogger(__name__)

# NumberDataPoint's fixed-width fields: start_time_unix_nano (2) and time_unix_nano (3) are
# fixed64, as_double (4) a double, as_int (6) an sfixed64; each is a tag byte and 8 bytes.
_TIMES = struct.Struct("<BQBQ")
_TIME = struct.Struct("<BQ")
_PACK_DOUBLE = struct.Struct("<Bd").pack
_PACK_INT = struct.Struct("<Bq").pack
_START_TAG, _TIME_TAG, _DOUBLE_TAG, _INT_TAG = 0x11, 0x19, 0x21, 0x31
_SUM_FIXED, _GAUGE_FIXED = 27, 18
"""Bytes of a point after its attributes: two times (one for a gauge) and a value."""
# Length-delimited fields by (message, field): data_points of Sum and Gauge (1), Metric's
# gauge (5) and sum (7), ScopeMetrics' scope (1) and metrics (2), ResourceMetrics' resource (1)
# and scope_metrics (2), the request's resource_metrics (1).
_POINT, _GAUGE, _SUM, _FIRST, _SECOND = 0x0A, 0x2A, 0x3A, 0x0A, 0x12
_SUM_TAIL = b"\x10\x02\x18\x01"
"""Sum.aggregation_temporality = CUMULATIVE (2), Sum.is_monotonic = true: every agent counter."""


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field: tag, length, payload."""
    return bytes((tag,)) + _varint(len(payload)) + payload


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


@dataclass(frozen=True, slots=True)
class EncodedMetrics:
    """One serialised ``ExportMetricsServiceRequest`` and the number of points in it."""

    payload: bytes
    points: int


_Ids = dict[int, tuple[Mapping[str, str], bytes]]
"""An attribute mapping's id → (the mapping, its point head). Kept with the samples that hold
the mappings, so no id in it can be that of a dead object (and reused)."""


@dataclass(slots=True)
class _Group:
    """One metric's points as last encoded, less their times: ``times.join(pieces)`` writes them."""

    fixed: int
    samples: tuple[Sample, ...]
    pieces: list[bytes]
    """[head 1, value 1 + head 2, ..., value n]: every point's bytes but its times, in join order."""
    count: int
    invalid: int
    """Samples left out: their value is not a number."""
    ids: _Ids


class SampleEncoder:
    """Samples grouped by metric → one serialised ``ExportMetricsServiceRequest`` for one resource and scope.

    Counters become cumulative monotonic sums starting at ``start_ns``; gauges, gauges.
    ``descriptions`` (metric name → text) fill the metrics' descriptions. At most
    ``max_entries`` attribute sets are kept encoded; past that, that cache starts afresh.

    A sample's attributes are read as the `Sample` that carries them is: never changed
    once made. Within one encoder the same mapping object therefore stands for the same
    bytes, which spares hashing its contents on every export. Likewise a metric whose
    samples are all the very objects of the last export (sources hand out a sample again
    while its value stands still: NVLink between reads, error counters) is not encoded
    again: only its times are new.
    """

    def __init__(self, *, resource: Resource, scope: str, descriptions: Mapping[str, str] | None = None,
                 max_entries: int = 200_000) -> None:
        self._max = max_entries
        self._descriptions = dict(descriptions or {})
        self._resource = _field(_FIRST, PbResource(attributes=key_values(resource.attributes)).SerializeToString())
        self._scope = _field(_FIRST, InstrumentationScope(name=scope).SerializeToString())
        self._heads: dict[tuple[int, tuple[tuple[str, Any], ...]], bytes] = {}
        self._metrics: dict[tuple[str, str], bytes] = {}
        self._groups: dict[str, _Group] = {}  # the last export's metrics, by name
        self.invalid_points = 0
        """Points left out because their value is not a number (cumulative, counted at each export)."""
        self._warned = False

    def encode(self, groups: Iterable[tuple[str, Sequence[Sample]]], *, start_ns: int, now_ns: int) -> EncodedMetrics:
        """The request for ``groups`` (metric name, its samples; the first sample's kind and unit stand for all)."""
        times = {_SUM_FIXED: _TIMES.pack(_START_TAG, start_ns, _TIME_TAG, now_ns),
                 _GAUGE_FIXED: _TIME.pack(_TIME_TAG, now_ns)}
        last, kept = self._groups, {}
        parts: list[bytes] = []
        size = points = 0
        for name, samples in groups:
            if not samples:
                continue
            is_sum = samples[0].kind is MetricKind.COUNTER
            fixed = _SUM_FIXED if is_sum else _GAUGE_FIXED
            group = last.get(name)
            if group is None or group.fixed != fixed or not _same(group.samples, samples):
                group = self._group(samples, fixed, group.ids if group is not None and group.fixed == fixed else {})
            kept[name] = group
            self.invalid_points += group.invalid
            if not group.count:  # every value was bad: no metric rather than an empty one
                continue
            body = times[fixed].join(group.pieces)
            length = len(body) + (len(_SUM_TAIL) if is_sum else 0)
            metric = self._metric(name, samples[0].unit) + bytes((_SUM if is_sum else _GAUGE,)) + _varint(length)
            header = bytes((_SECOND,)) + _varint(len(metric) + length) + metric
            parts += (header, body, _SUM_TAIL) if is_sum else (header, body)
            size += len(header) + length
            points += group.count
        self._groups = kept  # metrics not in this export are forgotten
        scope_metrics = len(self._scope) + size
        resource_metrics = self._resource + bytes((_SECOND,)) + _varint(scope_metrics) + self._scope
        head = bytes((_FIRST,)) + _varint(len(resource_metrics) + size) + resource_metrics
        return EncodedMetrics(b"".join([head, *parts]), points)

    def _group(self, samples: Sequence[Sample], fixed: int, known: _Ids) -> _Group:
        """Encode one metric's points; ``known``: the id table of its last encoding."""
        ids: _Ids = {}
        pieces: list[bytes] = []
        pending = b""  # the last point's value, which goes before the next point's head
        invalid = 0
        for sample in samples:
            value = sample.value
            if value.__class__ is float:
                number = _PACK_DOUBLE(_DOUBLE_TAG, value)
            else:
                number = self._number(sample)
                if not number:
                    invalid += 1
                    continue
            attributes = sample.attributes
            hit = known.get(id(attributes))
            if hit is None or hit[0] is not attributes:
                hit = known[id(attributes)] = (attributes, self._head(attributes, fixed))  # for its next samples
            ids[id(attributes)] = hit
            pieces.append(pending + hit[1])
            pending = number
        count = len(pieces)
        pieces.append(pending)
        return _Group(fixed, tuple(samples), pieces, count, invalid, ids)

    def _number(self, sample: Sample) -> bytes:
        """An int as ``as_int`` (as the SDK writes one), anything float() takes as ``as_double``; else b""."""
        value: Any = sample.value
        try:
            if isinstance(value, int):
                return _PACK_INT(_INT_TAG, value)
            return _PACK_DOUBLE(_DOUBLE_TAG, float(value))
        except (TypeError, ValueError, OverflowError, struct.error) as exc:
            if not self._warned:
                self._warned = True
                log.warning("leaving out points whose value is not a number, first %s %r: %s",
                            sample.name, value, exc)
            return b""

    def _head(self, attributes: Mapping[str, Any], fixed: int) -> bytes:
        """A data point's tag, length and encoded attributes, for a point of ``fixed`` more bytes."""
        try:
            key = (fixed, tuple(attributes.items()))
            head = self._heads.get(key)
        except TypeError:  # an unhashable value (a list): encoded every time
            return _point_head(attributes, fixed)
        if head is None:
            if len(self._heads) >= self._max:
                self._heads.clear()
            head = self._heads[key] = _point_head(attributes, fixed)
        return head

    def _metric(self, name: str, unit: str) -> bytes:
        """Metric's name (1), description (2) and unit (3) fields."""
        encoded = self._metrics.get((name, unit))
        if encoded is None:
            fields = pb.Metric(name=name, description=self._descriptions.get(name, ""), unit=unit)
            encoded = self._metrics[(name, unit)] = fields.SerializeToString()
        return encoded


def _point_head(attributes: Mapping[str, Any], fixed: int) -> bytes:
    encoded: bytes = pb.NumberDataPoint(attributes=key_values(attributes)).SerializeToString()
    return bytes((_POINT,)) + _varint(len(encoded) + fixed) + encoded


def _same(last: tuple[Sample, ...], samples: Sequence[Sample]) -> bool:
    """Whether ``samples`` are the very objects of ``last``, in order."""
    return len(last) == len(samples) and all(map(operator.is_, last, samples))
