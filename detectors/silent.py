"""AgentSilent: a node that sent telemetry recently and then stopped.

This is the only detector a telemetry gap may trigger; every other one reads absence as
"no evidence", never as a fault.
"""

from __future__ import annotations

from ridethrough.detectors import sql
from ridethrough.detectors.contract import Detector, EntityType, Finding, FindingKind, Severity, Window

_SQL = f"""
    SELECT node, any(host) AS host, max(t) AS last_ns FROM (
        SELECT {sql.NODE} AS node, {sql.HOST} AS host, max({sql.T_NS}) AS t FROM otel_metrics_gauge
        WHERE {sql.T_NS} >= {{start:Int64}} AND {sql.CLUSTER} GROUP BY node, host
        UNION ALL
        SELECT {sql.NODE} AS node, {sql.HOST} AS host, max({sql.T_NS}) AS t FROM otel_metrics_sum
        WHERE {sql.T_NS} >= {{start:Int64}} AND {sql.CLUSTER} GROUP BY node, host
        UNION ALL
        SELECT {sql.NODE} AS node, {sql.HOST} AS host, max(toUnixTimestamp64Nano(Timestamp)) AS t FROM otel_logs
        WHERE toUnixTimestamp64Nano(Timestamp) >= {{start:Int64}} AND {sql.CLUSTER} GROUP BY node, host
    )
    WHERE node != ''
    GROUP BY node
    HAVING last_ns < {{silent_before:Int64}}
"""
"""Query ``node_last_seen``: per node seen since the window's start, its newest point.
No upper time bound: a node whose clock ran ahead still counts as heard from."""


class AgentSilent:
    """A node with data in the window (default: the last hour) but none in the last
    ``silent_after_s`` seconds before the window's end."""

    name = "agent_silent"

    def __init__(self, *, interval_s: float = 5.0, window_s: float = 3600.0, silent_after_s: float = 30.0) -> None:
        self.interval_s = interval_s
        self.window_s = window_s
        self.silent_after_s = silent_after_s

    def detect(self, window: Window) -> list[Finding]:
        """One finding per silent node."""
        silent_before = window.end_ns - int(self.silent_after_s * 1e9)
        rows = sql.run(window, _SQL, sql.params(window, silent_before=silent_before))
        return [
            Finding(
                detector=self.name, kind=FindingKind.AGENT_SILENT, entity_type=EntityType.HOST, entity=r["node"],
                severity=Severity.ERROR, confidence=0.9,
                summary=f"{r['node']} silent for {(window.end_ns - r['last_ns']) / 1e9:.0f} s",
                observed_at_ns=int(r["last_ns"]), cluster=window.cluster,
                evidence={"query": "node_last_seen", "host": r["host"], "last_seen_ns": int(r["last_ns"]),
                          "silent_s": (window.end_ns - r["last_ns"]) / 1e9, "silent_after_s": self.silent_after_s},
            )
            for r in rows
        ]


def build(cfg: object) -> list[Detector]:
    """The silence detector, thresholds from ``cfg`` where it has them."""
    return [AgentSilent(interval_s=getattr(cfg, "silent_interval_s", 5.0),
                        window_s=getattr(cfg, "silent_window_s", 3600.0),
                        silent_after_s=getattr(cfg, "silent_after_s", 30.0))]
