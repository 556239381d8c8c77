"""Fleet audits for the dashboard, from both places an audit is recorded.

* the ``audits`` table (`ridethrough.audit_store`: an audit that wrote into a store it could write), with
  its JSON result and HTML report;
* ``audit.completed`` log records in ``otel_logs`` (`ridethrough.audit_events`: an audit recorded through a
  gateway, the one writer of a lab's store), with the JSON result as the body; the report is rendered from it.

An audit found in both reads from the table. Every value a caller gives is a bound parameter; a table that
does not exist yet reads as empty.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ridethrough.audit_events import EVENT, SERVICE, result_from_json
from ridethrough.audit_report import render_html
from ridethrough.audit_store import AUDITS
from ridethrough.dashboards.queries import rows, table_exists
from ridethrough.exporters.store import Store


@dataclass(frozen=True, slots=True)
class AuditSummary:
    """One audit as the list shows it."""

    audit_id: str
    cluster: str
    started_ns: int
    ended_ns: int
    budget_s: float
    status: str
    hosts: int
    hosts_failed: int
    links: int
    links_failed: int
    anomalies: int
    not_covered: int
    summary: str

    @property
    def duration_s(self) -> float:
        """How long it ran."""
        return max(0.0, (self.ended_ns - self.started_ns) / 1e9)


_FIELDS = ("audit_id, cluster, started_ns, ended_ns, budget_s, status, hosts, hosts_failed, links, links_failed, "
           "anomalies, not_covered, summary")
_FROM_TABLE = f"""
SELECT {_FIELDS} FROM (
    SELECT AuditId AS audit_id, any(Cluster) AS cluster, toInt64(toUnixTimestamp64Nano(any(StartedAt))) AS started_ns,
           toInt64(toUnixTimestamp64Nano(any(EndedAt))) AS ended_ns, any(BudgetSeconds) AS budget_s,
           any(Status) AS status, toInt64(any(Hosts)) AS hosts, toInt64(any(HostsFailed)) AS hosts_failed,
           toInt64(any(Links)) AS links, toInt64(any(LinksFailed)) AS links_failed,
           toInt64(any(Anomalies)) AS anomalies, toInt64(length(any(NotCovered))) AS not_covered,
           any(Summary) AS summary
    FROM audits WHERE {{cluster:String}} = '' OR Cluster = {{cluster:String}}
    GROUP BY AuditId
) ORDER BY started_ns DESC LIMIT {{limit:UInt32}}
"""
_EVENTS_WHERE = f"ServiceName = '{SERVICE}' AND LogAttributes['event.name'] = '{EVENT}'"
_FROM_EVENTS = f"""
SELECT {_FIELDS} FROM (
    SELECT LogAttributes['audit.id'] AS audit_id, any(LogAttributes['cluster']) AS cluster,
           toInt64(toUnixTimestamp64Nano(any(Timestamp))) AS started_ns,
           toInt64OrZero(any(LogAttributes['audit.ended_ns'])) AS ended_ns,
           toFloat64OrZero(any(LogAttributes['audit.budget_s'])) AS budget_s,
           any(LogAttributes['audit.status']) AS status,
           toInt64OrZero(any(LogAttributes['audit.hosts'])) AS hosts,
           toInt64OrZero(any(LogAttributes['audit.hosts_failed'])) AS hosts_failed,
           toInt64OrZero(any(LogAttributes['audit.links'])) AS links,
           toInt64OrZero(any(LogAttributes['audit.links_failed'])) AS links_failed,
           toInt64OrZero(any(LogAttributes['audit.anomalies'])) AS anomalies,
           toInt64OrZero(any(LogAttributes['audit.not_covered'])) AS not_covered,
           any(LogAttributes['audit.summary']) AS summary
    FROM otel_logs WHERE {_EVENTS_WHERE} AND ({{cluster:String}} = '' OR LogAttributes['cluster'] = {{cluster:String}})
    GROUP BY audit_id
) ORDER BY started_ns DESC LIMIT {{limit:UInt32}}
"""


def audits(store: Store, *, cluster: str = "", limit: int = 200) -> list[AuditSummary]:
    """The newest ``limit`` audits (of ``cluster``; empty: all), newest first."""
    found: dict[str, AuditSummary] = {}
    params = {"cluster": cluster, "limit": limit}
    sources = [_FROM_TABLE] if table_exists(store, AUDITS.name) else []
    if table_exists(store, "otel_logs"):
        sources.append(_FROM_EVENTS)
    for sql in sources:  # the table first: an audit in both reads from it
        for r in rows(store, sql, params):
            found.setdefault(r["audit_id"], AuditSummary(**r))
    return sorted(found.values(), key=lambda a: a.started_ns, reverse=True)[:limit]


@dataclass(frozen=True, slots=True)
class StoredAudit:
    """One audit's JSON result and its HTML report."""

    result: dict[str, Any]
    report_html: str


_ONE_FROM_TABLE = "SELECT Result, Report FROM audits WHERE AuditId = {id:String} LIMIT 1"
_ONE_FROM_EVENTS = (f"SELECT Body FROM otel_logs WHERE {_EVENTS_WHERE} AND LogAttributes['audit.id'] = {{id:String}} "
                    "LIMIT 1")


def audit(store: Store, audit_id: str) -> StoredAudit | None:
    """One audit (None if neither place holds it); ValueError if what is stored is not an audit result."""
    if not audit_id:
        return None
    if table_exists(store, AUDITS.name):
        _, found = store.query(_ONE_FROM_TABLE, parameters={"id": audit_id})
        if found:
            return StoredAudit(_parse(found[0][0]), str(found[0][1]))
    if table_exists(store, "otel_logs"):
        _, found = store.query(_ONE_FROM_EVENTS, parameters={"id": audit_id})
        if found:
            doc = _parse(found[0][0])
            return StoredAudit(doc, render_html(result_from_json(doc)))
    return None


def _parse(text: str) -> dict[str, Any]:
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"a stored audit result is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ValueError("a stored audit result is not a JSON object")
    return doc
