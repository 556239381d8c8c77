"""Incidents and actions for the dashboard: current versions, read with ``argMax(..., Version)``.

Both are ``ReplacingMergeTree(Version)`` tables, so an id's rows may not be merged yet: each id
reads as its highest version (never ``FINAL``, which would merge whole parts on every page load).
Every value a caller gives is a bound parameter. A table that does not exist yet (nothing has
been written to it) reads as empty.
"""

from __future__ import annotations

from ridethrough.actuators.actions import ACTIONS, ActionRecord
from ridethrough.dashboards.queries import rows, table_exists
from ridethrough.detectors.incidents import INCIDENTS, Incident
from ridethrough.exporters.store import Store

_TIMES = frozenset(c.name for c in INCIDENTS.columns if c.type.startswith("DateTime64"))
_ISEL = ", ".join(f"toUnixTimestamp64Nano({c})" if c in _TIMES else c for c in INCIDENTS.insert_columns)
_INCIDENTS = f"""
SELECT row FROM (
    SELECT argMax(tuple({_ISEL}), Version) AS row, argMax(State, Version) AS state,
           argMax(OpenedAt, Version) AS opened, argMax(ResolvedAt, Version) AS resolved,
           argMax(Severity, Version) AS severity, argMax(Cluster, Version) AS cluster,
           argMax(TraceId, Version) AS trace
    FROM incidents WHERE {{any_id:Bool}} OR IncidentId = {{incident_id:String}}
    GROUP BY IncidentId
)
WHERE ({{cluster:String}} = '' OR cluster = {{cluster:String}})
  AND ({{trace_id:String}} = '' OR trace = {{trace_id:String}})
  AND (NOT {{open_only:Bool}} OR state = 'open')
  AND opened <= fromUnixTimestamp64Nano({{end:Int64}})
  AND (state = 'open' OR resolved >= fromUnixTimestamp64Nano({{start:Int64}}))
ORDER BY state = 'open' DESC, severity DESC, opened DESC
LIMIT {{limit:UInt32}}
"""
_ALL_TIME = (0, (1 << 63) - 1)


def incidents(store: Store, *, start_ns: int = _ALL_TIME[0], end_ns: int = _ALL_TIME[1], cluster: str = "",
              open_only: bool = False, incident_id: str = "", trace_id: str = "", limit: int = 500) -> list[Incident]:
    """Current versions of the incidents open at some time in ``[start_ns, end_ns]``: open ones first, then
    by severity and newest; none when the table does not exist yet."""
    if not table_exists(store, INCIDENTS.name):
        return []
    found = rows(store, _INCIDENTS, {"any_id": not incident_id, "incident_id": incident_id, "trace_id": trace_id,
                                     "cluster": cluster, "open_only": open_only, "start": start_ns, "end": end_ns,
                                     "limit": limit})
    return [Incident.from_row(r["row"]) for r in found]


def incident(store: Store, incident_id: str) -> Incident | None:
    """One incident's current version, or None."""
    found = incidents(store, incident_id=incident_id, limit=1) if incident_id else []
    return found[0] if found else None


def incident_of_trace(store: Store, trace_id: str) -> Incident | None:
    """The incident whose trace this is, or None."""
    found = incidents(store, trace_id=trace_id, limit=1) if trace_id else []
    return found[0] if found else None


_ATIMES = frozenset(c.name for c in ACTIONS.columns if c.type.startswith("DateTime64"))
_ASEL = ", ".join(f"toUnixTimestamp64Nano({c})" if c in _ATIMES else c for c in ACTIONS.insert_columns)
_ACTIONS = f"""
SELECT row FROM (
    SELECT argMax(tuple({_ASEL}), Version) AS row, argMax(DecidedAt, Version) AS decided,
           argMax(Cluster, Version) AS cluster, argMax(IncidentId, Version) AS incident
    FROM actions GROUP BY ActionId
)
WHERE decided >= fromUnixTimestamp64Nano({{since:Int64}}) AND ({{cluster:String}} = '' OR cluster = {{cluster:String}})
  AND ({{incident_id:String}} = '' OR incident = {{incident_id:String}})
ORDER BY decided DESC LIMIT {{limit:UInt32}}
"""


def actions(store: Store, *, since_ns: int = 0, cluster: str = "", incident_id: str = "",
            limit: int = 500) -> list[ActionRecord]:
    """Current versions of the actions decided since ``since_ns`` (of one incident), newest first."""
    if not table_exists(store, ACTIONS.name):
        return []
    found = rows(store, _ACTIONS, {"since": since_ns, "cluster": cluster, "incident_id": incident_id,
                                   "limit": limit})
    return [ActionRecord.from_row(r["row"]) for r in found]
