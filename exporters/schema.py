"""The store's tables, as the OpenTelemetry Collector's ClickHouse exporter defines them.

Generation matched: opentelemetry-collector-contrib ``exporter/clickhouseexporter``
``internal/sqltemplates/*_table.sql`` of 2025, the generation whose metric tables carry
``TimeUnix DateTime64(9)`` and ``ORDER BY (ServiceName, MetricName, Attributes,
toUnixTimestamp64Nano(TimeUnix))``. Table and column names and types are the upstream
ones, so the upstream Collector can write into these tables and every query here works
on both. Three deliberate differences, none visible to a reader of the tables:

* non-replicated tables set ``non_replicated_deduplication_window`` so that spool replays
  carrying an ``insert_deduplication_token`` are dropped by ClickHouse, not duplicated;
* the exponential-histogram table uses ``DateTime64(9)`` like its siblings (upstream kept
  ``DateTime`` there for a while; probe data needs sub-second resolution everywhere);
* the gauge table carries a projection ordered by metric then time (`BY_METRIC_TIME`), which
  ClickHouse reads instead of the table for "the last hour of a metric": a store an older
  version created gets it from `ridethrough.exporters.store.Store.init_schema`.

With a cluster name, every table is created ``ON CLUSTER`` as ``<name>_local`` with a
Replicated engine and the table's time to live (`RETENTION`), and a Distributed table
``<name>`` over it, sharded so a host's series stay together. The embedded store keeps
everything: lab scenarios and calibrations replay old timestamps that a TTL would drop.
The 1-minute rollups that dashboards and slow detectors read are in `schema_cluster`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

_Z = "CODEC(ZSTD(1))"
_DZ = "CODEC(Delta, ZSTD(1))"
_MAP = "Map(LowCardinality(String), String)"
DEDUP_WINDOW = 10_000
"""Recent insert tokens each non-replicated table remembers (ClickHouse's replicated default is 1000)."""


@dataclass(frozen=True, slots=True)
class Column:
    """One column; ``insert`` is False for ALIAS/DEFAULT columns that ClickHouse fills itself."""

    name: str
    type: str
    extra: str = _Z
    insert: bool = True


@dataclass(frozen=True, slots=True)
class Projection:
    """A second copy of some of a table's columns in another order, which ClickHouse reads instead of the
    table when that reads fewer granules (``optimize_use_projections``, on by default)."""

    name: str
    select: str

    def definition(self) -> str:
        """The projection's clause in CREATE TABLE and ALTER TABLE ... ADD PROJECTION."""
        return f"PROJECTION {quote(self.name)} ({self.select})"


@dataclass(frozen=True, slots=True)
class Table:
    """A table's columns and storage layout."""

    name: str
    columns: tuple[Column, ...]
    indexes: tuple[str, ...]
    partition_by: str
    order_by: str
    shard_key: str
    primary_key: str = ""
    engine: str = "MergeTree"
    projections: tuple[Projection, ...] = ()

    @property
    def insert_columns(self) -> tuple[str, ...]:
        """Columns an insert supplies, in table order (Nested parts as ``Parent.Child``)."""
        return tuple(c.name for c in self.columns if c.insert)


def _nested(parent: str, parts: tuple[tuple[str, str], ...]) -> tuple[Column, ...]:
    # Nested columns are flattened (flatten_nested=1, the default) into Array columns.
    return tuple(Column(f"{parent}.{name}", f"Array({typ})") for name, typ in parts)


_EXEMPLARS = _nested(
    "Exemplars",
    (
        ("FilteredAttributes", _MAP),
        ("TimeUnix", "DateTime64(9)"),
        ("Value", "Float64"),
        ("SpanId", "String"),
        ("TraceId", "String"),
    ),
)

_METRIC_HEAD = (
    Column("ResourceAttributes", _MAP),
    Column("ResourceSchemaUrl", "String"),
    Column("ScopeName", "String"),
    Column("ScopeVersion", "String"),
    Column("ScopeAttributes", _MAP),
    Column("ScopeDroppedAttrCount", "UInt32"),
    Column("ScopeSchemaUrl", "String"),
    Column("ServiceName", "LowCardinality(String)"),
    Column("MetricName", "String"),
    Column("MetricDescription", "String"),
    Column("MetricUnit", "String"),
    Column("Attributes", _MAP),
    Column("StartTimeUnix", "DateTime64(9)", _DZ),
    Column("TimeUnix", "DateTime64(9)", _DZ),
)


def _map_indexes(*maps: str) -> tuple[str, ...]:
    prefixes = {"ResourceAttributes": "res_attr", "ScopeAttributes": "scope_attr", "Attributes": "attr",
                "SpanAttributes": "span_attr", "LogAttributes": "log_attr"}
    out: list[str] = []
    for col in maps:
        p = prefixes[col]
        out.append(f"INDEX idx_{p}_key mapKeys({col}) TYPE bloom_filter(0.01) GRANULARITY 1")
        out.append(f"INDEX idx_{p}_value mapValues({col}) TYPE bloom_filter(0.01) GRANULARITY 1")
    return tuple(out)


_METRIC_INDEXES = _map_indexes("ResourceAttributes", "ScopeAttributes", "Attributes")
_METRIC_ORDER = "(ServiceName, MetricName, Attributes, toUnixTimestamp64Nano(TimeUnix))"
_HOST_SHARD = "cityHash64(ResourceAttributes['host.name'])"
BY_METRIC_TIME = Projection(
    "by_metric_time",
    "SELECT MetricName, TimeUnix, ResourceAttributes, Attributes, Value ORDER BY MetricName, TimeUnix")
"""The gauges by metric then time: the upstream order (series, then time) makes "the last hour of a metric"
read the whole day of it, since every series spans the day; the dashboards' and detectors' reads of recent
gauges (one-way delays, NIC and agent states, series) read only that hour from here. It holds the columns
those reads use, not exemplars or scope."""


def _metric_table(name: str, body: tuple[Column, ...], projections: tuple[Projection, ...] = ()) -> Table:
    return Table(name, _METRIC_HEAD + body, _METRIC_INDEXES, "toDate(TimeUnix)", _METRIC_ORDER, _HOST_SHARD,
                 projections=projections)


GAUGE = _metric_table(
    "otel_metrics_gauge",
    (Column("Value", "Float64"), Column("Flags", "UInt32"), *_EXEMPLARS),
    (BY_METRIC_TIME,),
)
SUM = _metric_table(
    "otel_metrics_sum",
    (
        Column("Value", "Float64"),
        Column("Flags", "UInt32"),
        *_EXEMPLARS,
        Column("AggregationTemporality", "Int32"),
        Column("IsMonotonic", "Boolean", _DZ),
    ),
)
_MIN_MAX_TEMPORALITY = (
    Column("Flags", "UInt32"),
    Column("Min", "Float64"),
    Column("Max", "Float64"),
    Column("AggregationTemporality", "Int32"),
)
HISTOGRAM = _metric_table(
    "otel_metrics_histogram",
    (
        Column("Count", "UInt64", _DZ),
        Column("Sum", "Float64"),
        Column("BucketCounts", "Array(UInt64)"),
        Column("ExplicitBounds", "Array(Float64)"),
        *_EXEMPLARS,
        *_MIN_MAX_TEMPORALITY,
    ),
)
EXP_HISTOGRAM = _metric_table(
    "otel_metrics_exponential_histogram",
    (
        Column("Count", "UInt64", _DZ),
        Column("Sum", "Float64"),
        Column("Scale", "Int32"),
        Column("ZeroCount", "UInt64"),
        Column("PositiveOffset", "Int32"),
        Column("PositiveBucketCounts", "Array(UInt64)"),
        Column("NegativeOffset", "Int32"),
        Column("NegativeBucketCounts", "Array(UInt64)"),
        *_EXEMPLARS,
        *_MIN_MAX_TEMPORALITY,
    ),
)
SUMMARY = _metric_table(
    "otel_metrics_summary",
    (
        Column("Count", "UInt64", _DZ),
        Column("Sum", "Float64"),
        *_nested("ValueAtQuantiles", (("Quantile", "Float64"), ("Value", "Float64"))),
        Column("Flags", "UInt32"),
    ),
)

TRACES = Table(
    "otel_traces",
    (
        Column("Timestamp", "DateTime64(9)", "CODEC(Delta(8), ZSTD(1))"),
        Column("TraceId", "String"),
        Column("SpanId", "String"),
        Column("ParentSpanId", "String"),
        Column("TraceState", "String"),
        Column("SpanName", "LowCardinality(String)"),
        Column("SpanKind", "LowCardinality(String)"),
        Column("ServiceName", "LowCardinality(String)"),
        Column("ResourceAttributes", _MAP),
        Column("ScopeName", "String"),
        Column("ScopeVersion", "String"),
        Column("SpanAttributes", _MAP),
        Column("Duration", "UInt64", "CODEC(T64, ZSTD(1))"),
        Column("StatusCode", "LowCardinality(String)"),
        Column("StatusMessage", "String"),
        *_nested("Events", (("Timestamp", "DateTime64(9)"), ("Name", "LowCardinality(String)"),
                            ("Attributes", _MAP))),
        *_nested("Links", (("TraceId", "String"), ("SpanId", "String"), ("TraceState", "String"),
                           ("Attributes", _MAP))),
        Column("ResourceAttributeItems", "Array(String)",
               "ALIAS arrayMap(kv -> concat(kv.1, '=', kv.2), "
               "CAST(ResourceAttributes, 'Array(Tuple(String, String))'))", insert=False),
        Column("SpanAttributeItems", "Array(String)",
               "ALIAS arrayMap(kv -> concat(kv.1, '=', kv.2), "
               "CAST(SpanAttributes, 'Array(Tuple(String, String))'))", insert=False),
    ),
    (
        "INDEX idx_trace_id TraceId TYPE bloom_filter(0.001) GRANULARITY 1",
        *_map_indexes("ResourceAttributes", "SpanAttributes"),
        "INDEX idx_duration Duration TYPE minmax GRANULARITY 1",
        "INDEX idx_lower_span_name lower(SpanName) TYPE tokenbf_v1(32768, 3, 0) GRANULARITY 8",
    ),
    "toDate(Timestamp)",
    "(ServiceName, SpanName, toDateTime(Timestamp), Timestamp)",
    "cityHash64(TraceId)",
    primary_key="(ServiceName, SpanName, toDateTime(Timestamp))",
)

TRACE_ID_TS = Table(
    "otel_traces_trace_id_ts",
    (
        Column("TraceId", "String"),
        Column("Start", "SimpleAggregateFunction(min, DateTime)"),
        Column("End", "SimpleAggregateFunction(max, DateTime)"),
    ),
    (),
    "toStartOfWeek(Start)",
    "(TraceId)",
    "cityHash64(TraceId)",
    engine="AggregatingMergeTree",
)

LOGS = Table(
    "otel_logs",
    (
        Column("Timestamp", "DateTime64(9)", "CODEC(Delta(8), ZSTD(1))"),
        Column("TimestampTime", "DateTime", "DEFAULT toDateTime(Timestamp)", insert=False),
        Column("TraceId", "String"),
        Column("SpanId", "String"),
        Column("TraceFlags", "UInt8", ""),
        Column("SeverityText", "LowCardinality(String)"),
        Column("SeverityNumber", "UInt8", ""),
        Column("ServiceName", "LowCardinality(String)"),
        Column("Body", "String"),
        Column("ResourceSchemaUrl", "LowCardinality(String)"),
        Column("ResourceAttributes", _MAP),
        Column("ScopeSchemaUrl", "LowCardinality(String)"),
        Column("ScopeName", "String"),
        Column("ScopeVersion", "LowCardinality(String)"),
        Column("ScopeAttributes", _MAP),
        Column("LogAttributes", _MAP),
    ),
    (
        "INDEX idx_trace_id TraceId TYPE bloom_filter(0.001) GRANULARITY 1",
        *_map_indexes("ResourceAttributes", "ScopeAttributes", "LogAttributes"),
        "INDEX idx_body Body TYPE tokenbf_v1(32768, 3, 0) GRANULARITY 8",
        "INDEX idx_body_ngrambf Body TYPE ngrambf_v1(4, 32768, 3, 0) GRANULARITY 1",
    ),
    "toDate(TimestampTime)",
    "(ServiceName, TimestampTime, Timestamp)",
    _HOST_SHARD,
    primary_key="(ServiceName, TimestampTime)",
)

TABLES: tuple[Table, ...] = (GAUGE, SUM, HISTOGRAM, EXP_HISTOGRAM, SUMMARY, TRACES, TRACE_ID_TS, LOGS)
TABLES_BY_NAME = {t.name: t for t in TABLES}


@dataclass(frozen=True, slots=True)
class Retention:
    """How long a table keeps a row: ``days`` after its ``time`` column; rows matching
    ``keep_longer`` (a boolean SQL expression over the row) stay ``longer_days`` instead."""

    time: str
    days: int
    keep_longer: str = ""
    longer_days: int = 0

    def ttl(self) -> str:
        """The TTL clause's expression list."""
        at = f"toDateTime({self.time})"
        if not self.keep_longer:
            return f"{at} + INTERVAL {self.days} DAY"
        return (f"{at} + INTERVAL {self.days} DAY DELETE WHERE NOT ({self.keep_longer}), "
                f"{at} + INTERVAL {self.longer_days} DAY")


_YEARS_5 = 5 * 365 + 1
RETENTION: Mapping[str, Retention] = MappingProxyType({
    # Raw points: days. Detectors read minutes to hours of them; longer views read the rollups.
    **{t: Retention("TimeUnix", 14) for t in ("otel_metrics_gauge", "otel_metrics_sum", "otel_metrics_histogram",
                                              "otel_metrics_exponential_histogram", "otel_metrics_summary")},
    # 1-minute aggregates (schema_cluster): months, long enough to compare this quarter with last year's.
    **{t: Retention("Minute", 400) for t in ("otel_metrics_gauge_1m", "otel_metrics_sum_1m")},
    "otel_traces": Retention("Timestamp", 90),
    "otel_traces_trace_id_ts": Retention("Start", 90),
    # Job lifecycle events are goodput's input (ridethrough.dashboards.goodput_sql): years, like the books.
    "otel_logs": Retention("TimestampTime", 90, "startsWith(LogAttributes['event.name'], 'job.') "
                           "OR LogAttributes['event.name'] IN ('audit.completed', 'action.decision')", 2 * 365),
    # The domain tables beside the OTel ones (detectors.incidents, actuators.actions, lab.truth): years.
    "incidents": Retention("OpenedAt", _YEARS_5),
    "actions": Retention("DecidedAt", _YEARS_5),
    "approvals": Retention("DecidedAt", _YEARS_5),  # ridethrough.actuators.approvals_table: who allowed what
    "lab_truth": Retention("RunStartedAt", _YEARS_5),
    "audits": Retention("StartedAt", _YEARS_5),  # ridethrough.audit_store: fleet acceptance records
})
"""Every clustered table's time to live, by table name, in one place (a table missing here cannot be
created on a cluster: `create_table_sql` says so)."""


def quote(name: str) -> str:
    """``name`` as a ClickHouse identifier in backquotes (a backquote inside is doubled)."""
    return "`" + name.replace("`", "``") + "`"


def _on_cluster(cluster: str) -> str:
    return f" ON CLUSTER {quote(cluster)}" if cluster else ""


def _engine(table: Table, local_name: str, cluster: str) -> str:
    if not cluster:
        return table.engine
    # {shard}/{replica} are macros every replica defines in its server config.
    zk_path = f"'/clickhouse/tables/{{shard}}/{{database}}/{local_name}'"
    # An engine with parameters (``ReplacingMergeTree(Version)``) keeps them after the replication ones.
    engine, _, params = table.engine.partition("(")
    extra = f", {params.removesuffix(')')}" if params else ""
    return f"Replicated{engine}({zk_path}, '{{replica}}'{extra})"


def _settings(cluster: str) -> str:
    base = "index_granularity = 8192, ttl_only_drop_parts = 1"
    if cluster:
        return base  # replicated tables deduplicate insert tokens by default
    return f"{base}, non_replicated_deduplication_window = {DEDUP_WINDOW}"


def create_table_sql(table: Table, *, cluster: str = "") -> str:
    """The CREATE TABLE statement for one table (the ``_local`` one, with its TTL, when clustered)."""
    name = f"{table.name}_local" if cluster else table.name
    body = [f"    {c.name} {c.type} {c.extra}".rstrip() for c in table.columns if "." not in c.name]
    body += _nested_definitions(table)
    body += [f"    {ix}" for ix in table.indexes]
    body += [f"    {p.definition()}" for p in table.projections]
    lines = [
        f"CREATE TABLE IF NOT EXISTS {quote(name)}{_on_cluster(cluster)} (",
        ",\n".join(body),
        f") ENGINE = {_engine(table, name, cluster)}",
        f"PARTITION BY {table.partition_by}",
    ]
    if table.primary_key:
        lines.append(f"PRIMARY KEY {table.primary_key}")
    lines.append(f"ORDER BY {table.order_by}")
    if cluster:
        lines.append(f"TTL {_retention(table).ttl()}")
    lines.append(f"SETTINGS {_settings(cluster)}")
    return "\n".join(lines)


def _retention(table: Table) -> Retention:
    try:
        return RETENTION[table.name]
    except KeyError:
        # A fleet's store must not grow without bound: a new table states its retention here.
        raise ValueError(f"table {table.name!r} has no entry in schema.RETENTION") from None


def _nested_definitions(table: Table) -> list[str]:
    groups: dict[str, list[str]] = {}
    for c in table.columns:
        if "." in c.name:
            parent, child = c.name.split(".", 1)
            inner = c.type.removeprefix("Array(").removesuffix(")")
            groups.setdefault(parent, []).append(f"{child} {inner}")
    return [f"    {parent} Nested ({', '.join(parts)}) {_Z}" for parent, parts in groups.items()]


def domain_ddl(table: Table, *, cluster: str = "") -> Iterator[str]:
    """The statements that create one of the project's own tables (incidents, actions, lab truth,
    audits): the table, or ``<name>_local`` + its Distributed table when clustered."""
    yield create_table_sql(table, cluster=cluster)
    if cluster:
        yield create_distributed_sql(table, cluster=cluster)


def add_columns_sql(table: Table, present: Iterable[str], *, cluster: str = "") -> list[str]:
    """The ALTERs that bring a table created by an older version up to ``table``: each column it lacks,
    added with its type and default (rows written before read the default), on ``<name>_local`` and
    the Distributed table when clustered. Columns are only ever added, never changed or dropped."""
    have = set(present)
    missing = [c for c in table.columns if "." not in c.name and c.name not in have]
    if not missing:
        return []

    def alter(name: str, *, storage: bool) -> str:  # a Distributed table stores nothing: type only, no codec
        adds = (f"ADD COLUMN IF NOT EXISTS {c.name} {c.type} {c.extra if storage else ''}".rstrip() for c in missing)
        return f"ALTER TABLE {quote(name)}{_on_cluster(cluster)} " + ", ".join(adds)
    if cluster:
        return [alter(f"{table.name}_local", storage=True), alter(table.name, storage=False)]
    return [alter(table.name, storage=True)]


def add_projection_sql(table: Table, projection: Projection, *, cluster: str = "") -> list[str]:
    """The ALTERs that give a table created before ``projection`` existed: add it (new parts carry it), then
    build it for the parts already there (a mutation ClickHouse runs in the background)."""
    name = quote(f"{table.name}_local" if cluster else table.name)
    return [f"ALTER TABLE {name}{_on_cluster(cluster)} ADD PROJECTION IF NOT EXISTS {quote(projection.name)} "
            f"({projection.select})",
            f"ALTER TABLE {name}{_on_cluster(cluster)} MATERIALIZE PROJECTION {quote(projection.name)}"]


def create_distributed_sql(table: Table, *, cluster: str) -> str:
    """The Distributed table that fronts ``<name>_local`` on every shard."""
    return (
        f"CREATE TABLE IF NOT EXISTS {quote(table.name)}{_on_cluster(cluster)} "
        f"AS {quote(table.name + '_local')} "
        f"ENGINE = Distributed({quote(cluster)}, currentDatabase(), {quote(table.name + '_local')}, "
        f"{table.shard_key})"
    )


def trace_id_ts_view_sql(*, cluster: str = "") -> str:
    """The materialized view that keeps each trace's time span for fast lookup by TraceId."""
    suffix = "_local" if cluster else ""
    return (
        f"CREATE MATERIALIZED VIEW IF NOT EXISTS {quote('otel_traces_trace_id_ts_mv' + suffix)}"
        f"{_on_cluster(cluster)} TO {quote('otel_traces_trace_id_ts' + suffix)} AS SELECT "
        "TraceId, min(Timestamp) AS Start, max(Timestamp) AS End "
        f"FROM {quote('otel_traces' + suffix)} WHERE TraceId != '' GROUP BY TraceId"
    )


def ddl(*, cluster: str = "") -> Iterator[str]:
    """Every statement that creates the schema, in order; each is idempotent."""
    for table in TABLES:
        yield create_table_sql(table, cluster=cluster)
        if cluster:
            yield create_distributed_sql(table, cluster=cluster)
    yield trace_id_ts_view_sql(cluster=cluster)
