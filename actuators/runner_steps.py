"""Running one action: its phases, each recorded in the ``actions`` journal and as spans.

`ActionSteps.execute` runs an accepted action: apply → verify, and rollback when either fails (a
verify that could not decide leaves the action in place as ``unverified``);
`ActionSteps.resume` goes on with one a previous runner left in flight (verify or roll back
again; never apply). Each phase runs under its deadline (`run_phase`), and the row that names a
phase is written before the phase starts, so a crash leaves the journal saying how far it got.
A store that does not take a row or a span is logged and counted: the action goes on, as
stopping halfway would be worse.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from ridethrough.actuators.actions import ActionLog, ActionRecord, Status
from ridethrough.actuators.contract import Actuator, Deadline, Plan, Result
from ridethrough.actuators.policy import RunnerPolicy
from ridethrough.actuators.tracing import ActionTrace, SpanData, SpanWriter, run_phase
from ridethrough.exporters.store import StoreError, StoreUnavailable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunnerMetrics:
    """The runner's own health on /metrics."""

    registry: CollectorRegistry
    decisions: Counter
    outcomes: Counter
    store_errors: Counter
    in_flight: Gauge

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> RunnerMetrics:
        """Metrics in ``registry`` (a fresh one by default: no global state)."""
        reg = registry if registry is not None else CollectorRegistry()
        return cls(reg,
                   Counter("ridethrough_actuator_decisions", "Runner decisions by plugin and status",
                           ["plugin", "status"], registry=reg),
                   Counter("ridethrough_actuator_outcomes", "Finished actions by plugin and final status",
                           ["plugin", "status"], registry=reg),
                   Counter("ridethrough_actuator_store_errors", "Action rows or spans the store did not take",
                           ["what"], registry=reg),
                   Gauge("ridethrough_actuator_in_flight", "Actions in flight (awaiting approval included)",
                         registry=reg))


@dataclass(eq=False)
class RunningAction:
    """One action the runner is running: its newest row, its plan, plugin and trace."""

    record: ActionRecord
    plan: Plan
    plugin: Actuator
    trace: ActionTrace
    needs_approval: bool
    resumed: bool = False


class ActionSteps:
    """Runs the phases of actions and writes their journal rows and spans (see the module docstring)."""

    def __init__(self, *, log: ActionLog, spans: SpanWriter, policy: RunnerPolicy, metrics: RunnerMetrics,
                 clock: Callable[[], int]) -> None:
        self._log = log
        self._spans = spans
        self._policy = policy
        self._metrics = metrics
        self._clock = clock

    def execute(self, a: RunningAction) -> None:
        """Apply, then verify; roll back when either fails. The row of each phase is written before it runs."""
        applied, apply_s = self._phase(a, "apply", a.plugin.apply, self._policy.apply_timeout_s)
        timings = {"apply_s": apply_s, **applied.timings_s}
        results = [f"apply: {applied.detail}"]
        if not applied.ok:
            self._undo(a, f"apply failed: {applied.detail}", timings, results)
            return
        self.update(a, status=Status.VERIFYING, timings_s=timings)  # the journal: applied, now checking
        self._verify(a, timings, results)

    def resume(self, a: RunningAction) -> None:
        """Go on with a taken-over action: verify (apply had started) or roll back again; never apply."""
        timings = dict(a.record.timings_s)
        results = [a.record.detail] if a.record.detail else []
        if a.record.status is Status.ROLLING_BACK:
            self._undo(a, a.record.reason, timings, results, journal=False)
        else:
            self._verify(a, timings, results, note=" after a runner restart")

    def _verify(self, a: RunningAction, timings: dict[str, float], results: list[str], *, note: str = "") -> None:
        verified, verify_s = self._phase(a, "verify", a.plugin.verify, self._policy.verify_timeout_s)
        timings |= {"verify_s": verify_s, **verified.timings_s}
        results.append(f"verify: {verified.detail}")
        if verified.ok and verified.inconclusive:
            self._end(a, Status.UNVERIFIED, f"left in place, not verified{note}: {verified.detail}", timings,
                      results)
        elif verified.ok:
            self._end(a, Status.SUCCEEDED, f"verified{note}", timings, results)
        else:
            self._undo(a, f"verify failed{note}: {verified.detail}", timings, results)

    def _undo(self, a: RunningAction, failure: str, timings: dict[str, float], results: list[str], *,
              journal: bool = True) -> None:
        if journal:
            self.update(a, status=Status.ROLLING_BACK, reason=failure, timings_s=timings)
        undone, rollback_s = self._phase(a, "rollback", a.plugin.rollback, self._policy.rollback_timeout_s)
        timings |= {"rollback_s": rollback_s, **undone.timings_s}
        results.append(f"rollback: {undone.detail}")
        if undone.ok:
            self._end(a, Status.ROLLED_BACK, failure, timings, results)
        else:
            self._end(a, Status.FAILED, f"{failure}; rollback failed: {undone.detail}", timings, results)

    def _end(self, a: RunningAction, status: Status, reason: str, timings: dict[str, float],
             results: list[str]) -> None:
        self.update(a, status=status, reason=reason, detail="; ".join(results), timings_s=timings,
                     ended_at_ns=self._clock())

    def _phase(self, a: RunningAction, name: str, method: Callable[[Plan, Deadline], Result],
               timeout_s: float) -> tuple[Result, float]:
        result, seconds, spans = run_phase(
            a.trace, name, lambda deadline: method(a.plan, deadline), timeout_s=timeout_s,
            what=f"{a.plan.plugin}.{name}",
            attributes={"action.id": a.record.action_id, "action.plugin": a.plan.plugin,
                        "action.recoveries": a.record.recoveries})
        self.write_spans(spans)
        return result, seconds

    def update(self, a: RunningAction, **changes: Any) -> None:
        """Write the action's next version with ``changes``."""
        a.record = replace(a.record, version=a.record.version + 1, **changes)
        try:
            self._log.write(a.record)
        except (StoreUnavailable, StoreError) as exc:  # the action goes on: stopping halfway is worse
            log.warning("cannot record action %s as %s: %s", a.record.action_id, a.record.status.value, exc)
            self._metrics.store_errors.labels(what="actions").inc()

    def write_spans(self, spans: list[SpanData]) -> None:
        """Write finished spans of an action."""
        try:
            self._spans.write(spans)
        except (StoreUnavailable, StoreError, ValueError) as exc:
            log.warning("cannot write %d action spans: %s", len(spans), exc)
            self._metrics.store_errors.labels(what="spans").inc()
