"""MTU mismatch: the two ends of one cable set to different MTUs.

A classic silent misconfiguration: the link is up and small packets (probes, handshakes) pass, but
every frame longer than the smaller MTU is dropped at that end, so bulk transfers through the link
stall. Probe loss cannot show it and error counters show it only under load; what shows it at once
is configuration, as fabric audits do (``ibdiagnet``'s neighbour MTU check, LLDP on Ethernet):
both ends of every cable report their MTU (``ridethrough.nic.mtu``, from the agents' netdev source
and the switches' exporters) and the fabric map (`ridethrough.detectors.fabric_map`) pairs the ends.

The finding is a ``link_degrading`` on the link (large frames over it are lost, and traffic should
leave it as it would leave a link dropping frames for any other reason), with both MTUs in its
evidence. Without a fabric map there is no cable to pair ends on, and nothing is found.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ridethrough.detectors import sql
from ridethrough.detectors.contract import Detector, EntityType, Finding, FindingKind, Severity, Window
from ridethrough.detectors.fabric_map import RouteFile, RouteMap
from ridethrough.detectors.link import NIC

METRIC = "ridethrough.nic.mtu"


class MtuMismatch:
    """A cable whose two ends last reported different MTUs (see the module docstring).

    Query ``nic_mtu``: per port, the latest ``ridethrough.nic.mtu`` in the window.
    """

    name = "mtu_mismatch"

    def __init__(self, *, interval_s: float = 5.0, window_s: float = 60.0,
                 fabric: Callable[[], RouteMap] | None = None) -> None:
        self.interval_s = interval_s
        self.window_s = window_s
        self.fabric = fabric

    def detect(self, window: Window) -> list[Finding]:
        """One finding per cable whose ends disagree."""
        if self.fabric is None:
            return []
        fmap = self.fabric()
        ends: dict[str, dict[str, dict[str, Any]]] = {}  # link -> node -> its port's newest row there
        for row in sql.gauge_series(window, METRIC, NIC):
            port = f"{row['node']}/{row[NIC[0]]}"
            link = fmap.link_of(port)
            if link is None or row["latest"] <= 0:
                continue
            prev = ends.setdefault(link, {}).get(row["node"])
            if prev is None or row["last_ns"] > prev["last_ns"]:
                ends[link][row["node"]] = {**row, "port": port}
        return [self._finding(link, by_node, window) for link, by_node in sorted(ends.items())
                if len(by_node) == 2 and len({r["latest"] for r in by_node.values()}) == 2]

    def _finding(self, link: str, by_node: dict[str, dict[str, Any]], window: Window) -> Finding:
        low, high = sorted(by_node.values(), key=lambda r: (r["latest"], r["node"]))
        return Finding(
            detector=self.name, kind=FindingKind.LINK_DEGRADING, entity_type=EntityType.LINK, entity=link,
            severity=Severity.WARNING, confidence=1.0,
            summary=f"{link}: MTU mismatch: {low['port']} {low['latest']:g}, {high['port']} {high['latest']:g}; "
                    f"frames over {low['latest']:g} bytes are dropped",
            observed_at_ns=max(int(low["last_ns"]), int(high["last_ns"])), cluster=window.cluster,
            evidence={"query": "nic_mtu", "mtu": {low["port"]: low["latest"], high["port"]: high["latest"]},
                      "nics": sorted((low["port"], high["port"]))},
        )


def build(cfg: object) -> list[Detector]:
    """The MTU check, on ``cfg.fabric_map_file`` (none without it: no cable to pair ends on)."""
    path: str = getattr(cfg, "fabric_map_file", "")
    if not path:
        return []
    return [MtuMismatch(interval_s=getattr(cfg, "mtu_mismatch_interval_s", 5.0),
                        window_s=getattr(cfg, "mtu_mismatch_window_s", 60.0), fabric=RouteFile(path))]
