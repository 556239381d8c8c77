"""Clock detectors: a node whose clock stepped, and one whose offset is not known well enough.

Both read the clock service's per-node solution (``ridethrough.clock.node.offset`` and
``.uncertainty``, one series per ``clock.node`` and ``clock.reference``; see
`ridethrough.exporters.clock_service`). Entities are nodes (``EntityType.CLOCK``).

A step is told from the noise and the drift of the node's own series: the offset moves by
``drift x dt`` between points, so each step between consecutive points is compared with the
series' median rate times its time gap (a telemetry gap is not a jump), and the residual must
exceed ``jump_min_s``, ``jump_factor`` times the median residual (its own spread), and the
distance the clock drifts in ``lag_s``. That last bound is a margin for late samples: each
point is stamped with the time of the newest pair estimate its solution holds at
(`ridethrough.exporters.clock_service.snapshot_request`), but older pairs are carried to that
time along drifts known only roughly, and on a clock drifting 100 ppm an offset 5 s stale sits
500 µs off the line and the next one catches up, which is a late sample, not a step.
The ``hold_points`` points after it must then all sit beyond the ``hold_points``
before it (a single outlier that comes back is not a step).
Only points the clock service had converged on count: a point whose uncertainty (same node,
reference and time) is above ``converged_max_s`` is left out (right after a start the solution
still moves by large amounts while its uncertainty is large), as is a NaN or infinite offset.
A new reference node starts new series, so a change of reference is not a step either. If
most nodes step together by the same amount under one reference, the reference's clock
moved, not theirs: the finding names the reference.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Any

from ridethrough.detectors import sql
from ridethrough.detectors.contract import Detector, EntityType, Finding, FindingKind, Severity, Window

_SERIES = f"""
    SELECT node, reference, groupArray((t, v)) AS raw, arraySort(p -> p.1, raw) AS pts,
           arrayMap(p -> p.1, pts) AS ts, arrayMap(p -> p.2, pts) AS vs, length(pts) AS n, max(host) AS host
    FROM (
        SELECT Attributes['clock.node'] AS node, Attributes['clock.reference'] AS reference, {sql.T_NS} AS t,
               avg(Value) AS v, any({sql.HOST}) AS host
        FROM otel_metrics_gauge
        WHERE MetricName = {{metric:String}} AND {sql.IN_WINDOW} AND {sql.CLUSTER}
          AND NOT isNaN(Value) AND ({{finite_only:UInt8}} = 0 OR isFinite(Value))
        GROUP BY node, reference, t
    )
    WHERE node != ''
    GROUP BY node, reference
"""
"""Per (node, reference): the series' points sorted by time, one per timestamp (duplicates averaged)."""

_CONVERGED = f"""
    SELECT node, reference, groupArray((t, v)) AS raw, arraySort(p -> p.1, raw) AS pts,
           arrayMap(p -> p.1, pts) AS ts, arrayMap(p -> p.2, pts) AS vs, length(pts) AS n, max(host) AS host
    FROM (
        SELECT Attributes['clock.node'] AS node, Attributes['clock.reference'] AS reference, {sql.T_NS} AS t,
               avgIf(Value, MetricName = 'ridethrough.clock.node.offset') AS v,
               countIf(MetricName = 'ridethrough.clock.node.uncertainty') AS u_n,
               maxIf(Value, MetricName = 'ridethrough.clock.node.uncertainty') AS u, any({sql.HOST}) AS host
        FROM otel_metrics_gauge
        WHERE MetricName IN ('ridethrough.clock.node.offset', 'ridethrough.clock.node.uncertainty')
          AND {sql.IN_WINDOW} AND {sql.CLUSTER} AND NOT isNaN(Value)
        GROUP BY node, reference, t
        HAVING countIf(MetricName = 'ridethrough.clock.node.offset') > 0 AND isFinite(v)
           AND (u_n = 0 OR u <= {{converged_max:Float64}})
    )
    WHERE node != ''
    GROUP BY node, reference
"""
"""Per (node, reference): the offset points the service had converged on (uncertainty at most the bound,
or none written at that time), sorted by time, one per timestamp (duplicates averaged)."""

_STEPS = f"""
    SELECT node, reference, host, n, ts[n] AS last_ns, vs[n] AS latest, rate, spread, threshold,
           arrayReduce('median', dt) AS dt_median, arrayMap(i -> (ts[i + 1], res[i]), steps) AS steps
    FROM (
        SELECT *, arrayPopFront(arrayDifference(vs)) AS dv, arrayPopFront(arrayDifference(ts)) AS dt,
               arrayReduce('median', arrayMap((d, g) -> d / g, dv, dt)) AS rate,
               arrayMap((d, g) -> d - rate * g, dv, dt) AS res,
               arrayReduce('median', arrayMap(x -> abs(x), res)) AS spread,
               greatest({{jump_min:Float64}}, {{jump_factor:Float64}} * spread, abs(rate) * 1e9 * {{lag_s:Float64}})
                   AS threshold,
               arrayConcat([0.], arrayCumSum(res)) AS level,
               arrayFilter(i -> abs(res[i]) > threshold AND i >= {{hold:UInt32}} AND i + {{hold:UInt32}} <= n
                           AND if(res[i] > 0,
                                  arrayMin(arraySlice(level, i + 1, {{hold:UInt32}}))
                                  - arrayMax(arraySlice(level, i + 1 - {{hold:UInt32}}, {{hold:UInt32}})),
                                  arrayMin(arraySlice(level, i + 1 - {{hold:UInt32}}, {{hold:UInt32}}))
                                  - arrayMax(arraySlice(level, i + 1, {{hold:UInt32}}))) > threshold / 2,
                           arrayEnumerate(res)) AS steps
        FROM ({_CONVERGED})
        WHERE n >= {{min_points:UInt32}}
    )
    WHERE length(steps) > 0
"""
"""Query ``clock_offset_steps``: per series, the steps (time, size in s) that exceed the threshold and hold:
``level`` is the detrended offset of each point; the ``hold`` points after a step must all sit beyond the
``hold`` points before it by half the threshold, on the step's side."""

_UNSYNCED = f"""
    SELECT node, reference, host, n, ts[n] AS last_ns, vs[n] AS latest,
           arrayMax(arrayFilter((t, v) -> v <= {{bound:Float64}}, ts, vs)) AS last_ok_ns,
           arrayFilter((t, v) -> v > {{bound:Float64}} AND t > last_ok_ns, ts, vs) AS over_ts,
           length(over_ts) AS over_n, (ts[n] - arrayMin(over_ts)) / 1e9 AS over_s
    FROM ({_SERIES})
    WHERE over_n >= {{min_points:UInt32}} AND over_s >= {{sustain_s:Float64}}
"""
"""Query ``clock_uncertainty_over``: per series, the run of points above the bound up to the newest one
(an infinite uncertainty counts as above, NaN is left out)."""


def _biggest(row: dict[str, Any]) -> tuple[int, float]:
    """The (time ns, size s) of a series' largest step."""
    at_ns, size = max(row["steps"], key=lambda s: abs(s[1]))
    return int(at_ns), float(size)


def _finding(detector: str, kind: FindingKind, severity: Severity, node: str, summary: str, observed_at_ns: int,
             window: Window, evidence: dict[str, Any], confidence: float) -> Finding:
    return Finding(detector=detector, kind=kind, entity_type=EntityType.CLOCK, entity=node, severity=severity,
                   confidence=confidence, summary=summary, observed_at_ns=observed_at_ns, cluster=window.cluster,
                   evidence=evidence)


class ClockJump:
    """A node whose clock offset stepped (see the module docstring); one finding per node."""

    name = "clock_jump"

    def __init__(self, *, interval_s: float = 5.0, window_s: float = 120.0, jump_min_s: float = 50e-6,
                 jump_factor: float = 10.0, hold_points: int = 2, min_points: int = 6, lag_s: float = 10.0,
                 converged_max_s: float = 100e-6) -> None:
        if lag_s < 0 or converged_max_s <= 0:
            raise ValueError(f"clock_jump: expected lag_s >= 0 and converged_max_s > 0, got {lag_s}, "
                             f"{converged_max_s}")
        self.interval_s = interval_s
        self.window_s = window_s
        self.jump_min_s, self.jump_factor = jump_min_s, jump_factor
        self.hold_points, self.min_points = hold_points, min_points
        self.lag_s, self.converged_max_s = lag_s, converged_max_s

    def detect(self, window: Window) -> list[Finding]:
        """Nodes whose offset stepped, or the reference when its nodes stepped together."""
        rows = sql.run(window, _STEPS, sql.params(
            window, jump_min=self.jump_min_s, jump_factor=self.jump_factor, lag_s=self.lag_s,
            converged_max=self.converged_max_s, hold=self.hold_points, min_points=self.min_points))
        nodes = self._series_nodes(window)
        by_ref: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in rows:
            by_ref[r["reference"]].append(r)
        out: dict[str, Finding] = {}
        for reference, stepped in by_ref.items():
            moved = self._reference_moved(stepped, len(nodes.get(reference, ())))
            for f in ([self._reference(reference, moved, window)] if moved is not None
                      else [self._node(r, window) for r in stepped]):
                out.setdefault(f.entity, f)
        return list(out.values())

    def _series_nodes(self, window: Window) -> dict[str, set[str]]:
        """Per reference, the nodes with a series long enough to judge (the reference itself left out)."""
        sql_text = f"SELECT reference, groupUniqArray(node) AS nodes FROM ({_CONVERGED}) " \
                   "WHERE n >= {min_points:UInt32} AND node != reference GROUP BY reference"
        rows = sql.run(window, sql_text, sql.params(window, converged_max=self.converged_max_s,
                                                     min_points=self.min_points))
        return {r["reference"]: set(r["nodes"]) for r in rows}

    @staticmethod
    def _reference_moved(stepped: list[dict[str, Any]], nodes: int) -> list[dict[str, Any]] | None:
        """The rows, if most of the reference's nodes stepped at once by about the same amount: its clock moved."""
        rows = [r for r in stepped if r["node"] != r["reference"]]
        if len(rows) < 2 or 2 * len(rows) < nodes:
            return None
        biggest = [_biggest(r) for r in rows]
        at, size = statistics.median(b[0] for b in biggest), statistics.median(b[1] for b in biggest)
        together = all(abs(t - at) <= 2 * r["dt_median"] for (t, _), r in zip(biggest, rows, strict=True))
        return rows if together and all(abs(s - size) <= 0.2 * abs(size) for _, s in biggest) else None

    def _node(self, r: dict[str, Any], window: Window) -> Finding:
        at_ns, size = _biggest(r)
        return _finding(self.name, FindingKind.CLOCK_JUMP, Severity.WARNING, r["node"],
                        f"{r['node']} clock stepped {size * 1e6:+.1f} µs against {r['reference']} "
                        f"(threshold {r['threshold'] * 1e6:.1f} µs)", int(r["last_ns"]), window,
                        {"query": "clock_offset_steps", "reference": r["reference"], "step_s": size,
                         "step_at_ns": int(at_ns), "steps": len(r["steps"]), "threshold_s": r["threshold"],
                         "lag_s": self.lag_s, "spread_s": r["spread"], "drift_s_per_s": r["rate"] * 1e9,
                         "points": r["n"]}, 0.8)

    def _reference(self, reference: str, rows: list[dict[str, Any]], window: Window) -> Finding:
        # every offset is node minus reference: the nodes moved opposite to the reference
        size = -statistics.median(_biggest(r)[1] for r in rows)
        return _finding(self.name, FindingKind.CLOCK_JUMP, Severity.WARNING, reference,
                        f"{reference} (clock reference) stepped {size * 1e6:+.1f} µs: {len(rows)} nodes moved "
                        "together against it", max(int(r["last_ns"]) for r in rows), window,
                        {"query": "clock_offset_steps", "reference": reference, "step_s": size,
                         "nodes": sorted(r["node"] for r in rows)}, 0.7)


class ClockUnsynced:
    """A node whose offset uncertainty has stayed above ``uncertainty_max_s`` for ``sustain_s`` and
    ``min_points`` points, up to its newest point."""

    name = "clock_unsynced"

    def __init__(self, *, interval_s: float = 10.0, window_s: float = 300.0, uncertainty_max_s: float = 100e-6,
                 sustain_s: float = 30.0, min_points: int = 3) -> None:
        self.interval_s = interval_s
        self.window_s = window_s
        self.uncertainty_max_s, self.sustain_s, self.min_points = uncertainty_max_s, sustain_s, min_points

    def detect(self, window: Window) -> list[Finding]:
        """One finding per node over the bound."""
        rows = sql.run(window, _UNSYNCED, sql.params(
            window, metric="ridethrough.clock.node.uncertainty", finite_only=0, bound=self.uncertainty_max_s,
            sustain_s=self.sustain_s, min_points=self.min_points))
        return [_finding(self.name, FindingKind.CLOCK_UNSYNCED, Severity.WARNING, r["node"],
                         f"{r['node']} clock uncertainty {r['latest'] * 1e6:.1f} µs, above "
                         f"{self.uncertainty_max_s * 1e6:.1f} µs for {r['over_s']:.0f} s", int(r["last_ns"]), window,
                         {"query": "clock_uncertainty_over", "reference": r["reference"],
                          # evidence is JSON: an unbounded uncertainty (the node fell off the graph) is null
                          "uncertainty_s": r["latest"] if math.isfinite(r["latest"]) else None,
                          "bound_s": self.uncertainty_max_s, "over_s": r["over_s"], "points_over": r["over_n"]}, 0.8)
                for r in rows]


def build(cfg: object) -> list[Detector]:
    """The clock detectors, thresholds from ``cfg`` where it has them."""
    return [
        ClockJump(interval_s=getattr(cfg, "clock_jump_interval_s", 5.0),
                  window_s=getattr(cfg, "clock_jump_window_s", 120.0),
                  jump_min_s=getattr(cfg, "clock_jump_min_s", 50e-6),
                  jump_factor=getattr(cfg, "clock_jump_factor", 10.0),
                  hold_points=getattr(cfg, "clock_jump_hold_points", 2),
                  lag_s=getattr(cfg, "clock_jump_lag_s", 10.0),
                  converged_max_s=getattr(cfg, "clock_uncertainty_max_s", 100e-6)),
        ClockUnsynced(interval_s=getattr(cfg, "clock_unsynced_interval_s", 10.0),
                      window_s=getattr(cfg, "clock_unsynced_window_s", 300.0),
                      uncertainty_max_s=getattr(cfg, "clock_uncertainty_max_s", 100e-6),
                      sustain_s=getattr(cfg, "clock_unsynced_sustain_s", 30.0)),
    ]
