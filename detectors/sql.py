"""Query helpers the detectors share: one summary row per series, aggregated in ClickHouse.

Every query is parameterised (server-side binding, ``{name:Type}``); attribute names and
metric names travel as parameters too, never formatted into the SQL text. Each helper
filters by ``window.cluster`` when it is set.

Robustness the helpers give every detector:

* duplicated rows (a batch inserted twice under different dedup tokens) change nothing:
  series are reduced to ``(time, value)`` points, sorted, and only differences are summed,
  so a repeated point contributes a difference of zero;
* a counter that goes down (a reset, or a sample reordered by a clock step) contributes
  nothing: only positive differences count as increase;
* points outside ``[start, end]`` (a host whose clock jumped away) are not read.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from ridethrough.detectors.contract import Window

NODE = ("if(ResourceAttributes['ridethrough.node.id'] != '', ResourceAttributes['ridethrough.node.id'], "
        "ResourceAttributes['host.name'])")
"""The node a row came from: its agent's node id, else its host name."""
HOST = "ResourceAttributes['host.name']"
T_NS = "toUnixTimestamp64Nano(TimeUnix)"
IN_WINDOW = f"{T_NS} BETWEEN {{start:Int64}} AND {{end:Int64}}"
CLUSTER = "({cluster:String} = '' OR ResourceAttributes['ridethrough.cluster'] = {cluster:String})"
_MID = "intDiv({start:Int64} + {end:Int64}, 2)"


def _points(cond: str = "") -> str:
    """The series' distinct (time ns, value) points, sorted by time (``cond`` filters them)."""
    if cond:
        return f"arraySort(p -> p.1, groupUniqArrayIf(({T_NS}, Value), {cond}))"
    return f"arraySort(p -> p.1, groupUniqArray(({T_NS}, Value)))"


def _increase(points: str) -> str:
    """Sum of the positive steps between consecutive points: decreases (resets) count 0."""
    return f"arraySum(arrayMap(d -> greatest(d, 0), arrayDifference(arrayMap(p -> p.2, {points}))))"


def params(window: Window, **extra: Any) -> dict[str, Any]:
    """The window's bound parameters (``start``, ``end`` in ns, ``cluster``) plus ``extra``."""
    return {"start": window.start_ns, "end": window.end_ns, "cluster": window.cluster, **extra}


def run(window: Window, sql: str, parameters: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Run ``sql`` through the window; rows as dicts keyed by column name."""
    names, rows = window.query(sql, parameters)
    return [dict(zip(names, row, strict=True)) for row in rows]


def _keys(attrs: Sequence[str]) -> tuple[str, dict[str, str]]:
    cols = ", ".join(f"Attributes[{{k{i}:String}}] AS k{i}" for i in range(len(attrs)))
    return cols, {f"k{i}": a for i, a in enumerate(attrs)}


def _match(match: Mapping[str, Sequence[str]]) -> tuple[str, dict[str, Any]]:
    clauses: list[str] = []
    bound: dict[str, Any] = {}
    for i, (attr, values) in enumerate(match.items()):
        clauses.append(f" AND Attributes[{{mk{i}:String}}] IN {{mv{i}:Array(String)}}")
        bound[f"mk{i}"] = attr
        bound[f"mv{i}"] = list(values)
    return "".join(clauses), bound


def _rename(rows: list[dict[str, Any]], attrs: Sequence[str]) -> list[dict[str, Any]]:
    for row in rows:
        for i, attr in enumerate(attrs):
            row[attr] = row.pop(f"k{i}")
    return rows


def gauge_series(window: Window, metric: str, attrs: Sequence[str], *, up_value: float = 1.0,
                 match: Mapping[str, Sequence[str]] | None = None) -> list[dict[str, Any]]:
    """Per gauge series in the window: ``latest`` value, ``last_ns``, ``had_up`` (the value
    ``up_value`` was seen), ``first_up_ns`` and ``last_down_ns`` (0 when never), ``transitions``
    (changes between ``== up_value`` and not), and ``slope_per_s`` (least-squares slope of value over time)."""
    cols, bound = _keys(attrs)
    where, mbound = _match(match or {})
    sql = f"""
        SELECT {NODE} AS node, any({HOST}) AS host_any, {cols},
               argMax(Value, {T_NS}) AS latest, max({T_NS}) AS last_ns,
               countIf(Value = {{up:Float64}}) > 0 AS had_up,
               minIf({T_NS}, Value = {{up:Float64}}) AS first_up_ns,
               maxIf({T_NS}, Value != {{up:Float64}}) AS last_down_ns,
               arraySum(arrayMap(d -> abs(d), arrayDifference(
                   arrayMap(p -> toInt8(p.2 = {{up:Float64}}), {_points()})))) AS transitions,
               simpleLinearRegression(({T_NS} - {{start:Int64}}) / 1e9, Value).1 AS slope_per_s
        FROM otel_metrics_gauge
        WHERE MetricName = {{metric:String}} AND {IN_WINDOW} AND {CLUSTER}{where}
        GROUP BY node, {", ".join(f"k{i}" for i in range(len(attrs)))}
    """
    rows = run(window, sql, params(window, metric=metric, up=up_value, **bound, **mbound))
    for row in rows:
        row["host"] = row.pop("host_any")
    return _rename(rows, attrs)


def counter_series(window: Window, metric: str, attrs: Sequence[str], *,
                   match: Mapping[str, Sequence[str]] | None = None, split_ns: int | None = None,
                   with_points: bool = False) -> list[dict[str, Any]]:
    """Per cumulative counter series in the window: ``increase`` (sum of positive steps),
    ``increase_first``/``increase_second`` (the same before and after ``split_ns``, by default
    the window's middle), ``rises`` (how many steps between points were positive: a burst
    counts once however large), ``last_increase`` (the step between the two newest points; 0
    for a decrease or a single point), ``last_rise_ns`` (the point that ended the last positive step; 0
    when none), ``latest`` and ``last_ns``; with ``with_points``, ``points`` too (the distinct (ns, value)
    points, by time)."""
    cols, bound = _keys(attrs)
    where, mbound = _match(match or {})
    split = _MID if split_ns is None else "{split:Int64}"
    points = f", {_points()} AS points" if with_points else ""
    sql = f"""
        SELECT {NODE} AS node, any({HOST}) AS host_any, {cols},
               {_increase(_points())} AS increase,
               {_increase(_points(f"{T_NS} <= {split}"))} AS increase_first,
               {_increase(_points(f"{T_NS} >= {split}"))} AS increase_second,
               arrayCount(d -> d > 0, arrayDifference(arrayMap(p -> p.2, {_points()}))) AS rises,
               greatest(arrayElement(arrayDifference(arrayMap(p -> p.2, {_points()})), -1), 0) AS last_increase,
               arrayMax(arrayMap((d, p) -> if(d > 0, p.1, 0), arrayDifference(arrayMap(p -> p.2, {_points()})),
                                 {_points()})) AS last_rise_ns,
               argMax(Value, {T_NS}) AS latest, max({T_NS}) AS last_ns{points}
        FROM otel_metrics_sum
        WHERE MetricName = {{metric:String}} AND {IN_WINDOW} AND {CLUSTER}{where}
        GROUP BY node, {", ".join(f"k{i}" for i in range(len(attrs)))}
    """
    extra = {} if split_ns is None else {"split": split_ns}
    rows = run(window, sql, params(window, metric=metric, **bound, **mbound, **extra))
    for row in rows:
        row["host"] = row.pop("host_any")
    return _rename(rows, attrs)


def xid_events(window: Window, classes: Sequence[str]) -> list[dict[str, Any]]:
    """Per GPU, the ``gpu.xid`` log events of the given classes in the window: ``count``
    (distinct events), ``xids`` and ``last_ns``."""
    sql = f"""
        SELECT {NODE} AS node, any({HOST}) AS host, LogAttributes['gpu.index'] AS `gpu.index`,
               LogAttributes['hw.id'] AS `hw.id`,
               uniqExact(toUnixTimestamp64Nano(Timestamp), LogAttributes['gpu.xid']) AS count,
               arraySort(groupUniqArray(LogAttributes['gpu.xid'])) AS xids,
               arraySort(groupUniqArray(LogAttributes['gpu.xid.class'])) AS classes,
               max(toUnixTimestamp64Nano(Timestamp)) AS last_ns
        FROM otel_logs
        WHERE LogAttributes['event.name'] = 'gpu.xid'
          AND LogAttributes['gpu.xid.class'] IN {{classes:Array(String)}}
          AND toUnixTimestamp64Nano(Timestamp) BETWEEN {{start:Int64}} AND {{end:Int64}} AND {CLUSTER}
        GROUP BY node, `gpu.index`, `hw.id`
    """
    return run(window, sql, params(window, classes=list(classes)))


def gauge_shift(window: Window, metric: str, attrs: Sequence[str], *, split_ns: int, factor: float,
                margin: float, match: Mapping[str, Sequence[str]] | None = None) -> list[dict[str, Any]]:
    """Per gauge series, its recent level against its own baseline, split at ``split_ns``.

    Columns: ``base`` (median of the distinct points before the split; NaN without any),
    ``base_n``, ``recent`` (median of those at or after it), ``recent_n``, ``above`` (recent
    points above both ``base * factor`` and ``base + margin``), ``latest`` and ``last_ns``.
    NaN points are left out; duplicated points count once.
    """
    cols, bound = _keys(attrs)
    where, mbound = _match(match or {})
    keys = ", ".join(f"k{i}" for i in range(len(attrs)))
    sql = f"""
        SELECT node, host_any, {keys}, base, base_n, recent, recent_n, latest, last_ns,
               arrayCount(v -> v > base * {{factor:Float64}} AND v > base + {{margin:Float64}}, after) AS above
        FROM (
            SELECT {NODE} AS node, any({HOST}) AS host_any, {cols},
                   groupUniqArray(({T_NS}, Value)) AS pts,
                   arrayMap(p -> p.2, arrayFilter(p -> p.1 < {{split:Int64}}, pts)) AS before,
                   arrayMap(p -> p.2, arrayFilter(p -> p.1 >= {{split:Int64}}, pts)) AS after,
                   length(before) AS base_n, length(after) AS recent_n,
                   arrayReduce('median', before) AS base, arrayReduce('median', after) AS recent,
                   argMax(Value, {T_NS}) AS latest, max({T_NS}) AS last_ns
            FROM otel_metrics_gauge
            WHERE MetricName = {{metric:String}} AND {IN_WINDOW} AND {CLUSTER} AND NOT isNaN(Value){where}
            GROUP BY node, {keys}
        )
    """
    rows = run(window, sql, params(window, metric=metric, split=split_ns, factor=factor, margin=margin,
                                   **bound, **mbound))
    for row in rows:
        row["host"] = row.pop("host_any")
    return _rename(rows, attrs)


PROBE_PATH = ("probe.src.node", "probe.src.nic", "probe.dst.node", "probe.dst.nic")
"""The attributes naming a probed path (its prober's NIC, then the peer's)."""
PathKey = tuple[str, str, str, str]


def prober_presence(window: Window) -> dict[str, tuple[int, int]]:
    """Per node whose prober reported in the window: (its first point's ns, the longest gap in ns between
    two of its points). A node that started, or came back, within the window shows a late first point
    or a long gap."""
    sql = f"""
        SELECT node, arrayElement(ts, 1) AS first_ns, arrayMax(arrayPushFront(arrayDifference(ts), 0)) AS max_gap_ns
        FROM (SELECT {NODE} AS node, arraySort(groupUniqArray({T_NS})) AS ts FROM otel_metrics_sum
              WHERE MetricName = 'ridethrough.probe.sent' AND {IN_WINDOW} AND {CLUSTER} GROUP BY node)
    """
    return {str(r["node"]): (int(r["first_ns"]), int(r["max_gap_ns"])) for r in run(window, sql, params(window))}


STALL_S = 0.5
"""Seconds of probe-thread stall in a window that make a node's silence its own, not its paths'."""


def stalled_nodes(window: Window, *, min_s: float = STALL_S) -> set[str]:
    """Nodes whose prober or responder says it was held off the CPU for ``min_s`` or more in the window
    (``ridethrough.probe.stalled``)."""
    stalled: dict[str, float] = {}
    for row in counter_series(window, "ridethrough.probe.stalled", ("probe.role",)):
        stalled[row["node"]] = stalled.get(row["node"], 0.0) + float(row["increase"])
    return {node for node, seconds in stalled.items() if seconds >= min_s}


def probe_loss(window: Window, *, recent_s: float = 5.0) -> dict[PathKey, dict[str, float]]:
    """Per probed path in the window: ``sent``, ``lost_forward`` and ``lost_reverse`` (counter increases: resets
    and duplicates add nothing; probes the prober could not judge, its peer silent on every rail, count as lost
    forward unless either end of the path says it stalled in the window, and are left out of ``sent`` if one
    did: see `stalled_nodes`), the same over the last ``recent_s`` seconds
    (``sent_recent``, ``lost_forward_recent``, ``lost_reverse_recent``), the same over the newest
    collection alone (``sent_last``, ``lost_forward_last``, ``lost_reverse_last``), ``loss_rises_forward`` and
    ``loss_rises_reverse`` (how many collections saw new losses: a one-off burst is 1),
    ``loss_last_ns_forward`` and ``loss_last_ns_reverse`` (when the last new loss was seen; 0 for none),
    ``suspended`` (1.0 if the prober's latest point in the window says the path is suspended,
    else 0.0), ``suspended_last_ns`` (its newest point saying suspended; 0 for none),
    ``sent_since_loss_forward`` and ``sent_since_loss_reverse`` (probes sent after the
    point that showed the direction's last new loss; all in the window when none) and ``last_ns``."""
    out: dict[PathKey, dict[str, float]] = {}
    split = window.end_ns - round(recent_s * 1e9)

    def path(row: dict[str, Any]) -> PathKey:
        return row["probe.src.node"], row["probe.src.nic"], row["probe.dst.node"], row["probe.dst.nic"]

    def entry(row: dict[str, Any]) -> dict[str, float]:
        got = out.setdefault(path(row), {"sent": 0.0, "lost_forward": 0.0, "lost_reverse": 0.0, "sent_recent": 0.0,
                                   "lost_forward_recent": 0.0, "lost_reverse_recent": 0.0, "loss_rises_forward": 0.0,
                                   "loss_rises_reverse": 0.0, "loss_last_ns_forward": 0, "loss_last_ns_reverse": 0,
                                   "suspended": 0.0, "last_ns": 0})
        got["last_ns"] = max(int(got["last_ns"]), int(row["last_ns"]))  # an int: ns do not fit a float
        return got

    sent_points: dict[PathKey, list[tuple[int, float]]] = {}
    for row in counter_series(window, "ridethrough.probe.sent", PROBE_PATH, split_ns=split, with_points=True):
        sent_points[path(row)] = [(int(t), float(v)) for t, v in row["points"]]
        entry(row)["sent"] += row["increase"]
        entry(row)["sent_recent"] += row["increase_second"]
        entry(row)["sent_last"] = entry(row).get("sent_last", 0.0) + row["last_increase"]
    stalled = stalled_nodes(window)
    for row in counter_series(window, "ridethrough.probe.unknown", PROBE_PATH, split_ns=split):
        if {row["probe.src.node"], row["probe.dst.node"]} & stalled:  # a busy host, not its paths: not judged
            entry(row)["sent"] -= row["increase"]
            entry(row)["sent_recent"] -= row["increase_second"]
            entry(row)["sent_last"] = entry(row).get("sent_last", 0.0) - row["last_increase"]
        else:  # neither end was held off: silence on every rail is the paths'
            _fold_loss(entry(row), "forward", row)
    for row in counter_series(window, "ridethrough.probe.lost", (*PROBE_PATH, "probe.direction"),
                              match={"probe.direction": ["forward", "reverse"]}, split_ns=split):
        _fold_loss(entry(row), row["probe.direction"], row)
    for row in gauge_series(window, "ridethrough.probe.path.suspended", PROBE_PATH, up_value=0.0):
        entry(row)["suspended"] = max(entry(row)["suspended"], float(row["latest"] == 1.0))
        entry(row)["suspended_last_ns"] = max(entry(row).get("suspended_last_ns", 0), int(row["last_down_ns"]))
    for key, st in out.items():
        st["sent"], st["sent_recent"] = max(0.0, st["sent"]), max(0.0, st["sent_recent"])
        points = sent_points.get(key, [])
        for direction in ("forward", "reverse"):
            after = int(st.get(f"loss_last_ns_{direction}", 0))
            steps = itertools.pairwise(points)
            st[f"sent_since_loss_{direction}"] = sum(max(0.0, b[1] - a[1]) for a, b in steps if a[0] >= after)
    return out


def _fold_loss(st: dict[str, float], direction: str, row: Mapping[str, Any]) -> None:
    """Add one lost counter series' increases (``counter_series`` with a split) to a path's entry."""
    st[f"lost_{direction}"] += row["increase"]
    st[f"lost_{direction}_recent"] += row["increase_second"]
    st[f"lost_{direction}_last"] = st.get(f"lost_{direction}_last", 0.0) + row["last_increase"]
    st[f"loss_rises_{direction}"] += row["rises"]
    last = f"loss_last_ns_{direction}"
    st[last] = max(st.get(last, 0), row["last_rise_ns"])
