"""Goodput in ClickHouse: the definitions of `ridethrough.dashboards.goodput`, as one parameterised query.

Inputs, all read where they lie:

* ``otel_logs``: the job source's ``job.step``, ``job.started`` and ``job.ended`` events (one log
  record each; ``LogAttributes`` carry ``job.id``, ``job.customer``, ``job.rank``, ``job.world_size``,
  ``job.step``, ``job.step.start_ns``, ``job.step.end_ns``, ``job.phase.<phase>_s``, ``job.tokens``,
  ``job.samples``, ``job.time_ns``, ``job.end.reason``; the agent's node in ``ResourceAttributes``);
* ``incidents`` (optional): an incident counts for a job when its entity is one of the job's nodes,
  something on one (``node/...``), or one of its ranks (``job/rankN``), in the same cluster;
* ``actions`` (optional; written by the actuator runner): ``migrate`` actions, matched the same way.
  Without the table, migration pause is zero.

Every value the caller gives travels as a bound parameter (``{name:Type}``); the only text
spliced into the SQL is this module's own constants.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ridethrough.dashboards.goodput import NS_PER_S, Category, JobGoodput
from ridethrough.detectors.sql import NODE
from ridethrough.exporters.store import Store, StoreError

DEFAULT_LOOKBACK_S = 7 * 86400.0
"""How far before the period events are read: a gap (or a rollback) reaching back further is not seen."""
MIGRATION_PLUGINS = ("migrate",)
"""Actuator plugins whose actions pause the job they act on."""
ACTION_COLUMNS = ("ActionId", "Cluster", "Entity", "Plugin", "Status", "DryRun", "StartedAt", "EndedAt", "Version")
"""The ``actions`` columns read (ridethrough.actuators.actions.ACTIONS)."""

_NO_WINDOWS = "SELECT '' AS cluster, '' AS entity, toInt64(0) AS a, toInt64(0) AS b WHERE 0"
# An incident or action still open lasts until the end of the last period ({hi}).
_INCIDENTS = """
    SELECT argMax(Cluster, Version) AS cluster, argMax(Entity, Version) AS entity,
           toUnixTimestamp64Nano(argMax(OpenedAt, Version)) AS a,
           if(argMax(State, Version) = 'resolved', toUnixTimestamp64Nano(argMax(ResolvedAt, Version)),
              {hi:Int64}) AS b
    FROM incidents GROUP BY IncidentId"""
# Migrations that touched the fleet: started, not a dry run; ended, or still in flight.
_ACTIONS = """
    SELECT cluster, entity, a,
           if(ended > a, ended, if(status IN ('applying', 'verifying', 'rolling_back'), {hi:Int64}, 0)) AS b
    FROM (SELECT argMax(Cluster, Version) AS cluster, argMax(Entity, Version) AS entity,
                 argMax(Plugin, Version) AS plugin, argMax(DryRun, Version) AS dry, argMax(Status, Version) AS status,
                 toUnixTimestamp64Nano(argMax(StartedAt, Version)) AS a,
                 toUnixTimestamp64Nano(argMax(EndedAt, Version)) AS ended
          FROM actions GROUP BY ActionId)
    WHERE plugin IN {migration_plugins:Array(String)} AND NOT dry AND a > 0"""

_MATERIALIZE = {"enable_materialized_cte": 1}
_OVERLAP = "arraySum(iv -> greatest(0, least(y, iv.2) - greatest(x, iv.1)), {arr})"

_QUERY = f"""
WITH
parsed AS (
    SELECT LogAttributes['event.name'] AS name, LogAttributes['job.id'] AS job,
           ResourceAttributes['ridethrough.cluster'] AS cluster, {NODE} AS node,
           toUInt32OrNull(LogAttributes['job.rank']) AS rank_n,
           toUInt32OrNull(LogAttributes['job.world_size']) AS world_n,
           toInt64OrNull(LogAttributes['job.step']) AS step_n,
           toInt64OrNull(LogAttributes['job.step.start_ns']) AS s_n,
           toInt64OrNull(LogAttributes['job.step.end_ns']) AS e_n,
           toInt64OrNull(LogAttributes['job.time_ns']) AS t_n,
           LogAttributes['job.end.reason'] AS reason,
           toFloat64OrZero(LogAttributes['job.phase.checkpoint_s']) AS ckpt_raw,
           toFloat64OrZero(LogAttributes['job.phase.wait_s']) AS wait_raw,
           toInt64OrZero(LogAttributes['job.tokens']) AS tokens,
           toInt64OrZero(LogAttributes['job.samples']) AS samples
    FROM otel_logs
    WHERE LogAttributes['job.customer'] = {{customer:String}}
      AND LogAttributes['event.name'] IN ('job.step', 'job.started', 'job.ended')
      AND ({{job:String}} = '' OR LogAttributes['job.id'] = {{job:String}})
      AND Timestamp >= fromUnixTimestamp64Nano({{lo:Int64}})
      -- the same bound on the (second-resolution) sorting and partition key: only the days and granules it
      -- reaches are read, not the whole table
      AND TimestampTime >= toDateTime(intDiv({{lo:Int64}}, 1000000000))
),
-- A CTE named more than once is computed once when the store keeps CTEs (MATERIALIZED), else once per
-- name: the events, ordered runs, jobs, ranks and actions are each named two to four times below.
ev AS {{materialized}}(  -- rows whose attributes do not parse (not from our agent) are left out
    SELECT name, job, cluster, node, reason, tokens, samples,
           assumeNotNull(rank_n) AS rank, assumeNotNull(world_n) AS world, assumeNotNull(step_n) AS step,
           assumeNotNull(s_n) AS s, assumeNotNull(e_n) AS e, assumeNotNull(t_n) AS t,
           if(isFinite(ckpt_raw) AND ckpt_raw > 0, ckpt_raw, 0) AS ckpt,
           if(isFinite(wait_raw) AND wait_raw > 0, wait_raw, 0) AS wait
    FROM parsed
    WHERE rank_n IS NOT NULL AND world_n IS NOT NULL
      AND if(name = 'job.step', step_n IS NOT NULL AND s_n IS NOT NULL AND e_n IS NOT NULL AND e_n >= s_n,
             t_n IS NOT NULL)
),
runs AS (  -- a step run stored twice (a retried insert) is one run
    SELECT job, rank, step, s, e, max(ckpt) AS ckpt, max(wait) AS wait, max(tokens) AS tokens,
           max(samples) AS samples
    FROM ev WHERE name = 'job.step' GROUP BY job, rank, step, s, e
),
ordered AS {{materialized}}(
    SELECT *, min(toNullable(step)) OVER later AS later_min, max(toNullable(e)) OVER earlier AS prev_end,
           max(toNullable(step)) OVER earlier AS prev_max
    FROM runs
    WINDOW later AS (PARTITION BY job, rank ORDER BY s, step, e ROWS BETWEEN 1 FOLLOWING AND UNBOUNDED FOLLOWING),
           earlier AS (PARTITION BY job, rank ORDER BY s, step, e ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING)
),
jobs AS {{materialized}}(
    SELECT job, max(world) AS world, min(if(name = 'job.step', s, t)) AS alloc_a,
           max(if(name = 'job.step', e, t)) AS alloc_b
    FROM ev GROUP BY job
),
ranks AS {{materialized}}(
    SELECT job, rank, maxIf(toNullable(e), name = 'job.step') AS last_e,
           groupArrayIf(t, name = 'job.started' OR (name = 'job.ended' AND reason != 'completed')) AS restarts
    FROM ev GROUP BY job, rank
),
nodes AS (SELECT DISTINCT job, cluster, node FROM ev),
inc AS ({{incidents}}),
act AS {{materialized}}({{actions}}),
win AS (
    SELECT DISTINCT n.job AS job, w.kind AS kind, w.a AS a, w.b AS b
    FROM (SELECT 'dis' AS kind, cluster, entity, a, b FROM inc
          UNION ALL SELECT 'dis' AS kind, cluster, entity, a, b FROM act
          UNION ALL SELECT 'mig' AS kind, cluster, entity, a, b FROM act) AS w
    INNER JOIN nodes AS n ON w.cluster = n.cluster
    WHERE w.b > w.a AND (w.entity = n.node OR startsWith(w.entity, concat(n.node, '/'))
                         OR startsWith(w.entity, concat(n.job, '/rank')))
),
islands AS (  -- overlapping or touching windows get one island number: merged below
    SELECT job, kind, a, b, sum(fresh) OVER (PARTITION BY job, kind ORDER BY a, b ROWS UNBOUNDED PRECEDING) AS island
    FROM (SELECT job, kind, a, b,
                 if(a > ifNull(max(toNullable(b)) OVER (PARTITION BY job, kind ORDER BY a, b
                                                        ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), a - 1),
                    1, 0) AS fresh
          FROM win)
),
merged AS (
    SELECT job, groupArrayIf((a, b), kind = 'mig') AS mig, groupArrayIf((a, b), kind = 'dis') AS dis
    FROM (SELECT job, kind, min(a) AS a, max(b) AS b FROM islands GROUP BY job, kind, island)
    GROUP BY job
),
seg AS (  -- each rank's timeline: its runs, the gap before each run, the gap after its last run
    SELECT job, rank, 1 AS is_run, ifNull(greatest(s, prev_end), s) AS a, greatest(e, a) AS b, s, e,
           toUInt8(ifNull(later_min <= step, 0)) AS rolled, toUInt8(0) AS flagged, ckpt, wait, tokens, samples
    FROM ordered
    UNION ALL
    SELECT o.job AS job, o.rank AS rank, 0 AS is_run, ifNull(o.prev_end, j.alloc_a) AS a, greatest(o.s, a) AS b,
           toInt64(0) AS s, toInt64(0) AS e, toUInt8(0) AS rolled,
           toUInt8(o.prev_end IS NULL OR ifNull(o.prev_max >= o.step, 0)) AS flagged,
           0. AS ckpt, 0. AS wait, toInt64(0) AS tokens, toInt64(0) AS samples
    FROM ordered AS o INNER JOIN jobs AS j ON o.job = j.job
    UNION ALL
    SELECT r.job AS job, r.rank AS rank, 0 AS is_run, ifNull(r.last_e, j.alloc_a) AS a, greatest(j.alloc_b, a) AS b,
           toInt64(0) AS s, toInt64(0) AS e, toUInt8(0) AS rolled, toUInt8(r.last_e IS NULL) AS flagged,
           0. AS ckpt, 0. AS wait, toInt64(0) AS tokens, toInt64(0) AS samples
    FROM ranks AS r INNER JOIN jobs AS j ON r.job = j.job
),
joined AS (
    SELECT seg.job AS job, seg.is_run AS is_run, seg.a AS a, seg.b AS b, seg.s AS s, seg.e AS e,
           seg.rolled AS rolled, seg.flagged AS flagged, seg.ckpt AS ckpt, seg.wait AS wait, seg.tokens AS tokens,
           seg.samples AS samples, m.mig AS mig, m.dis AS dis, r.restarts AS restarts
    FROM seg LEFT JOIN merged AS m ON seg.job = m.job
    LEFT JOIN ranks AS r ON seg.job = r.job AND seg.rank = r.rank
),
pieces AS (
    SELECT job, bk.1 AS p0, bk.2 AS p1, greatest(a, p0) AS x, least(b, p1) AS y, greatest(y - x, 0) AS len,
           {_OVERLAP.format(arr="mig")} AS in_mig, {_OVERLAP.format(arr="dis")} AS in_dis,
           if(e > s, len / (e - s), 0.) AS share, toFloat64(len - in_mig) AS rest,
           least(ckpt * 1e9 * share, rest) AS ck, least(greatest(wait * 1e9 * share - in_mig, 0.), rest - ck) AS wt,
           is_run AND b >= p0 AND b < p1 AS ends_here,
           if(is_run AND rolled, 0, in_mig) AS mig_ns,
           if(is_run AND rolled, len, 0) AS recomp_ns,
           if(is_run AND NOT rolled, ck, 0.) AS ckpt_ns,
           if(is_run AND NOT rolled, wt, 0.) AS wait_ns,
           if(is_run AND NOT rolled, rest - ck - wt, 0.) AS prod_ns,
           flagged OR arrayExists(t -> t >= a AND t <= b, restarts) AS restart_gap,
           if(is_run, 0, if(restart_gap, len - in_mig, in_dis - in_mig)) AS restart_ns,
           if(ends_here AND NOT rolled, tokens, 0) AS tok, if(ends_here AND NOT rolled, samples, 0) AS smp,
           ends_here AND NOT rolled AS kept_step, ends_here AND rolled AS rolled_step
    FROM joined
    ARRAY JOIN arrayFilter(bk -> bk.1 <= b AND a < bk.2, {{buckets:Array(Tuple(Int64, Int64))}}) AS bk
),
totals AS (
    SELECT job, p0, p1, sum(recomp_ns) AS recomp, sum(mig_ns) AS mig, sum(ckpt_ns) AS ckpt, sum(wait_ns) AS wait,
           sum(prod_ns) AS prod, sum(restart_ns) AS restart, sum(tok) AS tokens, sum(smp) AS samples,
           sum(kept_step) AS steps, sum(rolled_step) AS rolled
    FROM pieces GROUP BY job, p0, p1
),
alloc AS (
    SELECT job, world, bk.1 AS p0, bk.2 AS p1,
           world * greatest(0, least(alloc_b, p1) - greatest(alloc_a, p0)) AS allocated
    FROM jobs ARRAY JOIN {{buckets:Array(Tuple(Int64, Int64))}} AS bk
)
SELECT al.job AS job, al.world AS world, al.p0 AS p0, al.p1 AS p1, al.allocated AS allocated,
       t.recomp AS recomp, t.mig AS mig, t.ckpt AS ckpt, t.wait AS wait, t.prod AS prod, t.restart AS restart,
       t.tokens AS tokens, t.samples AS samples, t.steps AS steps, t.rolled AS rolled
FROM alloc AS al LEFT JOIN totals AS t ON t.job = al.job AND t.p0 = al.p0 AND t.p1 = al.p1
WHERE al.allocated > 0
ORDER BY p0, job
"""


class GoodputError(Exception):
    """The goodput query cannot run as asked (bad period, a domain table of an unexpected shape)."""


@dataclass(frozen=True, slots=True)
class Period:
    """``[start_ns, end_ns)``, non-empty."""

    start_ns: int
    end_ns: int

    def __post_init__(self) -> None:
        if self.end_ns <= self.start_ns:
            raise GoodputError(f"the period is empty: from {self.start_ns} ns is not before to {self.end_ns} ns")


def buckets(period: Period, count: int) -> list[Period]:
    """``period`` cut into ``count`` equal pieces (the last takes the remainder)."""
    if count < 1:
        raise GoodputError(f"bucket count must be at least 1, got {count}")
    width = max(1, (period.end_ns - period.start_ns) // count)
    edges = [period.start_ns + i * width for i in range(count)] + [period.end_ns]
    return [Period(a, b) for a, b in itertools.pairwise(edges) if b > a]


def _table_exists(store: Store, name: str) -> bool:
    _, rows = store.query("EXISTS TABLE {name:Identifier}", parameters={"name": name})
    return bool(rows and rows[0][0])


def _actions_source(store: Store) -> str:
    if not _table_exists(store, "actions"):
        return _NO_WINDOWS
    _, rows = store.query("SELECT name FROM system.columns WHERE database = currentDatabase() AND table = 'actions'")
    missing = sorted(set(ACTION_COLUMNS) - {r[0] for r in rows})
    if missing:
        raise GoodputError(f"table 'actions' lacks the column(s) {', '.join(missing)} that migration pauses are "
                           f"read from (expected {', '.join(ACTION_COLUMNS)})")
    return _ACTIONS


def materialized_cte(store: Store) -> bool:
    """Whether the store computes ``WITH x AS MATERIALIZED (...)`` once per query (ClickHouse 25.x and
    later, ``enable_materialized_cte``; a read-only user may not be allowed the setting)."""
    try:
        store.query("WITH x AS MATERIALIZED (SELECT 1 AS one) SELECT one FROM x", settings=_MATERIALIZE)
    except StoreError:
        return False
    return True


def job_goodput(store: Store, *, customer: str, periods: Sequence[Period], job: str = "",
                lookback_s: float = DEFAULT_LOOKBACK_S, materialize: bool | None = None) -> list[JobGoodput]:
    """One `JobGoodput` per (period, job of ``customer`` allocated in it), ordered by period then job.

    ``job`` restricts the report to one job. The events are read once when the store can keep a
    CTE (``materialize``; None asks it), else once per use: the same answer, about twice as slow.
    Raises `GoodputError` for no periods or a negative look-back, and the store's
    `StoreError`/`StoreUnavailable` as they come.
    """
    if not periods:
        raise GoodputError("at least one period is needed")
    if lookback_s < 0:
        raise GoodputError(f"lookback_s must not be negative, got {lookback_s}")
    lo = max(0, min(p.start_ns for p in periods) - round(lookback_s * NS_PER_S))
    incidents = _INCIDENTS if _table_exists(store, "incidents") else _NO_WINDOWS
    # Only this module's constants are spliced in; every caller value is a bound parameter.
    if materialize is None:
        materialize = materialized_cte(store)
    sql = (_QUERY.replace("{incidents}", incidents).replace("{actions}", _actions_source(store))
           .replace("{materialized}", "MATERIALIZED " if materialize else ""))
    names, rows = store.query(sql, settings=_MATERIALIZE if materialize else None, parameters={
        "customer": customer, "job": job, "lo": lo, "hi": max(p.end_ns for p in periods),
        "buckets": [(p.start_ns, p.end_ns) for p in periods],
        "migration_plugins": list(MIGRATION_PLUGINS)})
    return [_row(customer, dict(zip(names, row, strict=True))) for row in rows]


def _row(customer: str, r: dict[str, Any]) -> JobGoodput:
    seconds = {Category.RECOMPUTATION: r["recomp"], Category.MIGRATION: r["mig"], Category.CHECKPOINT: r["ckpt"],
               Category.WAIT: r["wait"], Category.PRODUCTIVE: r["prod"], Category.RESTART: r["restart"]}
    out = {c: float(v or 0) / NS_PER_S for c, v in seconds.items()}
    allocated_s = float(r["allocated"]) / NS_PER_S
    out[Category.IDLE] = max(0.0, allocated_s - sum(out.values()))
    return JobGoodput(customer, r["job"], int(r["world"]), int(r["p0"]), int(r["p1"]), allocated_s, out,
                      int(r["tokens"] or 0), int(r["samples"] or 0), int(r["steps"] or 0), int(r["rolled"] or 0))
