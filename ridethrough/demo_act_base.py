"""What every act of the demo shares: its context, its result, and watching the store for an incident and its action.

An act injects a real fault through the lab, then polls the store until the outcome it expects
has landed or its time is up, and always undoes the fault. Its result holds only what the store
(or the PagerDuty sink) said: each line is ``ok`` (the piece did its job), ``missing`` (nothing
recorded: the piece is absent or did not act in time) or ``fail`` (recorded, and it failed).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ridethrough import demo_checks as checks
from ridethrough.demo_job import JOB_ID, DemoJob
from ridethrough.demo_stack import Stack

POLL_S = 1.0
TERMINAL = frozenset({"succeeded", "unverified", "failed", "rolled_back", "refused", "denied", "dry_run",
                      "interrupted"})
"""Action states that end a decision (the runner's `Status` values)."""
FINAL = TERMINAL - {"refused"}
"""Decisions an act stops waiting at: a refusal (hysteresis, cooldown) may be followed by an action."""


@dataclass
class Context:
    """What an act may use: the running stack and job, its deadline, a status line and the stop flag."""

    stack: Stack
    job: DemoJob | None
    deadline: float
    """``time.monotonic()`` by which the act ends (its fault undone)."""
    status: Callable[[str], None]
    stop: threading.Event

    def left_s(self) -> float:
        """Seconds left to this act."""
        return self.deadline - time.monotonic()

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds`` (never past the deadline); False when told to stop."""
        return not self.stop.wait(max(0.0, min(seconds, self.left_s())))


@dataclass
class ActResult:
    """One act's outcome: lines for people, facts for the record (and the e2e test)."""

    number: int
    key: str
    title: str
    lines: list[tuple[str, str]] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)

    def add(self, status: str, text: str) -> None:
        """One line: ``ok``, ``missing``, ``fail`` or ``info``."""
        self.lines.append((status, text))


@dataclass
class Seen:
    """An incident and the actions decided on it, as last read."""

    incident: checks.IncidentRow | None = None
    actions: list[checks.ActionRow] = field(default_factory=list)

    @property
    def settled(self) -> bool:
        """An incident with at least one action in a final state."""
        return self.incident is not None and any(a.status in FINAL for a in self.actions)


def find_incident(ctx: Context, *, since_ns: int, kinds: Sequence[str], entities: Sequence[str]) -> Seen:
    """The first incident of ``kinds`` whose entity names one of ``entities``, with its actions."""
    for inc in checks.incidents(ctx.stack.store, since_ns=since_ns, kinds=kinds):
        if any(e == inc.entity or inc.entity.startswith(f"{e}/") for e in entities):
            return Seen(inc, checks.actions(ctx.stack.store, [inc.incident_id]))
    return Seen()


def watch(ctx: Context, *, since_ns: int, kinds: Sequence[str], entities: Sequence[str], what: str,
          until: Callable[[Seen], bool] = lambda s: s.settled) -> Seen:
    """Poll for the incident and its actions until ``until`` holds or the act's time is up."""
    seen = Seen()
    while True:
        seen = find_incident(ctx, since_ns=since_ns, kinds=kinds, entities=entities)
        ctx.status(f"{what}: " + describe(seen, since_ns))
        if until(seen) or not ctx.wait(POLL_S) or ctx.left_s() <= 0:
            return seen


def describe(seen: Seen, since_ns: int) -> str:
    """A short status: waiting, or the incident and its actions' states."""
    if seen.incident is None:
        return f"waiting for an incident ({(time.time_ns() - since_ns) / 1e9:.0f} s)"
    acts = ", ".join(f"{a.plugin} {a.status}" for a in seen.actions) or "no action yet"
    return f"{seen.incident.kind} on {seen.incident.entity} ({seen.incident.state}); {acts}"


def report_incident(result: ActResult, ctx: Context, seen: Seen, *, since_ns: int, want_entity: str,
                    kinds: Sequence[str]) -> None:
    """Lines and facts for the incident, its localisation, its actions and its trace."""
    inc = seen.incident
    result.facts["incident"] = None if inc is None else {
        "id": inc.incident_id, "kind": inc.kind, "entity": inc.entity, "entity_type": inc.entity_type,
        "state": inc.state, "opened_after_s": round((inc.opened_ns - since_ns) / 1e9, 2), "trace_id": inc.trace_id}
    result.facts["actions"] = [{"plugin": a.plugin, "status": a.status, "reason": a.reason, "dry_run": a.dry_run,
                                "summary": a.summary, "timings": a.timings} for a in seen.actions]
    if inc is None:
        result.add("missing", f"no {' / '.join(kinds)} incident recorded for {want_entity} in time")
        return
    after_s = (inc.opened_ns - since_ns) / 1e9
    when = f"opened {after_s:.1f} s after the fault" if after_s >= 0 else "found again (opened before this act)"
    result.add("ok", f"incident {inc.kind} on {inc.entity} {when} ({inc.incident_id})")
    localised = inc.entity == want_entity
    result.facts["localised"] = localised
    result.add("ok" if localised else "missing",
               f"localised to {want_entity}" if localised else f"named {inc.entity}, not {want_entity}")
    if not seen.actions:
        result.add("missing", "no action recorded on this incident (no actuator plugin acted on it in time)")
    for a in seen.actions:
        if a.status == "succeeded":
            state = "ok"
        elif a.status not in TERMINAL or (a.status == "refused" and a.reason.startswith("duplicate")):
            state = "info"  # still running, or the same plan already decided: the runner acting once, as it should
        else:
            state = "fail"
        why = f": {a.reason}" if a.reason else ""
        result.add(state, f"action {a.plugin} {a.status}{' (dry run)' if a.dry_run else ''}{why}")
    spans = checks.trace_spans(ctx.stack.store, inc.trace_id)
    result.facts["trace_spans"] = spans
    result.add("ok" if spans else "missing", f"trace {inc.trace_id or '-'}: {spans} spans "
                                             f"(ridethrough trace {inc.incident_id})")


def job_before(ctx: Context) -> checks.JobProgress | None:
    """The job's progress as the act starts (None without a job)."""
    return None if ctx.job is None else checks.job_progress(ctx.stack.store, JOB_ID)


def report_job(result: ActResult, ctx: Context, before: checks.JobProgress | None, *, settle_s: float = 4.0) -> None:
    """Whether the job kept stepping through the act: steps advanced, none missing, none redone."""
    if ctx.job is None or before is None:
        result.add("missing", "no training job in this run")
        return
    ctx.wait(settle_s)  # the steps of the last seconds reach the store
    after = checks.job_progress(ctx.stack.store, JOB_ID)
    result.facts["job"] = {"steps_before": before.last_step, "steps_after": after.last_step,
                           "gaps": list(after.gaps[:20]), "repeats": after.repeats, "starts_before": before.starts,
                           "starts_after": after.starts, "failed_ends": after.failed_ends}
    advanced = after.last_step > before.last_step
    if advanced and after.continuous:
        result.add("ok", f"job kept training: step {before.last_step} -> {after.last_step}, no step missing or redone")
    elif advanced:
        result.add("fail", f"job advanced {before.last_step} -> {after.last_step} but {len(after.gaps)} steps "
                           f"missing, {after.repeats} redone")
    else:
        result.add("fail", f"job did not advance past step {before.last_step} during the act")
    if after.starts > before.starts:
        result.add("info", f"{after.starts - before.starts} rank process(es) started (a spare taking a rank)")
