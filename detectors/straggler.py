"""Straggler detector: a rank that is slower than its job's other ranks.

In a synchronous job every rank waits for the slowest in each collective, so step times are
alike and the straggler shows in how the step splits: it *computes* longer and waits less.
Where ranks report phases, the detector compares compute seconds per step (the second half
of the window, from the reset-proof counter increases); it also compares whole step times,
which tell an unsynchronised job's slow rank.
"""

from __future__ import annotations

import statistics
from typing import Any

from ridethrough.detectors import sql
from ridethrough.detectors.contract import Detector, EntityType, Finding, FindingKind, Severity, Window

_RANK_MEDIANS = f"""
    SELECT job, rank, node, host, med, steps, last_ns,
           median(med) OVER (PARTITION BY job) AS job_med,
           count() OVER (PARTITION BY job) AS ranks
    FROM (
        SELECT Attributes['job.id'] AS job, Attributes['job.rank'] AS rank,
               any({sql.NODE}) AS node, any({sql.HOST}) AS host,
               median(Value) AS med, uniqExact({sql.T_NS}) AS steps, max({sql.T_NS}) AS last_ns
        FROM (SELECT DISTINCT * FROM otel_metrics_gauge
              WHERE MetricName = 'ridethrough.job.step.duration' AND {sql.IN_WINDOW} AND {sql.CLUSTER})
        GROUP BY job, rank
        HAVING steps >= {{min_steps:UInt64}}
    )
"""
"""Query ``rank_step_medians``: per rank, the median step duration (duplicate rows removed,
ranks with too few samples left out), beside its job's median of rank medians."""


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
                    "last_ns": max(r["last_ns"], s["last_ns"])})
    return out


class Straggler:
    """A rank, in a job of at least ``min_ranks`` ranks, that is ``factor`` times slower than its job's median
    rank and at least an absolute margin slower, by one of two measures:

    * compute seconds per step (``job.phase.time{phase=compute}`` over ``job.steps``, the window's second half,
      at least ``min_steps`` steps; margin ``min_compute_excess_s``);
    * the median of ``step.duration`` points (at least ``min_steps``, one per collection, so a long step is
      counted once per collection it spans; margin ``min_excess_s``)."""

    name = "straggler"

    def __init__(self, *, interval_s: float = 10.0, window_s: float = 120.0, factor: float = 1.5,
                 min_excess_s: float = 0.05, min_steps: int = 5, min_ranks: int = 2,
                 min_compute_excess_s: float = 0.003) -> None:
        self.min_compute_excess_s = min_compute_excess_s
        self.interval_s = interval_s
        self.window_s = window_s
        self.factor = factor
        self.min_excess_s = min_excess_s
        self.min_steps = min_steps
        self.min_ranks = min_ranks

    def detect(self, window: Window) -> list[Finding]:
        """One finding per straggling rank (by compute time per step, else by step time)."""
        found: dict[str, Finding] = {}
        by_job: dict[str, list[dict[str, Any]]] = {}
        for r in _compute_per_step(window):
            by_job.setdefault(r["job"], []).append(r)
        for ranks in by_job.values():
            job_med = statistics.median(r["value"] for r in ranks)
            for r in ranks:
                if (len(ranks) >= self.min_ranks and r["steps"] >= self.min_steps
                        and r["value"] > self.factor * job_med and r["value"] - job_med >= self.min_compute_excess_s):
                    f = self._finding(r, window, "rank_compute_per_step", "compute per step", job_med, len(ranks))
                    found[f.entity] = f
        for r in sql.run(window, _RANK_MEDIANS, sql.params(window, min_steps=self.min_steps)):
            if (r["ranks"] >= self.min_ranks and r["med"] > self.factor * r["job_med"]
                    and r["med"] - r["job_med"] >= self.min_excess_s):
                f = self._finding({**r, "value": r["med"]}, window, "rank_step_medians", "median step", r["job_med"],
                                  r["ranks"])
                found.setdefault(f.entity, f)
        return list(found.values())

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
                      min_compute_excess_s=getattr(cfg, "straggler_min_compute_excess_s", 0.003))]
