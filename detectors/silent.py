"""AgentSilent: a node that sent telemetry recently and then stopped.

This is the only detector a telemetry gap may trigger; every other one reads absence as
"no evidence", never as a fault.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ridethrough.detectors import sql
from ridethrough.detectors.contract import Detector, EntityType, Finding, FindingKind, Severity, Window
from ridethrough.detectors.heard import LastHeard

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
    """A node with data in the window (default: the last hour) but none in the ``silent_after_s``
    seconds before the freshest node's newest point (or the window's end, if that is sooner).
    A store that lags behind all agents alike (an ingest stall) silences no one; the price is
    that a whole fleet going quiet at once is not reported here (it cannot be told from a
    stalled gateway or store from the store alone).

    Scanning an hour of every table each run is the costliest query of all, and the live
    feed's fast detectors wait for the run in progress. So the detector remembers each node's
    newest point, per cluster, and after the first window reads only what came since its last
    run (less ``silent_after_s``, for rows that land late); a window that does not follow on
    (time went back, or a gap longer than the window) is read in full again. Nodes older than
    the window are forgotten, as the full query would.

    Beside a gateway it needs no query after the first: `follow_feed` gives the live feed a
    `LastHeard` to fill from every written batch, and from then on each run reads the store only
    for a window that does not follow on. Such a run costs the store nothing, so it goes in the
    controller's live lane (``live``) and a frozen host is told within an interval of its
    ``silent_after_s``, not behind the scheduled lane's slow trend queries.
    """

    name = "agent_silent"

    def __init__(self, *, interval_s: float = 5.0, window_s: float = 3600.0, silent_after_s: float = 30.0) -> None:
        self.interval_s = interval_s
        self.window_s = window_s
        self.silent_after_s = silent_after_s
        self._seen: dict[str, tuple[int, dict[str, tuple[int, str]]]] = {}
        """Per cluster: the end of the last window read, and node → (newest point ns, host)."""
        self._heard: LastHeard | None = None

    @property
    def live(self) -> bool:
        """True once a live feed fills its `LastHeard`: a run then queries nothing (the controller's live lane)."""
        return self._heard is not None and self._heard.attached

    def follow_feed(self) -> LastHeard:
        """The observer of written batches to hand the live feed; it marks itself attached."""
        if self._heard is None:
            self._heard = LastHeard()
        self._heard.attached = True
        return self._heard

    def detect(self, window: Window) -> list[Finding]:
        """One finding per silent node."""
        last = self._refresh(window)
        # Silent against the freshest node, not the wall clock: when the gateway or the store falls behind,
        # every node's newest point ages alike and none is silent; a frozen host falls behind the others.
        newest = min(window.end_ns, max((t for t, _ in last.values()), default=0))
        silent_before = newest - int(self.silent_after_s * 1e9)
        rows: list[dict[str, Any]] = [{"node": node, "host": host, "last_ns": t, "behind_s": (newest - t) / 1e9}
                                      for node, (t, host) in sorted(last.items()) if t < silent_before]
        return [
            Finding(
                detector=self.name, kind=FindingKind.AGENT_SILENT, entity_type=EntityType.HOST, entity=r["node"],
                severity=Severity.ERROR, confidence=0.9,
                summary=f"{r['node']} silent for {r['behind_s']:.0f} s while other nodes reported",
                observed_at_ns=int(r["last_ns"]), cluster=window.cluster,
                evidence={"query": "node_last_seen", "host": r["host"], "last_seen_ns": int(r["last_ns"]),
                          "silent_s": r["behind_s"], "silent_after_s": self.silent_after_s},
            )
            for r in rows
        ]

    def _refresh(self, window: Window) -> dict[str, tuple[int, str]]:
        """Every node's newest point seen since the window's start (query ``node_last_seen``)."""
        prev_end, known = self._seen.get(window.cluster, (0, {}))
        follows = window.start_ns <= prev_end <= window.end_ns
        heard = self._heard
        if follows and heard is not None and heard.attached:  # the feed has had every batch since the last read
            return self._keep(window, known, heard.snapshot(window.cluster))
        start = max(window.start_ns, prev_end - int(self.silent_after_s * 1e9)) if follows else window.start_ns
        seen = dict(known) if follows else {}
        # no node is "silent before" the far future: every node read since ``start``, with its newest point
        rows = sql.run(window, _SQL, {**sql.params(window, silent_before=2**62), "start": start})
        return self._keep(window, seen, {r["node"]: (int(r["last_ns"]), r["host"]) for r in rows})

    def _keep(self, window: Window, seen: dict[str, tuple[int, str]], news: Mapping[str, tuple[int, str]]
              ) -> dict[str, tuple[int, str]]:
        """``seen`` with the newer of each node's points from ``news``, less nodes older than the window; kept
        as the cluster's state at the window's end."""
        out = dict(seen)
        for node, (t, host) in news.items():
            if t > out.get(node, (0, ""))[0]:
                out[node] = (t, host)
        out = {n: v for n, v in out.items() if v[0] >= window.start_ns}
        self._seen[window.cluster] = (window.end_ns, out)
        return out


def build(cfg: object) -> list[Detector]:
    """The silence detector, thresholds from ``cfg`` where it has them."""
    return [AgentSilent(interval_s=getattr(cfg, "silent_interval_s", 5.0),
                        window_s=getattr(cfg, "silent_window_s", 3600.0),
                        silent_after_s=getattr(cfg, "silent_after_s", 30.0))]
