"""Actions taken, as PagerDuty change events: what the actuators did to the fleet, beside the page.

The actuator runner tells its listeners when an action whose apply started ends: succeeded,
rolled back, failed (its rollback failed too: the fleet may be half changed), or interrupted (a
restarted controller could not finish it). `ActionChanges` is such a listener: it queues one
change event per action and final state in the PagerDuty outbox, on the route its incident paged
(or would page), with links to the incident's dashboard page and trace. Refusals, denials and
dry runs changed nothing, so they are not sent: a responder's timeline shows what was done.

An event, as it leaves here (the sender adds ``routing_key``)::

    {"payload": {"summary": "ridethrough reroute on h3-leaf1r0: rolled back (verify failed: loss 30%);
                             route around h3-leaf1r0",
                 "source": "h3-leaf1r0", "timestamp": "2025-01-01T00:00:07.000+00:00",
                 "custom_details": {"action_id": "…", "plugin": "reroute", "outcome": "rolled_back",
                                    "incident_key": "link_down:link:h3-leaf1r0", "trace_id": "…", …}},
     "links": [{"href": "https://dash/incidents/…", "text": "Incident in ridethrough"},
               {"href": "https://dash/traces/…", "text": "Incident trace"}]}

The idempotency key is the action id and its final state, so a runner that tells an action
again after a restart (it does, for recent ones) queues nothing new.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ridethrough.actuators.actions import IN_FLIGHT, ActionRecord, Status
from ridethrough.detectors.incidents import Incident
from ridethrough.exporters import pagerduty_events as events
from ridethrough.exporters.pagerduty import PagerDutyExporter

log = logging.getLogger(__name__)

_OUTCOME = {Status.SUCCEEDED: "succeeded", Status.UNVERIFIED: "applied, not verified",
            Status.ROLLED_BACK: "rolled back", Status.FAILED: "FAILED",
            Status.INTERRUPTED: "interrupted, needs a human"}
"""The final states of an action that touched the fleet, as a summary says them."""

IncidentOf = Callable[[ActionRecord], Incident | None]
"""The incident an action was about (the controller's tracker knows the open and recent ones)."""


def summary(r: ActionRecord) -> str:
    """One line (≤ 1024 characters) for the change event: plugin, entity, outcome (and why), the plan."""
    outcome = _OUTCOME.get(r.status, r.status.value)
    why = "" if r.status is Status.SUCCEEDED or not r.reason else f" ({r.reason})"
    plan = f"; {r.summary}" if r.summary else ""
    return events.truncate(f"ridethrough {r.plugin} on {r.entity}: {outcome}{why}{plan}")


def details(r: ActionRecord) -> dict[str, Any]:
    """``custom_details``: the action, its plan, its incident and trace, and how long each phase took."""
    return {"action_id": r.action_id, "plugin": r.plugin, "entity": r.entity, "cluster": r.cluster,
            "outcome": r.status.value, "reason": r.reason, "detail": r.detail, "plan_id": r.plan_id,
            "plan_summary": r.summary, "steps": list(r.steps), "drains_hosts": list(r.drains_hosts),
            "removes_paths": list(r.removes_paths), "incident_id": r.incident_id, "incident_key": r.incident_key,
            "trace_id": r.trace_id, "decided_at": events.iso8601(r.decided_at_ns),
            "started_at": events.iso8601(r.started_at_ns), "ended_at": events.iso8601(r.ended_at_ns),
            "timings_s": dict(r.timings_s), "takeovers": r.recoveries}


def source(r: ActionRecord) -> str:
    """Where the change happened: the host of ``host/part`` entities, else the entity (a link, a host)."""
    host, sep, part = r.entity.partition("/")
    return host if sep and host and part else (r.entity or r.cluster or "ridethrough")


class ActionChanges:
    """A runner listener that queues a change event for each action that touched the fleet, once it ends."""

    def __init__(self, exporter: PagerDutyExporter, *, incident_of: IncidentOf) -> None:
        self._exporter = exporter
        self._incident_of = incident_of

    def __call__(self, r: ActionRecord) -> None:
        """Queue the change event of ``r`` (nothing for refusals, dry runs and actions still in flight)."""
        if not r.took_action or r.status in IN_FLIGHT:
            return
        incident = self._incident_of(r)
        if incident is not None and incident.incident_id != r.incident_id:
            incident = None  # the key's newer incident, not this action's: route and link by the action's own ids
        self._exporter.change(
            summary=summary(r), at_ns=r.ended_at_ns or r.decided_at_ns, source=source(r), details=details(r),
            incident=incident, idempotency_key=f"action:{r.action_id}:{r.status.value}",
            links=events.incident_links(r.incident_id, r.trace_id, self._exporter.dashboard_url),
            incident_key=r.incident_key, cluster=r.cluster)
