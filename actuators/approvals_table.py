"""The ``approvals`` table: operators' approve/deny decisions on actions awaiting approval.

The runner runs inside the controller, and operators reach the controller only through the store:
``ridethrough actions approve|deny`` appends a decision here, and the controller's
`ridethrough.actuators.approvals.ApprovalPoller` reads the decisions on the actions its runner holds
and answers them. Append-only (``MergeTree``): a decision is never changed; when two operators answer
the same action, the earliest decision wins (`ApprovalLog.first_decisions`).

Every value goes in through parameters or column inserts, never into SQL text: a reason may be any
string an operator typed.

The decisions on one action::

    SELECT Verdict, Operator, Reason, DecidedAt FROM approvals WHERE ActionId = '...' ORDER BY DecidedAt
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

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


_SELECT = ", ".join("toUnixTimestamp64Nano(DecidedAt)" if c == "DecidedAt" else c for c in APPROVALS.insert_columns)
# The earliest decision on each of the actions (ties broken by decision id, so every reader agrees).
_FIRST = f"""
SELECT argMin(tuple({_SELECT}), (DecidedAt, DecisionId)) FROM approvals
WHERE ActionId IN {{action_ids:Array(String)}}
GROUP BY ActionId
"""


class ApprovalLog:
    """Reads and writes ``approvals`` through a `Store`."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def ensure_table(self) -> None:
        """Create the table if it is missing."""
        ensure_approvals_table(self._store)

    def write(self, decision: Decision) -> None:
        """Append one decision; a retry of the same decision id is dropped by the store."""
        token = "approvals:" + hashlib.sha256(decision.decision_id.encode()).hexdigest()
        self._store.insert_columns(APPROVALS, [[v] for v in decision.row()], token=token)

    def first_decisions(self, action_ids: Sequence[str], *,
                        settings: dict[str, Any] | None = None) -> dict[str, Decision]:
        """Action id → the earliest decision on it, for those of ``action_ids`` that have one."""
        if not action_ids:
            return {}
        _, rows = self._store.query(_FIRST, parameters={"action_ids": list(action_ids)}, settings=settings)
        decisions = (Decision.from_row(r[0]) for r in rows)
        return {d.action_id: d for d in decisions}
