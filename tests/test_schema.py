"""Schema DDL: the upstream exporter's names and types, single node and clustered; the rollups on one node."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

from ridethrough.exporters import schema, schema_cluster
from ridethrough.exporters.convert_metrics import convert_metrics
from ridethrough.exporters.rows import Limits, Rejections, Rows
from ridethrough.exporters.store import Store
from tests.otlp_util import gauge_request


def test_tables_carry_the_upstream_names_and_nanosecond_times() -> None:
    names = [t.name for t in schema.TABLES]
    assert names == ["otel_metrics_gauge", "otel_metrics_sum", "otel_metrics_histogram",
                     "otel_metrics_exponential_histogram", "otel_metrics_summary", "otel_traces",
                     "otel_traces_trace_id_ts", "otel_logs"]
    for table in schema.TABLES[:5]:
        types = {c.name: c.type for c in table.columns}
        assert types["TimeUnix"] == "DateTime64(9)" and types["Attributes"].startswith("Map(")
    sql = schema.create_table_sql(schema.SUM)
    assert "Exemplars Nested (FilteredAttributes Map(LowCardinality(String), String)" in sql
    assert "IsMonotonic Boolean" in sql and "ENGINE = MergeTree" in sql
    assert "non_replicated_deduplication_window" in sql
    assert "ORDER BY (ServiceName, MetricName, Attributes, toUnixTimestamp64Nano(TimeUnix))" in sql


def test_alias_and_default_columns_are_not_inserted() -> None:
    assert "ResourceAttributeItems" not in schema.TRACES.insert_columns
    assert "TimestampTime" not in schema.LOGS.insert_columns
    assert "Events.Name" in schema.TRACES.insert_columns


def test_cluster_ddl_is_replicated_local_tables_behind_distributed_ones() -> None:
    statements = list(schema.ddl(cluster="fleet"))
    assert len(statements) == 2 * len(schema.TABLES) + 1
    local = schema.create_table_sql(schema.GAUGE, cluster="fleet")
    assert local.startswith("CREATE TABLE IF NOT EXISTS `otel_metrics_gauge_local` ON CLUSTER `fleet`")
    assert "ReplicatedMergeTree('/clickhouse/tables/{shard}/{database}/otel_metrics_gauge_local', '{replica}')" in local
    assert "non_replicated_deduplication_window" not in local
    dist = schema.create_distributed_sql(schema.GAUGE, cluster="fleet")
    assert "Distributed(`fleet`, currentDatabase(), `otel_metrics_gauge_local`, " \
           "cityHash64(ResourceAttributes['host.name']))" in dist
    assert "ReplicatedAggregatingMergeTree" in schema.create_table_sql(schema.TRACE_ID_TS, cluster="fleet")
    view = schema.trace_id_ts_view_sql(cluster="fleet")
    assert "TO `otel_traces_trace_id_ts_local`" in view and "FROM `otel_traces_local`" in view


def test_hostile_cluster_name_is_quoted() -> None:
    sql = schema.create_table_sql(schema.GAUGE, cluster="a`; DROP TABLE x; --")
    assert "ON CLUSTER `a``; DROP TABLE x; --`" in sql


def test_single_node_tables_keep_everything_and_deduplicate_replays() -> None:
    for statement in schema.ddl():
        assert "ON CLUSTER" not in statement and "\nTTL " not in statement and "Replicated" not in statement
    for statement in schema_cluster.rollup_ddl():
        if statement.startswith("CREATE TABLE"):
            assert "ENGINE = AggregatingMergeTree" in statement and "non_replicated_deduplication_window" in statement


def test_rollup_ddl_on_one_node_is_tables_then_views() -> None:
    statements = list(schema_cluster.rollup_ddl())
    assert [s.split("`")[1] for s in statements] == [
        "otel_metrics_gauge_1m", "otel_metrics_gauge_1m_mv", "otel_metrics_sum_1m", "otel_metrics_sum_1m_mv"]
    assert "FROM `otel_metrics_gauge` WHERE startsWith(MetricName, 'ridethrough.probe.')" in statements[1]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(f"chdb://{tmp_path / 'store'}")
    s.init_schema()
    for statement in schema_cluster.rollup_ddl():
        s.command(statement)
    yield s
    s.close()


def _insert(store: Store, req: ExportMetricsServiceRequest, token: str) -> None:
    rows, rej = Rows(), Rejections()
    convert_metrics(req, Limits(), rows, rej)
    for name in rows.columns:
        table = schema.TABLES_BY_NAME[name]
        store.insert_columns(table, rows.ordered(table), token=f"{token}:{name}")


def test_rollups_fill_from_gateway_inserts_and_a_replayed_batch_counts_once(store: Store) -> None:
    probe = gauge_request(3, name="ridethrough.probe.rtt", values=[0.001, 0.003, 0.002])
    other = gauge_request(2, name="hw.temperature", values=[40.0, 41.0])
    _insert(store, probe, "batch-1")
    _insert(store, probe, "batch-1")  # the spool replays a batch ClickHouse already has
    _insert(store, other, "batch-2")
    _, raw = store.query("SELECT count() FROM otel_metrics_gauge")
    assert raw == [(5,)]
    _, rows = store.query("SELECT MetricName, HostName, sum(Count), min(Min), max(Max), sum(Sum) "
                          "FROM otel_metrics_gauge_1m GROUP BY MetricName, HostName")
    assert len(rows) == 1  # only the probe source's gauges are rolled up
    name, host, count, lo, hi, total = rows[0]
    assert (name, host, count, lo, hi) == ("ridethrough.probe.rtt", "test-host", 3, 0.001, 0.003)
    assert total == pytest.approx(0.006)


def test_counter_rollup_keeps_first_and_last_of_each_minute(store: Store) -> None:
    req = gauge_request(0)
    metric = req.resource_metrics[0].scope_metrics[0].metrics.add(name="ridethrough.probe.sent", unit="{probe}")
    metric.sum.is_monotonic = True
    metric.sum.aggregation_temporality = 2  # cumulative
    minute_ns = 1_767_225_600 * 10**9  # 2026-01-01 00:00:00 UTC
    for offset_s, value in ((50, 7.0), (10, 5.0), (30, 6.0), (70, 9.0)):
        metric.sum.data_points.add(time_unix_nano=minute_ns + offset_s * 10**9, as_double=value)
    _insert(store, req, "counters")
    _, rows = store.query("SELECT toUnixTimestamp(Minute), argMinMerge(First), argMaxMerge(Last), sum(Count) "
                          "FROM otel_metrics_sum_1m GROUP BY Minute ORDER BY Minute")
    assert [tuple(r) for r in rows] == [(1_767_225_600, 5.0, 7.0, 3), (1_767_225_660, 9.0, 9.0, 1)]


def test_ensure_table_adds_the_columns_an_older_version_created_without(tmp_path: Path) -> None:
    new = schema.Table("upgraded", (schema.Column("Id", "String"), schema.Column("Status", "LowCardinality(String)"),
                                    schema.Column("Params", "Map(String, String)"),
                                    schema.Column("Recoveries", "UInt8")),
                       (), "tuple()", "Id", "Id")
    old = schema.Table("upgraded", new.columns[:2], (), "tuple()", "Id", "Id")
    s = Store(f"chdb://{tmp_path / 'store'}")
    try:
        s.command(schema.create_table_sql(old))
        s.command("INSERT INTO upgraded (Id, Status) VALUES ('a', 'succeeded')")
        s.ensure_table(new)
        s.ensure_table(new)  # once up to date, nothing more to add
        s.insert_columns(new, [["b"], ["applying"], [{"k": "v"}], [1]], token="t1")
        _, rows = s.query("SELECT Id, Status, Params, Recoveries FROM upgraded ORDER BY Id")
        assert rows == [("a", "succeeded", {}, 0), ("b", "applying", {"k": "v"}, 1)]
    finally:
        s.close()
    assert schema.add_columns_sql(new, ["Id", "Status", "Params", "Recoveries"]) == []
    clustered = schema.add_columns_sql(new, ["Id", "Status"], cluster="c1")
    assert [q.split(" ON CLUSTER")[0] for q in clustered] == ["ALTER TABLE `upgraded_local`", "ALTER TABLE `upgraded`"]
    assert "ADD COLUMN IF NOT EXISTS Params Map(String, String) CODEC" in clustered[0]
    assert clustered[1].endswith("ADD COLUMN IF NOT EXISTS Params Map(String, String), "
                                 "ADD COLUMN IF NOT EXISTS Recoveries UInt8")


_DAY_OF_GAUGES = """
INSERT INTO otel_metrics_gauge (ResourceAttributes, ServiceName, MetricName, Attributes, TimeUnix, Value)
SELECT map('host.name', concat('h', toString(number % 100))), 'ridethrough-agent',
       if(number % 2 = 0, 'ridethrough.probe.owd', 'hw.temperature'),
       map('series', toString(number % 200)),
       fromUnixTimestamp64Nano({end:Int64}) - toIntervalMinute(intDiv(number, 200)),
       number % 97
FROM numbers(200 * 1440)
"""
_LAST_HOUR = ("SELECT Attributes['series'] AS s, ResourceAttributes['host.name'] AS h, count(), median(Value) "
              "FROM otel_metrics_gauge WHERE MetricName = 'ridethrough.probe.owd' "
              "AND TimeUnix >= fromUnixTimestamp64Nano({start:Int64}) GROUP BY s, h ORDER BY s, h")


def test_an_older_gauge_table_gets_the_metric_time_projection_and_recent_reads_use_it(tmp_path: Path) -> None:
    end_ns = 1_767_225_600 * 10**9
    params = {"end": end_ns, "start": end_ns - 3600 * 10**9}
    s = Store(f"chdb://{tmp_path / 'store'}")
    try:
        # the table as a version before the projection created it, a day of points in it
        s.command(schema.create_table_sql(dataclasses.replace(schema.GAUGE, projections=())))
        s.command(_DAY_OF_GAUGES.replace("{end:Int64}", str(end_ns)))
        without = s.query(_LAST_HOUR, parameters=params)
        first = s.init_schema()
        _, found = s.query("SELECT name FROM system.projections WHERE table = 'otel_metrics_gauge'")
        assert found == [("by_metric_time",)]
        assert s.init_schema() == first - 2  # added and built once, then nothing more to do
        for _ in range(600):  # MATERIALIZE PROJECTION is a mutation, done in the background
            _, pending = s.query("SELECT count() FROM system.mutations WHERE NOT is_done")
            if not pending[0][0]:
                break
            time.sleep(0.1)
        _, plan = s.query("EXPLAIN projections = 1 " + _LAST_HOUR, parameters=params)
        assert any("by_metric_time" in r[0] for r in plan)
        # the same answer as the table itself gives: 100 hosts x 2 series each, 60 or 61 points an hour
        assert s.query(_LAST_HOUR, parameters=params) == without
        assert len(without[1]) == 100 and {r[2] for r in without[1]} <= {60, 61}
    finally:
        s.close()
    assert "PROJECTION `by_metric_time` (SELECT MetricName, TimeUnix" in schema.create_table_sql(schema.GAUGE)
    clustered = schema.add_projection_sql(schema.GAUGE, schema.BY_METRIC_TIME, cluster="c1")
    assert clustered[0].startswith("ALTER TABLE `otel_metrics_gauge_local` ON CLUSTER `c1` ADD PROJECTION IF NOT")
