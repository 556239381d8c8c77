"""Runs a scenario's timeline against any `LabControl`, on one clock, interruptibly.

Every start and undo is an action at a planned offset from the run's start (deadlines come
from that one start time, so a slow call does not shift what follows). At equal offsets undos
come before starts. Each action records the wall time (``time.time_ns``) it was applied and
its error: a `LabError` is recorded and the run goes on, and a fault whose start failed is not
undone. A recovery kind first undoes the open-ended faults it ends (`Fault.closes`), then makes
its own call. When the run ends, is stopped (the ``stop`` event) or fails, every fault still on
is undone, newest first, and the jobs are stopped: the lab is left as it was found.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from ridethrough.lab.control import LabControl, LabError
from ridethrough.lab.scenario import Fault, Job, Scenario

log = logging.getLogger(__name__)


class Phase(enum.StrEnum):
    """Whether an action starts a fault or undoes it."""

    START = "start"
    UNDO = "undo"


@dataclass(frozen=True, slots=True)
class Action:
    """One planned call: ``window`` numbers a flap's pulses (0 for every other kind)."""

    offset_s: float
    index: int
    window: int
    phase: Phase


@dataclass(frozen=True, slots=True)
class ActionRecord:
    """What one action did, and when."""

    offset_s: float
    """Planned offset from the run's start (for cleanup undos, when the cleanup began)."""
    index: int
    window: int
    phase: Phase
    kind: str
    target: str
    applied_at_ns: int
    error: str = ""
    reason: str = "timeline"
    """``timeline``, ``ended by timeline[N]``, ``run end``, ``stopped`` or ``aborted`` (an exception)."""


@dataclass(frozen=True, slots=True)
class FaultOutcome:
    """What happened to one timeline item, with its truth times in wall-clock nanoseconds."""

    index: int
    applied: bool
    started_at_ns: int
    """When it was applied (or attempted; or planned, if the run never reached it)."""
    ended_at_ns: int | None
    precursor_at_ns: int | None
    failure_at_ns: int | None
    error: str = ""


@dataclass(frozen=True, slots=True)
class RunResult:
    """A finished run: every action and the outcome of every timeline item."""

    started_at_ns: int
    ended_at_ns: int
    stopped: bool
    records: tuple[ActionRecord, ...]
    outcomes: tuple[FaultOutcome, ...]
    job_error: str = ""


class JobLauncher(Protocol):
    """Starts a scenario's jobs before its timeline and stops them after it."""

    def start(self, jobs: Sequence[Job]) -> None:
        """Start every job; raise `LabError` if they cannot run."""
        ...

    def stop(self) -> None:
        """Stop what `start` started."""
        ...


def plan(scenario: Scenario) -> list[Action]:
    """Every scheduled action of a scenario, in the order the runner applies them."""
    actions: list[Action] = []
    for fault in scenario.timeline:
        for w, (start, end) in enumerate(fault.windows(scenario.names)):
            actions.append(Action(start, fault.index, w, Phase.START))
            if end is not None and fault.spec.undo is not None:
                actions.append(Action(end, fault.index, w, Phase.UNDO))
    return sorted(actions, key=lambda a: (a.offset_s, a.phase is Phase.START, a.index, a.window))


def run_timeline(scenario: Scenario, lab: LabControl, *, stop: threading.Event | None = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], object] | None = None,
                 wall_ns: Callable[[], int] = time.time_ns, on_event: Callable[[ActionRecord], object] | None = None,
                 jobs: JobLauncher | None = None) -> RunResult:
    """Run the timeline to ``scenario.duration_s`` (or until ``stop`` is set); never raises `LabError`.

    ``sleep`` defaults to waiting on ``stop`` (so a stop wakes it); tests pass a fake clock and
    sleep. ``on_event`` sees every `ActionRecord` as it happens (its errors are logged).
    """
    event = stop or threading.Event()
    return _Run(scenario, lab, event, clock, sleep or event.wait, wall_ns, on_event, jobs).run()


class _Run:
    def __init__(self, scenario: Scenario, lab: LabControl, stop: threading.Event, clock: Callable[[], float],
                 sleep: Callable[[float], object], wall_ns: Callable[[], int],
                 on_event: Callable[[ActionRecord], object] | None, jobs: JobLauncher | None) -> None:
        self.scenario, self.lab, self.stop, self.clock = scenario, lab, stop, clock
        self.sleep, self.wall_ns, self.on_event, self.jobs = sleep, wall_ns, on_event, jobs
        self.active: dict[tuple[int, int], str | None] = {}  # (index, window) -> handle, in start order
        self.records: list[ActionRecord] = []
        self.closed_at: dict[int, float] = {}
        self.job_error = ""
        self.t0 = 0.0
        self.start_ns = 0
        self.stopped_at: float | None = None
        self.aborted = False

    def run(self) -> RunResult:
        self.t0, self.start_ns = self.clock(), self.wall_ns()
        try:
            self.start_jobs()
            for action in plan(self.scenario):
                if not self.wait_until(action.offset_s):
                    break
                self.execute(action)
            else:
                self.wait_until(self.scenario.duration_s)
        except BaseException:
            self.aborted = True
            raise
        finally:
            if self.stop.is_set():
                self.stopped_at = self.clock() - self.t0
            self.cleanup()
        end_ns = self.wall_ns()
        outcomes = tuple(self.outcome(f) for f in self.scenario.timeline)
        return RunResult(self.start_ns, end_ns, self.stopped_at is not None, tuple(self.records), outcomes,
                         self.job_error)

    def wait_until(self, offset_s: float) -> bool:
        """Sleep until ``offset_s`` after the start; False if stopped first."""
        while not self.stop.is_set():
            remaining = offset_s - (self.clock() - self.t0)
            if remaining <= 0:
                return True
            self.sleep(remaining)
        return False

    def start_jobs(self) -> None:
        if self.jobs is None or not self.scenario.jobs:
            return
        try:
            self.jobs.start(self.scenario.jobs)
        except LabError as exc:
            self.job_error = str(exc) or type(exc).__name__
            log.warning("scenario %s: jobs did not start: %s", self.scenario.name, exc)

    def execute(self, action: Action) -> None:
        fault = self.scenario.timeline[action.index]
        if action.phase is Phase.UNDO:
            if (action.index, action.window) in self.active:
                self.undo(fault, action.window, action.offset_s, "timeline")
            return
        for index in fault.closes:
            self.closed_at[index] = action.offset_s
            for key in [k for k in self.active if k[0] == index]:
                self.undo(self.scenario.timeline[index], key[1], action.offset_s, f"ended by timeline[{fault.index}]")
        applied_ns = self.wall_ns()
        try:
            handle = fault.spec.start(self.lab, fault.call(self.scenario.names))
        except LabError as exc:
            self.record(action.offset_s, fault, action.window, Phase.START, applied_ns, _message(exc))
            return
        if fault.spec.undo is not None and (fault.spec.lasting or fault.for_s is not None):
            self.active[(fault.index, action.window)] = handle
        self.record(action.offset_s, fault, action.window, Phase.START, applied_ns)

    def undo(self, fault: Fault, window: int, offset_s: float, reason: str) -> None:
        handle = self.active.pop((fault.index, window))
        assert fault.spec.undo is not None, "only faults with an undo are active"
        applied_ns = self.wall_ns()
        error = ""
        try:
            fault.spec.undo(self.lab, fault.call(self.scenario.names), handle)
        except LabError as exc:
            error = _message(exc)
        except Exception as exc:
            if reason == "timeline":
                raise
            # Cleanup goes on: every other active fault still gets its undo.
            log.exception("undo of timeline[%d] (%s) raised", fault.index, fault.kind)
            error = f"{type(exc).__name__}: {exc}"
        self.record(offset_s, fault, window, Phase.UNDO, applied_ns, error, reason)

    def cleanup(self) -> None:
        reason = "stopped" if self.stopped_at is not None else "aborted" if self.aborted else "run end"
        offset_s = self.clock() - self.t0
        for index, window in reversed(list(self.active)):
            self.undo(self.scenario.timeline[index], window, offset_s, reason)
        if self.jobs is not None and self.scenario.jobs and not self.job_error:
            try:
                self.jobs.stop()
            except Exception as exc:  # the faults are undone; a launcher failing to stop is reported
                log.exception("scenario %s: stopping jobs raised", self.scenario.name)
                self.job_error = f"stopping jobs: {_message(exc)}"

    def record(self, offset_s: float, fault: Fault, window: int, phase: Phase, applied_ns: int,
               error: str = "", reason: str = "timeline") -> None:
        rec = ActionRecord(offset_s, fault.index, window, phase, fault.kind, fault.target, applied_ns, error, reason)
        self.records.append(rec)
        if self.on_event is not None:
            try:
                self.on_event(rec)
            except Exception:  # an observer must not break the run or its cleanup
                log.exception("on_event callback raised")

    def outcome(self, fault: Fault) -> FaultOutcome:
        mine = [r for r in self.records if r.index == fault.index]
        starts = [r for r in mine if r.phase is Phase.START]
        good = [r for r in starts if not r.error]
        undos = [r for r in mine if r.phase is Phase.UNDO]
        planned_ns = self.start_ns + round(fault.at_s * 1e9)
        started = good[0].applied_at_ns if good else starts[0].applied_at_ns if starts else planned_ns
        error = "; ".join(r.error for r in mine if r.error)
        if not starts:
            error = "not reached: the run was stopped first"
        ended = undos[-1].applied_at_ns if good and undos else None
        limit = min(self.closed_at.get(fault.index, float("inf")),
                    float("inf") if self.stopped_at is None else self.stopped_at)

        def wall(t: float | None) -> int | None:
            if t is None or not good or t > limit:
                return None  # never happened in this run
            return started + round((t - fault.at_s) * 1e9)

        return FaultOutcome(fault.index, bool(good), started, ended, wall(fault.truth.precursor_at_s),
                            wall(fault.truth.failure_at_s), error)


def _message(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__
