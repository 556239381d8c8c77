"""Straggler detector: a rank whose steps take much longer than its job's other ranks."""

from __future__ import annotations

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


class Straggler:
    """A rank whose median step time exceeds its job's median of rank medians by ``factor``
    and by at least ``min_excess_s``, over at least ``min_steps`` samples, in a job of at
    least ``min_ranks`` ranks. Samples are the ``step.duration`` gauge's points (one per
    collection, so a long step is counted once per collection it spans)."""

    name = "straggler"

    def __init__(self, *, interval_s: float = 10.0, window_s: float = 120.0, factor: float = 1.5,
                 min_excess_s: float = 0.05, min_steps: int = 5, min_ranks: int = 2) -> None:
        self.interval_s = interval_s
        self.window_s = window_s
        self.factor = factor
        self.min_excess_s = min_excess_s
        self.min_steps = min_steps
        self.min_ranks = min_ranks

    def detect(self, window: Window) -> list[Finding]:
        """One finding per straggling rank."""
        rows = sql.run(window, _RANK_MEDIANS, sql.params(window, min_steps=self.min_steps))
        return [
            Finding(
                detector=self.name, kind=FindingKind.STRAGGLER, entity_type=EntityType.RANK,
                entity=f"{r['job']}/rank{r['rank']}", severity=Severity.WARNING, confidence=0.7,
                summary=f"job {r['job']} rank {r['rank']} on {r['node']}: median step {r['med']:.3g} s, "
                        f"job median {r['job_med']:.3g} s",
                observed_at_ns=int(r["last_ns"]), cluster=window.cluster,
                evidence={"query": "rank_step_medians", "node": r["node"], "host": r["host"],
                          "rank_median_s": r["med"], "job_median_s": r["job_med"], "steps": r["steps"],
                          "ranks": r["ranks"]},
            )
            for r in rows
            if r["ranks"] >= self.min_ranks and r["med"] > self.factor * r["job_med"]
            and r["med"] - r["job_med"] >= self.min_excess_s
        ]


def build(cfg: object) -> list[Detector]:
    """The straggler detector, thresholds from ``cfg`` where it has them."""
    return [Straggler(interval_s=getattr(cfg, "straggler_interval_s", 10.0),
                      window_s=getattr(cfg, "straggler_window_s", 120.0),
                      factor=getattr(cfg, "straggler_factor", 1.5),
                      min_excess_s=getattr(cfg, "straggler_min_excess_s", 0.05),
                      min_steps=getattr(cfg, "straggler_min_steps", 5),
                      min_ranks=getattr(cfg, "straggler_min_ranks", 2))]
