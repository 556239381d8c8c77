"""Link detectors: a port that went down, one that flaps, one whose error rate is climbing.

The evidence is per port, ``{node}/{ib.device}`` (IB) or ``{node}/{interface}`` (netdev). With a
fabric map (`ridethrough.detectors.fabric_map`, ``fabric_map_file``) a finding names the cable
the port is on (``h3-leaf1r0``), and the IB port and the netdev of one cable fold into one
finding; without one, it names the NIC.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ridethrough.detectors import sql
from ridethrough.detectors.contract import Detector, EntityType, Finding, FindingKind, Severity, Window
from ridethrough.detectors.fabric_map import RouteFile, RouteMap

FabricMap = Callable[[], RouteMap]
"""The current fabric map (a `RouteFile` re-reads its file when it changes)."""

IB_ACTIVE = 4.0
"""``ridethrough.ib.port.state`` of an ACTIVE port."""
IB_PORT = ("ib.device", "ib.port")
NIC = ("network.interface.name",)
DEGRADING_COUNTERS = ("symbol_error", "link_error_recovery", "port_rcv_errors", "local_link_integrity_errors")


def _nic_entity(row: dict[str, Any], device_attr: str) -> str:
    return f"{row['node']}/{row[device_attr]}"


def _finding(detector: str, kind: FindingKind, severity: Severity, row: dict[str, Any], device_attr: str,
             summary: str, window: Window, evidence: dict[str, Any], **extra: Any) -> Finding:
    return Finding(
        detector=detector, kind=kind, entity_type=EntityType.NIC, entity=_nic_entity(row, device_attr),
        severity=severity, confidence=extra.pop("confidence", 0.9), summary=summary,
        observed_at_ns=int(row["last_ns"]), cluster=window.cluster,
        evidence={"node": row["node"], "host": row["host"], "device": row[device_attr], **evidence}, **extra,
    )


def to_links(findings: Sequence[Finding], fabric: FabricMap | None) -> list[Finding]:
    """NIC findings renamed to the link each NIC is cabled to, one per link and kind (the most severe,
    listing every NIC behind it); findings the map does not know stay as they are."""
    if fabric is None:
        return list(findings)
    fmap = fabric()
    out: dict[str, Finding] = {}
    for f in findings:
        link = fmap.link_of(f.entity) if f.entity_type is EntityType.NIC else None
        if link is None:
            out[f.key] = f
            continue
        nics = [f.entity]
        g = dataclasses.replace(f, entity_type=EntityType.LINK, entity=link, summary=f"{link}: {f.summary}")
        prev = out.get(g.key)
        if prev is not None:
            nics = [*prev.evidence["nics"], f.entity]
            if (prev.severity, prev.confidence) >= (g.severity, g.confidence):
                g = prev
            g = dataclasses.replace(g, observed_at_ns=max(prev.observed_at_ns, f.observed_at_ns))
        out[g.key] = dataclasses.replace(g, evidence={**g.evidence, "nics": sorted(set(nics))})
    return list(out.values())


def _went_down(row: dict[str, Any], window: Window, recent_s: float) -> bool:
    """Down now after being up, or down at a sample within ``recent_s`` that came after an up one
    (a short outage between two collections' worth of "up" is still an outage)."""
    if not row["had_up"]:
        return False
    up = row["latest"] == row["up_value"]
    return not up or (row["first_up_ns"] < row["last_down_ns"] >= window.end_ns - recent_s * 1e9)


class LinkDown:
    """A port that is down now after being up in the window, went down recently, or whose ``link_downed`` rose.

    Queries: ``ib_port_state`` (state per port over the window), ``ib_link_downed`` (increase of
    the counter), ``nic_up`` (``ridethrough.nic.up`` over the window). A port back up is still
    reported for ``recent_s`` after its last down sample, so a one-second outage opens an incident.
    """

    name = "link_down"
    triggers: Mapping[str, Callable[[float], bool]] = {
        "ridethrough.nic.up": lambda v: v != 1.0,
        "ridethrough.ib.port.state": lambda v: v != IB_ACTIVE,
    }
    """Live-feed triggers (`ridethrough.detectors.live`): run as soon as a port turns down."""

    def __init__(self, *, interval_s: float = 2.0, window_s: float = 60.0, recent_s: float = 15.0,
                 fabric: FabricMap | None = None) -> None:
        self.interval_s = interval_s
        self.window_s = window_s
        self.recent_s = recent_s
        self.fabric = fabric

    def detect(self, window: Window) -> list[Finding]:
        """Findings for ports down now or lately (state) or that went down in the window (counter)."""
        found: dict[str, Finding] = {}
        for row in sql.gauge_series(window, "ridethrough.ib.port.state", IB_PORT, up_value=IB_ACTIVE):
            if _went_down({**row, "up_value": IB_ACTIVE}, window, self.recent_s):
                now = f"IB port state {row['latest']:g}" if row["latest"] != IB_ACTIVE else "IB port was down"
                values = {"state": row["latest"], "last_down_ns": row["last_down_ns"]}
                f = self._ib(row, window, "ib_port_state", values, f"{now} (was ACTIVE)")
                found[f.entity] = f
        downed = sql.counter_series(window, "ridethrough.ib.port.errors", IB_PORT,
                                    match={"ib.counter": ["link_downed"]})
        for row in downed:
            if row["increase"] > 0 and _nic_entity(row, "ib.device") not in found:
                f = self._ib(row, window, "ib_link_downed", {"link_downed_increase": row["increase"]},
                             f"link_downed rose by {row['increase']:g}")
                found[f.entity] = f
        for row in sql.gauge_series(window, "ridethrough.nic.up", NIC):
            if _went_down({**row, "up_value": 1.0}, window, self.recent_s):
                state = "is down" if row["latest"] != 1.0 else "was down"
                f = _finding(self.name, FindingKind.LINK_DOWN, Severity.CRITICAL, row, "network.interface.name",
                             f"{_nic_entity(row, 'network.interface.name')} {state} (was up)", window,
                             {"query": "nic_up", "up": row["latest"], "last_down_ns": row["last_down_ns"]})
                found[f.entity] = f
        return to_links(list(found.values()), self.fabric)

    def _ib(self, row: dict[str, Any], window: Window, query: str, values: dict[str, Any], why: str) -> Finding:
        entity = _nic_entity(row, "ib.device")
        return _finding(self.name, FindingKind.LINK_DOWN, Severity.CRITICAL, row, "ib.device",
                        f"{entity} port {row['ib.port']} down: {why}", window,
                        {"query": query, "port": row["ib.port"], **values})


class LinkFlap:
    """A port that went down and up at least ``min_transitions`` times in the window.

    IB: changes of ``ib.port.state`` between ACTIVE and not, or twice the ``link_downed``
    increase (each down is a down and an up), whichever is more. Netdev: changes of
    ``nic.up``, or the ``carrier_changes`` increase, whichever is more.
    """

    name = "link_flap"

    def __init__(self, *, interval_s: float = 5.0, window_s: float = 300.0, min_transitions: int = 3,
                 fabric: FabricMap | None = None) -> None:
        self.interval_s = interval_s
        self.window_s = window_s
        self.min_transitions = min_transitions
        self.fabric = fabric

    def detect(self, window: Window) -> list[Finding]:
        """One finding per flapping NIC."""
        counts: dict[tuple[str, str], tuple[float, dict[str, Any], str]] = {}

        def note(row: dict[str, Any], attr: str, n: float, query: str) -> None:
            key = (attr, _nic_entity(row, attr))
            if n > counts.get(key, (0.0, row, query))[0]:
                counts[key] = (n, row, query)

        for row in sql.gauge_series(window, "ridethrough.ib.port.state", IB_PORT, up_value=IB_ACTIVE):
            note(row, "ib.device", row["transitions"], "ib_port_state")
        for row in sql.counter_series(window, "ridethrough.ib.port.errors", IB_PORT,
                                      match={"ib.counter": ["link_downed"]}):
            note(row, "ib.device", 2 * row["increase"], "ib_link_downed")
        for row in sql.gauge_series(window, "ridethrough.nic.up", NIC):
            note(row, "network.interface.name", row["transitions"], "nic_up")
        for row in sql.counter_series(window, "ridethrough.nic.carrier_changes", NIC):
            note(row, "network.interface.name", row["increase"], "nic_carrier_changes")
        return to_links([
            _finding(self.name, FindingKind.LINK_FLAP, Severity.WARNING, row, attr,
                     f"{entity} flapped: {n:g} up/down transitions in {window.seconds:g} s", window,
                     {"query": query, "transitions": n})
            for (attr, entity), (n, row, query) in counts.items() if n >= self.min_transitions
        ], self.fabric)


class LinkDegrading:
    """A port whose physical-layer error rate is above a floor and rising: a prediction.

    Query ``ib_error_rate``: per port, the increase of the error counters in each half of
    the window. It fires when the second half's rate exceeds ``min_rate_per_s`` and is at
    least ``rise_factor`` times the first half's (a flat non-zero rate, normal on PAM4 links,
    does not fire). Time to failure, crudely: the rate is taken to grow linearly, at the
    slope between the two halves' rates, and the link to fail when it reaches
    ``failure_rate_per_s``: ``(failure - r2) / slope`` (0 when already past).
    """

    name = "link_degrading"

    def __init__(self, *, interval_s: float = 10.0, window_s: float = 300.0, min_rate_per_s: float = 1.0,
                 rise_factor: float = 1.5, failure_rate_per_s: float = 100.0, fabric: FabricMap | None = None) -> None:
        self.interval_s = interval_s
        self.fabric = fabric
        self.window_s = window_s
        self.min_rate_per_s = min_rate_per_s
        self.rise_factor = rise_factor
        self.failure_rate_per_s = failure_rate_per_s

    def detect(self, window: Window) -> list[Finding]:
        """One finding per port with a rising error rate (its counters summed)."""
        per_port: dict[tuple[str, str, str], dict[str, Any]] = {}
        rows = sql.counter_series(window, "ridethrough.ib.port.errors", (*IB_PORT, "ib.counter"),
                                  match={"ib.counter": list(DEGRADING_COUNTERS)})
        for row in rows:
            port = per_port.setdefault((row["node"], row["ib.device"], row["ib.port"]),
                                       {**row, "first": 0.0, "second": 0.0, "counters": {}})
            port["first"] += row["increase_first"]
            port["second"] += row["increase_second"]
            port["counters"][row["ib.counter"]] = row["increase"]
            port["last_ns"] = max(port["last_ns"], row["last_ns"])
        half_s = window.seconds / 2
        return to_links([f for port in per_port.values() if (f := self._judge(port, half_s, window)) is not None],
                        self.fabric)

    def _judge(self, port: dict[str, Any], half_s: float, window: Window) -> Finding | None:
        if half_s <= 0:
            return None
        r1, r2 = port["first"] / half_s, port["second"] / half_s
        if r2 < self.min_rate_per_s or r2 < self.rise_factor * r1:
            return None
        slope = (r2 - r1) / half_s
        ttf = max(0.0, (self.failure_rate_per_s - r2) / slope) if slope > 0 else math.inf
        return _finding(
            self.name, FindingKind.LINK_DEGRADING, Severity.WARNING, port, "ib.device",
            f"{_nic_entity(port, 'ib.device')} port {port['ib.port']} errors rising: "
            f"{r1:.3g}/s then {r2:.3g}/s", window,
            {"query": "ib_error_rate", "port": port["ib.port"], "rate_first_per_s": r1,
             "rate_second_per_s": r2, "increase_by_counter": port["counters"]},
            confidence=0.6, time_to_failure_s=None if math.isinf(ttf) else ttf,
        )


def build(cfg: object) -> list[Detector]:
    """The link detectors, thresholds from ``cfg`` where it has them; links named through
    ``cfg.fabric_map_file`` when it is set (a bad file raises ValueError naming it)."""
    path: str = getattr(cfg, "fabric_map_file", "")
    fabric = RouteFile(path) if path else None
    return [
        LinkDown(interval_s=getattr(cfg, "link_down_interval_s", 2.0),
                 window_s=getattr(cfg, "link_down_window_s", 60.0),
                 recent_s=getattr(cfg, "link_down_recent_s", 15.0), fabric=fabric),
        LinkFlap(interval_s=getattr(cfg, "link_flap_interval_s", 5.0),
                 window_s=getattr(cfg, "link_flap_window_s", 300.0),
                 min_transitions=getattr(cfg, "link_flap_min_transitions", 3), fabric=fabric),
        LinkDegrading(interval_s=getattr(cfg, "link_degrading_interval_s", 10.0),
                      window_s=getattr(cfg, "link_degrading_window_s", 300.0),
                      min_rate_per_s=getattr(cfg, "link_degrading_min_rate_per_s", 1.0),
                      rise_factor=getattr(cfg, "link_degrading_rise_factor", 1.5),
                      failure_rate_per_s=getattr(cfg, "link_degrading_failure_rate_per_s", 100.0),
                      fabric=fabric),
    ]
