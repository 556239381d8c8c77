"""Congestion read where it happens: an egress port whose transmit wait keeps climbing.

``PortXmitWait`` (``ridethrough.ib.port.xmit_wait``) counts the ticks a port had data to send and
could not: the queue of a congested egress, counted by the port itself. It is the counter an IB
fabric's congestion monitoring reads (UFM, ``ibdiagnet``'s congestion report), and it names the
link without any probe: the port sits on one end of one cable. The probes' view
(`ridethrough.detectors.congestion`) needs enough paths through the queue to fold them into a
link; this one needs only the port. Both name the link, so their findings fold into one incident
(kind ``congestion``, the same link).

A port is congested when, over the last ``recent_s`` of the window, its wait grew at
``min_rate_per_s`` or more and rose at ``min_rises`` samples or more: a sustained queue, not one
burst. Healthy ports count no wait (an idle port has nothing waiting; a port at line rate with room
in its buffers waits next to never).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ridethrough.detectors import sql
from ridethrough.detectors.congestion_links import XMIT_WAIT
from ridethrough.detectors.contract import Detector, EntityType, Finding, FindingKind, Severity, Window
from ridethrough.detectors.fabric_map import RouteFile, RouteMap
from ridethrough.detectors.link import IB_PORT, to_links


class PortCongestion:
    """A port whose transmit wait grew fast and steadily (see the module docstring).

    Query ``ib_xmit_wait``: per port, the wait's increase after ``recent_s`` before the window's end,
    and how many of the samples rose.
    """

    name = "port_congestion"

    def __init__(self, *, interval_s: float = 5.0, window_s: float = 60.0, recent_s: float = 20.0,
                 min_rate_per_s: float = 100.0, min_rises: int = 3,
                 fabric: Callable[[], RouteMap] | None = None) -> None:
        if not 0 < recent_s <= window_s:
            raise ValueError("port_congestion: recent_s must be positive and at most window_s")
        self.interval_s = interval_s
        self.window_s = window_s
        self.recent_s = recent_s
        self.min_rate_per_s = min_rate_per_s
        self.min_rises = min_rises
        self.fabric = fabric

    def detect(self, window: Window) -> list[Finding]:
        """One finding per congested port, named by its link when the fabric map knows it."""
        split = window.end_ns - round(self.recent_s * 1e9)
        found = [f for row in sql.counter_series(window, XMIT_WAIT, IB_PORT, split_ns=split)
                 if (f := self._judge(row, window)) is not None]
        return to_links(found, self.fabric)

    def _judge(self, row: dict[str, Any], window: Window) -> Finding | None:
        rate = row["increase_second"] / self.recent_s
        if rate < self.min_rate_per_s or row["rises"] < self.min_rises:
            return None
        port = f"{row['node']}/{row['ib.device']}"
        return Finding(
            detector=self.name, kind=FindingKind.CONGESTION, entity_type=EntityType.NIC, entity=port,
            severity=Severity.WARNING, confidence=0.9,
            summary=f"{port} congested: it waited to send {rate:.3g} times a second over the last {self.recent_s:g} s",
            observed_at_ns=int(row["last_ns"]), cluster=window.cluster,
            evidence={"query": "ib_xmit_wait", "node": row["node"], "host": row["host"], "device": row["ib.device"],
                      "port": row["ib.port"], "xmit_wait_per_s": rate, "rises": row["rises"]},
        )


def build(cfg: object) -> list[Detector]:
    """The port congestion detector, thresholds from ``cfg`` where it has them; ports named by their cable
    through ``cfg.fabric_map_file`` when it is set (a bad file raises ValueError naming it)."""
    path: str = getattr(cfg, "fabric_map_file", "")
    return [PortCongestion(interval_s=getattr(cfg, "port_congestion_interval_s", 5.0),
                           window_s=getattr(cfg, "port_congestion_window_s", 60.0),
                           recent_s=getattr(cfg, "port_congestion_recent_s", 20.0),
                           min_rate_per_s=getattr(cfg, "port_congestion_min_rate_per_s", 100.0),
                           min_rises=getattr(cfg, "port_congestion_min_rises", 3),
                           fabric=RouteFile(path) if path else None)]
