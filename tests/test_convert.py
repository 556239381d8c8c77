"""OTLP → rows: every metric kind, spans and logs, and the rules that reject items one by one."""

from __future__ import annotations

import math

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from ridethrough.exporters import schema
from ridethrough.exporters.convert_metrics import convert_metrics
from ridethrough.exporters.convert_spans_logs import convert_logs, convert_traces
from ridethrough.exporters.rows import Limits, Rejections, Rows, any_value_str
from tests.otlp_util import kv

T0 = 1_700_000_000_000_000_000


def _metrics() -> tuple[ExportMetricsServiceRequest, object]:
    req = ExportMetricsServiceRequest()
    rm = req.resource_metrics.add()
    rm.resource.attributes.extend([kv("service.name", "svc"), kv("host.name", "h")])
    rm.schema_url = "https://opentelemetry.io/schemas/1.26.0"
    sm = rm.scope_metrics.add()
    sm.scope.name, sm.scope.version = "scope", "1.2"
    return req, sm


def _convert(req, fn=convert_metrics) -> tuple[Rows, Rejections]:
    rows, rej = Rows(), Rejections()
    fn(req, Limits(), rows, rej)
    return rows, rej


def _column(rows: Rows, table: schema.Table, name: str) -> list:
    return rows.columns[table.name][name]


def test_every_metric_kind_lands_in_its_table_with_all_columns() -> None:
    req, sm = _metrics()
    g = sm.metrics.add(name="temp", unit="Cel", description="GPU temperature")
    g.gauge.data_points.add(time_unix_nano=T0, as_double=71.5).attributes.append(kv("gpu", "0"))
    s = sm.metrics.add(name="bytes", unit="By")
    s.sum.is_monotonic, s.sum.aggregation_temporality = True, 2
    s.sum.data_points.add(time_unix_nano=T0, start_time_unix_nano=T0 - 10, as_int=1 << 40)
    h = sm.metrics.add(name="lat").histogram
    h.aggregation_temporality = 2
    h.data_points.add(time_unix_nano=T0, count=3, sum=6.0, min=1.0, max=3.0, bucket_counts=[1, 2, 0],
                      explicit_bounds=[1.5, 2.5])
    e = sm.metrics.add(name="exp").exponential_histogram
    p = e.data_points.add(time_unix_nano=T0, count=2, scale=3, zero_count=1)
    p.positive.offset, p.positive.bucket_counts[:] = 4, [1]
    q = sm.metrics.add(name="sum").summary.data_points.add(time_unix_nano=T0, count=4, sum=10.0)
    q.quantile_values.add(quantile=0.5, value=2.0)
    rows, rej = _convert(req)
    assert rej.count == 0
    assert dict(rows.counts) == {t.name: 1 for t in schema.TABLES[:5]}
    for table in schema.TABLES[:5]:
        cols = rows.columns[table.name]
        assert list(cols) == list(table.insert_columns)
        assert all(len(v) == 1 for v in cols.values())
        assert cols["ServiceName"] == ["svc"] and cols["ScopeVersion"] == ["1.2"]
    assert _column(rows, schema.GAUGE, "Value") == [71.5]
    assert _column(rows, schema.GAUGE, "Attributes") == [{"gpu": "0"}]
    assert _column(rows, schema.GAUGE, "MetricDescription") == ["GPU temperature"]
    assert _column(rows, schema.SUM, "Value") == [float(1 << 40)]
    assert _column(rows, schema.SUM, "IsMonotonic") == [True]
    assert _column(rows, schema.SUM, "StartTimeUnix") == [T0 - 10]
    assert _column(rows, schema.HISTOGRAM, "BucketCounts") == [[1, 2, 0]]
    assert _column(rows, schema.EXP_HISTOGRAM, "PositiveBucketCounts") == [[1]]
    assert _column(rows, schema.SUMMARY, "ValueAtQuantiles.Quantile") == [[0.5]]


def test_invalid_points_are_rejected_one_by_one_with_reasons() -> None:
    req, sm = _metrics()
    g = sm.metrics.add(name="g").gauge
    g.data_points.add(time_unix_nano=T0, as_double=1.0)
    g.data_points.add(time_unix_nano=T0, as_double=math.nan)
    g.data_points.add(time_unix_nano=0, as_double=2.0)
    g.data_points.add(time_unix_nano=T0, as_double=3.0).attributes.extend(kv(f"k{i}", "v") for i in range(200))
    g.data_points.add(time_unix_nano=T0, as_double=4.0).attributes.append(kv("big", "é" * 5000))
    sm.metrics.add(name="").gauge.data_points.add(time_unix_nano=T0, as_double=1.0)
    h = sm.metrics.add(name="h").histogram
    h.data_points.add(time_unix_nano=T0, bucket_counts=[1, 2], explicit_bounds=[1.0, 2.0])
    rows, rej = _convert(req)
    assert rows.total == 1 and _column(rows, schema.GAUGE, "Value") == [1.0]
    assert rej.count == 6
    text = rej.message(limit=10)
    for reason in ("non-finite", "missing time_unix_nano", "more than 128 attributes", "over 4096 bytes",
                   "without a name", "bucket_counts"):
        assert reason in text


def test_non_string_attribute_values_are_stringified_like_upstream() -> None:
    arr = AnyValue(array_value=ArrayValue(values=[AnyValue(int_value=1), AnyValue(string_value="a")]))
    assert any_value_str(arr) == '[1,"a"]'
    assert any_value_str(AnyValue(bool_value=True)) == "true"
    assert any_value_str(AnyValue(int_value=-3)) == "-3"
    assert any_value_str(AnyValue(bytes_value=b"\x00\xff")) == "AP8="
    assert any_value_str(AnyValue()) == ""
    req, sm = _metrics()
    p = sm.metrics.add(name="g").gauge.data_points.add(time_unix_nano=T0, as_double=1.0)
    p.attributes.extend([KeyValue(key="n", value=AnyValue(int_value=7)), kv("s", "")])
    rows, _ = _convert(req)
    assert _column(rows, schema.GAUGE, "Attributes") == [{"n": "7", "s": ""}]


def test_spans_with_events_links_and_invalid_ids() -> None:
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.append(kv("service.name", "ctl"))
    ss = rs.scope_spans.add()
    good = ss.spans.add(trace_id=b"\x01" * 16, span_id=b"\x02" * 8, name="act", kind=Span.SPAN_KIND_CLIENT,
                        start_time_unix_nano=T0, end_time_unix_nano=T0 + 500)
    good.events.add(time_unix_nano=T0 + 1, name="step").attributes.append(kv("n", "1"))
    good.links.add(trace_id=b"\x03" * 16, span_id=b"\x04" * 8)
    good.status.code = 2
    ss.spans.add(trace_id=b"\x01" * 15, span_id=b"\x02" * 8, name="bad", start_time_unix_nano=T0,
                 end_time_unix_nano=T0)
    ss.spans.add(trace_id=b"\x01" * 16, span_id=b"\x02" * 8, name="backwards", start_time_unix_nano=T0,
                 end_time_unix_nano=T0 - 1)
    rows, rej = _convert(req, convert_traces)
    assert rows.total == 1 and rej.count == 2
    cols = rows.columns[schema.TRACES.name]
    assert cols["TraceId"] == ["01" * 16] and cols["SpanKind"] == ["Client"] and cols["StatusCode"] == ["Error"]
    assert cols["Duration"] == [500] and cols["Events.Name"] == [["step"]]
    assert cols["Links.SpanId"] == [["04" * 8]] and cols["ParentSpanId"] == [""]


def test_logs_take_observed_time_when_time_is_missing() -> None:
    req = ExportLogsServiceRequest()
    rl = req.resource_logs.add()
    rl.resource.attributes.append(kv("service.name", "agent"))
    sl = rl.scope_logs.add()
    sl.log_records.add(observed_time_unix_nano=T0, severity_number=17, severity_text="ERROR",
                       body=AnyValue(string_value="link down"), flags=0x101)
    sl.log_records.add(body=AnyValue(string_value="no time at all"))
    rows, rej = _convert(req, convert_logs)
    assert rows.total == 1 and rej.count == 1
    cols = rows.columns[schema.LOGS.name]
    assert cols["Timestamp"] == [T0] and cols["Body"] == ["link down"] and cols["TraceFlags"] == [1]
