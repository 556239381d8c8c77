"""GPU detectors: a GPU that has failed, and one that is about to.

Entities are ``{node}/gpu{index}``; the GPU's UUID (``hw.id``) goes in the evidence. Every
signal for one GPU folds into one finding, its reasons listed in the evidence.
"""

from __future__ import annotations

from typing import Any

from ridethrough.detectors import sql
from ridethrough.detectors.contract import Detector, EntityType, Finding, FindingKind, Severity, Window

GPU = ("gpu.index", "hw.id")
FATAL_XID_CLASSES = ("gpu_reset", "node_reboot")
THERMAL_REASONS = ("SwThermalSlowdown", "HwThermalSlowdown")


class _Reasons:
    """Reasons gathered per GPU across queries, turned into one finding each."""

    def __init__(self) -> None:
        self.by_gpu: dict[tuple[str, str], dict[str, Any]] = {}

    def add(self, row: dict[str, Any], query: str, values: dict[str, Any]) -> None:
        key = (row["node"], str(row["gpu.index"]))
        gpu = self.by_gpu.setdefault(key, {"node": row["node"], "host": row["host"], "index": key[1],
                                           "uuid": row["hw.id"], "last_ns": 0, "reasons": {}})
        gpu["reasons"][query] = values
        gpu["last_ns"] = max(gpu["last_ns"], int(row["last_ns"]))

    def findings(self, detector: str, kind: FindingKind, severity: Severity, window: Window,
                 verb: str) -> list[Finding]:
        out = []
        for gpu in self.by_gpu.values():
            entity = f"{gpu['node']}/gpu{gpu['index']}"
            out.append(Finding(
                detector=detector, kind=kind, entity_type=EntityType.GPU, entity=entity, severity=severity,
                confidence=0.9 if kind is FindingKind.GPU_FAILED else 0.6,
                summary=f"{entity} {verb}: {', '.join(sorted(gpu['reasons']))}",
                observed_at_ns=gpu["last_ns"], cluster=window.cluster,
                evidence={"node": gpu["node"], "host": gpu["host"], "uuid": gpu["uuid"], **gpu["reasons"]},
            ))
        return out


class GpuFailed:
    """A GPU that has failed.

    Queries: ``hw_status_failed`` (latest ``hw.status{hw.state=failed}`` is 1),
    ``xid_fatal`` (a gpu.xid event of class gpu_reset or node_reboot in the window),
    ``recovery_action`` (latest ``ridethrough.gpu.recovery_action`` is 1 for an action other than none).
    """

    name = "gpu_failed"

    def __init__(self, *, interval_s: float = 5.0, window_s: float = 60.0) -> None:
        self.interval_s = interval_s
        self.window_s = window_s

    def detect(self, window: Window) -> list[Finding]:
        """One finding per failed GPU."""
        reasons = _Reasons()
        for row in sql.gauge_series(window, "hw.status", GPU, match={"hw.state": ["failed"]}):
            if row["latest"] == 1.0:
                reasons.add(row, "hw_status_failed", {"value": row["latest"]})
        for row in sql.xid_events(window, FATAL_XID_CLASSES):
            reasons.add(row, "xid_fatal", {"xids": row["xids"], "classes": row["classes"], "count": row["count"]})
        for row in sql.gauge_series(window, "ridethrough.gpu.recovery_action", (*GPU, "gpu.recovery_action")):
            if row["latest"] == 1.0 and row["gpu.recovery_action"] != "none":
                reasons.add(row, "recovery_action", {"action": row["gpu.recovery_action"]})
        return reasons.findings(self.name, FindingKind.GPU_FAILED, Severity.CRITICAL, window, "failed")


class GpuFailing:
    """A GPU showing the precursors of failure: a prediction.

    Queries: ``ecc_corrected_rate`` (corrected ECC errors per second over the window above
    ``ecc_rate_per_s``; resets and duplicates contribute nothing), ``remap_pending`` (latest
    1), ``xid_precursor`` (a precursor-class gpu.xid event in the window), ``thermal`` (a
    thermal slowdown reason latest 1 while ``hw.temperature`` rises faster than
    ``temp_slope_c_per_s``).
    """

    name = "gpu_failing"

    def __init__(self, *, interval_s: float = 10.0, window_s: float = 300.0, ecc_rate_per_s: float = 0.1,
                 temp_slope_c_per_s: float = 0.01) -> None:
        self.interval_s = interval_s
        self.window_s = window_s
        self.ecc_rate_per_s = ecc_rate_per_s
        self.temp_slope_c_per_s = temp_slope_c_per_s

    def detect(self, window: Window) -> list[Finding]:
        """One finding per GPU with any precursor."""
        reasons = _Reasons()
        seconds = max(window.seconds, 1e-9)
        for row in sql.counter_series(window, "hw.errors", GPU, match={"error.type": ["corrected"]}):
            rate = row["increase"] / seconds
            if rate > self.ecc_rate_per_s:
                reasons.add(row, "ecc_corrected_rate", {"rate_per_s": rate, "increase": row["increase"]})
        for row in sql.gauge_series(window, "ridethrough.gpu.memory.remap_pending", GPU):
            if row["latest"] == 1.0:
                reasons.add(row, "remap_pending", {"value": row["latest"]})
        for row in sql.xid_events(window, ("precursor",)):
            reasons.add(row, "xid_precursor", {"xids": row["xids"], "count": row["count"]})
        self._thermal(window, reasons)
        return reasons.findings(self.name, FindingKind.GPU_FAILING, Severity.ERROR, window, "failing")

    def _thermal(self, window: Window, reasons: _Reasons) -> None:
        hot = {(r["node"], str(r["gpu.index"])) for r in sql.gauge_series(
            window, "ridethrough.gpu.clock_event_reason", (*GPU, "gpu.clock_event_reason"),
            match={"gpu.clock_event_reason": list(THERMAL_REASONS)}) if r["latest"] == 1.0}
        if not hot:
            return
        for row in sql.gauge_series(window, "hw.temperature", GPU):
            slope = row["slope_per_s"]
            if (row["node"], str(row["gpu.index"])) in hot and slope == slope and slope > self.temp_slope_c_per_s:
                reasons.add(row, "thermal", {"temperature_c": row["latest"], "slope_c_per_s": slope})


def build(cfg: object) -> list[Detector]:
    """The GPU detectors, thresholds from ``cfg`` where it has them."""
    return [
        GpuFailed(interval_s=getattr(cfg, "gpu_failed_interval_s", 5.0),
                  window_s=getattr(cfg, "gpu_failed_window_s", 60.0)),
        GpuFailing(interval_s=getattr(cfg, "gpu_failing_interval_s", 10.0),
                   window_s=getattr(cfg, "gpu_failing_window_s", 300.0),
                   ecc_rate_per_s=getattr(cfg, "gpu_failing_ecc_rate_per_s", 0.1),
                   temp_slope_c_per_s=getattr(cfg, "gpu_failing_temp_slope_c_per_s", 0.01)),
    ]
