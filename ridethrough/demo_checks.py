"""What the demo's acts read back from the store: incidents, actions, reflex events and job steps.

Every outcome the demo prints comes from here, so what it says is what the store holds: an act
whose action never landed reads "no action recorded", never a made-up success. A store that is
away reads as "nothing yet" (the next poll tries again).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ridethrough.exporters.store import Store, StoreError, StoreUnavailable

log = logging.getLogger(__name__)

_INCIDENTS = """
SELECT IncidentId, Kind, EntityType, Entity, State, toUnixTimestamp64Nano(OpenedAt),
       toUnixTimestamp64Nano(ResolvedAt), TraceId, Summary
FROM incidents FINAL
WHERE greatest(OpenedAt, LastFindingAt) >= fromUnixTimestamp64Nano({since:Int64}) AND Kind IN {kinds:Array(String)}
ORDER BY OpenedAt
"""
_ACTIONS = """
SELECT ActionId, IncidentId, Plugin, Entity, Status, Reason, DryRun, Summary, Timings, Detail
FROM actions FINAL
WHERE IncidentId IN {ids:Array(String)}
ORDER BY DecidedAt
"""
_REFLEX = """
SELECT ResourceAttributes['ridethrough.node.id'], LogAttributes['event.name'], LogAttributes['reflex.peer'],
       toFloat64OrZero(LogAttributes['reflex.evidence_ms']), toFloat64OrZero(LogAttributes['reflex.apply_ms']),
       toUnixTimestamp64Nano(Timestamp)
FROM otel_logs
WHERE Timestamp >= fromUnixTimestamp64Nano({since:Int64}) AND startsWith(LogAttributes['event.name'], 'reflex.')
ORDER BY Timestamp
"""
# DISTINCT: an agent resends an event batch the gateway stored after the agent had given up waiting
# (collector/export_logs.py), so one report may be stored twice; the same (rank, step) with another
# end time is a step run again (after a restart from a checkpoint), which is what `repeats` counts.
_STEPS = """
SELECT DISTINCT toUInt32OrZero(LogAttributes['job.rank']) AS rank, toInt64OrZero(LogAttributes['job.step']) AS step,
       toInt64OrZero(LogAttributes['job.step.end_ns']) AS end_ns
FROM otel_logs
WHERE LogAttributes['event.name'] = 'job.step' AND LogAttributes['job.id'] = {job:String}
"""
_STARTS = """
SELECT DISTINCT LogAttributes['event.name'], LogAttributes['job.rank'], LogAttributes['job.end.reason'],
       LogAttributes['job.time_ns']
FROM otel_logs
WHERE LogAttributes['event.name'] IN ('job.started', 'job.ended') AND LogAttributes['job.id'] = {job:String}
"""
SPAN_COUNT = "SELECT count() FROM otel_traces WHERE TraceId = {trace:String}"


@dataclass(frozen=True, slots=True)
class IncidentRow:
    """An incident as the store holds it now."""

    incident_id: str
    kind: str
    entity_type: str
    entity: str
    state: str
    opened_ns: int
    resolved_ns: int
    trace_id: str
    summary: str


@dataclass(frozen=True, slots=True)
class ActionRow:
    """An action decided on an incident, at its latest version."""

    action_id: str
    incident_id: str
    plugin: str
    entity: str
    status: str
    reason: str
    dry_run: bool
    summary: str
    timings: dict[str, float]
    detail: str = ""
    """What the last step said (a verify's evidence, a failure's reason)."""


@dataclass(frozen=True, slots=True)
class ReflexEvent:
    """One reflex decision an agent reported (``reflex.reroute``, ``.return``, ``.held``, ``.failed``)."""

    node: str
    name: str
    peer: str
    evidence_ms: float
    apply_ms: float
    time_ns: int


@dataclass(frozen=True, slots=True)
class JobProgress:
    """A job's steps so far, from its ranks' step events."""

    ranks: int
    last_step: int
    """Highest step any rank completed; -1 before the first."""
    last_step_end_ns: int
    gaps: tuple[int, ...]
    """Steps below ``last_step`` that no rank reported (empty: continuous)."""
    starts: int
    """``job.started`` events: one per rank process, spares taking a rank included."""
    failed_ends: int
    """``job.ended`` events whose reason is not ``completed`` (a rank that died or was stopped)."""
    repeats: int
    """(rank, step) pairs reported more than once: work redone, as after a restart from a checkpoint."""

    @property
    def continuous(self) -> bool:
        """Steps advanced with none missing and none redone."""
        return self.last_step >= 0 and not self.gaps and not self.repeats


def _rows(store: Store, sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    try:
        _, rows = store.query(sql, parameters=params)
    except (StoreUnavailable, StoreError) as exc:  # the next poll tries again
        log.warning("demo check: store query failed (tried again at the next poll): %s", exc)
        return []
    return list(rows)


def incidents(store: Store, *, since_ns: int, kinds: Sequence[str]) -> list[IncidentRow]:
    """Incidents of ``kinds`` opened, or found again, since ``since_ns`` (a reopened incident keeps its first
    opening time), oldest first."""
    rows = _rows(store, _INCIDENTS, {"since": since_ns, "kinds": list(kinds)})
    return [IncidentRow(str(r[0]), str(r[1]), str(r[2]), str(r[3]), str(r[4]), int(r[5]), int(r[6]), str(r[7]),
                        str(r[8])) for r in rows]


def actions(store: Store, incident_ids: Sequence[str]) -> list[ActionRow]:
    """Every action decided on these incidents, oldest first."""
    if not incident_ids:
        return []
    rows = _rows(store, _ACTIONS, {"ids": list(incident_ids)})
    return [ActionRow(str(r[0]), str(r[1]), str(r[2]), str(r[3]), str(r[4]), str(r[5]), bool(r[6]), str(r[7]),
                      {str(k): float(v) for k, v in dict(r[8]).items()}, str(r[9])) for r in rows]


def reflex_events(store: Store, *, since_ns: int) -> list[ReflexEvent]:
    """Reflex decisions reported since ``since_ns``, oldest first."""
    rows = _rows(store, _REFLEX, {"since": since_ns})
    return [ReflexEvent(str(r[0]), str(r[1]), str(r[2]), float(r[3]), float(r[4]), int(r[5])) for r in rows]


def trace_spans(store: Store, trace_id: str) -> int:
    """Spans stored under one trace (0 for none, or an empty id)."""
    if not trace_id:
        return 0
    rows = _rows(store, SPAN_COUNT, {"trace": trace_id})
    return int(rows[0][0]) if rows else 0


def job_progress(store: Store, job: str) -> JobProgress:
    """The job's steps, their continuity and its rank (re)starts, from its step and lifecycle events."""
    steps = _rows(store, _STEPS, {"job": job})
    done = {int(step) for _, step, _ in steps}
    pairs = [(int(rank), int(step)) for rank, step, _ in steps]
    last = max(done, default=-1)
    first = min(done, default=0)
    gaps = tuple(s for s in range(first, last) if s not in done)
    events = _rows(store, _STARTS, {"job": job})
    starts = sum(1 for name, *_ in events if name == "job.started")
    failed = sum(1 for name, _, reason, _ in events if name == "job.ended" and reason != "completed")
    last_end = max((int(end) for _, step, end in steps if int(step) == last), default=0)
    return JobProgress(ranks=len({int(rank) for rank, _, _ in steps}), last_step=last, last_step_end_ns=last_end,
                       gaps=gaps, starts=starts, failed_ends=failed, repeats=len(pairs) - len(set(pairs)))
