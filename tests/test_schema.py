"""Schema DDL: the upstream exporter's names and types, single node and clustered."""

from __future__ import annotations

from ridethrough.exporters import schema


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
