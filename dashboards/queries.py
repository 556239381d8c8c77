"""The dashboard's reads: every query is parameterised (``{name:Type}``, bound by the store), never formatted.

The only text spliced into SQL is this module's own constants (the gauge and counter query shapes,
aggregate expressions picked from `AGGREGATES` by name); every value a user can influence (a node,
a metric, an attribute name or value) travels as a bound parameter. Long series are
downsampled in SQL: `series` returns at most ``buckets`` points per series.

Incidents and actions are read in `ridethrough.dashboards.queries_incidents`, GPU states and series by
GPU id in `ridethrough.dashboards.queries_gpus`, audits in `ridethrough.dashboards.queries_audits`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ridethrough.detectors.sql import CLUSTER, NODE
from ridethrough.exporters.store import Store

if TYPE_CHECKING:
    from ridethrough.dashboards.queries_gpus import GpuInventory

T_NS = "toUnixTimestamp64Nano(TimeUnix)"
# Comparing the column itself (not a function of it) lets ClickHouse skip whole date partitions.
IN_RANGE = "TimeUnix BETWEEN fromUnixTimestamp64Nano({start:Int64}) AND fromUnixTimestamp64Nano({end:Int64})"
HEARTBEAT = "ridethrough.agent.export.buffered"
"""A gauge every agent reports at every export: its newest point is the agent's freshness."""
THROTTLE_MASK = 0x4 | 0x8 | 0x20 | 0x40 | 0x80
"""NVML clock-event bits that mean throttling: SwPowerCap, HwSlowdown, SwThermal, HwThermal, HwPowerBrake."""
TABLES = {"gauge": "otel_metrics_gauge", "counter": "otel_metrics_sum"}
AGGREGATES = {
    "avg": "avg(Value)", "max": "max(Value)", "min": "min(Value)", "last": f"argMax(Value, {T_NS})", "count": "count()",
    "throttled": f"avg(bitAnd(toUInt64(greatest(Value, 0)), {THROTTLE_MASK}) != 0)",
}
"""Per-bucket aggregates of a gauge, by name (a counter's bucket value is always its increase per second)."""


@dataclass(frozen=True, slots=True)
class TimeRange:
    """``[start_ns, end_ns]`` with the bucket width that gives at most ``buckets`` points."""

    start_ns: int
    end_ns: int
    buckets: int = 240

    def __post_init__(self) -> None:
        if self.end_ns <= self.start_ns or self.buckets < 1:
            raise ValueError(f"empty time range {self.start_ns}..{self.end_ns} or bucket count {self.buckets}")

    @property
    def step_ns(self) -> int:
        """Bucket width in nanoseconds (at least one second)."""
        return max(1_000_000_000, -(-(self.end_ns - self.start_ns) // self.buckets))

    def params(self, cluster: str = "", **extra: Any) -> dict[str, Any]:
        """The bound parameters every range query takes."""
        return {"start": self.start_ns, "end": self.end_ns, "step": self.step_ns, "cluster": cluster, **extra}


def rows(store: Store, sql: str, parameters: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Run ``sql`` with bound ``parameters``; rows as dicts keyed by column name."""
    names, found = store.query(sql, parameters=dict(parameters))
    return [dict(zip(names, r, strict=True)) for r in found]


EXISTS_TABLE = "EXISTS TABLE {name:Identifier}"


def table_exists(store: Store, name: str) -> bool:
    """Whether ``name`` exists in the current database (domain tables appear with their first writer)."""
    _, found = store.query(EXISTS_TABLE, parameters={"name": name})
    return bool(found and found[0][0])


# --- time series ----------------------------------------------------------------------------------

# The node filter names the nodes twice: hasAny over the map's values lets the bloom-filter index on
# the resource (or attribute) values skip every granule of other nodes; the second test is the exact one.
NODES = ("({all_nodes:Bool} OR (hasAny(mapValues({node_map}), {nodes:Array(String)}) "
         "AND node IN {nodes:Array(String)}))")
_GAUGE = f"""
SELECT {{node_expr}} AS node, MetricName AS metric_name, {{keys}},
       intDiv({T_NS} - {{start:Int64}}, {{step:Int64}}) AS b, {{agg}} AS v
FROM otel_metrics_gauge
WHERE MetricName IN {{metrics:Array(String)}} AND {IN_RANGE} AND {CLUSTER} AND NOT isNaN(Value) {{where}} AND {NODES}
GROUP BY node, metric_name, {{key_names}}, b ORDER BY node, metric_name, {{key_names}}, b
"""
# A cumulative counter: the last value of each series per bucket, then the positive steps between
# buckets (a reset or a duplicate adds nothing), summed over the series that share the keys.
_COUNTER = f"""
SELECT node, metric_name, {{key_names}}, b, sum(inc) / ({{step:Int64}} / 1e9) AS v FROM (
    SELECT node, metric_name, {{key_names}}, pt.1 AS b, pt.2 AS inc FROM (
        SELECT node, metric_name, {{key_names}}, arraySort(p -> p.1, groupArray((b, m))) AS pts,
               arrayZip(arrayMap(p -> p.1, pts),
                        arrayMap(d -> greatest(d, 0), arrayDifference(arrayMap(p -> p.2, pts)))) AS incs
        FROM (
            SELECT {{node_expr}} AS node, MetricName AS metric_name, {{keys}}, cityHash64(Attributes) AS series,
                   intDiv({T_NS} - {{start:Int64}}, {{step:Int64}}) AS b, max(Value) AS m
            FROM otel_metrics_sum
            WHERE MetricName IN {{metrics:Array(String)}} AND {IN_RANGE} AND {CLUSTER} {{where}} AND {NODES}
            GROUP BY node, metric_name, {{key_names}}, series, b
        ) GROUP BY node, metric_name, {{key_names}}, series
    ) ARRAY JOIN incs AS pt
) GROUP BY node, metric_name, {{key_names}}, b ORDER BY node, metric_name, {{key_names}}, b
"""
SeriesKey = tuple[str, ...]
"""(node, key attribute values...); with several metrics, (node, metric, key attribute values...)."""
Points = tuple[list[int], list[float]]
"""(bucket start times in ns, values)."""


def series(store: Store, rng: TimeRange, metric: str | Mapping[str, str], *, kind: str = "gauge",
           keys: Sequence[str] = (), agg: str = "avg", match: Mapping[str, Sequence[str]] | None = None,
           nodes: Sequence[str] | None = None, node_attr: str = "", cluster: str = "") -> dict[SeriesKey, Points]:
    """Downsampled series of a metric, one per (node, ``keys`` attribute values).

    A gauge's bucket value is ``AGGREGATES[agg]``; a counter's (``kind="counter"``) is its increase
    per second in the bucket. ``metric`` may map several metrics (of one kind) to their aggregates:
    they are read in one scan, and each key then names its metric after the node. ``match`` keeps
    points whose attributes take one of the listed values; ``nodes`` keeps those nodes (None: all);
    ``node_attr`` reads the node from an attribute (the clock service's ``clock.node``) instead of
    the sender's resource.
    """
    several = not isinstance(metric, str)
    aggs = dict(metric) if not isinstance(metric, str) else {metric: agg}
    if kind not in TABLES or not aggs or not set(aggs.values()) <= set(AGGREGATES):
        raise ValueError(f"unknown series kind {kind!r} or aggregate in {sorted(aggs.values())}")
    keys = ("",) if not keys else tuple(keys)  # one empty key keeps the GROUP BY well-formed
    bound: dict[str, Any] = {f"k{i}": k for i, k in enumerate(keys)}
    bound.update({f"m{i}": m for i, m in enumerate(aggs)})
    where = ""
    for i, (attr, allowed) in enumerate((match or {}).items()):
        where += f" AND Attributes[{{mk{i}:String}}] IN {{mv{i}:Array(String)}}"
        bound.update({f"mk{i}": attr, f"mv{i}": list(allowed)})
    # Each metric's aggregate, picked by the metric (a grouping key); every aggregate is computed, one is kept.
    picked = "".join(f"metric_name = {{m{i}:String}}, {AGGREGATES[a]}, " for i, a in enumerate(aggs.values()))
    # Only this module's constants are spliced in; every caller value is a bound parameter.
    text = (_COUNTER if kind == "counter" else _GAUGE)
    for marker, fragment in (
            ("{node_expr}", "Attributes[{node_attr:String}]" if node_attr else NODE),
            ("{node_map}", "Attributes" if node_attr else "ResourceAttributes"),
            ("{keys}", ", ".join(f"Attributes[{{k{i}:String}}] AS k{i}" for i in range(len(keys)))),
            ("{key_names}", ", ".join(f"k{i}" for i in range(len(keys)))),
            ("{agg}", f"multiIf({picked}nan)"), ("{where}", where)):
        text = text.replace(marker, fragment)
    params = rng.params(cluster, metrics=list(aggs), all_nodes=nodes is None, nodes=list(nodes or ()),
                        node_attr=node_attr, **bound)
    out: dict[SeriesKey, Points] = {}
    for r in rows(store, text, params):
        named = (r["metric_name"],) if several else ()
        key = (r["node"], *named, *(r[f"k{i}"] for i in range(len(keys)) if keys[i]))
        times, values = out.setdefault(key, ([], []))
        times.append(rng.start_ns + int(r["b"]) * rng.step_ns)
        values.append(float(r["v"]))
    return out


# --- the fleet now ----------------------------------------------------------------------------------

_HEALTH = f"""
SELECT node, 'agent' AS what, 0 AS level, toFloat64(max({T_NS})) AS value, '' AS detail
FROM (SELECT {NODE} AS node, TimeUnix FROM otel_metrics_gauge
      WHERE MetricName = '{HEARTBEAT}' AND TimeUnix >= fromUnixTimestamp64Nano({{seen:Int64}}) AND {CLUSTER})
GROUP BY node
UNION ALL
SELECT node, 'nic', if(countIf(v != 1) > 0, 2, 0), toFloat64(countIf(v != 1)),
       arrayStringConcat(arraySort(groupArrayIf(concat(nic, ' down'), v != 1)), ', ')
FROM (SELECT {NODE} AS node, Attributes['network.interface.name'] AS nic, argMax(Value, TimeUnix) AS v
      FROM otel_metrics_gauge WHERE MetricName = 'ridethrough.nic.up' AND {IN_RANGE} AND {CLUSTER}
      GROUP BY node, nic) GROUP BY node
UNION ALL
SELECT node, 'clock', multiIf(u > {{clock_bad:Float64}}, 2, u > {{clock_warn:Float64}}, 1, 0), o,
       concat('offset ', toString(round(o * 1e6, 1)), ' us, uncertainty ', toString(round(u * 1e6, 1)), ' us')
FROM (SELECT Attributes['clock.node'] AS node,
             argMaxIf(Value, TimeUnix, MetricName = 'ridethrough.clock.node.offset') AS o,
             argMaxIf(Value, TimeUnix, MetricName = 'ridethrough.clock.node.uncertainty') AS u
      FROM otel_metrics_gauge
      WHERE MetricName IN ('ridethrough.clock.node.offset', 'ridethrough.clock.node.uncertainty') AND {IN_RANGE}
      GROUP BY node) WHERE node != ''
"""
CLOCK_WARN_S = 50e-6
CLOCK_BAD_S = 100e-6
"""Clock uncertainty above which a node's clock is a warning / bad (ClockUnsynced's default is 100 us)."""


def fleet_health(store: Store, *, now_ns: int, recent_s: float = 300.0, seen_s: float = 3600.0,
                 cluster: str = "", inventory: GpuInventory | None = None) -> list[dict[str, Any]]:
    """Per (node, ``what``): ``level`` (0 ok, 1 warning, 2 bad), ``value`` and ``detail``, from the newest
    points of the last ``recent_s``. ``what`` is ``gpu`` (value: GPUs not ok; from
    `ridethrough.dashboards.queries_gpus.gpu_states`, through ``inventory``), ``nic`` (NICs down), ``clock``
    (value: offset in s; the clock service's rows name no cluster) or ``agent`` (value: the newest heartbeat
    in the last ``seen_s``, ns; its level is the caller's to judge)."""
    from ridethrough.dashboards.queries_gpus import gpu_states  # it builds on this module

    rng = TimeRange(now_ns - round(recent_s * 1e9), now_ns)
    found = rows(store, _HEALTH, rng.params(cluster, seen=now_ns - round(seen_s * 1e9), clock_warn=CLOCK_WARN_S,
                                            clock_bad=CLOCK_BAD_S))
    by_node: dict[str, list[str]] = {}
    states = gpu_states(store, now_ns=now_ns, recent_s=recent_s, cluster=cluster, inventory=inventory)
    for (node, gpu), state in sorted(states.items()):
        by_node.setdefault(node, [])
        if state != "ok":
            by_node[node].append(f"gpu{gpu} {state}")
    for node, bad in by_node.items():
        level = 2 if any(b.endswith(" failed") for b in bad) else 1 if bad else 0
        found.append({"node": node, "what": "gpu", "level": level, "value": float(len(bad)),
                      "detail": ", ".join(bad)})
    return found


# --- the fabric -------------------------------------------------------------------------------------

_OWD = f"""
SELECT Attributes['probe.src.node'] AS src, Attributes['probe.dst.node'] AS dst, median(Value) AS owd_s, count() AS n
FROM otel_metrics_gauge
WHERE MetricName = 'ridethrough.probe.owd' AND {IN_RANGE} AND {CLUSTER}
  AND Attributes['probe.direction'] = {{direction:String}} AND Attributes['probe.quantile'] = 'p50'
  AND isFinite(Value)
GROUP BY src, dst ORDER BY src, dst
"""


def owd_matrix(store: Store, rng: TimeRange, *, direction: str, cluster: str = "") -> list[dict[str, Any]]:
    """Median p50 one-way delay (s) per (src node, dst node) in one direction (forward: src→dst as probed
    by src; reverse: dst→src, measured by the same prober)."""
    if direction not in ("forward", "reverse"):
        raise ValueError(f"direction must be forward or reverse, got {direction!r}")
    return rows(store, _OWD, rng.params(cluster, direction=direction))


_NIC_ERRORS = f"""
SELECT node, nic, sum(inc) AS errors FROM (
    SELECT {NODE} AS node, if(MetricName = 'ridethrough.ib.port.errors', Attributes['ib.device'],
                              Attributes['network.interface.name']) AS nic,
           arraySum(arrayMap(d -> greatest(d, 0), arrayDifference(
               arrayMap(p -> p.2, arraySort(p -> p.1, groupArray(({T_NS}, Value))))))) AS inc
    FROM otel_metrics_sum
    WHERE MetricName IN ('system.network.errors', 'ridethrough.ib.port.errors') AND {IN_RANGE} AND {CLUSTER}
    GROUP BY node, nic, MetricName, Attributes
) GROUP BY node, nic
"""
_NIC_UP = f"""
SELECT {NODE} AS node, Attributes['network.interface.name'] AS nic, argMax(Value, TimeUnix) AS up,
       min(Value) AS min_up
FROM otel_metrics_gauge WHERE MetricName = 'ridethrough.nic.up' AND {IN_RANGE} AND {CLUSTER}
GROUP BY node, nic
"""


def nic_state(store: Store, rng: TimeRange, *, cluster: str = "") -> dict[str, dict[str, float]]:
    """Per NIC (``node/nic``; an IB port by its device): ``errors`` (counter increase in the range),
    ``up`` (latest ``ridethrough.nic.up``) and ``min_up`` (0 if it was down at some point)."""
    out: dict[str, dict[str, float]] = {}
    for r in rows(store, _NIC_ERRORS, rng.params(cluster)):
        out.setdefault(f"{r['node']}/{r['nic']}", {})["errors"] = float(r["errors"])
    for r in rows(store, _NIC_UP, rng.params(cluster)):
        out.setdefault(f"{r['node']}/{r['nic']}", {}).update(up=float(r["up"]), min_up=float(r["min_up"]))
    return out


_CUSTOMERS = """
SELECT DISTINCT LogAttributes['job.customer'] AS customer FROM otel_logs
WHERE LogAttributes['event.name'] = 'job.step' AND customer != ''
  AND Timestamp BETWEEN fromUnixTimestamp64Nano({start:Int64}) AND fromUnixTimestamp64Nano({end:Int64})
ORDER BY customer LIMIT 1000
"""


def customers(store: Store, rng: TimeRange) -> list[str]:
    """Customers whose jobs reported steps in the range."""
    return [r["customer"] for r in rows(store, _CUSTOMERS, rng.params())]
