"""1-minute rollups of probe and counter data, for dashboards and slow detectors at fleet scale.

Raw points are kept for days (`schema.RETENTION`); a week or a quarter of a 2,048-node fleet
is read from these aggregates instead, which materialized views fill as the raw rows arrive:

* ``otel_metrics_gauge_1m``: the probe source's gauges (one-way delay, RTT, loss and purity
  ratios), per series and minute: ``Count``, ``Sum``, ``Min``, ``Max`` and the ``Last`` value;
* ``otel_metrics_sum_1m``: every cumulative counter, per series and minute: ``Count``, ``Min``,
  ``Max``, ``First`` and ``Last`` (a counter's increase over minutes is the difference of
  consecutive ``Last`` values; a drop is a reset).

Series are keyed by the agent's node (``NodeId``, ``HostName``), its fleet ``Cluster``, the
metric and its ``Attributes``. Rows are partial aggregates until ClickHouse merges them, so a
reader always groups, e.g. the p99 one-way delay of each path over a day::

    SELECT NodeId, Attributes['probe.dst.node'] AS dst, Minute,
           max(Max) AS worst, sum(Sum) / sum(Count) AS mean, argMaxMerge(Last) AS last
    FROM otel_metrics_gauge_1m
    WHERE MetricName = 'ridethrough.probe.owd' AND Attributes['probe.quantile'] = 'p99'
      AND Minute >= now() - INTERVAL 1 DAY
    GROUP BY NodeId, dst, Minute

With a cluster name the views are created on each shard's ``_local`` tables, so a host's
rollups are computed and stored on the shard that holds its raw rows (both tables are sharded
by host name), and a Distributed table fronts each rollup. A spool replay that ClickHouse drops
as a duplicate is dropped from the rollups too (deduplication reaches dependent views).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from ridethrough.exporters.schema import Column, Table, create_distributed_sql, create_table_sql, quote

_LC = "LowCardinality(String)"
_MAP = "Map(LowCardinality(String), String)"
_LAST = "AggregateFunction(argMax, Float64, DateTime64(9))"
_FIRST = "AggregateFunction(argMin, Float64, DateTime64(9))"
PROBE_PREFIX = "ridethrough.probe."
"""Gauges rolled up: the probe source's (the catalogue's ``ridethrough/metrics/probe.yaml``)."""

_KEY = (
    Column("ServiceName", _LC),
    Column("MetricName", _LC),
    Column("Cluster", _LC),
    Column("NodeId", _LC),
    Column("HostName", _LC),
    Column("Attributes", _MAP),
    Column("Minute", "DateTime", "CODEC(Delta, ZSTD(1))"),
)
_ORDER = "(MetricName, Cluster, Minute, NodeId, HostName, ServiceName, Attributes)"
_PRIMARY = "(MetricName, Cluster, Minute, NodeId)"
# The same host key as the raw tables' Distributed sharding, so a host's rollups share its raw rows' shard.
_SHARD = "cityHash64(HostName)"


def _rollup(name: str, aggregates: tuple[Column, ...]) -> Table:
    return Table(name, _KEY + aggregates, (), "toYYYYMM(Minute)", _ORDER, _SHARD, primary_key=_PRIMARY,
                 engine="AggregatingMergeTree")


GAUGE_1M = _rollup("otel_metrics_gauge_1m", (
    Column("Count", "SimpleAggregateFunction(sum, UInt64)"),
    Column("Sum", "SimpleAggregateFunction(sum, Float64)"),
    Column("Min", "SimpleAggregateFunction(min, Float64)"),
    Column("Max", "SimpleAggregateFunction(max, Float64)"),
    Column("Last", _LAST),
))
SUM_1M = _rollup("otel_metrics_sum_1m", (
    Column("Count", "SimpleAggregateFunction(sum, UInt64)"),
    Column("Min", "SimpleAggregateFunction(min, Float64)"),
    Column("Max", "SimpleAggregateFunction(max, Float64)"),
    Column("First", _FIRST),
    Column("Last", _LAST),
))


@dataclass(frozen=True, slots=True)
class Rollup:
    """A 1-minute aggregate table and the view that fills it from a raw table."""

    table: Table
    source: str
    aggregates: str
    where: str = ""

    @property
    def view(self) -> str:
        """The materialized view's name (``_local`` is added when clustered)."""
        return f"{self.table.name}_mv"


_KEY_SELECT = (
    "ServiceName, MetricName, "
    "ResourceAttributes['ridethrough.cluster'] AS Cluster, "
    "ResourceAttributes['ridethrough.node.id'] AS NodeId, "
    "ResourceAttributes['host.name'] AS HostName, "
    "Attributes, toStartOfMinute(TimeUnix) AS Minute"
)
_KEY_GROUP = "ServiceName, MetricName, Cluster, NodeId, HostName, Attributes, Minute"

ROLLUPS: tuple[Rollup, ...] = (
    Rollup(GAUGE_1M, "otel_metrics_gauge",
           "count() AS Count, sum(Value) AS Sum, min(Value) AS Min, max(Value) AS Max, "
           "argMaxState(Value, TimeUnix) AS Last",
           f"startsWith(MetricName, '{PROBE_PREFIX}')"),
    Rollup(SUM_1M, "otel_metrics_sum",
           "count() AS Count, min(Value) AS Min, max(Value) AS Max, "
           "argMinState(Value, TimeUnix) AS First, argMaxState(Value, TimeUnix) AS Last"),
)
"""Every rollup, in creation order."""


def rollup_view_sql(rollup: Rollup, *, cluster: str = "") -> str:
    """The materialized view that feeds ``rollup.table`` from its raw table (shard-local when clustered)."""
    suffix = "_local" if cluster else ""
    on_cluster = f" ON CLUSTER {quote(cluster)}" if cluster else ""
    where = f" WHERE {rollup.where}" if rollup.where else ""
    return (
        f"CREATE MATERIALIZED VIEW IF NOT EXISTS {quote(rollup.view + suffix)}{on_cluster} "
        f"TO {quote(rollup.table.name + suffix)} AS SELECT {_KEY_SELECT}, {rollup.aggregates} "
        f"FROM {quote(rollup.source + suffix)}{where} GROUP BY {_KEY_GROUP}"
    )


def rollup_ddl(*, cluster: str = "") -> Iterator[str]:
    """Every statement that creates the rollups, after `schema.ddl` (the views read its tables); idempotent."""
    for rollup in ROLLUPS:
        yield create_table_sql(rollup.table, cluster=cluster)
        if cluster:
            yield create_distributed_sql(rollup.table, cluster=cluster)
        yield rollup_view_sql(rollup, cluster=cluster)
