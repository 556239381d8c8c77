"""Cluster DDL: valid ClickHouse, the single-node tables' columns, retention, rollups on each shard.

chDB has no Keeper and no cluster, so the clustered statements are checked in two ways: every
one is parsed by ClickHouse itself (``EXPLAIN AST``), and then run on one node with the parts
that need a cluster taken out (``ON CLUSTER``, the replication arguments, the Distributed
tables, whose AST is checked instead). What runs is the rest of each statement as written:
columns, codecs, TTLs, partitioning, sorting keys and the views' queries.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from ridethrough.actuators.actions import actions_ddl
from ridethrough.actuators.approvals_table import approvals_ddl
from ridethrough.detectors.incidents import incidents_ddl
from ridethrough.exporters import schema, schema_cluster
from ridethrough.exporters.store import Store
from ridethrough.lab.truth import truth_ddl

CLUSTER = "fleet"
_REPLICATED = re.compile(
    r"Replicated(\w*MergeTree)\('/clickhouse/tables/\{shard\}/\{database\}/(\w+)', '\{replica\}'(?:, ([^)]*))?\)")


def all_ddl(cluster: str = "") -> list[str]:
    """What ``ridethrough store init`` runs, plus the rollups."""
    return [*schema.ddl(cluster=cluster), *schema_cluster.rollup_ddl(cluster=cluster), *truth_ddl(cluster=cluster),
            *incidents_ddl(cluster=cluster), *actions_ddl(cluster=cluster),
            *approvals_ddl(cluster=cluster)]


def on_one_node(statement: str) -> str:
    """A clustered statement as one node without Keeper can run it."""
    sql = statement.replace(f" ON CLUSTER `{CLUSTER}`", "")
    return _REPLICATED.sub(lambda m: f"{m[1]}({m[3] or ''})", sql)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    s = Store(f"chdb://{tmp_path_factory.mktemp('cluster-ddl') / 'store'}")
    for statement in all_ddl():
        s.command(statement)
    for statement in all_ddl(CLUSTER):
        if "ENGINE = Distributed(" not in statement:
            s.command(on_one_node(statement))
    yield s
    s.close()


def _ast(store: Store, statement: str) -> str:
    _, rows = store.query(f"EXPLAIN AST {statement}")
    return "\n".join(str(r[0]) for r in rows)


def test_every_clustered_statement_parses_as_clickhouse(store: Store) -> None:
    statements = all_ddl(CLUSTER)
    assert all(" ON CLUSTER `fleet`" in s for s in statements)
    for statement in statements:
        assert _ast(store, statement).startswith("CreateQuery"), statement


def test_clustered_tables_have_the_single_node_columns(store: Store) -> None:
    sql = ("SELECT table, groupArray((position, name, type, default_kind, default_expression, compression_codec)) "
           "FROM (SELECT * FROM system.columns WHERE database = currentDatabase() ORDER BY position) GROUP BY table")
    _, rows = store.query(sql)
    columns = {table: cols for table, cols in rows}
    tables = [t.name for t in (*schema.TABLES, *(r.table for r in schema_cluster.ROLLUPS))]
    tables += ["lab_truth", "incidents", "actions"]
    for name in tables:
        assert columns[name] == columns[f"{name}_local"], name
        assert len(columns[name]) >= 3


def test_local_tables_replicate_with_their_engine_parameters() -> None:
    for statement in all_ddl(CLUSTER):
        if statement.startswith("CREATE TABLE") and "_local` ON CLUSTER" in statement:
            match = _REPLICATED.search(statement)
            assert match, statement
            assert statement.startswith(f"CREATE TABLE IF NOT EXISTS `{match[2]}`")  # the table's own Keeper path
    incidents = next(incidents_ddl(cluster=CLUSTER))
    assert "ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/incidents_local', " \
           "'{replica}', Version)" in incidents


def test_distributed_tables_front_the_local_ones_sharded_by_host(store: Store) -> None:
    dist = [s for s in all_ddl(CLUSTER) if "ENGINE = Distributed(" in s]
    local = [s for s in all_ddl(CLUSTER) if s.startswith("CREATE TABLE") and "ENGINE = Distributed(" not in s]
    assert len(dist) == len(local)
    for statement in dist:
        ast = _ast(store, statement)
        assert "Function Distributed" in ast and "Identifier fleet" in ast
    by_table = {s.split("`")[1]: s for s in dist}
    host = "cityHash64(ResourceAttributes['host.name'])"
    for name in ("otel_metrics_gauge", "otel_metrics_sum", "otel_logs"):
        assert by_table[name].endswith(f"`{name}_local`, {host})")
    for rollup in ("otel_metrics_gauge_1m", "otel_metrics_sum_1m"):
        assert by_table[rollup].endswith(f"`{rollup}_local`, cityHash64(HostName))")


def _ttl(store: Store, table: str) -> str:
    _, rows = store.query("SELECT engine_full FROM system.tables WHERE database = currentDatabase() AND name = "
                          "{t:String}", parameters={"t": table})
    full = str(rows[0][0])
    return full.split(" TTL ", 1)[1].split(" SETTINGS ", 1)[0] if " TTL " in full else ""


def test_retention_is_days_for_raw_months_for_rollups_years_for_the_books(store: Store) -> None:
    # ClickHouse shows the TTL as it parsed it: ``INTERVAL 14 DAY`` reads back as ``toIntervalDay(14)``.
    assert _ttl(store, "otel_metrics_gauge_local") == "toDateTime(TimeUnix) + toIntervalDay(14)"
    assert _ttl(store, "otel_metrics_sum_1m_local") == "toDateTime(Minute) + toIntervalDay(400)"
    for table, column in (("incidents_local", "OpenedAt"), ("actions_local", "DecidedAt")):
        assert _ttl(store, table) == f"toDateTime({column}) + toIntervalDay(1826)"
    assert _ttl(store, "otel_logs_local") == (
        "toDateTime(TimestampTime) + toIntervalDay(90) WHERE NOT (startsWith(LogAttributes['event.name'], 'job.') "
        "OR ((LogAttributes['event.name']) IN ('audit.completed', 'action.decision'))), "
        "toDateTime(TimestampTime) + toIntervalDay(730)")
    assert _ttl(store, "otel_metrics_gauge") == "" and _ttl(store, "incidents") == ""  # single node: unchanged


def test_retention_drops_old_rows_but_keeps_job_events_for_goodput(store: Store) -> None:
    store.command("""INSERT INTO otel_logs_local (Timestamp, ServiceName, LogAttributes) VALUES
        (now64(9) - INTERVAL 100 DAY, 't', {'event.name': 'gpu.xid'}),
        (now64(9) - INTERVAL 100 DAY, 't', {'event.name': 'job.step'}),
        (now64(9), 't', {'event.name': 'gpu.xid'})""")
    store.command("OPTIMIZE TABLE otel_logs_local FINAL")
    _, rows = store.query("SELECT LogAttributes['event.name'], Timestamp < now64(9) - INTERVAL 90 DAY "
                          "FROM otel_logs_local WHERE ServiceName = 't' ORDER BY Timestamp")
    assert [(name, bool(old)) for name, old in rows] == [("job.step", True), ("gpu.xid", False)]


def test_a_table_without_retention_is_refused_when_clustered() -> None:
    table = schema.Table("mystery", (schema.Column("T", "DateTime"),), (), "toDate(T)", "(T)", "rand()")
    assert "CREATE TABLE" in schema.create_table_sql(table)  # one node keeps everything
    with pytest.raises(ValueError, match=r"'mystery' has no entry in schema\.RETENTION"):
        schema.create_table_sql(table, cluster=CLUSTER)


def test_rollup_views_read_and_write_the_shard_local_tables(store: Store) -> None:
    views = [s for s in schema_cluster.rollup_ddl(cluster=CLUSTER) if "MATERIALIZED VIEW" in s]
    assert len(views) == len(schema_cluster.ROLLUPS)
    assert "TO `otel_metrics_gauge_1m_local`" in views[0] and "FROM `otel_metrics_gauge_local`" in views[0]
    head = "ResourceAttributes, ServiceName, MetricName, Attributes, TimeUnix, Value"
    res = "{'host.name': 'h1', 'ridethrough.node.id': 'n1', 'ridethrough.cluster': 'c1'}"
    store.command(f"""INSERT INTO otel_metrics_gauge_local ({head}) VALUES
        ({res}, 'a', 'ridethrough.probe.owd', {{'probe.quantile': 'p99'}}, '2026-01-01 00:00:10', 0.002),
        ({res}, 'a', 'ridethrough.probe.owd', {{'probe.quantile': 'p99'}}, '2026-01-01 00:00:40', 0.004),
        ({res}, 'a', 'hw.temperature', {{}}, '2026-01-01 00:00:40', 40)""")
    _, rows = store.query("SELECT MetricName, Cluster, NodeId, HostName, Minute, sum(Count), min(Min), max(Max), "
                          "argMaxMerge(Last) FROM otel_metrics_gauge_1m_local GROUP BY ALL")
    assert [tuple(r[:4]) + tuple(r[5:]) for r in rows] == [
        ("ridethrough.probe.owd", "c1", "n1", "h1", 2, 0.002, 0.004, 0.004)]
