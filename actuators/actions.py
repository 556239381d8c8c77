"""The ``actions`` table: every runner decision and every step of every action, restart-safe.

One row per version of an action (``ReplacingMergeTree(Version)``, like ``incidents``): a
decision writes version 1 (``refused``, ``dry_run``, ``awaiting_approval``, ``applying`` or
``failed`` when planning itself failed), and each later phase writes the next. The rows are the
runner's journal: each is written before the step it names starts, so the newest version says
how far an action got::

    applying      apply may have started and may be half done (``StartedAt`` is set)
    verifying     apply returned ok: the plan is applied, its effect is being checked
    rolling_back  apply or verify failed: the partial or complete apply is being undone
    succeeded | unverified | rolled_back | failed | interrupted | refused | denied | dry_run   (final)

``unverified``: applied, and its verify found nothing wrong but could not confirm it either
(too little evidence by the deadline): it stays in place, and says so.

A restarted runner reads the newest version of each action to know which plans were already
decided (idempotency), when each entity was last acted on (cooldown), and which actions a
crash cut short: it finishes those from the stored plan (``Params`` and the plan's fields) by
verifying or rolling back, never by applying again (`ridethrough.actuators.runner_recovery`).

Current state, one row per action::

    SELECT ActionId, Plugin, Entity, Status, Reason FROM actions FINAL ORDER BY DecidedAt
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ridethrough.actuators.policy import LastAction
from ridethrough.exporters import schema
from ridethrough.exporters.schema import Column, Table
from ridethrough.exporters.store import Store

_LC = "LowCardinality(String)"
_TIME = "DateTime64(9)"

ACTIONS = Table(
    "actions",
    (
        Column("ActionId", "String"),
        Column("PlanId", "String"),
        Column("IncidentId", "String"),
        Column("IncidentKey", "String"),
        Column("TraceId", "String"),
        Column("Cluster", _LC),
        Column("Plugin", _LC),
        Column("Entity", "String"),
        Column("Status", _LC),
        Column("Reason", "String"),
        Column("DryRun", "Bool"),
        Column("Summary", "String"),
        Column("Steps", "Array(String)"),
        Column("DrainsHosts", "Array(String)"),
        Column("RemovesPaths", "Array(String)"),
        Column("PathShares", "Map(String, Float64)"),
        Column("Detail", "String"),
        Column("DecidedAt", _TIME),
        Column("StartedAt", _TIME),
        Column("EndedAt", _TIME),
        Column("Timings", "Map(LowCardinality(String), Float64)"),
        Column("Version", "UInt64"),
        Column("Params", "Map(String, String)"),
        Column("Recoveries", "UInt8"),
    ),
    (),
    "toYYYYMM(DecidedAt)",
    "(Cluster, PlanId, ActionId)",
    "cityHash64(Cluster, PlanId)",
    engine="ReplacingMergeTree(Version)",
)
"""``actions``: the highest ``Version`` of an ``ActionId`` is its state. ``PlanId`` is the plan's
idempotency key ('' when planning failed); ``StartedAt``/``EndedAt`` are 0 (1970) until apply
starts/the action ends (an action with a ``StartedAt`` touched the fleet, or may have);
``Timings`` holds seconds per phase (``apply_s``...) and the plugin's own; ``Params`` the plan's
params (with the other plan columns, enough to rebuild the `Plan` after a restart);
``Recoveries`` how many restarted runners have taken the action over."""


class Status(enum.Enum):
    """Where an action is; the first five can be a decision, the rest follow from one."""

    REFUSED = "refused"
    """By policy (the reason says which rule) or an approval that timed out."""
    FAILED = "failed"
    """Planning raised or gave a bad plan, or the action failed and its rollback failed too."""
    DRY_RUN = "dry_run"
    AWAITING_APPROVAL = "awaiting_approval"
    APPLYING = "applying"
    DENIED = "denied"
    VERIFYING = "verifying"
    ROLLING_BACK = "rolling_back"
    SUCCEEDED = "succeeded"
    UNVERIFIED = "unverified"
    """Applied and left in place: the verify found nothing wrong, but had too little evidence to confirm it."""
    ROLLED_BACK = "rolled_back"
    INTERRUPTED = "interrupted"
    """The runner stopped (crashed) mid-action and a restarted one could not finish it (see the
    reason: plugin gone, dry-run mode, too many restarts); never re-run automatically."""


IN_FLIGHT = frozenset({Status.AWAITING_APPROVAL, Status.APPLYING, Status.VERIFYING, Status.ROLLING_BACK})
TOUCHING = frozenset({Status.APPLYING, Status.VERIFYING, Status.ROLLING_BACK})
"""In flight after apply started: the fleet was, or may have been, changed."""


def consumes_key(status: Status, *, dry_run_mode: bool) -> bool:
    """Whether a plan decided with ``status`` may never be decided again (its key is spent).

    A refusal does not spend the key (the same plan may pass later); a dry run spends it only
    for other dry runs, so turning dry-run off lets the plan act for real once.
    """
    if status is Status.REFUSED:
        return False
    if status is Status.DRY_RUN:
        return dry_run_mode
    return True


@dataclass(frozen=True, slots=True)
class ActionRecord:
    """One version of one action (a row of ``actions``)."""

    action_id: str
    plan_id: str
    incident_id: str
    incident_key: str
    trace_id: str
    cluster: str
    plugin: str
    entity: str
    status: Status
    reason: str
    dry_run: bool
    summary: str
    steps: tuple[str, ...]
    drains_hosts: tuple[str, ...]
    removes_paths: tuple[str, ...]
    path_shares: Mapping[str, float]
    detail: str
    decided_at_ns: int
    started_at_ns: int = 0
    ended_at_ns: int = 0
    timings_s: Mapping[str, float] = field(default_factory=dict)
    version: int = 1
    params: Mapping[str, str] = field(default_factory=dict)
    recoveries: int = 0

    @property
    def took_action(self) -> bool:
        """Apply started (the fleet was or may have been changed): what an operator hears about."""
        return self.started_at_ns != 0 and not self.dry_run

    def row(self) -> tuple[Any, ...]:
        """The values in `ACTIONS`' insert order."""
        return (self.action_id, self.plan_id, self.incident_id, self.incident_key, self.trace_id, self.cluster,
                self.plugin, self.entity, self.status.value, self.reason, self.dry_run, self.summary,
                list(self.steps), list(self.drains_hosts), list(self.removes_paths), dict(self.path_shares),
                self.detail, self.decided_at_ns, self.started_at_ns, self.ended_at_ns, dict(self.timings_s),
                self.version, dict(self.params), self.recoveries)

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> ActionRecord:
        """A record from a row read back in `ACTIONS`' insert order (times as Unix nanoseconds)."""
        (aid, pid, iid, ikey, trace, cluster, plugin, entity, status, reason, dry, summary, steps, drains,
         removes, shares, detail, decided, started, ended, timings, version, params, recoveries) = row
        return cls(aid, pid, iid, ikey, trace, cluster, plugin, entity, Status(status), reason, bool(dry), summary,
                   tuple(steps), tuple(drains), tuple(removes), dict(shares), detail, int(decided), int(started),
                   int(ended), dict(timings), int(version), dict(params), int(recoveries))


def actions_ddl(*, cluster: str = "") -> Iterator[str]:
    """The statements that create ``actions`` (``_local`` + Distributed when clustered)."""
    return schema.domain_ddl(ACTIONS, cluster=cluster)


def ensure_actions_table(store: Store) -> None:
    """Create ``actions`` if it is missing (idempotent)."""
    store.ensure_table(ACTIONS)


_TIMES = frozenset(c.name for c in ACTIONS.columns if c.type == _TIME)
_SELECT = ", ".join(f"toUnixTimestamp64Nano({c})" if c in _TIMES else c for c in ACTIONS.insert_columns)
# The newest version of each action of one plan.
_BY_PLAN = f"""
SELECT argMax(tuple({_SELECT}), Version) FROM actions
WHERE Cluster = {{cluster:String}} AND PlanId = {{plan_id:String}}
GROUP BY ActionId
"""
# The newest version of each action that may matter to a starting runner: decided recently
# (cooldowns), or last seen in flight (a crash cut it short).
_RECENT = f"""
SELECT argMax(tuple({_SELECT}), Version) AS row, argMax(Status, Version) AS status,
       argMax(DecidedAt, Version) AS decided
FROM actions
WHERE {{all_clusters:Bool}} OR Cluster = {{cluster:String}}
GROUP BY ActionId
HAVING status IN {{in_flight:Array(String)}} OR decided >= fromUnixTimestamp64Nano(toInt64({{since_ns:Int64}}))
ORDER BY decided
"""


class ActionLog:
    """Reads and writes ``actions`` through the shared `Store`."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def ensure_table(self) -> None:
        """Create the table if it is missing."""
        ensure_actions_table(self._store)

    def write(self, record: ActionRecord) -> None:
        """Insert one version; a retry of the same (action, version) is dropped by the store."""
        token = "actions:" + hashlib.sha256(f"{record.action_id}:{record.version}".encode()).hexdigest()
        self._store.insert_columns(ACTIONS, [[v] for v in record.row()], token=token)

    def by_plan(self, plan_id: str, *, cluster: str) -> list[ActionRecord]:
        """The newest version of every action decided for this plan id."""
        _, rows = self._store.query(_BY_PLAN, parameters={"cluster": cluster, "plan_id": plan_id})
        return [ActionRecord.from_row(r[0]) for r in rows]

    def recent(self, since_ns: int, *, cluster: str | None) -> list[ActionRecord]:
        """Newest versions of actions decided since ``since_ns`` or still in flight (None: every cluster)."""
        _, rows = self._store.query(_RECENT, parameters={
            "all_clusters": cluster is None, "cluster": cluster or "", "since_ns": since_ns,
            "in_flight": sorted(s.value for s in IN_FLIGHT)})
        return [ActionRecord.from_row(r[0]) for r in rows]


def last_acted(records: Iterable[ActionRecord], *, dry_run: bool) -> dict[tuple[str, str], LastAction]:
    """(cluster, entity) → its last action (when it ended, or was decided if it has not), for cooldowns.

    Only actions whose apply started count (they changed the fleet, or may have), and dry runs
    in dry-run mode.
    """
    last: dict[tuple[str, str], LastAction] = {}
    for r in records:
        if r.started_at_ns or (r.status is Status.DRY_RUN and dry_run):
            key, ended = (r.cluster, r.entity), r.ended_at_ns or r.decided_at_ns
            if key not in last or ended >= last[key].ended_ns:
                last[key] = LastAction(ended, r.incident_key, undone=r.status is Status.ROLLED_BACK)
    return last
