"""The actuator runner: plans actions for open incidents, applies the safety policy, runs them.

For each open incident and each plugin, `Runner.consider`:

1. asks the plugin for a `Plan` (under ``plan_timeout_s``; a raise or a bad plan is recorded as ``failed``);
2. refuses a plan already decided (its idempotency key is spent, checked in ``actions``, so a
   retried or duplicated command never acts twice, also after a restart), then applies the
   `policy.refusal` rules; refusals are recorded with their reason (a repeat of the same rule
   for the same plan is not recorded again);
3. in dry-run mode records ``dry_run`` and stops; else records the decision and runs the action
   on its own thread: approval (if required) → apply → verify, and rollback when apply or
   verify fails. Every phase has its deadline, and the version of the action row that names it is
   written before it starts (the row is the journal a restarted runner reads).

Every decision and phase is a span in the incident's trace (`ridethrough.actuators.tracing`).
One runner owns a cluster's actions: at `load`, it takes over the actions a previous runner left
in flight and finishes them by verifying or rolling back, never by applying again
(`ridethrough.actuators.runner_recovery`). When an action that touched the fleet ends, the
``on_end`` listeners hear of it (PagerDuty change events, in the controller); the runner knows
nothing of what they do with it.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from ridethrough.actuators.actions import IN_FLIGHT, ActionLog, ActionRecord, Status, consumes_key, last_acted
from ridethrough.actuators.contract import Actuator, Deadline, FleetState, Plan
from ridethrough.actuators.plugins import call_with_deadline, check_plan
from ridethrough.actuators.policy import Answer, ApprovalQueue, InFlight, LastAction, RunnerPolicy, Verdict, refusal
from ridethrough.actuators.runner_recovery import Takeover, take_over
from ridethrough.actuators.runner_steps import ActionSteps, RunningAction
from ridethrough.actuators.runner_steps import RunnerMetrics as RunnerMetrics  # re-exported: the runner's API
from ridethrough.actuators.tracing import ActionTrace, SpanWriter, action_attributes
from ridethrough.detectors.incidents import Incident, State, Transition, TransitionKind
from ridethrough.exporters.gateway_metrics import GatewayMetrics
from ridethrough.exporters.store import Store, StoreError, StoreUnavailable

log = logging.getLogger(__name__)
ActionListener = Callable[[ActionRecord], object]
"""Hears the final version of every action whose apply started; may hear one again after a restart
(the runner replays recent ones, as it cannot know whether the last process got to tell it)."""


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


def _rule(reason: str) -> str:
    return reason.split(":", 1)[0]


def _answered(verb: str, answer: Answer, anonymous: str) -> str:
    """The action's reason after a human's answer: "approved by alice: looks right"."""
    if not answer.by:
        return anonymous
    return f"{verb} by {answer.by}: {answer.reason}" if answer.reason else f"{verb} by {answer.by}"


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
                 cluster: str | None = None, on_end: Sequence[ActionListener] = ()) -> None:
        self._plugins = list(plugins)
        self._on_end = list(on_end)
        self.policy = policy
        self._fleet = fleet
        self._clock = clock
        self._cluster = cluster
        self.metrics = metrics if metrics is not None else RunnerMetrics.create()
        self._log = ActionLog(store)
        self._steps = ActionSteps(log=self._log, spans=SpanWriter(store=store, metrics=span_metrics
                                                                  or GatewayMetrics.create()),
                                  policy=policy, metrics=self.metrics, clock=clock)
        self.approvals = ApprovalQueue()
        """Plans waiting for a human (``approvals.approve(plan_id)``, ``deny``, ``pending``)."""
        self._lock = threading.Lock()
        self._in_flight: dict[str, RunningAction] = {}
        self._last_acted: dict[tuple[str, str], LastAction] = {}
        self._recorded: dict[str, dict[str, str]] = {}  # incident id → plan/plugin key → rule last recorded
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self.loaded = False

    # -- start-up ---------------------------------------------------------------------------

    def load(self) -> int:
        """Read recent actions (cooldowns) and take over those a previous runner left in flight; returns
        how many it took over (resumed or closed). Does nothing once loaded; raises the store's errors."""
        if self.loaded:
            return 0
        self._log.ensure_table()
        now = self._clock()
        records = self._log.recent(now - round(self.policy.cooldown_s * 1e9), cluster=self._cluster)
        plugins = {p.name: p for p in self._plugins}
        takeovers = [take_over(r, plugins, dry_run=self.policy.dry_run, now_ns=now)
                     for r in records if r.status in IN_FLIGHT]
        for t in takeovers:
            self._log.write(t.record)  # before acting on it: the next restart must see this takeover
        closed = [t.record for t in takeovers if not t.resumes]
        with self._lock:
            self._last_acted = last_acted([*records, *closed], dry_run=self.policy.dry_run)
            self.loaded = True
            for t in takeovers:
                if t.resumes:
                    self._resume(t)
        for r in [*records, *closed]:
            if r.status not in IN_FLIGHT:
                self._notify(r)
        return len(takeovers)

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
                self._clock(), [a.plan for a in self._in_flight.values()], self._last_acted))
            if reason is not None:
                return self._record(plan, incident, Status.REFUSED, reason, started, plugin, fleet=fleet)
            if self.policy.dry_run:
                decision = self._record(plan, incident, Status.DRY_RUN, "dry run", started, plugin, fleet=fleet)
                if decision.action_id:
                    self._last_acted[(plan.cluster, plan.entity)] = LastAction(self._clock(), incident.key)
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
                              started_at_ns=self._clock() if status is Status.APPLYING else 0,
                              params=dict(plan.params))
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
        self._steps.write_spans([span])
        if approval:
            self.approvals.submit(plan)
        if status in (Status.APPLYING, Status.AWAITING_APPROVAL):
            self._start(RunningAction(record, plan, plugin, trace, approval))
        return Decision(action_id, plan.plugin, incident.incident_id, status, reason, shown)

    # -- running ----------------------------------------------------------------------------

    def _start(self, action: RunningAction) -> None:
        self._in_flight[action.record.action_id] = action
        self.metrics.in_flight.set(len(self._in_flight))
        thread = threading.Thread(target=self._run, args=(action,), name=f"rt-action-{action.record.action_id[:8]}",
                                  daemon=True)
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _resume(self, t: Takeover) -> None:
        """Go on with an action a previous runner left in flight (under the lock)."""
        if t.plan is None or t.plugin is None:
            raise ValueError(f"action {t.record.action_id} was closed, not resumed")
        r = t.record
        trace = ActionTrace(trace_id=r.trace_id, action_id=r.action_id, clock=self._clock, epoch=r.recoveries)
        span = trace.start("action.recover", {**action_attributes(r), "action.recoveries": r.recoveries})
        span.end(self._clock())
        self._steps.write_spans([span])
        log.warning("action %s (%s on %s) was left in flight; %s", r.action_id, r.plugin, r.entity, r.reason)
        self._start(RunningAction(r, t.plan, t.plugin, trace, needs_approval=False, resumed=True))

    def _run(self, a: RunningAction) -> None:
        acted = False
        try:
            if a.needs_approval and not self._approved(a):
                return
            acted = True
            if a.resumed:
                self._steps.resume(a)
            else:
                self._steps.execute(a)
        except Exception:  # a runner bug must not leave the action looking in flight forever
            log.exception("action %s failed in the runner", a.record.action_id)
            self._steps.update(a, status=Status.FAILED, reason="runner error (see the controller log)",
                               ended_at_ns=self._clock())
        finally:
            with self._lock:
                self._in_flight.pop(a.record.action_id, None)
                self.metrics.in_flight.set(len(self._in_flight))
                if acted:
                    self._last_acted[(a.plan.cluster, a.plan.entity)] = LastAction(
                        self._clock(), a.record.incident_key, undone=a.record.status is Status.ROLLED_BACK)
            self.metrics.outcomes.labels(plugin=a.plan.plugin, status=a.record.status.value).inc()
            self._notify(a.record)

    def _notify(self, r: ActionRecord) -> None:
        if not r.took_action or r.status in IN_FLIGHT:
            return
        for listener in self._on_end:
            try:
                listener(r)
            except Exception:  # a listener (a page, a change event) must not undo or stop the runner
                log.exception("action listener failed on action %s (%s)", r.action_id, r.status.value)

    def _approved(self, a: RunningAction) -> bool:
        span = a.trace.start("action.approval", {"action.id": a.record.action_id})
        answer = self.approvals.wait(a.plan.idempotency_key, self.policy.approval_timeout_s)
        verdict = answer.verdict
        span.end(self._clock(), attributes={"approval.verdict": verdict.value,
                                            **({"approval.by": answer.by} if answer.by else {})})
        self._steps.write_spans([span])
        if verdict is Verdict.APPROVED:
            self._steps.update(a, status=Status.APPLYING, reason=_answered("approved", answer, "approved"),
                               started_at_ns=self._clock())
            return True
        status, reason = {
            Verdict.DENIED: (Status.DENIED, _answered("denied", answer, "denied by a human")),
            Verdict.TIMED_OUT: (Status.REFUSED, f"approval timed out after {self.policy.approval_timeout_s:g} s"),
            Verdict.ABANDONED: (Status.REFUSED, "approval abandoned: the runner shut down"),
        }[verdict]
        self._steps.update(a, status=status, reason=reason, ended_at_ns=self._clock())
        return False

    # -- approvals and lifetime -------------------------------------------------------------

    def approve(self, plan_id: str, *, by: str = "", reason: str = "") -> None:
        """Let a plan awaiting approval run (by its idempotency key; ``by`` and ``reason`` go into the action's
        reason); `UnknownPlan` if none is waiting."""
        self.approvals.approve(plan_id, by=by, reason=reason)

    def deny(self, plan_id: str, *, by: str = "", reason: str = "") -> None:
        """Refuse a plan awaiting approval for good (its key is spent); `UnknownPlan` if none is waiting."""
        self.approvals.deny(plan_id, by=by, reason=reason)

    def awaiting_approval(self) -> dict[str, str]:
        """Action id → plan id of the actions now waiting for a human here."""
        with self._lock:
            return {aid: a.plan.idempotency_key for aid, a in self._in_flight.items()
                    if a.needs_approval and a.record.status is Status.AWAITING_APPROVAL}

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
