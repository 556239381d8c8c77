"""Goodput: where a job's allocated GPU-seconds went, one category per second (docs/goodput.md).

This module holds the definitions and a pure-Python reference of them: `account` takes one job's
step runs, lifecycle events and disruption windows and splits its allocated GPU-seconds in a
period into `Category`. `ridethrough.dashboards.goodput_sql` computes the same numbers in
ClickHouse; tests hold the two to each other on hand-built event sets with known answers.

A rank is one GPU. Every second of every rank's allocation lands in exactly one category; when
several apply, the first in `Category`'s order wins (its precedence)::

    recomputation > migration_pause > checkpoint_stall > straggler_wait > productive > restart > idle
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

NS_PER_S = 1_000_000_000
Interval = tuple[int, int]
"""``[start_ns, end_ns)``."""


class Category(enum.Enum):
    """Where a GPU-second went, in precedence order (the first that applies wins)."""

    RECOMPUTATION = "recomputation"
    """Inside a step run that a later run of the same or an earlier step rolled back."""
    MIGRATION = "migration_pause"
    """Inside a migration action's window on the job (every rank waits for the migrating one)."""
    CHECKPOINT = "checkpoint_stall"
    """A kept step's reported ``checkpoint_s``."""
    WAIT = "straggler_wait"
    """A kept step's reported ``wait_s`` (peers, data, network), less its migration seconds."""
    PRODUCTIVE = "productive"
    """The rest of a kept step."""
    RESTART = "restart"
    """Between steps: start-up, a restart (lifecycle or rollback), or while an incident on the job was open."""
    IDLE = "idle"
    """The rest of the allocation: gaps with no restart or incident, ranks that never reported."""


BADPUT = tuple(c for c in Category if c is not Category.PRODUCTIVE)
"""The categories that are not productive, in precedence order."""


@dataclass(frozen=True, slots=True)
class StepRun:
    """One report of one finished step on one rank (a step reported twice is two runs)."""

    rank: int
    step: int
    start_ns: int
    end_ns: int
    checkpoint_s: float = 0.0
    wait_s: float = 0.0
    tokens: int = 0
    samples: int = 0


@dataclass(frozen=True, slots=True)
class RankEvent:
    """A rank started (``kind="start"``) or ended (``kind="end"``, with the sender's ``reason``)."""

    rank: int
    kind: str
    time_ns: int
    reason: str = ""

    @property
    def restart(self) -> bool:
        """True when it marks a (re)start: any start, or an end that was not ``completed``."""
        return self.kind == "start" or (self.kind == "end" and self.reason != "completed")


@dataclass(frozen=True, slots=True)
class JobRecord:
    """Everything known about one job: the input of `account`."""

    customer: str
    job: str
    world_size: int
    runs: Sequence[StepRun] = ()
    events: Sequence[RankEvent] = ()
    incidents: Sequence[Interval] = ()
    """Windows of incidents on the job's nodes or ranks (they may overlap)."""
    migrations: Sequence[Interval] = ()
    """Windows of migration actions on the job (they may overlap)."""


@dataclass(frozen=True, slots=True)
class JobGoodput:
    """One job's (or a total's) GPU-seconds in ``[start_ns, end_ns)``, by category."""

    customer: str
    job: str
    world_size: int
    start_ns: int
    end_ns: int
    allocated_s: float
    seconds: Mapping[Category, float] = field(default_factory=dict)
    tokens: int = 0
    """Tokens of kept steps that end in the period."""
    samples: int = 0
    steps: int = 0
    """Kept step runs that end in the period."""
    steps_rolled_back: int = 0
    """Rolled-back step runs that end in the period."""

    @property
    def productive_s(self) -> float:
        """Productive GPU-seconds."""
        return self.seconds.get(Category.PRODUCTIVE, 0.0)

    @property
    def badput_s(self) -> float:
        """Allocated GPU-seconds that were not productive."""
        return sum(self.seconds.get(c, 0.0) for c in BADPUT)

    @property
    def goodput(self) -> float:
        """Productive over allocated GPU-seconds (0 when nothing was allocated)."""
        return self.productive_s / self.allocated_s if self.allocated_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Flat, JSON-ready: identity, seconds per category (``<category>_s``), ratios and counts."""
        out: dict[str, Any] = {"customer": self.customer, "job": self.job, "world_size": self.world_size,
                               "start_ns": self.start_ns, "end_ns": self.end_ns, "allocated_s": self.allocated_s}
        out.update({f"{c.value}_s": self.seconds.get(c, 0.0) for c in Category})
        out.update({"badput_s": self.badput_s, "goodput": self.goodput, "tokens": self.tokens,
                    "samples": self.samples, "steps": self.steps, "steps_rolled_back": self.steps_rolled_back})
        return out


def total(rows: Iterable[JobGoodput], *, customer: str, job: str = "*", start_ns: int, end_ns: int) -> JobGoodput:
    """The sum of several jobs' (or buckets') goodput, labelled ``job``."""
    rows = list(rows)
    seconds = {c: sum(r.seconds.get(c, 0.0) for r in rows) for c in Category}
    return JobGoodput(customer, job, sum(r.world_size for r in rows), start_ns, end_ns,
                      sum(r.allocated_s for r in rows), seconds, sum(r.tokens for r in rows),
                      sum(r.samples for r in rows), sum(r.steps for r in rows),
                      sum(r.steps_rolled_back for r in rows))


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Overlapping or touching intervals merged; empty ones dropped; sorted."""
    out: list[Interval] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def overlap(x: int, y: int, merged: Sequence[Interval]) -> int:
    """Nanoseconds of ``[x, y)`` covered by ``merged`` (disjoint intervals, as `merge` returns)."""
    return sum(max(0, min(y, b) - max(x, a)) for a, b in merged)


def allocation(job: JobRecord) -> Interval | None:
    """The job's allocation: its first start or step start to its last end or step end."""
    starts = [r.start_ns for r in job.runs] + [e.time_ns for e in job.events]
    ends = [r.end_ns for r in job.runs] + [e.time_ns for e in job.events]
    return (min(starts), max(ends)) if starts else None


@dataclass(slots=True)
class _Tally:
    seconds: dict[Category, float] = field(default_factory=lambda: dict.fromkeys(Category, 0.0))
    tokens: int = 0
    samples: int = 0
    steps: int = 0
    rolled: int = 0

    def add(self, category: Category, ns: float) -> None:
        self.seconds[category] += ns / NS_PER_S


def account(job: JobRecord, start_ns: int, end_ns: int) -> JobGoodput:
    """Split ``job``'s allocated GPU-seconds in ``[start_ns, end_ns)`` into categories (the reference)."""
    if end_ns <= start_ns:
        raise ValueError(f"the period must not be empty: start {start_ns} >= end {end_ns}")
    span = allocation(job)
    tally = _Tally()
    allocated_ns = 0
    if span is not None:
        allocated_ns = job.world_size * max(0, min(span[1], end_ns) - max(span[0], start_ns))
        mig = merge(job.migrations)
        disrupted = merge([*job.incidents, *job.migrations])
        for rank in sorted({r.rank for r in job.runs} | {e.rank for e in job.events}):
            _rank(job, rank, span, (start_ns, end_ns), mig, disrupted, tally)
    accounted = sum(tally.seconds.values())
    tally.seconds[Category.IDLE] += max(0.0, allocated_ns / NS_PER_S - accounted)
    return JobGoodput(job.customer, job.job, job.world_size, start_ns, end_ns, allocated_ns / NS_PER_S,
                      tally.seconds, tally.tokens, tally.samples, tally.steps, tally.rolled)


def _rank(job: JobRecord, rank: int, span: Interval, period: Interval, mig: list[Interval],
          disrupted: list[Interval], tally: _Tally) -> None:
    # The same step run stored twice (a retried insert) is one run.
    runs = sorted({r for r in job.runs if r.rank == rank and r.end_ns >= r.start_ns},
                  key=lambda r: (r.start_ns, r.step, r.end_ns))
    restarts = [e.time_ns for e in job.events if e.rank == rank and e.restart]
    later_min: list[int | None] = [None] * len(runs)  # the lowest step reported after each run
    lowest: int | None = None
    for i in range(len(runs) - 1, -1, -1):
        later_min[i] = lowest
        lowest = runs[i].step if lowest is None else min(lowest, runs[i].step)
    prev_end: int | None = None
    prev_max_step: int | None = None
    for i, run in enumerate(runs):
        gap_a = span[0] if prev_end is None else prev_end
        gap_b = max(run.start_ns, gap_a)
        rollback = prev_max_step is not None and prev_max_step >= run.step
        _gap(gap_a, gap_b, prev_end is None or rollback, restarts, period, mig, disrupted, tally)
        a = run.start_ns if prev_end is None else max(run.start_ns, prev_end)
        rolled = (low := later_min[i]) is not None and low <= run.step
        _run(run, a, max(run.end_ns, a), rolled, period, mig, tally)
        prev_end = run.end_ns if prev_end is None else max(prev_end, run.end_ns)
        prev_max_step = run.step if prev_max_step is None else max(prev_max_step, run.step)
    last = span[0] if prev_end is None else prev_end
    _gap(last, max(span[1], last), prev_end is None, restarts, period, mig, disrupted, tally)


def _gap(a: int, b: int, restart: bool, restarts: Sequence[int], period: Interval, mig: list[Interval],
         disrupted: list[Interval], tally: _Tally) -> None:
    x, y = max(a, period[0]), min(b, period[1])
    if y <= x:
        return
    in_mig = overlap(x, y, mig)
    tally.add(Category.MIGRATION, in_mig)
    if restart or any(a <= t <= b for t in restarts):
        tally.add(Category.RESTART, (y - x) - in_mig)
    else:  # disrupted covers every migration window, so this is the incident time outside migrations
        tally.add(Category.RESTART, overlap(x, y, disrupted) - in_mig)


def _run(run: StepRun, a: int, b: int, rolled: bool, period: Interval, mig: list[Interval], tally: _Tally) -> None:
    x, y = max(a, period[0]), min(b, period[1])
    length = max(0, y - x)
    if period[0] <= b < period[1]:
        if rolled:
            tally.rolled += 1
        else:
            tally.steps += 1
            tally.tokens += run.tokens
            tally.samples += run.samples
    if rolled:
        tally.add(Category.RECOMPUTATION, length)
        return
    # Phases are amounts, not intervals: the part of the step counted here carries its share.
    share = length / (run.end_ns - run.start_ns) if run.end_ns > run.start_ns else 0.0
    in_mig = overlap(x, y, mig) if length else 0
    rest = length - in_mig
    ckpt = min(run.checkpoint_s * NS_PER_S * share, rest)
    # A rank stalled by a migration reports the stall as waiting: take it out of wait first.
    wait = min(max(run.wait_s * NS_PER_S * share - in_mig, 0.0), rest - ckpt)
    tally.add(Category.MIGRATION, in_mig)
    tally.add(Category.CHECKPOINT, ckpt)
    tally.add(Category.WAIT, wait)
    tally.add(Category.PRODUCTIVE, rest - ckpt - wait)
