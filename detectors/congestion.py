"""Congestion: a queue building in one direction of a probed path, with no loss.

A path is congested in one direction when, over the last ``recent_s`` of the window, most
(``min_fraction``) of that direction's p50 one-way delays stand above its own baseline (the
median p50 before) by ``factor`` and by ``margin_s``, while

* the other direction stays flat (moved by less than ``flat_ratio`` of the excess): a queue
  on one egress, not a slow host or a shared bottleneck;
* the RTT, which no clock offset touches, grew by at least ``rtt_ratio`` of the excess: a
  clock correction that shifts one direction up and the other down is not a queue;
* the path lost at most ``loss_max_ratio`` of its probes and was not suspended: a link that
  drops packets is breakage (tomography, link detectors), not congestion.

Only clock-corrected delays (``probe.clock.corrected=true``) can tell directions apart;
uncorrected ones are RTT/2 in both directions and are not read. Entities are directed NIC
pairs, ``h0/nic0->h5/nic0`` (the direction the queue is in); with a fabric map, the congested
directions a link explains fold into one finding on that link (`congestion_links`: the
tomography's set cover over the queueing and the flat directions, ties broken by the ports'
transmit wait).

How congestion stays out of the link detectors: `LinkDegrading` reads physical-layer error
counters only, which a queue does not raise; tomography never calls a path bad for delay, and
leaves out of its vote a lossy path whose RTT has grown (a queue dropping), so congestion
neither blames nor clears a link there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ridethrough.detectors import sql
from ridethrough.detectors.congestion_links import LinkCover, to_links
from ridethrough.detectors.contract import Detector, EntityType, Finding, FindingKind, Severity, Window
from ridethrough.detectors.fabric_map import RouteFile, RouteMap, path_id

OTHER = {"forward": "reverse", "reverse": "forward"}


def _key(row: dict[str, Any]) -> sql.PathKey:
    return row["probe.src.node"], row["probe.src.nic"], row["probe.dst.node"], row["probe.dst.nic"]


class Congestion:
    """A one-directional, loss-free, sustained rise of one-way delay (see the module docstring).

    Queries: ``probe_owd_shift`` and ``probe_rtt_shift`` (`sql.gauge_shift` over the p50s),
    ``probe_loss`` (`sql.probe_loss`). Each direction needs ``min_points`` points before and
    after the split, and the path ``min_probes`` probes sent in the window.
    """

    name = "congestion"

    def __init__(self, *, interval_s: float = 10.0, window_s: float = 120.0, recent_s: float = 30.0,
                 factor: float = 1.5, margin_s: float = 50e-6, min_fraction: float = 0.8, min_points: int = 5,
                 flat_ratio: float = 0.25, rtt_ratio: float = 0.5, loss_max_ratio: float = 0.005,
                 min_probes: int = 20, fabric: Callable[[], RouteMap] | None = None,
                 cover: LinkCover | None = None) -> None:
        if not 0 < recent_s < window_s:
            raise ValueError("congestion: recent_s must be positive and shorter than window_s")
        self.interval_s = interval_s
        self.window_s = window_s
        self.recent_s, self.factor, self.margin_s = recent_s, factor, margin_s
        self.min_fraction, self.min_points = min_fraction, min_points
        self.flat_ratio, self.rtt_ratio = flat_ratio, rtt_ratio
        self.loss_max_ratio, self.min_probes = loss_max_ratio, min_probes
        self.fabric, self.cover = fabric, cover or LinkCover()

    def detect(self, window: Window) -> list[Finding]:
        """One finding per congested direction of a NIC pair."""
        split = window.end_ns - round(self.recent_s * 1e9)
        owd_rows = sql.gauge_shift(window, "ridethrough.probe.owd", (*sql.PROBE_PATH, "probe.direction"),
                                   split_ns=split, factor=self.factor, margin=self.margin_s,
                                   match={"probe.quantile": ["p50"], "probe.clock.corrected": ["true"]})
        owd = {(*_key(r), r["probe.direction"]): r for r in owd_rows}
        rtt = {_key(r): r for r in sql.gauge_shift(window, "ridethrough.probe.rtt", sql.PROBE_PATH, split_ns=split,
                                                   factor=self.factor, margin=self.margin_s,
                                                   match={"probe.quantile": ["p50"]})}
        loss = sql.probe_loss(window)
        found: dict[str, Finding] = {}
        flat: list[str] = []
        for row in owd_rows:
            key, direction = _key(row), row["probe.direction"]
            f = self._judge(key, direction, row, owd.get((*key, OTHER.get(direction, ""))), rtt.get(key),
                            loss.get(key), window)
            if f is not None:
                found.setdefault(f.entity, f)
            elif self._enough(row) and row["above"] < (1 - self.min_fraction) * row["recent_n"]:
                flat.append(path_id(*key, direction))  # no queue on it: it clears the links it must cross
        if self.fabric is None:
            return list(found.values())
        return to_links(list(found.values()), flat, self.fabric(), window, self.cover)

    def _enough(self, row: dict[str, Any]) -> bool:
        return bool(row["base_n"] >= self.min_points and row["recent_n"] >= self.min_points)

    def _judge(self, key: sql.PathKey, direction: str, row: dict[str, Any], other: dict[str, Any] | None,
               rtt: dict[str, Any] | None, loss: dict[str, float] | None, window: Window) -> Finding | None:
        if other is None or rtt is None or loss is None or not all(map(self._enough, (row, other, rtt))):
            return None  # too little to judge is no evidence
        excess = row["recent"] - row["base"]
        fraction = row["above"] / row["recent_n"]
        if fraction < self.min_fraction or excess <= self.margin_s:
            return None
        other_moved = abs(other["recent"] - other["base"])
        rtt_grew = rtt["recent"] - rtt["base"]
        sent = loss["sent"]
        lost = (loss["lost_forward"] + loss["lost_reverse"]) / sent if sent else 1.0
        if other_moved > self.flat_ratio * excess or rtt_grew < self.rtt_ratio * excess:
            return None
        if sent < self.min_probes or lost > self.loss_max_ratio or loss["suspended"]:
            return None
        src, src_nic, dst, dst_nic = key
        a, b = (f"{src}/{src_nic}", f"{dst}/{dst_nic}") if direction == "forward" else (
            f"{dst}/{dst_nic}", f"{src}/{src_nic}")
        return Finding(
            detector=self.name, kind=FindingKind.CONGESTION, entity_type=EntityType.PATH, entity=f"{a}->{b}",
            severity=Severity.WARNING, confidence=min(1.0, fraction),
            summary=f"{a}->{b} queueing: one-way delay p50 {row['base'] * 1e6:.0f} µs -> {row['recent'] * 1e6:.0f} µs "
                    f"over the last {self.recent_s:g} s, reverse flat, no loss",
            observed_at_ns=int(row["last_ns"]), cluster=window.cluster,
            evidence={"query": "probe_owd_shift", "prober": src, "direction": direction,
                      "path": path_id(*key, direction),
                      "owd_base_s": row["base"], "owd_recent_s": row["recent"], "excess_s": excess,
                      "fraction_above": fraction, "reverse_moved_s": other_moved, "rtt_grew_s": rtt_grew,
                      "loss_ratio": lost, "probes_sent": sent},
        )


def build(cfg: object) -> list[Detector]:
    """The congestion detector, thresholds from ``cfg`` where it has them; congested paths folded into links
    through ``cfg.fabric_map_file`` when it is set (a bad file raises ValueError naming it)."""
    path: str = getattr(cfg, "fabric_map_file", "")
    return [Congestion(interval_s=getattr(cfg, "congestion_interval_s", 10.0),
                       fabric=RouteFile(path) if path else None,
                       window_s=getattr(cfg, "congestion_window_s", 120.0),
                       recent_s=getattr(cfg, "congestion_recent_s", 30.0),
                       factor=getattr(cfg, "congestion_factor", 1.5),
                       margin_s=getattr(cfg, "congestion_margin_s", 50e-6),
                       min_fraction=getattr(cfg, "congestion_min_fraction", 0.8),
                       loss_max_ratio=getattr(cfg, "congestion_loss_max_ratio", 0.005))]
