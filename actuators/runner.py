"""The actuator runner: plans actions for open incidents, applies the safety policy, runs them.

For each open incident and each plugin, `Runner.consider`:

1. asks the plugin for a `Plan` (under ``plan_timeout_s``; a raise or a bad plan is recorded as ``failed``);
2. refuses a plan already decided (its idempotency key is spent, checked in ``actions``, so a
   retried or duplicated command never acts twice, also after a restart), then applies the
   `policy.refusal` rules; refusals are recorded with their reason (a repeat of the same rule
   for the same plan is not recorded again);
3. in dry-run mode records ``dry_run`` and stops; else records the decision and runs the action
   on its own thread: approval (if required) → apply → verify, and rollback when apply or
   verify fails. Every phase has its deadline and writes the next version of the action row.

Every decision and phase is a span in the incident's trace (`ridethrough.actuators.tracing`).
One runner owns a cluster's actions: at `load`, actions a previous runner left in flight are
marked ``interrupted`` (or refused, if they only awaited approval) and never re-run.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from ridethrough.actuators.actions import ActionLog, ActionRecord, Status, consumes_key
from ridethrough.actuators.contract import Actuator, Deadline, FleetState, Plan, Result
from ridethrough.actuators.plugins import call_with_deadline, check_plan
from ridethrough.actuators.policy import ApprovalQueue, InFlight, RunnerPolicy, Verdict, refusal
from ridethrough.actuators.tracing import ActionTrace, SpanData, SpanWriter, action_attributes, run_phase
from ridethrough.detectors.incidents import Incident, State, Transition, TransitionKind
from ridethrough.exporters.gateway_metrics import GatewayMetrics
from ridethrough.exporters.store import Store, StoreError, StoreUnavailable

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


@dataclass(frozen=True, slots=True)
class Decision:
    """What `Runner.consider` decided for one plugin and one incident."""

    action_id: str
    """'' when nothing new was recorded (a repeat of the same refusal, or the store was away)."""
    plugin: str
    incident_id: str
    status: Status
    reason: str
    plan: Plan | None


@dataclass(eq=False)
class _Action:
    record: ActionRecord
    plan: Plan
    plugin: Actuator
    trace: ActionTrace
    needs_approval: bool


def _rule(reason: str) -> str:
    return reason.split(":", 1)[0]


def _traceable(incident: Incident) -> bool:
    # Every action is a part of its incident's trace: an incident without a valid one is not acted on.
    if len(incident.trace_id) == 32 and all(c in "0123456789abcdef" for c in incident.trace_id):
        return True
    log.error("incident %s has a malformed trace id %r; not acted on", incident.incident_id, incident.trace_id)
    return False


class Runner:
    """Decides and runs actions for incidents (see the module docstring)."""

    def __init__(self, *, store: Store, plugins: Sequence[Actuator], policy: RunnerPolicy,
                 fleet: Callable[[], FleetState], clock: Callable[[], int] = time.time_ns,
                 metrics: RunnerMetrics | None = None, span_metrics: GatewayMetrics | None = None,
                 cluster: str | None = None) -> None:
        self._plugins = list(plugins)
        self.policy = policy
        self._fleet = fleet
        self._clock = clock
        self._cluster = cluster
        self.metrics = metrics if metrics is not None else RunnerMetrics.create()
        self._log = ActionLog(store)
        self._spans = SpanWriter(store=store, metrics=span_metrics or GatewayMetrics.create())
        self.approvals = ApprovalQueue()
        """Plans waiting for a human (``approvals.approve(plan_id)``, ``deny``, ``pending``)."""
        self._lock = threading.Lock()
        self._in_flight: dict[str, _Action] = {}
        self._last_ended: dict[tuple[str, str], int] = {}
        self._recorded: dict[str, dict[str, str]] = {}  # incident id → plan/plugin key → rule last recorded
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self.loaded = False

    # -- start-up ---------------------------------------------------------------------------

    def load(self) -> int:
        """Read recent actions (cooldowns) and close those a previous runner left in flight; returns those."""
        self._log.ensure_table()
        closed, self._last_ended = self._log.recover(self._clock(), cooldown_s=self.policy.cooldown_s,
                                                     dry_run=self.policy.dry_run, cluster=self._cluster)
        self.loaded = True
        return closed

    # -- deciding ---------------------------------------------------------------------------

    def on_transitions(self, transitions: Sequence[Transition]) -> list[Decision]:
        """Consider the incidents that changed (chain it after the controller's emit)."""
        latest: dict[str, Incident] = {}
        for t in transitions:
            if t.kind is TransitionKind.RESOLVED:
                with self._lock:
                    self._recorded.pop(t.incident.incident_id, None)
            latest[t.incident.incident_id] = t.incident
        return self.consider(latest.values())

    def consider(self, incidents: Iterable[Incident]) -> list[Decision]:
        """Plan, check and start actions for the open ``incidents``; returns every decision taken."""
        if not self.loaded:
            try:
                self.load()
            except (StoreUnavailable, StoreError) as exc:  # acting without the history would be blind
                log.warning("cannot read earlier actions; no actions this round: %s", exc)
                self.metrics.store_errors.labels(what="load").inc()
                return []
        wanted = [i for i in incidents if i.state is State.OPEN and _traceable(i)]
        if not wanted or self._stopping:
            return []
        try:
            fleet = self._fleet()
        except Exception:
            log.exception("fleet state unavailable; no actions this round")
            return []
        out = []
        for incident in wanted:
            for plugin in self._plugins:
                decision = self._decide(plugin, incident, fleet)
                if decision is not None:
                    out.append(decision)
        return out

    def _decide(self, plugin: Actuator, incident: Incident, fleet: FleetState) -> Decision | None:
        started = self._clock()
        value, error = call_with_deadline(lambda: plugin.plan(incident, fleet),
                                          Deadline.after(self.policy.plan_timeout_s))
        if error is None:
            error = check_plan(value, plugin, incident)
        if error is not None:
            stub = Plan.for_incident(plugin.name, incident)
            with self._lock:
                return self._record(stub, incident, Status.FAILED, f"plan {error}", started, plugin, plan_id="")
        if value is None:
            return None
        plan: Plan = value
        with self._lock:
            try:
                reason = self._duplicate(plan)
            except (StoreUnavailable, StoreError) as exc:
                reason = f"store: cannot check earlier decisions: {exc}"
            reason = reason or refusal(self.policy, plan, incident, fleet, InFlight(
                self._clock(), [a.plan for a in self._in_flight.values()], self._last_ended))
            if reason is not None:
                return self._record(plan, incident, Status.REFUSED, reason, started, plugin, fleet=fleet)
            if self.policy.dry_run:
                decision = self._record(plan, incident, Status.DRY_RUN, "dry run", started, plugin, fleet=fleet)
                if decision.action_id:
                    self._last_ended[(plan.cluster, plan.entity)] = self._clock()
                return decision
            approval = self.policy.require_approval or plan.needs_approval
            status = Status.AWAITING_APPROVAL if approval else Status.APPLYING
            return self._record(plan, incident, status, "approval required" if approval else "accepted", started,
                                plugin, fleet=fleet, approval=approval)

    def _duplicate(self, plan: Plan) -> str | None:
        key = plan.idempotency_key
        for a in self._in_flight.values():
            if a.plan.idempotency_key == key:
                return f"duplicate: plan {key} is in flight as action {a.record.action_id}"
        for r in self._log.by_plan(key, cluster=plan.cluster):
            if consumes_key(r.status, dry_run_mode=self.policy.dry_run):
                return f"duplicate: plan {key} was decided before as action {r.action_id} ({r.status.value})"
        return None

    def _record(self, plan: Plan, incident: Incident, status: Status, reason: str, started_ns: int,
                plugin: Actuator, *, plan_id: str | None = None, fleet: FleetState | None = None,
                approval: bool = False) -> Decision:
        """Write the decision (row and span); start the action when it was accepted."""
        plan_id = plan.idempotency_key if plan_id is None else plan_id
        seen = self._recorded.setdefault(incident.incident_id, {})
        memo = plan_id or plan.plugin
        shown = plan if plan_id else None  # a failed planning has no plan to show
        if status in (Status.REFUSED, Status.FAILED) and seen.get(memo) == _rule(reason):
            return Decision("", plan.plugin, incident.incident_id, status, reason, shown)
        action_id = uuid.uuid4().hex
        shares = fleet.path_shares(plan.removes_paths) if fleet is not None else {}
        record = ActionRecord(action_id, plan_id, incident.incident_id, incident.key, incident.trace_id,
                              plan.cluster, plan.plugin, plan.entity, status, reason, self.policy.dry_run,
                              plan.summary, plan.steps, tuple(sorted(plan.drains_hosts)),
                              tuple(sorted(plan.removes_paths)), shares, "", self._clock(),
                              started_at_ns=self._clock() if status is Status.APPLYING else 0)
        try:
            self._log.write(record)
        except (StoreUnavailable, StoreError) as exc:
            log.warning("cannot record %s decision of %s: %s", status.value, plan.plugin, exc)
            self.metrics.store_errors.labels(what="actions").inc()
            return Decision("", plan.plugin, incident.incident_id, Status.REFUSED, f"store: {exc}", shown)
        seen[memo] = _rule(reason)
        self.metrics.decisions.labels(plugin=plan.plugin, status=status.value).inc()
        trace = ActionTrace(trace_id=incident.trace_id, action_id=action_id, clock=self._clock)
        span = trace.start("action.decide", action_attributes(record))
        span.start_ns = started_ns
        span.end(self._clock(), error=reason if status is Status.FAILED else None)
        self._write_spans([span])
        if approval:
            self.approvals.submit(plan)
        if status in (Status.APPLYING, Status.AWAITING_APPROVAL):
            self._start(_Action(record, plan, plugin, trace, approval))
        return Decision(action_id, plan.plugin, incident.incident_id, status, reason, shown)

    # -- running ----------------------------------------------------------------------------

    def _start(self, action: _Action) -> None:
        self._in_flight[action.record.action_id] = action
        self.metrics.in_flight.set(len(self._in_flight))
        thread = threading.Thread(target=self._run, args=(action,), name=f"rt-action-{action.record.action_id[:8]}",
                                  daemon=True)
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _run(self, a: _Action) -> None:
        acted = False
        try:
            if a.needs_approval and not self._approved(a):
                return
            acted = True
            self._execute(a)
        except Exception:  # a runner bug must not leave the action looking in flight forever
            log.exception("action %s failed in the runner", a.record.action_id)
            self._update(a, status=Status.FAILED, reason="runner error (see the controller log)",
                         ended_at_ns=self._clock())
        finally:
            with self._lock:
                self._in_flight.pop(a.record.action_id, None)
                self.metrics.in_flight.set(len(self._in_flight))
                if acted:
                    self._last_ended[(a.plan.cluster, a.plan.entity)] = self._clock()
            self.metrics.outcomes.labels(plugin=a.plan.plugin, status=a.record.status.value).inc()

    def _approved(self, a: _Action) -> bool:
        span = a.trace.start("action.approval", {"action.id": a.record.action_id})
        verdict = self.approvals.wait(a.plan.idempotency_key, self.policy.approval_timeout_s)
        span.end(self._clock(), attributes={"approval.verdict": verdict.value})
        self._write_spans([span])
        if verdict is Verdict.APPROVED:
            self._update(a, status=Status.APPLYING, reason="approved", started_at_ns=self._clock())
            return True
        status, reason = {
            Verdict.DENIED: (Status.DENIED, "denied by a human"),
            Verdict.TIMED_OUT: (Status.REFUSED, f"approval timed out after {self.policy.approval_timeout_s:g} s"),
            Verdict.ABANDONED: (Status.REFUSED, "approval abandoned: the runner shut down"),
        }[verdict]
        self._update(a, status=status, reason=reason, ended_at_ns=self._clock())
        return False

    def _execute(self, a: _Action) -> None:
        p = self.policy
        applied, apply_s = self._phase(a, "apply", a.plugin.apply, p.apply_timeout_s)
        timings = {"apply_s": apply_s, **applied.timings_s}
        results = [f"apply: {applied.detail}"]
        failure = None if applied.ok else f"apply failed: {applied.detail}"
        if applied.ok:
            self._update(a, status=Status.VERIFYING, timings_s=timings)
            verified, verify_s = self._phase(a, "verify", a.plugin.verify, p.verify_timeout_s)
            timings |= {"verify_s": verify_s, **verified.timings_s}
            results.append(f"verify: {verified.detail}")
            failure = None if verified.ok else f"verify failed: {verified.detail}"
        final, reason = Status.SUCCEEDED, "verified"
        if failure is not None:
            self._update(a, status=Status.ROLLING_BACK, reason=failure, timings_s=timings)
            undone, rollback_s = self._phase(a, "rollback", a.plugin.rollback, p.rollback_timeout_s)
            timings |= {"rollback_s": rollback_s, **undone.timings_s}
            results.append(f"rollback: {undone.detail}")
            final = Status.ROLLED_BACK if undone.ok else Status.FAILED
            reason = failure if undone.ok else f"{failure}; rollback failed: {undone.detail}"
        self._update(a, status=final, reason=reason, detail="; ".join(results), timings_s=timings,
                     ended_at_ns=self._clock())

    def _phase(self, a: _Action, name: str, method: Callable[[Plan, Deadline], Result],
               timeout_s: float) -> tuple[Result, float]:
        result, seconds, spans = run_phase(
            a.trace, name, lambda deadline: method(a.plan, deadline), timeout_s=timeout_s,
            what=f"{a.plan.plugin}.{name}",
            attributes={"action.id": a.record.action_id, "action.plugin": a.plan.plugin})
        self._write_spans(spans)
        return result, seconds

    def _update(self, a: _Action, **changes: Any) -> None:
        a.record = replace(a.record, version=a.record.version + 1, **changes)
        try:
            self._log.write(a.record)
        except (StoreUnavailable, StoreError) as exc:  # the action goes on: stopping halfway is worse
            log.warning("cannot record action %s as %s: %s", a.record.action_id, a.record.status.value, exc)
            self.metrics.store_errors.labels(what="actions").inc()

    def _write_spans(self, spans: list[SpanData]) -> None:
        try:
            self._spans.write(spans)
        except (StoreUnavailable, StoreError, ValueError) as exc:
            log.warning("cannot write %d action spans: %s", len(spans), exc)
            self.metrics.store_errors.labels(what="spans").inc()

    # -- approvals and lifetime -------------------------------------------------------------

    def approve(self, plan_id: str) -> None:
        """Let a plan awaiting approval run (by its idempotency key); `UnknownPlan` if none is waiting."""
        self.approvals.approve(plan_id)

    def deny(self, plan_id: str) -> None:
        """Refuse a plan awaiting approval for good (its key is spent); `UnknownPlan` if none is waiting."""
        self.approvals.deny(plan_id)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no action is in flight; False at the timeout."""
        deadline = Deadline.after(timeout_s)
        for t in list(self._threads):
            t.join(deadline.remaining_s())
        return not any(t.is_alive() for t in self._threads)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop deciding, refuse pending approvals, and wait for running actions up to ``timeout_s``."""
        self._stopping = True
        self.approvals.close()
        self.wait_idle(timeout_s)
