"""Audits in the store: one row per audit in ``audits``, with its JSON result and its HTML report.

The dashboard lists them and serves the report as it was written::

    SELECT AuditId, StartedAt, Status, Summary FROM audits WHERE Cluster = 'lab1' ORDER BY StartedAt DESC

Writing the same audit again is a no-op (the insert carries the audit id as its deduplication token).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from ridethrough.audit_model import AuditResult, Status
from ridethrough.exporters import schema
from ridethrough.exporters.schema import Column, Table
from ridethrough.exporters.store import Store

_LC = "LowCardinality(String)"
_TIME = "DateTime64(9)"

AUDITS = Table(
    "audits",
    (
        Column("AuditId", "String"),
        Column("Cluster", _LC),
        Column("StartedAt", _TIME),
        Column("EndedAt", _TIME),
        Column("BudgetSeconds", "Float64"),
        Column("Status", _LC),
        Column("Hosts", "UInt32"),
        Column("HostsFailed", "UInt32"),
        Column("Links", "UInt32"),
        Column("LinksFailed", "UInt32"),
        Column("Anomalies", "UInt32"),
        Column("Entities", "Array(String)"),
        Column("NotCovered", "Map(String, String)"),
        Column("Summary", "String"),
        Column("Result", "String"),
        Column("Report", "String"),
    ),
    (),
    "toYYYYMM(StartedAt)",
    "(Cluster, StartedAt, AuditId)",
    "cityHash64(AuditId)",
)
"""``audits``: ``Status`` is pass, fail or partial; ``Entities`` the anomalies' entities (``h3-leaf1r0``,
``h5/nic0``, ``h6/gpu3``); ``Result`` the JSON result; ``Report`` the self-contained HTML report."""


def audits_ddl(*, cluster: str = "") -> Iterator[str]:
    """The statements that create ``audits`` (``_local`` + Distributed when clustered)."""
    return schema.domain_ddl(AUDITS, cluster=cluster)


def ensure_audits_table(store: Store) -> None:
    """Create ``audits`` if it is missing (idempotent)."""
    store.ensure_table(AUDITS)


def summary(result: AuditResult) -> str:
    """One line: the verdict and the counts."""
    hosts_bad = sum(s is Status.FAIL for s in result.hosts.values())
    links_bad = sum(s is Status.FAIL for s in result.links.values())
    text = (f"{result.status.value}: {len(result.anomalies)} anomalies; {hosts_bad}/{len(result.hosts)} hosts and "
            f"{links_bad}/{len(result.links)} links failed; {result.duration_s:.0f} s of a "
            f"{result.budget_s:g} s budget")
    gaps = len(result.not_covered())
    return text + (f"; {gaps} things not covered" if gaps else "")


def audit_row(result: AuditResult, report_html: str) -> tuple[Any, ...]:
    """The values of one audit in `AUDITS`' insert order."""
    return (result.audit_id, result.cluster, result.started_ns, result.ended_ns, result.budget_s,
            result.status.value, len(result.hosts), sum(s is Status.FAIL for s in result.hosts.values()),
            len(result.links), sum(s is Status.FAIL for s in result.links.values()), len(result.anomalies),
            [a.entity for a in result.anomalies], result.not_covered(), summary(result), result.dumps(), report_html)


def write_audit(store: Store, result: AuditResult, report_html: str) -> None:
    """Create the table if needed and insert the audit (a retried insert is dropped as a duplicate)."""
    ensure_audits_table(store)
    row = audit_row(result, report_html)
    store.insert_columns(AUDITS, [[v] for v in row], token=f"audit-{result.audit_id}")


def read_audit(store: Store, audit_id: str) -> dict[str, Any] | None:
    """One stored audit's JSON result, or None if the store has no such audit."""
    _, rows = store.query("SELECT Result FROM audits WHERE AuditId = {id:String} LIMIT 1", parameters={"id": audit_id})
    return json.loads(rows[0][0]) if rows else None
