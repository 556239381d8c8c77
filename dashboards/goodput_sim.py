"""What-if goodput: a discrete-event model of one large synchronous training run under failures.

Failures arrive as independent Poisson processes, one per row of a rate table (by default the
Llama 3 405B interruption table shipped as package data: 16,384 GPUs, 54 days, 419 unexpected
interruptions). Rates are per GPU-day, so a run of another size or length scales them. Each
replication draws one failure history; every policy replays the *same* history (common random
numbers), so their difference is measured more tightly than either alone.

A policy says, per failure, how long the job stops (``pause_s``) and whether the work since the
last checkpoint or snapshot is lost. Between failures the job computes in cycles of
``interval_s`` of compute then ``stall_s`` of checkpointing. Work is *committed* when a cycle's
stall ends; a losing failure throws away what is not (recomputation); a non-losing pause keeps it.
A failure during a pause starts the recovery again. The window is fixed (``days``): goodput loss is
the share of it not spent on committed compute, the same for every GPU of a synchronous job.
See docs/goodput.md for the policies' default costs and where they come from.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

Floats = npt.NDArray[np.float64]
DAY_S = 86400.0
SOURCE_GPUS = 16_384
SOURCE_DAYS = 54.0


class SimulationError(ValueError):
    """Bad simulator input: a rate table or a parameter; the message says which and why."""


@dataclass(frozen=True, slots=True)
class Rate:
    """Failures of one component seen over a table's exposure."""

    component: str
    category: str
    count: int


@dataclass(frozen=True, slots=True)
class RateTable:
    """Failure counts and the exposure they were seen over (``gpus`` for ``days``)."""

    rates: tuple[Rate, ...]
    gpus: int = SOURCE_GPUS
    days: float = SOURCE_DAYS

    def expected(self, *, gpus: int, days: float) -> Floats:
        """Mean failures per row for a run of ``gpus`` GPUs over ``days`` (rates scale per GPU-day)."""
        scale = (gpus * days) / (self.gpus * self.days)
        return np.array([r.count for r in self.rates], dtype=np.float64) * scale


def parse_rates(text: str, *, name: str = "rates", gpus: int = SOURCE_GPUS, days: float = SOURCE_DAYS) -> RateTable:
    """A rate table from CSV text (columns ``component,category,count``; ``#`` lines are comments)."""
    if gpus < 1 or not days > 0:
        raise SimulationError(f"{name}: the table's exposure needs gpus >= 1 and days > 0, got {gpus}, {days}")
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip() and not line.startswith("#")]
    reader = csv.reader(io.StringIO("\n".join(line for _, line in lines)))
    rows = list(reader)
    if not rows or [c.strip() for c in rows[0]] != ["component", "category", "count"]:
        raise SimulationError(f"{name}: the header must be 'component,category,count'")
    rates = []
    for (lineno, _), row in zip(lines[1:], rows[1:], strict=True):
        if len(row) != 3:
            raise SimulationError(f"{name}:{lineno}: expected 3 fields, got {len(row)}")
        component, category, count = (c.strip() for c in row)
        if not count.isdigit():
            raise SimulationError(f"{name}:{lineno}: count must be a non-negative integer, got {count!r}")
        if not component or not category:
            raise SimulationError(f"{name}:{lineno}: component and category must not be empty")
        rates.append(Rate(component, category, int(count)))
    if not rates:
        raise SimulationError(f"{name}: no rows")
    return RateTable(tuple(rates), gpus, days)


def load_rates(path: Path | None = None, *, gpus: int = SOURCE_GPUS, days: float = SOURCE_DAYS) -> RateTable:
    """The rate table at ``path``, or the packaged Llama 3 table (``ridethrough/data/llama3_interruptions.csv``)."""
    if path is None:
        text = resources.files("ridethrough").joinpath("data/llama3_interruptions.csv").read_text("utf-8")
        return parse_rates(text, name="llama3_interruptions.csv", gpus=gpus, days=days)
    try:
        text = path.read_text("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SimulationError(f"cannot read the rate table {path}: {exc}") from exc
    return parse_rates(text, name=str(path), gpus=gpus, days=days)


def _check_non_negative(owner: str, values: Mapping[str, Any]) -> None:
    for key, value in values.items():
        if isinstance(value, float | int) and (not math.isfinite(value) or value < 0):
            raise SimulationError(f"{owner}.{key} must be a finite number >= 0, got {value}")


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointRestart:
    """Periodic checkpoints; every failure restarts the job from the last one."""

    checkpoint_interval_s: float = 900.0
    checkpoint_stall_s: float = 10.0
    """Training blocked per checkpoint (asynchronous checkpointing: the copy out of GPU memory)."""
    detect_s: float = 60.0
    """From the failure until the job is known dead (a crash, or a collective timeout)."""
    restart_s: float = 180.0
    """Reschedule, replace the node, start every process, form the process groups."""
    reload_s: float = 180.0
    """Read the checkpoint back into every GPU (a well-tuned median; the worst case is far longer)."""

    def __post_init__(self) -> None:
        _check_non_negative("CheckpointRestart", asdict(self))
        if self.checkpoint_interval_s <= 0:
            raise SimulationError("CheckpointRestart.checkpoint_interval_s must be > 0")


@dataclass(frozen=True, slots=True, kw_only=True)
class Ridethrough:
    """Reroute network faults, migrate GPU failures to a hot spare, restore a snapshot otherwise."""

    reroute_pause_s: float = 5.0
    """Network: fast detection (BFD-like, ~150 ms), local failover, collectives retried."""
    migrate_predicted_s: float = 30.0
    """A GPU failure predicted ahead: its rank moves to a hot spare live, at a step boundary."""
    migrate_failed_s: float = 120.0
    """A GPU that failed unannounced: a spare joins and takes the state from data-parallel peers."""
    predicted_fraction: float = 0.3
    """Share of GPU failures predicted early enough for a live migration."""
    snapshot_interval_s: float = 300.0
    snapshot_stall_s: float = 2.0
    """In-memory snapshots (copied to host memory and peers; made durable off the critical path)."""
    detect_s: float = 10.0
    """Detectors and the agent's reflex see a dead GPU or host in seconds, not at a collective timeout."""
    restart_s: float = 180.0
    restore_s: float = 60.0
    """Load the snapshot from host memory or peers rather than from storage."""
    reroute_categories: tuple[str, ...] = ("Network",)
    migrate_categories: tuple[str, ...] = ("GPU",)

    def __post_init__(self) -> None:
        _check_non_negative("Ridethrough", asdict(self))
        if self.snapshot_interval_s <= 0 or not 0.0 <= self.predicted_fraction <= 1.0:
            raise SimulationError("Ridethrough needs snapshot_interval_s > 0 and predicted_fraction in [0, 1]")


# Recovery kinds: the index into a policy's (pause, loses work) table and the badput it is booked as.
RECOVERIES = ("restart", "reroute_pause", "migration_pause", "snapshot_restore")
_RESTART, _REROUTE, _MIGRATE, _SNAPSHOT = range(4)


@dataclass(frozen=True, slots=True)
class Plan:
    """A policy applied to one set of failure histories: its work cycle, and per failure its recovery."""

    interval_s: float
    stall_s: float
    recovery: npt.NDArray[np.int64]
    """(replications, failures): which recovery each failure takes."""
    pause_s: Floats
    loses: npt.NDArray[np.bool_]


def _plan_checkpoint(p: CheckpointRestart, shape: tuple[int, int]) -> Plan:
    pause = np.full(shape, p.detect_s + p.restart_s + p.reload_s)
    return Plan(p.checkpoint_interval_s, p.checkpoint_stall_s, np.full(shape, _RESTART), pause,
                 np.ones(shape, dtype=bool))


def _plan_ridethrough(p: Ridethrough, rates: Sequence[Rate], kinds: npt.NDArray[np.int64],
                      predicted: npt.NDArray[np.bool_]) -> Plan:
    by_row = np.array([_REROUTE if r.category in p.reroute_categories else _MIGRATE
                       if r.category in p.migrate_categories else _SNAPSHOT for r in rates])
    recovery = by_row[kinds]
    restore = p.detect_s + p.restart_s + p.restore_s
    pause = np.select([recovery == _REROUTE, (recovery == _MIGRATE) & predicted, recovery == _MIGRATE],
                      [p.reroute_pause_s, p.migrate_predicted_s, p.migrate_failed_s], restore)
    return Plan(p.snapshot_interval_s, p.snapshot_stall_s, recovery, pause.astype(np.float64),
                 recovery == _SNAPSHOT)


def _cycles(length: Floats, carry: Floats, interval: float, stall: float) -> tuple[Floats, Floats, Floats]:
    """Computing for ``length`` s with ``carry`` s uncommitted: (newly committed, uncommitted after, stalled)."""
    virtual = length + carry  # as if the interval had started when the carried work did
    n = np.floor(virtual / (interval + stall))
    rest = virtual - n * (interval + stall)
    computing = np.minimum(rest, interval)
    return n * interval, computing, n * stall + (rest - computing)


def replay(times: Floats, plan: Plan, window_s: float) -> dict[str, Floats]:
    """Seconds per replication in each use (``productive``, ``recomputation``, ``checkpoint_stall``, then
    one per `RECOVERIES`) for failure ``times`` (replications x failures, ``inf``-padded, sorted)."""
    reps = times.shape[0]
    ready, since, carry = np.zeros(reps), np.zeros(reps), np.zeros(reps)
    kind = np.zeros(reps, dtype=np.int64)
    out = {k: np.zeros(reps) for k in ("productive", "recomputation", "checkpoint_stall", *RECOVERIES)}
    recovering = np.zeros((len(RECOVERIES), reps))
    rows = np.arange(reps)
    for k in range(times.shape[1]):
        f = times[:, k]
        live = f < window_s
        if not live.any():
            break
        f = np.where(live, f, window_s)
        recovering[kind, rows] += np.where(live, np.minimum(f, ready) - since, 0.0)
        committed, pending, stalled = _cycles(np.maximum(f - ready, 0.0), carry, plan.interval_s, plan.stall_s)
        loses = plan.loses[:, k] & live
        out["productive"] += np.where(live, committed, 0.0)
        out["checkpoint_stall"] += np.where(live, stalled, 0.0)
        out["recomputation"] += np.where(loses, pending, 0.0)
        carry = np.where(live, np.where(loses, 0.0, pending), carry)
        since = np.where(live, f, since)
        ready = np.where(live, f + plan.pause_s[:, k], ready)
        kind = np.where(live, plan.recovery[:, k], kind)
    recovering[kind, rows] += np.minimum(window_s, ready) - since
    committed, pending, stalled = _cycles(np.maximum(window_s - ready, 0.0), carry, plan.interval_s, plan.stall_s)
    out["productive"] += committed + pending  # work in progress at the window's end is not lost: the run goes on
    out["checkpoint_stall"] += stalled
    for i, name in enumerate(RECOVERIES):
        out[name] += recovering[i]
    return out


def draw(rates: RateTable, *, gpus: int, days: float, replications: int,
         rng: np.random.Generator) -> tuple[Floats, npt.NDArray[np.int64]]:
    """Failure times (sorted, ``inf``-padded) and their rate-table rows, one line per replication."""
    counts = rng.poisson(rates.expected(gpus=gpus, days=days), size=(replications, len(rates.rates)))
    totals = counts.sum(axis=1)
    width = max(1, int(totals.max()))
    slot = np.arange(width)
    # The j-th failure of a replication belongs to the first row whose running count exceeds j.
    kinds = (slot[None, :, None] >= counts.cumsum(axis=1)[:, None, :]).sum(axis=2)
    real = slot[None, :] < totals[:, None]
    kinds = np.where(real, kinds, 0)  # padding: never live (its time is inf), but a valid row index
    times = np.where(real, rng.uniform(0.0, days * DAY_S, (replications, width)), np.inf)
    order = np.argsort(times, axis=1)
    return np.take_along_axis(times, order, axis=1), np.take_along_axis(kinds, order, axis=1).astype(np.int64)


def _t95(df: int) -> float:
    """Two-sided 95% Student t quantile (Cornish-Fisher expansion; within 0.3% for df >= 4)."""
    table = {1: 12.706, 2: 4.303, 3: 3.182}
    if df in table:
        return table[df]
    z = 1.959964
    return float(z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
                 + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3))


def mean_ci(values: Floats) -> tuple[float, float, float]:
    """Mean and its 95% confidence interval (Student t); a single value has an interval of itself."""
    mean = float(values.mean())
    if len(values) < 2:
        return mean, mean, mean
    half = _t95(len(values) - 1) * float(values.std(ddof=1)) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def simulate(rates: RateTable, *, gpus: int = SOURCE_GPUS, days: float = SOURCE_DAYS, replications: int = 200,
             seed: int = 0, checkpoint: CheckpointRestart | None = None,
             ridethrough: Ridethrough | None = None) -> dict[str, Any]:
    """Replay ``replications`` failure histories under both policies; a JSON-ready summary."""
    if gpus < 1 or not 0 < days <= 36500 or replications < 1:
        raise SimulationError(f"need gpus >= 1, 0 < days <= 36500, replications >= 1; got {gpus}, {days}, "
                              f"{replications}")
    checkpoint, ridethrough = checkpoint or CheckpointRestart(), ridethrough or Ridethrough()
    rng = np.random.default_rng(seed)
    times, kinds = draw(rates, gpus=gpus, days=days, replications=replications, rng=rng)
    predicted = rng.random(times.shape) < ridethrough.predicted_fraction
    window = days * DAY_S
    plans = {"checkpoint_restart": (_plan_checkpoint(checkpoint, times.shape), asdict(checkpoint)),
             "ridethrough": (_plan_ridethrough(ridethrough, rates.rates, kinds, predicted), asdict(ridethrough))}
    losses: dict[str, Floats] = {}
    policies: dict[str, Any] = {}
    for name, (plan, params) in plans.items():
        used = replay(times, plan, window)
        losses[name] = 1.0 - used["productive"] / window
        mean, lo, hi = mean_ci(losses[name])
        policies[name] = {"goodput_loss": mean, "goodput_loss_ci95": [lo, hi],
                          "gpu_hours_lost": mean * window * gpus / 3600.0,
                          "badput": {k: float(v.mean() / window) for k, v in used.items() if k != "productive"},
                          "parameters": _params(params)}
    saved, lo, hi = mean_ci(losses["checkpoint_restart"] - losses["ridethrough"])
    count, clo, chi = mean_ci(np.isfinite(times).sum(axis=1).astype(np.float64))
    return {"gpus": gpus, "days": days, "replications": replications, "seed": seed,
            "interruptions": count, "interruptions_ci95": [clo, chi],
            "expected_interruptions": float(rates.expected(gpus=gpus, days=days).sum()),
            "policies": policies, "goodput_loss_saved": {"mean": saved, "ci95": [lo, hi]}}


def _params(params: Mapping[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in params.items()}
