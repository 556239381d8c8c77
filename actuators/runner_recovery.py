"""Taking over the actions a previous runner left in flight (it crashed, or was killed mid-action).

The ``actions`` rows are the runner's journal (see `ridethrough.actuators.actions`): the newest
version of an action says how far it got. A starting runner decides, for each one left in flight:

===================  ===========================================================================
left as              what the new runner does
===================  ===========================================================================
awaiting_approval    ``refused``: nothing was applied, and the human who was asked is gone
applying             apply may be half done: **verify**; ok → ``succeeded`` (the apply had
                     completed), else **roll back** (the contract's rollback undoes a partial
                     apply) → ``rolled_back`` or ``failed``
verifying            apply completed: verify again, then the same as above
rolling_back         roll back again (rollback must be idempotent) → ``rolled_back`` or ``failed``
===================  ===========================================================================

Apply is never called again: a plan is applied at most once, whatever crashes when. The plan is
rebuilt from the row (its fields and ``Params``) and must hash to the stored idempotency key,
else the row is not trusted. An action is closed as ``interrupted`` instead (a human looks at
it) when its plugin is no longer loaded, when the runner now runs in dry-run mode (which
promises to change nothing), or after `MAX_RECOVERIES` takeovers (a plugin that crashes its
controller must not crash every later one too).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from ridethrough.actuators.actions import ActionRecord, Status
from ridethrough.actuators.contract import Actuator, Plan

MAX_RECOVERIES = 3
"""Takeovers of one action before it is left to a human as ``interrupted``."""


@dataclass(frozen=True, slots=True)
class Takeover:
    """What a starting runner does with one action left in flight."""

    record: ActionRecord
    """The next version to write: final (``refused``/``interrupted``) or the phase it resumes in."""
    plan: Plan | None = None
    """The rebuilt plan when the action resumes; None when it is closed."""
    plugin: Actuator | None = None

    @property
    def resumes(self) -> bool:
        """True when the runner goes on with the action (verify or rollback)."""
        return self.plan is not None


def rebuild_plan(r: ActionRecord) -> Plan:
    """The `Plan` an action row was decided for (``needs_approval`` is not kept: it no longer matters)."""
    return Plan(plugin=r.plugin, incident_id=r.incident_id, incident_key=r.incident_key, entity=r.entity,
                cluster=r.cluster, summary=r.summary, steps=tuple(r.steps), params=dict(r.params),
                drains_hosts=frozenset(r.drains_hosts), removes_paths=frozenset(r.removes_paths))


def take_over(r: ActionRecord, plugins: Mapping[str, Actuator], *, dry_run: bool, now_ns: int) -> Takeover:
    """What to do with ``r``, the newest version of an action in flight (see the module docstring)."""
    was = f"runner restarted while {r.status.value}"
    if r.status is Status.AWAITING_APPROVAL:
        return Takeover(replace(r, status=Status.REFUSED, reason=was, ended_at_ns=now_ns, version=r.version + 1))
    plugin = plugins.get(r.plugin)
    plan = rebuild_plan(r)
    why_not = None
    if dry_run:
        why_not = "the runner is now in dry-run mode, which changes nothing; check the entity by hand"
    elif plugin is None:
        why_not = f"plugin {r.plugin!r} is not loaded"
    elif r.recoveries >= MAX_RECOVERIES:
        why_not = f"gave up after {r.recoveries} takeovers"
    elif plan.idempotency_key != r.plan_id:
        why_not = "the stored plan does not match its idempotency key"
    if why_not is not None:
        return Takeover(replace(r, status=Status.INTERRUPTED, reason=f"{was}; not finished: {why_not}",
                                ended_at_ns=now_ns, version=r.version + 1))
    if r.status is Status.ROLLING_BACK:
        status, reason = Status.ROLLING_BACK, f"{r.reason}; {was}: rolling back again"
    else:
        status, reason = Status.VERIFYING, f"{was}: verifying what was applied (apply is never repeated)"
    return Takeover(replace(r, status=status, reason=reason, recoveries=r.recoveries + 1, version=r.version + 1),
                    plan, plugin)
