"""Straggler detector: a rank that is slower than its job's other ranks.

In a synchronous job every rank waits for the slowest in each collective, so step times are
alike and the straggler shows in how the step splits: it *computes* longer and waits less.
Where ranks report phases, the detector compares compute seconds per step (the second half
of the window, from the reset-proof counter increases); it also compares whole step times,
which tell an unsynchronised job's slow rank.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any

from ridethrough.detectors import sql
from ridethrough.detectors.contract import Detector, EntityType, Finding, FindingKind, Severity, Window

_RANK_MEDIANS = f"""
    SELECT *, median(abs(med - job_med)) OVER (PARTITION BY job) AS job_mad
    FROM (
    SELECT job, rank, node, host, med, steps, last_ns,
           median(med) OVER (PARTITION BY job) AS job_med,
           count() OVER (PARTITION BY job) AS ranks
    FROM (
        SELECT job, rank, node, any(host) AS host, groupUniqArray((step, dur)) AS pts,
               arrayReduce('median', arrayMap(p -> p.2, pts)) AS med, length(pts) AS steps, max(t) AS last_ns
        FROM (
            SELECT Attributes['job.id'] AS job, Attributes['job.rank'] AS rank, {sql.NODE} AS node,
                   any({sql.HOST}) AS host, {sql.T_NS} AS t,
                   anyIf(Value, MetricName = 'ridethrough.job.step.duration') AS dur,
                   if(countIf(MetricName = 'ridethrough.job.step.last') > 0,
                      anyIf(Value, MetricName = 'ridethrough.job.step.last'), -toFloat64(t)) AS step
            FROM otel_metrics_gauge
            WHERE MetricName IN ('ridethrough.job.step.duration', 'ridethrough.job.step.last')
              AND {sql.IN_WINDOW} AND {sql.CLUSTER}
            GROUP BY job, rank, node, t
            HAVING countIf(MetricName = 'ridethrough.job.step.duration') > 0
        )
        GROUP BY job, rank, node
        HAVING steps >= {{min_steps:UInt64}}
    ))
"""
"""Query ``rank_step_medians``: per rank (on its node), the median duration of its distinct steps in the
window, beside its job's median of rank medians and their median absolute deviation. The agent
re-reports a rank's last step at every collection until it forgets the rank, so points are told
apart by ``step.last`` (the step number; the time where it is missing): a rank that stopped
stepping, or is gone, has one step and is left out with the ranks that have too few, and a
duplicated row or a re-reported step counts once."""


def _compute_per_step(window: Window) -> list[dict[str, Any]]:
    """Per rank: compute seconds per step over the second half of the window (query ``rank_compute_per_step``)."""
    keys = ("job.id", "job.rank")
    compute = sql.counter_series(window, "ridethrough.job.phase.time", keys, match={"job.phase": ["compute"]})
    steps = {(r["node"], r["job.id"], r["job.rank"]): r for r in sql.counter_series(window, "ridethrough.job.steps",
                                                                                     keys)}
    out = []
    for r in compute:
        s = steps.get((r["node"], r["job.id"], r["job.rank"]))
        if s is None or s["increase_second"] <= 0:
            continue  # no finished steps in the recent half: nothing to compare (a hang is not a straggler)
        out.append({"job": r["job.id"], "rank": r["job.rank"], "node": r["node"], "host": r["host"],
                    "value": r["increase_second"] / s["increase_second"], "steps": s["increase_second"],
                    "last_ns": max(r["last_ns"], s["last_ns"]), "last_step_ns": int(s["last_rise_ns"])})
    return out


def robust_z(value: float, median: float, mad: float) -> float:
    """How far ``value`` stands above ``median``, in robust standard deviations (1.4826 times the median
    absolute deviation ``mad``); infinite where the values do not deviate at all (and ``value`` is above)."""
    if mad == 0:
        return math.inf if value > median else 0.0
    return (value - median) / (1.4826 * mad)


class Straggler:
    """A rank, in a job of at least ``min_ranks`` ranks, that is ``factor`` times slower than its job's median
    rank and at least an absolute margin slower, by one of two measures:

    * compute seconds per step (``job.phase.time{phase=compute}`` over ``job.steps``, the window's second half,
      at least ``min_steps`` steps, in a job whose ranks' step counts agree within ``max_step_spread`` and
      that finished a step within ``stale_s`` of the window's end; margin ``min_compute_excess_s``);
    * for a rank that reports no compute phase, the median duration of the distinct steps it
      reported (at least ``min_steps``; margin ``min_excess_s``).

    By either measure the rank must also stand out from its job's spread: a robust z-score (distance from
    the job's median over 1.4826 times the median absolute deviation) of at least ``min_z`` (3.5, the
    Iglewicz-Hoaglin outlier bound). Many ranks sharing few cores compute at times that scatter widely
    (in the lab, 32 ranks on 2 cores: 7 to 272 ms per step within ten seconds, median near 100), and one of
    them is always 1.5 times the median somewhere; a rank slowed by a fault stands far outside that scatter.
    Where the others agree exactly (no deviation), the factor and margin decide alone.

    A rank is reported once it stood out in ``min_runs`` consecutive runs (2: over one more
    interval of steps), not on one window's evidence. Seen in the lab: a 32-rank job on 2 cores
    eight steps after it started, queried while the newest seconds of its ranks' counters were
    still arriving, showed rank 3 at 1.8 times the median compute and a z-score over 3.5; on the
    same window once every row had landed the z-score was 3.3, and ten seconds later 1.9. A
    slowed rank stands out run after run (the lab's 3 % CPU cap: z from 22 to 109 in 13 runs)."""

    name = "straggler"

    def __init__(self, *, interval_s: float = 10.0, window_s: float = 120.0, factor: float = 1.5,
                 min_excess_s: float = 0.05, min_steps: int = 5, min_ranks: int = 2,
                 min_compute_excess_s: float = 0.003, max_step_spread: float = 0.25, stale_s: float = 20.0,
                 min_z: float = 3.5, min_runs: int = 2) -> None:
        self.min_z = min_z
        self.min_runs = min_runs
        self._suspects: dict[str, tuple[int, dict[str, int]]] = {}
        """Per cluster: the end of the last window judged, and entity → consecutive runs it stood out in."""
        self.min_compute_excess_s = min_compute_excess_s
        self.stale_s = stale_s
        self.max_step_spread = max_step_spread
        self.interval_s = interval_s
        self.window_s = window_s
        self.factor = factor
        self.min_excess_s = min_excess_s
        self.min_steps = min_steps
        self.min_ranks = min_ranks

    def detect(self, window: Window) -> list[Finding]:
        """One finding per rank that straggled in this run and the ``min_runs`` - 1 before it."""
        prev_end, prev = self._suspects.get(window.cluster, (0, {}))
        follows = window.end_ns > prev_end  # a window at or before the last one starts the count again
        out = []
        counts: dict[str, int] = {}
        for f in self._judge(window):
            counts[f.entity] = (prev.get(f.entity, 0) if follows else 0) + 1
            if counts[f.entity] >= self.min_runs:
                out.append(dataclasses.replace(f, evidence={**f.evidence, "runs": counts[f.entity]}))
        self._suspects[window.cluster] = (window.end_ns, counts)
        return out

    def _judge(self, window: Window) -> list[Finding]:
        """The ranks that straggle in this window alone (by compute time per step, else by step time)."""
        found: dict[str, Finding] = {}
        by_job: dict[str, list[dict[str, Any]]] = {}
        for r in _compute_per_step(window):
            by_job.setdefault(r["job"], []).append(r)
        for ranks in by_job.values():
            if not self._in_step(ranks) or not self._stepping(ranks, window):
                continue
            values = [r["value"] for r in ranks]
            job_med = statistics.median(values)
            mad = statistics.median(abs(v - job_med) for v in values)
            for r in ranks:
                if (len(ranks) >= self.min_ranks and r["steps"] >= self.min_steps
                        and r["value"] > self.factor * job_med and r["value"] - job_med >= self.min_compute_excess_s
                        and robust_z(r["value"], job_med, mad) >= self.min_z):
                    f = self._finding(r, window, "rank_compute_per_step", "compute per step", job_med, len(ranks))
                    found[f.entity] = f
        # A rank that reports its compute phase is judged by it: in a lockstep job every rank's step time is
        # the slowest rank's, so there it shows only noise; step time is the measure for the other ranks.
        phased = {(r["job"], r["rank"]) for ranks in by_job.values() for r in ranks}
        for r in sql.run(window, _RANK_MEDIANS, sql.params(window, min_steps=self.min_steps)):
            if (r["job"], r["rank"]) in phased:
                continue
            if (r["ranks"] >= self.min_ranks and r["med"] > self.factor * r["job_med"]
                    and r["med"] - r["job_med"] >= self.min_excess_s
                    and robust_z(r["med"], r["job_med"], r["job_mad"]) >= self.min_z):
                f = self._finding({**r, "value": r["med"]}, window, "rank_step_medians", "median step", r["job_med"],
                                  r["ranks"])
                found.setdefault(f.entity, f)
        return list(found.values())

    def _in_step(self, ranks: list[dict[str, Any]]) -> bool:
        """Whether a job's ranks finished about as many steps as each other in the recent half.

        In a lockstep job they do (each waits for the others), so counts that disagree by more
        than ``max_step_spread`` of their median mean the window is not comparable: ranks still
        joining or restarting, or a rank whose reports lag; judging compute per step then would
        blame whoever happened to start first."""
        counts = [r["steps"] for r in ranks]
        mid = statistics.median(counts)
        return bool(mid > 0 and (max(counts) - min(counts)) <= self.max_step_spread * mid)

    def _stepping(self, ranks: list[dict[str, Any]], window: Window) -> bool:
        """Whether a job still finished a step within ``stale_s`` of the window's end.

        A job that stopped (finished, killed, hung) has no straggler now, and the recent half of its
        window ends in its shutdown: a rank that was computing when it stopped counts that compute
        against no finished step and looks slow (seen in the lab: a rank flagged 46 s after its job ended)."""
        return bool(max(r["last_step_ns"] for r in ranks) >= window.end_ns - self.stale_s * 1e9)

    def _finding(self, r: dict[str, Any], window: Window, query: str, what: str, job_value: float,
                 ranks: int) -> Finding:
        return Finding(
            detector=self.name, kind=FindingKind.STRAGGLER, entity_type=EntityType.RANK,
            entity=f"{r['job']}/rank{r['rank']}", severity=Severity.WARNING, confidence=0.7,
            summary=f"job {r['job']} rank {r['rank']} on {r['node']}: {what} {r['value']:.3g} s, "
                    f"job median {job_value:.3g} s",
            observed_at_ns=int(r["last_ns"]), cluster=window.cluster,
            evidence={"query": query, "node": r["node"], "host": r["host"], "rank_s": r["value"],
                      "job_median_s": job_value, "steps": r["steps"], "ranks": ranks},
        )


def build(cfg: object) -> list[Detector]:
    """The straggler detector, thresholds from ``cfg`` where it has them."""
    return [Straggler(interval_s=getattr(cfg, "straggler_interval_s", 10.0),
                      window_s=getattr(cfg, "straggler_window_s", 120.0),
                      factor=getattr(cfg, "straggler_factor", 1.5),
                      min_excess_s=getattr(cfg, "straggler_min_excess_s", 0.05),
                      min_steps=getattr(cfg, "straggler_min_steps", 5),
                      min_ranks=getattr(cfg, "straggler_min_ranks", 2),
                      min_compute_excess_s=getattr(cfg, "straggler_min_compute_excess_s", 0.003),
                      max_step_spread=getattr(cfg, "straggler_max_step_spread", 0.25),
                      stale_s=getattr(cfg, "straggler_stale_s", 20.0),
                      min_z=getattr(cfg, "straggler_min_z", 3.5),
                      min_runs=getattr(cfg, "straggler_min_runs", 2))]
