"""The actuator contract: a plugin plans an action for an incident; the runner applies it safely.

    class Reroute:
        name = "reroute"
        def plan(self, incident: Incident, fleet_state: FleetState) -> Plan | None: ...
        def apply(self, plan: Plan, deadline: Deadline) -> Result: ...
        def verify(self, plan: Plan, deadline: Deadline) -> Result: ...
        def rollback(self, plan: Plan, deadline: Deadline) -> Result: ...

``plan`` is pure: it reads the incident and a snapshot of the fleet and says what it would do,
including the blast radius (hosts it drains, paths it removes) that the runner's policy caps.
The runner, not the plugin, checks the policy, records every decision, opens the spans and
enforces the deadlines; a plugin reports failure as a `Result` (raising is isolated too).

A controller can die mid-action. The runner that starts next never calls ``apply`` again: it
calls ``verify`` (the apply may be complete, partial, or not started) and, if that fails,
``rollback``, with the plan rebuilt from the ``actions`` table (so ``params`` must hold all
that apply, verify and rollback need, as strings). ``verify`` and ``rollback`` must therefore
tolerate a partial apply and being called more than once.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from ridethrough.detectors.incidents import Incident


@dataclass(frozen=True, slots=True)
class Deadline:
    """A point on the monotonic clock by which a step must be done; pass it down, ask what remains."""

    at_monotonic_s: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        """The deadline ``seconds`` from now."""
        return cls(time.monotonic() + seconds)

    def remaining_s(self) -> float:
        """Seconds left (0 once passed)."""
        return max(0.0, self.at_monotonic_s - time.monotonic())

    @property
    def expired(self) -> bool:
        """True once the deadline has passed."""
        return time.monotonic() >= self.at_monotonic_s


@dataclass(frozen=True, slots=True)
class Result:
    """What one apply, verify or rollback achieved."""

    ok: bool
    detail: str = ""
    """One line for a human (why it failed, what it changed)."""
    timings_s: Mapping[str, float] = field(default_factory=dict, hash=False)
    """The plugin's own breakdown, e.g. ``{"drain_s": 0.4}``; the runner times each call itself."""
    inconclusive: bool = False
    """A verify that could not decide (too little evidence by its deadline): ``ok``, as nothing showed the action
    wrong, so it stays in place; the runner records it ``unverified`` rather than ``succeeded``."""

    @classmethod
    def success(cls, detail: str = "", **timings_s: float) -> Result:
        """An ok result."""
        return cls(True, detail, timings_s)

    @classmethod
    def undecided(cls, detail: str, **timings_s: float) -> Result:
        """A verify's answer when the evidence did not decide by its deadline; ``detail`` says what was missing."""
        return cls(True, detail, timings_s, inconclusive=True)

    @classmethod
    def failure(cls, detail: str, **timings_s: float) -> Result:
        """A failed result; ``detail`` says why."""
        return cls(False, detail, timings_s)


@dataclass(frozen=True, slots=True)
class FleetState:
    """The snapshot of the fleet every plugin plans against (one per runner round).

    ``paths`` maps each host and each switch to the ids of the fabric paths through it; the
    policy measures a plan's blast radius as the share of a node's paths that would be gone.
    """

    taken_at_ns: int
    open_incidents: tuple[Incident, ...] = ()
    hosts: frozenset[str] = frozenset()
    drained_hosts: frozenset[str] = frozenset()
    """Hosts already out of service (by earlier actions or by hand)."""
    paths: Mapping[str, frozenset[str]] = field(default_factory=dict, hash=False)
    removed_paths: frozenset[str] = frozenset()
    """Paths already routed around."""

    def path_shares(self, removed: frozenset[str]) -> dict[str, float]:
        """For every node that ``removed`` touches: the share of its paths gone with ``removed_paths``."""
        gone = removed | self.removed_paths
        return {node: len(gone & ids) / len(ids) for node, ids in self.paths.items() if ids & removed}

    def unknown_paths(self, ids: frozenset[str]) -> frozenset[str]:
        """The ids in ``ids`` that no host or switch carries."""
        known: set[str] = set()
        for node_paths in self.paths.values():
            known |= node_paths
        return ids - known


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """What a plugin would do about one incident, and the blast radius of doing it."""

    plugin: str
    incident_id: str
    incident_key: str
    entity: str
    cluster: str = ""
    summary: str = ""
    """One line for a human: what and why."""
    steps: tuple[str, ...] = ()
    """The steps apply will take, in order, as a human reads them."""
    params: Mapping[str, str] = field(default_factory=dict, hash=False)
    """What apply needs beyond the incident (e.g. the link to route around)."""
    drains_hosts: frozenset[str] = frozenset()
    removes_paths: frozenset[str] = frozenset()
    needs_approval: bool = False
    """Ask a human even when the policy does not require approval for every plan."""

    @classmethod
    def for_incident(cls, plugin: str, incident: Incident, *, summary: str = "", steps: tuple[str, ...] = (),
                     params: Mapping[str, str] | None = None, drains_hosts: frozenset[str] = frozenset(),
                     removes_paths: frozenset[str] = frozenset(), needs_approval: bool = False) -> Plan:
        """A plan about ``incident`` (its id, key, entity and cluster filled in)."""
        return cls(plugin=plugin, incident_id=incident.incident_id, incident_key=incident.key,
                   entity=incident.entity, cluster=incident.cluster, summary=summary, steps=steps,
                   params=dict(params or {}), drains_hosts=drains_hosts, removes_paths=removes_paths,
                   needs_approval=needs_approval)

    @property
    def idempotency_key(self) -> str:
        """The plan's id: the same plugin, incident and content always give the same key."""
        doc = {"plugin": self.plugin, "incident": self.incident_id, "entity": self.entity, "cluster": self.cluster,
               "steps": list(self.steps), "params": dict(sorted(self.params.items())),
               "drains": sorted(self.drains_hosts), "removes": sorted(self.removes_paths)}
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]


@runtime_checkable
class Actuator(Protocol):
    """A plugin: a ``name`` and the four lifecycle methods (see the module docstring)."""

    @property
    def name(self) -> str:
        """Stable and short: recorded with every action."""
        ...

    def plan(self, incident: Incident, fleet_state: FleetState) -> Plan | None:
        """What to do about ``incident`` (None: nothing for this plugin); must not change anything."""
        ...

    def apply(self, plan: Plan, deadline: Deadline) -> Result:
        """Carry the plan out before ``deadline``."""
        ...

    def verify(self, plan: Plan, deadline: Deadline) -> Result:
        """Check that the applied plan had its effect (also after a restart, when apply may be partial)."""
        ...

    def rollback(self, plan: Plan, deadline: Deadline) -> Result:
        """Undo what apply did (also after a partial apply, and again if a restart cut a rollback short)."""
        ...
