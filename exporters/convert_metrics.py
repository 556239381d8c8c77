"""OTLP metrics → rows of the otel_metrics_* tables.

Invalid data points are rejected one by one (and counted for ``partial_success``); the
rest of the request is kept. A point is invalid when it has no timestamp, carries too
many or too large attributes, a non-finite number, or a histogram whose buckets do not
match its bounds. A metric without a name loses all its points.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.metrics.v1.metrics_pb2 import Exemplar, Metric, NumberDataPoint

from ridethrough.exporters import schema
from ridethrough.exporters.rows import (
    RESOURCE_LIMITS,
    InvalidItem,
    Limits,
    Rejections,
    Rows,
    attributes,
    check_time,
    finite,
    hex_id,
)

_SHARED = ("ResourceAttributes", "ResourceSchemaUrl", "ScopeName", "ScopeVersion", "ScopeAttributes",
           "ScopeDroppedAttrCount", "ScopeSchemaUrl", "ServiceName", "MetricName", "MetricDescription",
           "MetricUnit")
_EXEMPLAR_COLS = tuple(f"Exemplars.{n}" for n in ("FilteredAttributes", "TimeUnix", "Value", "SpanId", "TraceId"))
_Point = Any
_PointFn = Callable[[_Point, Limits], tuple[Any, ...]]


def convert_metrics(req: ExportMetricsServiceRequest, limits: Limits, rows: Rows, rej: Rejections) -> None:
    """Append every valid data point of ``req`` to ``rows``; count the others in ``rej``."""
    for rm in req.resource_metrics:
        for sm in rm.scope_metrics:
            try:
                head = _head(rm, sm)
            except InvalidItem as exc:
                rej.add(f"data points of a resource or scope with {exc}", _count_points(sm))
                continue
            for metric in sm.metrics:
                _convert_metric(metric, head, limits, rows, rej)


def _head(rm: Any, sm: Any) -> tuple[Any, ...]:
    res = attributes(rm.resource.attributes, len(rm.resource.attributes), RESOURCE_LIMITS)
    scope = sm.scope
    return (res, rm.schema_url, scope.name, scope.version,
            attributes(scope.attributes, len(scope.attributes), RESOURCE_LIMITS),
            scope.dropped_attributes_count, sm.schema_url, res.get("service.name", ""))


def _count_points(sm: Any) -> int:
    return sum(len(getattr(m, k).data_points) for m in sm.metrics if (k := m.WhichOneof("data")))


def _convert_metric(metric: Metric, head: tuple[Any, ...], limits: Limits, rows: Rows, rej: Rejections) -> None:
    kind = metric.WhichOneof("data")
    if kind is None:
        return
    data = getattr(metric, kind)
    points = data.data_points
    if not metric.name:
        rej.add("data points of a metric without a name", len(points))
        return
    table, point_fn, tail = _KINDS[kind]
    tail_values = tuple(getattr(data, attr) for attr in tail)
    per_point: list[tuple[Any, ...]] = []
    for p in points:
        try:
            per_point.append(point_fn(p, limits) + tail_values)
        except InvalidItem as exc:
            rej.add(f"{kind} points: {exc}")
    if per_point:
        _append(rows, table, (*head, metric.name, metric.description, metric.unit), per_point)


def _append(rows: Rows, table: schema.Table, shared: tuple[Any, ...], per_point: list[tuple[Any, ...]]) -> None:
    cols = rows.table(table)
    n = len(per_point)
    for name, value in zip(_SHARED, shared, strict=True):
        cols[name].extend([value] * n)
    for name, values in zip(_POINT_COLUMNS[table.name], zip(*per_point, strict=True), strict=True):
        cols[name].extend(values)
    rows.counts[table.name] += n


def _times(p: _Point) -> tuple[int, int]:
    if not p.time_unix_nano:
        raise InvalidItem("missing time_unix_nano")
    return check_time(p.start_time_unix_nano, "start_time_unix_nano"), check_time(p.time_unix_nano, "time_unix_nano")


# Nearly every point has no exemplars. One shared tuple of empty tuples (not five new
# lists per point) keeps the rows of a batch out of the garbage collector's sight: with
# lists, full collections cost about a third of the gateway's CPU.
_NO_EXEMPLARS: tuple[tuple[()], ...] = ((), (), (), (), ())


def _exemplars(exemplars: Any, limits: Limits) -> tuple[Any, ...]:
    if not exemplars:
        return _NO_EXEMPLARS
    e: list[Exemplar] = list(exemplars)
    return (
        [attributes(x.filtered_attributes, len(x.filtered_attributes), limits) for x in e],
        [check_time(x.time_unix_nano, "exemplar time_unix_nano") for x in e],
        [finite(x.as_double if x.WhichOneof("value") == "as_double" else float(x.as_int), "exemplar") for x in e],
        [hex_id(x.span_id, 8, "exemplar span_id", required=False) for x in e],
        [hex_id(x.trace_id, 16, "exemplar trace_id", required=False) for x in e],
    )


def _number(p: NumberDataPoint, limits: Limits) -> tuple[Any, ...]:
    start, t = _times(p)
    value = p.as_double if p.WhichOneof("value") == "as_double" else float(p.as_int)
    return (attributes(p.attributes, len(p.attributes), limits), start, t, finite(value, "value"), p.flags,
            *_exemplars(p.exemplars, limits))


def _optional(p: _Point, name: str) -> float:
    return finite(getattr(p, name), name) if p.HasField(name) else 0.0


def _histogram(p: _Point, limits: Limits) -> tuple[Any, ...]:
    start, t = _times(p)
    bounds = [finite(b, "bucket bound") for b in p.explicit_bounds]
    counts = list(p.bucket_counts)
    if counts and len(counts) != len(bounds) + 1:
        raise InvalidItem("bucket_counts length is not explicit_bounds length + 1")
    return (attributes(p.attributes, len(p.attributes), limits), start, t, p.count, _optional(p, "sum"),
            counts, bounds, *_exemplars(p.exemplars, limits), p.flags, _optional(p, "min"), _optional(p, "max"))


def _exp_histogram(p: _Point, limits: Limits) -> tuple[Any, ...]:
    start, t = _times(p)
    return (attributes(p.attributes, len(p.attributes), limits), start, t, p.count, _optional(p, "sum"),
            p.scale, p.zero_count, p.positive.offset, list(p.positive.bucket_counts), p.negative.offset,
            list(p.negative.bucket_counts), *_exemplars(p.exemplars, limits), p.flags,
            _optional(p, "min"), _optional(p, "max"))


def _summary(p: _Point, limits: Limits) -> tuple[Any, ...]:
    start, t = _times(p)
    quantiles = [q.quantile for q in p.quantile_values]
    if any(not 0.0 <= q <= 1.0 for q in quantiles):
        raise InvalidItem("quantile outside [0, 1]")
    values = [finite(q.value, "quantile value") for q in p.quantile_values]
    return (attributes(p.attributes, len(p.attributes), limits), start, t, p.count, finite(p.sum, "sum"),
            quantiles, values, p.flags)


_POINT_COLUMNS = {t.name: tuple(c for c in t.insert_columns if c not in _SHARED) for t in schema.TABLES[:5]}

# metric kind → (table, point converter, trailing per-metric columns read from the data message)
_KINDS: dict[str, tuple[schema.Table, _PointFn, tuple[str, ...]]] = {
    "gauge": (schema.GAUGE, _number, ()),
    "sum": (schema.SUM, _number, ("aggregation_temporality", "is_monotonic")),
    "histogram": (schema.HISTOGRAM, _histogram, ("aggregation_temporality",)),
    "exponential_histogram": (schema.EXP_HISTOGRAM, _exp_histogram, ("aggregation_temporality",)),
    "summary": (schema.SUMMARY, _summary, ()),
}
