"""Incidents: findings folded by key (kind + entity) into one record with a lifecycle.

    open ──finding──▶ updated (severity = max) ──quiet for quiet_s──▶ resolved
      ▲                                                                 │
      └────────── found again within reopen_hysteresis_s (same id) ◀────┘

The state lives in the store, in ``incidents``: every transition is a new row version
(``ReplacingMergeTree(Version)``), so a restarted tracker `load`\\ s what is open (and what was
resolved recently enough to reopen) and carries on without reopening or duplicating anything.
Flapping evidence makes one incident: a key must stay quiet for ``quiet_s`` before it
resolves, and coming back within ``reopen_hysteresis_s`` reopens the same incident.

Current state, one row per incident::

    SELECT IncidentId, Key, State, Severity, Findings FROM incidents FINAL ORDER BY OpenedAt
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import secrets
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ridethrough.detectors.contract import Finding, Severity
from ridethrough.exporters import schema
from ridethrough.exporters.schema import Column, Table
from ridethrough.exporters.store import Store

log = logging.getLogger(__name__)

_LC = "LowCardinality(String)"
_TIME = "DateTime64(9)"
_NS_PER_S = 1_000_000_000

INCIDENTS = Table(
    "incidents",
    (
        Column("IncidentId", "String"),
        Column("Key", "String"),
        Column("Kind", _LC),
        Column("EntityType", _LC),
        Column("Entity", "String"),
        Column("Cluster", _LC),
        Column("Detector", _LC),
        Column("Severity", "UInt8"),
        Column("State", _LC),
        Column("OpenedAt", _TIME),
        Column("UpdatedAt", _TIME),
        Column("ResolvedAt", _TIME),
        Column("LastFindingAt", _TIME),
        Column("Findings", "UInt32"),
        Column("Reopens", "UInt16"),
        Column("Summary", "String"),
        Column("Evidence", "String"),
        Column("TraceId", "String"),
        Column("Version", "UInt64"),
    ),
    (),
    "toYYYYMM(OpenedAt)",
    "(Cluster, Key, IncidentId)",
    "cityHash64(Cluster, Key)",
    engine="ReplacingMergeTree(Version)",
)
"""``incidents``: one row per transition; the highest ``Version`` of an ``IncidentId`` is its state.
``ResolvedAt`` is 0 (1970) while open; ``Evidence`` is the newest finding's evidence as JSON;
``LastFindingAt`` is the controller time the key was last found (quiet is measured from it)."""

_TIMES = frozenset(c.name for c in INCIDENTS.columns if c.type == _TIME)
_SELECT = ", ".join(f"toUnixTimestamp64Nano({c})" if c in _TIMES else c for c in INCIDENTS.insert_columns)
# The newest version of every incident still open, or resolved since {since_ns} (it may reopen).
_LOAD = f"""
SELECT argMax(tuple({_SELECT}), Version) AS row,
       argMax(State, Version) AS state, argMax(ResolvedAt, Version) AS resolved_at
FROM incidents
WHERE {{all_clusters:Bool}} OR Cluster = {{cluster:String}}
GROUP BY IncidentId
HAVING state = 'open' OR resolved_at >= fromUnixTimestamp64Nano(toInt64({{since_ns:Int64}}))
"""


class State(enum.Enum):
    """Where an incident is in its lifecycle."""

    OPEN = "open"
    RESOLVED = "resolved"


class TransitionKind(enum.Enum):
    """What happened to an incident in one `IncidentTracker.observe`."""

    OPENED = "opened"
    UPDATED = "updated"
    ESCALATED = "escalated"
    """Updated, and its severity went up."""
    RESOLVED = "resolved"
    REOPENED = "reopened"


@dataclass(frozen=True, slots=True)
class Incident:
    """One version of an incident (a row of ``incidents``)."""

    incident_id: str
    key: str
    kind: str
    entity_type: str
    entity: str
    cluster: str
    detector: str
    severity: Severity
    state: State
    opened_at_ns: int
    updated_at_ns: int
    resolved_at_ns: int
    last_finding_at_ns: int
    findings: int
    reopens: int
    summary: str
    evidence: str
    trace_id: str
    version: int

    def row(self) -> tuple[Any, ...]:
        """The values in `INCIDENTS`' insert order."""
        return (self.incident_id, self.key, self.kind, self.entity_type, self.entity, self.cluster, self.detector,
                int(self.severity), self.state.value, self.opened_at_ns, self.updated_at_ns, self.resolved_at_ns,
                self.last_finding_at_ns, self.findings, self.reopens, self.summary, self.evidence, self.trace_id,
                self.version)

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> Incident:
        """An incident from a row read back in `INCIDENTS`' insert order."""
        (iid, key, kind, etype, entity, cluster, detector, severity, state, opened, updated, resolved, last,
         findings, reopens, summary, evidence, trace_id, version) = row
        return cls(iid, key, kind, etype, entity, cluster, detector, Severity(severity), State(state), int(opened),
                   int(updated), int(resolved), int(last), int(findings), int(reopens), summary, evidence,
                   trace_id, int(version))


@dataclass(frozen=True, slots=True)
class Transition:
    """One change of one incident: what happened, and the incident's new version."""

    kind: TransitionKind
    incident: Incident
    finding: Finding | None
    """The finding behind it (None for a resolution)."""


def incidents_ddl(*, cluster: str = "") -> Iterator[str]:
    """The statements that create ``incidents`` (``_local`` + Distributed when clustered)."""
    return schema.domain_ddl(INCIDENTS, cluster=cluster)


def ensure_incidents_table(store: Store) -> None:
    """Create ``incidents`` if it is missing (idempotent)."""
    store.ensure_table(INCIDENTS)


def new_trace_id() -> str:
    """A random 16-byte trace id as lower-case hex (the incident's trace)."""
    return secrets.token_hex(16)


class IncidentTracker:
    """Folds findings into incidents and writes every transition to the store (see the module docstring)."""

    def __init__(self, store: Store, *, quiet_s: float = 30.0, reopen_hysteresis_s: float = 120.0,
                 clock: Callable[[], int] = time.time_ns, cluster: str | None = None) -> None:
        self._store = store
        self._cluster = cluster
        self._quiet_ns = round(quiet_s * _NS_PER_S)
        self._hysteresis_ns = round(reopen_hysteresis_s * _NS_PER_S)
        self._clock = clock
        self._by_key: dict[tuple[str, str], Incident] = {}
        self.loaded = False
        """True once `load` has read the store's state (observing before that could duplicate)."""

    def load(self) -> int:
        """Read open and recently resolved incidents from the store; returns how many are open.

        With a ``cluster``, only that cluster's incidents are this tracker's to update and resolve.
        """
        ensure_incidents_table(self._store)
        since = self._clock() - self._hysteresis_ns
        _, rows = self._store.query(_LOAD, parameters={
            "since_ns": since, "all_clusters": self._cluster is None, "cluster": self._cluster or ""})
        by_key: dict[tuple[str, str], Incident] = {}
        for row, _, _ in rows:
            incident = Incident.from_row(row)
            current = by_key.get((incident.cluster, incident.key))
            # Two incidents of one key (only possible after an unclean past): keep the newer.
            if current is None or incident.updated_at_ns > current.updated_at_ns:
                by_key[(incident.cluster, incident.key)] = incident
        self._by_key = by_key
        self.loaded = True
        return len(self.open())

    def open(self) -> list[Incident]:
        """The incidents open now, oldest first."""
        return sorted((i for i in self._by_key.values() if i.state is State.OPEN), key=lambda i: i.opened_at_ns)

    def get(self, key: str, *, cluster: str = "") -> Incident | None:
        """The latest known version of the incident with this key (open or recently resolved)."""
        return self._by_key.get((cluster, key))

    def observe(self, findings: Iterable[Finding], now_ns: int, *,
                ran: Collection[str] | None = None) -> list[Transition]:
        """Fold one round of findings in; write and return the transitions.

        ``ran`` names the detectors that ran (successfully) this round: only their incidents
        can resolve, so a detector that is slow or failing does not resolve what it found.
        None: every detector ran. Nothing changes in memory unless the write succeeds.
        """
        latest: dict[tuple[str, str], Finding] = {}
        for finding in findings:
            k = (finding.cluster, finding.key)
            if k not in latest or finding.severity > latest[k].severity:
                latest[k] = finding
        transitions = [self._fold(f, now_ns) for f in latest.values()]
        transitions += self._resolutions(set(latest), now_ns, ran)
        self._write(transitions)
        for t in transitions:
            self._by_key[(t.incident.cluster, t.incident.key)] = t.incident
        self._forget_old(now_ns)
        return transitions

    def _fold(self, f: Finding, now_ns: int) -> Transition:
        current = self._by_key.get((f.cluster, f.key))
        if current is None or (current.state is State.RESOLVED
                               and now_ns - current.resolved_at_ns >= self._hysteresis_ns):
            return Transition(TransitionKind.OPENED, self._opened(f, now_ns), f)
        severity = max(current.severity, f.severity)
        updated = replace(current, severity=severity, detector=f.detector, updated_at_ns=now_ns,
                          last_finding_at_ns=now_ns, findings=current.findings + 1, summary=f.summary,
                          evidence=_evidence(f), version=current.version + 1)
        if current.state is State.RESOLVED:
            reopened = replace(updated, state=State.OPEN, resolved_at_ns=0, reopens=current.reopens + 1)
            return Transition(TransitionKind.REOPENED, reopened, f)
        kind = TransitionKind.ESCALATED if severity > current.severity else TransitionKind.UPDATED
        return Transition(kind, updated, f)

    @staticmethod
    def _opened(f: Finding, now_ns: int) -> Incident:
        return Incident(uuid.uuid4().hex, f.key, f.kind.value, f.entity_type.value, f.entity, f.cluster,
                        f.detector, f.severity, State.OPEN, now_ns, now_ns, 0, now_ns, 1, 0, f.summary,
                        _evidence(f), new_trace_id(), 1)

    def _resolutions(self, seen: set[tuple[str, str]], now_ns: int,
                     ran: Collection[str] | None) -> list[Transition]:
        out = []
        for k, incident in self._by_key.items():
            if incident.state is not State.OPEN or k in seen:
                continue
            if ran is not None and incident.detector not in ran:
                continue
            if now_ns - incident.last_finding_at_ns >= self._quiet_ns:
                resolved = replace(incident, state=State.RESOLVED, resolved_at_ns=now_ns, updated_at_ns=now_ns,
                                   version=incident.version + 1)
                out.append(Transition(TransitionKind.RESOLVED, resolved, None))
        return out

    def _write(self, transitions: Sequence[Transition]) -> None:
        if not transitions:
            return
        rows = [t.incident.row() for t in transitions]
        ids = ",".join(sorted(f"{t.incident.incident_id}:{t.incident.version}" for t in transitions))
        # A retried batch carries the same (id, version) pairs, so the store drops it as a duplicate.
        token = "incidents:" + hashlib.sha256(ids.encode()).hexdigest()
        self._store.insert_columns(INCIDENTS, [list(c) for c in zip(*rows, strict=True)], token=token)

    def _forget_old(self, now_ns: int) -> None:
        # Resolved incidents past the hysteresis can no longer reopen: the next finding opens a new one.
        stale = [k for k, i in self._by_key.items()
                 if i.state is State.RESOLVED and now_ns - i.resolved_at_ns >= self._hysteresis_ns]
        for k in stale:
            del self._by_key[k]


def _evidence(f: Finding) -> str:
    doc = {"detector": f.detector, "confidence": f.confidence, "observed_at_ns": f.observed_at_ns,
           "time_to_failure_s": f.time_to_failure_s, "evidence": dict(f.evidence)}
    return json.dumps(doc, default=str, sort_keys=True)
