"""The ``approvals`` table: operators' approve/deny decisions on actions awaiting approval.

The runner runs inside the controller, and operators reach the controller only through the store:
``ridethrough actions approve|deny`` appends a decision here, or, where the store has one writer,
sends it to the gateway as an ``action.decision`` log record that lands in ``otel_logs``
(`ridethrough.actuators.approvals_events`). The controller's
`ridethrough.actuators.approvals.ApprovalPoller` reads the decisions on the actions its runner holds
from both places and answers them. Append-only (``MergeTree``): a decision is never changed; when two
operators answer the same action, the earliest decision wins, whichever way it came
(`ApprovalLog.first_decisions`).

Every value goes in through parameters or column inserts, never into SQL text: a reason may be any
string an operator typed.

The decisions on one action::

    SELECT Verdict, Operator, Reason, DecidedAt FROM approvals WHERE ActionId = '...' ORDER BY DecidedAt
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ridethrough.actuators.approvals_events import EVENTS_PARAMETERS, EVENTS_SELECT
from ridethrough.exporters import schema
from ridethrough.exporters.schema import Column, Table
from ridethrough.exporters.store import Store

_TIME = "DateTime64(9)"

APPROVALS = Table(
    "approvals",
    (
        Column("DecisionId", "String"),
        Column("ActionId", "String"),
        Column("PlanId", "String"),
        Column("Cluster", "LowCardinality(String)"),
        Column("Verdict", "LowCardinality(String)"),
        Column("Operator", "String"),
        Column("Reason", "String"),
        Column("DecidedAt", _TIME),
    ),
    (),
    "toYYYYMM(DecidedAt)",
    "(Cluster, ActionId, DecidedAt)",
    "cityHash64(Cluster, ActionId)",
)
"""``approvals``: one row per decision. ``ActionId`` names the action (a row of ``actions``) and
``PlanId`` its plan's idempotency key, which the runner's approval queue is keyed by; ``Verdict`` is
``approve`` or ``deny``; ``Operator`` who decided and ``Reason`` why, both as typed."""


class Verdict(enum.Enum):
    """An operator's answer."""

    APPROVE = "approve"
    DENY = "deny"


@dataclass(frozen=True, slots=True)
class Decision:
    """One row of ``approvals``."""

    decision_id: str
    action_id: str
    plan_id: str
    cluster: str
    verdict: Verdict
    operator: str
    reason: str
    decided_at_ns: int

    def row(self) -> tuple[Any, ...]:
        """The values in `APPROVALS`' insert order."""
        return (self.decision_id, self.action_id, self.plan_id, self.cluster, self.verdict.value, self.operator,
                self.reason, self.decided_at_ns)

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> Decision:
        """A decision from a row read in `APPROVALS`' insert order (the time as Unix nanoseconds)."""
        did, aid, pid, cluster, verdict, operator, reason, decided = row
        return cls(did, aid, pid, cluster, Verdict(verdict), operator, reason, int(decided))


def approvals_ddl(*, cluster: str = "") -> Iterator[str]:
    """The statements that create ``approvals`` (``_local`` + Distributed when clustered)."""
    return schema.domain_ddl(APPROVALS, cluster=cluster)


def ensure_approvals_table(store: Store) -> None:
    """Create ``approvals`` if it is missing (idempotent)."""
    store.ensure_table(APPROVALS)


# Both places a decision is recorded, in `Decision` row order: this table, and the gateway's log records.
_FROM_TABLE = """
SELECT DecisionId AS id, ActionId AS action, PlanId AS plan, toString(Cluster) AS cluster,
       toString(Verdict) AS verdict, Operator AS operator, Reason AS reason, toUnixTimestamp64Nano(DecidedAt) AS at
FROM approvals
WHERE ActionId IN {action_ids:Array(String)}
"""
_SOURCES = {APPROVALS.name: _FROM_TABLE, "otel_logs": EVENTS_SELECT}
# The earliest decision on each of the actions (ties broken by decision id, so every reader agrees). Only
# decisions on the plan that waits count (``keys``: "ACTION PLAN", empty: any plan), so a record naming another
# plan can neither win nor hide a later valid one; a verdict this code does not know is no decision; with a
# ``cluster``, only decisions for that cluster count (from the gateway: the cluster it stamped). (Doubled
# braces: server-side parameters inside a str.format template.)
_FIRST = """
SELECT argMin(tuple(id, action, plan, cluster, verdict, operator, reason, at), (at, id)) FROM ({union})
WHERE verdict IN ('approve', 'deny')
  AND (empty({{keys:Array(String)}}) OR concat(action, ' ', plan) IN {{keys:Array(String)}})
  AND ({{cluster:String}} = '' OR cluster = {{cluster:String}})
GROUP BY action
"""
_EXISTING = "SELECT name FROM system.tables WHERE database = currentDatabase() AND name IN {names:Array(String)}"


class ApprovalLog:
    """Writes ``approvals`` through a `Store`, and reads decisions from it and from the gateway's log records."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._sources: tuple[str, ...] = ()  # the tables that hold decisions, once both exist

    def ensure_table(self) -> None:
        """Create the table if it is missing."""
        ensure_approvals_table(self._store)

    def write(self, decision: Decision) -> None:
        """Append one decision; a retry of the same decision id is dropped by the store."""
        token = "approvals:" + hashlib.sha256(decision.decision_id.encode()).hexdigest()
        self._store.insert_columns(APPROVALS, [[v] for v in decision.row()], token=token)

    def first_decisions(self, action_ids: Sequence[str], *, plans: Mapping[str, str] | None = None,
                        cluster: str = "", settings: dict[str, Any] | None = None) -> dict[str, Decision]:
        """Action id → the earliest decision on it, for those of ``action_ids`` that have one, from ``approvals``
        and from ``action.decision`` records in ``otel_logs`` (either table may be missing). With ``plans``
        (action id → the plan it waits with), only decisions naming that plan count; with ``cluster``, only
        decisions for that cluster (a gateway record's is the one the gateway stamped from the sender's token)."""
        if not action_ids:
            return {}
        sources = self._existing(settings)
        if not sources:
            return {}
        union = " UNION ALL ".join(_SOURCES[name] for name in sources)
        keys = [f"{a} {plans[a]}" for a in action_ids if a in plans] if plans else []
        params: dict[str, Any] = {"action_ids": list(action_ids), "keys": keys, "cluster": cluster,
                                  **EVENTS_PARAMETERS}
        _, rows = self._store.query(_FIRST.format(union=union), parameters=params, settings=settings)
        decisions = (Decision.from_row(r[0]) for r in rows)
        return {d.action_id: d for d in decisions}

    def _existing(self, settings: dict[str, Any] | None) -> tuple[str, ...]:
        # Asked until both exist (then they stay): a store the gateway never wrote has no otel_logs, and
        # no operator may have decided anything through the table yet.
        if len(self._sources) < len(_SOURCES):
            _, rows = self._store.query(_EXISTING, parameters={"names": list(_SOURCES)}, settings=settings)
            self._sources = tuple(sorted(r[0] for r in rows))
        return self._sources
