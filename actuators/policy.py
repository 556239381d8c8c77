"""The runner's safety policy: its config, and the pure check of one plan against it.

`refusal` answers "may this plan run now?" with None or the reason it may not, from the
plan, its incident, the fleet snapshot and what is already in flight. Checks, first match wins:

1. one action per entity at a time, and none changing paths an action in flight changes (one's
   rollback would restore what the other moved);
2. hysteresis: the incident has been open at least ``hysteresis_s`` (flapping evidence does not act);
3. cooldown: the entity's last action ended at least ``cooldown_s`` ago, unless that action was rolled
   back and for another incident (a prediction whose reroute did not verify must not hold back the
   same link's failure: nothing of the first is left to fight with);
4. at most ``max_concurrent`` actions in flight (awaiting approval counts: its radius is reserved);
5. blast radius: at most ``max_drained_hosts`` hosts drained at once, and no host or switch
   losing more than ``max_path_share`` of its paths, counting what is already drained or
   removed and what actions in flight will drain or remove.

Idempotency (a plan already decided never runs twice) needs the store, so the runner checks it.
A plan that passes may still need a human: `ApprovalQueue` holds it until approve, deny or timeout,
and remembers who answered and why (`Answer`).
"""

from __future__ import annotations

import enum
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields

from ridethrough.actuators.contract import FleetState, Plan
from ridethrough.detectors.incidents import Incident

_NS_PER_S = 1_000_000_000


@dataclass(frozen=True, slots=True, kw_only=True)
class RunnerPolicy:
    """How cautious the actuator runner is (mirrored into the runner's settings)."""

    dry_run: bool = True
    """Decide and record, apply nothing (the safe default: acting is opted into)."""
    max_concurrent: int = 2
    """Actions in flight at once, awaiting approval included."""
    max_drained_hosts: int = 1
    """Hosts out of service at once, already drained ones included."""
    max_path_share: float = 0.5
    """Largest share (0..1) of one host's or one switch's paths that may be removed."""
    cooldown_s: float = 300.0
    """After an action on an entity ends, no other action on it for this long."""
    hysteresis_s: float = 10.0
    """An incident must have been open this long before it is acted on."""
    require_approval: bool = False
    """Every plan waits for a human's approve/deny (plans may also ask for it themselves)."""
    approval_timeout_s: float = 600.0
    """A plan not approved within this long is refused."""
    plan_timeout_s: float = 5.0
    apply_timeout_s: float = 60.0
    verify_timeout_s: float = 60.0
    rollback_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "dry_run" or f.name == "require_approval":
                if not isinstance(value, bool):
                    raise ValueError(f"RunnerPolicy.{f.name} must be true or false, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"RunnerPolicy.{f.name} must be a finite number, got {value!r}")
        positive = ("max_concurrent", "approval_timeout_s", "plan_timeout_s", "apply_timeout_s",
                    "verify_timeout_s", "rollback_timeout_s")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"RunnerPolicy.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("max_drained_hosts", "cooldown_s", "hysteresis_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"RunnerPolicy.{name} must be >= 0, got {getattr(self, name)!r}")
        if not 0 <= self.max_path_share <= 1:
            raise ValueError(f"RunnerPolicy.max_path_share must be within 0..1, got {self.max_path_share!r}")


@dataclass(frozen=True, slots=True)
class LastAction:
    """An entity's last action, as the cooldown weighs it."""

    ended_ns: int
    """When it ended (or a dry run was decided)."""
    incident_key: str
    undone: bool = False
    """Rolled back: the fleet is as it was before it."""


@dataclass(frozen=True, slots=True)
class InFlight:
    """What the runner is doing now, as the policy weighs it."""

    now_ns: int
    plans: Sequence[Plan] = ()
    """Plans accepted and not yet finished (awaiting approval, applying, verifying, rolling back)."""
    last_acted: Mapping[tuple[str, str], LastAction] | None = None
    """(cluster, entity) → its last action that started (or a dry run)."""


def refusal(policy: RunnerPolicy, plan: Plan, incident: Incident, fleet: FleetState, now: InFlight) -> str | None:
    """None if ``plan`` may run now, else why not (one line, recorded with the refusal)."""
    entity = (plan.cluster, plan.entity)
    if any((p.cluster, p.entity) == entity for p in now.plans):
        return f"busy: an action on {plan.entity} is in flight"
    for p in now.plans:
        # Two actions changing the same routes would undo each other: one's rollback restores what the other moved.
        shared = plan.removes_paths & p.removes_paths if p.cluster == plan.cluster else frozenset()
        if shared:
            return f"busy: the action on {p.entity} in flight changes {len(shared)} of the same paths"
    open_s = (now.now_ns - incident.opened_at_ns) / _NS_PER_S
    if open_s < policy.hysteresis_s:
        return f"hysteresis: incident open {open_s:.1f} s < {policy.hysteresis_s:g} s"
    last = (now.last_acted or {}).get(entity)
    if (last is not None and (since_s := (now.now_ns - last.ended_ns) / _NS_PER_S) < policy.cooldown_s
            and not (last.undone and last.incident_key != incident.key)):
        return f"cooldown: last action on {plan.entity} ended {since_s:.1f} s ago < {policy.cooldown_s:g} s"
    if len(now.plans) >= policy.max_concurrent:
        return f"concurrency: {len(now.plans)} actions in flight (max {policy.max_concurrent})"
    return _blast_radius(policy, plan, fleet, now.plans)


def _blast_radius(policy: RunnerPolicy, plan: Plan, fleet: FleetState, inflight: Sequence[Plan]) -> str | None:
    unknown_hosts = plan.drains_hosts - fleet.hosts
    if unknown_hosts:
        return f"blast radius: drains hosts unknown to the fleet: {', '.join(sorted(unknown_hosts))}"
    unknown_paths = fleet.unknown_paths(plan.removes_paths)
    if unknown_paths:
        return f"blast radius: removes paths unknown to the fleet: {', '.join(sorted(unknown_paths))}"
    drained = fleet.drained_hosts | plan.drains_hosts
    for p in inflight:
        drained |= p.drains_hosts
    if plan.drains_hosts and len(drained) > policy.max_drained_hosts:
        return f"blast radius: {len(drained)} hosts would be drained (max {policy.max_drained_hosts})"
    removed = plan.removes_paths
    for p in inflight:
        removed |= p.removes_paths
    shares = fleet.path_shares(removed)
    over = {n: s for n, s in shares.items() if fleet.paths[n] & plan.removes_paths and s > policy.max_path_share}
    if over:
        node, share = max(over.items(), key=lambda kv: (kv[1], kv[0]))
        return (f"blast radius: {node} would lose {share:.0%} of its paths "
                f"(max {policy.max_path_share:.0%})")
    return None


class UnknownPlan(LookupError):
    """approve/deny named a plan that is not awaiting approval."""


class Verdict(enum.Enum):
    """How a wait for approval ended."""

    APPROVED = "approved"
    DENIED = "denied"
    TIMED_OUT = "timed_out"
    ABANDONED = "abandoned"
    """The runner shut down while the plan waited."""


@dataclass(frozen=True, slots=True)
class Answer:
    """How a wait for approval ended, and who gave the answer (empty for a timeout, or a caller that
    did not say)."""

    verdict: Verdict
    by: str = ""
    reason: str = ""


@dataclass(eq=False)
class _Waiting:
    plan: Plan
    answered: threading.Event = field(default_factory=threading.Event)
    verdict: Verdict | None = None
    by: str = ""
    reason: str = ""


class ApprovalQueue:
    """Plans waiting for a human, by plan id (the idempotency key): `approve`, `deny`, or a timeout refuses."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[str, _Waiting] = {}
        self._closed = False

    def submit(self, plan: Plan) -> None:
        """Put ``plan`` in the queue (before the runner starts waiting for it)."""
        with self._lock:
            entry = _Waiting(plan)
            if self._closed:
                entry.verdict = Verdict.ABANDONED
                entry.answered.set()
            self._waiting[plan.idempotency_key] = entry

    def wait(self, plan_id: str, timeout_s: float) -> Answer:
        """Block until the plan is answered or ``timeout_s`` passes; the plan leaves the queue."""
        with self._lock:
            entry = self._waiting[plan_id]
        entry.answered.wait(timeout_s)
        with self._lock:
            # An answer that races the timeout wins: it was given before the plan left the queue.
            entry.verdict = entry.verdict or Verdict.TIMED_OUT
            del self._waiting[plan_id]
            return Answer(entry.verdict, entry.by, entry.reason)

    def pending(self) -> list[Plan]:
        """Plans not yet answered, in the order they arrived."""
        with self._lock:
            return [w.plan for w in self._waiting.values() if w.verdict is None]

    def approve(self, plan_id: str, *, by: str = "", reason: str = "") -> None:
        """Let the plan run (``by``: who approved, ``reason``: why); `UnknownPlan` if it is not waiting."""
        self._answer(plan_id, Verdict.APPROVED, by, reason)

    def deny(self, plan_id: str, *, by: str = "", reason: str = "") -> None:
        """Refuse the plan for good (``by``: who denied, ``reason``: why); `UnknownPlan` if it is not waiting."""
        self._answer(plan_id, Verdict.DENIED, by, reason)

    def _answer(self, plan_id: str, verdict: Verdict, by: str, reason: str) -> None:
        with self._lock:
            entry = self._waiting.get(plan_id)
            if entry is None or entry.verdict is not None:
                waiting = ", ".join(k for k, w in self._waiting.items() if w.verdict is None) or "none"
                raise UnknownPlan(f"no plan {plan_id!r} is awaiting approval (waiting: {waiting})")
            entry.verdict, entry.by, entry.reason = verdict, by, reason
            entry.answered.set()

    def close(self) -> None:
        """Abandon every waiting plan, and any submitted later (the runner is shutting down)."""
        with self._lock:
            self._closed = True
            for entry in self._waiting.values():
                if entry.verdict is None:
                    entry.verdict = Verdict.ABANDONED
                    entry.answered.set()
