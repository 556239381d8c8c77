"""The network effect: correct pairwise clock estimates jointly, around the loops of the probe graph.

Huygens (Geng et al., NSDI 2018, §4.3): offsets around any loop must sum to zero, so the pairwise
estimates over-determine the per-node clocks. A weighted least-squares fit on the graph
(incidence matrix, reference node fixed at 0, weights 1/uncertainty²) spreads each loop's
discrepancy over its edges, and the residuals point at the edge that broke the loop (a path whose
minimum delays are asymmetric, a window that went wrong). Such an edge is dropped and the fit
repeated, one edge at a time, unless the loops cannot tell it from a neighbour in series (a node
of degree two): then both are only marked suspect, since dropping the wrong one would silently
move a node.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ridethrough.collector.huygens import PairEstimate

FloatArray = npt.NDArray[np.float64]

_BRIDGE = 1.0 - 1e-9
"""An edge with leverage this close to 1 is in no loop: its residual is zero, whatever it says."""


@dataclass(frozen=True, slots=True)
class PairEdge:
    """One pairwise estimate: clock_b - clock_a ≈ offset_ns (drift_ppm likewise), all at one time."""

    a: str
    b: str
    offset_ns: float
    drift_ppm: float
    uncertainty_ns: float
    drift_uncertainty_ppm: float = 1.0

    @classmethod
    def from_estimate(cls, est: PairEstimate, *, at_ns: int | None = None) -> PairEdge:
        """An edge from a window's estimate, its offset carried to ``at_ns`` (A-clock) if given."""
        offset = est.offset_ns if at_ns is None else est.offset_at(at_ns)
        return cls(est.src, est.dst, offset, est.drift_ppm, est.uncertainty_ns,
                   max(est.drift_uncertainty_ppm, 1e-3))


@dataclass(frozen=True, slots=True)
class NodeClock:
    """A node's clock against the reference's: clock_node - clock_reference."""

    node: str
    offset_ns: float
    offset_uncertainty_ns: float
    drift_ppm: float
    drift_uncertainty_ppm: float


class EdgeStatus(enum.Enum):
    """What the solver made of an edge."""

    USED = "used"
    DROPPED = "dropped"
    """Its residual broke the loops it is in: left out of the final fit."""
    SUSPECT = "suspect"
    """Its residual is too large, but a neighbour in series is just as guilty: kept, flagged."""
    UNREACHABLE = "unreachable"
    """Not connected to the reference."""
    INVALID = "invalid"
    """A value or an uncertainty that is not a finite number, or a self-loop."""


@dataclass(frozen=True, slots=True)
class EdgeFit:
    """An edge against the final fit: residual = measured - fitted; z = residual in standard errors."""

    edge: PairEdge
    offset_residual_ns: float
    offset_z: float
    drift_residual_ppm: float
    drift_z: float
    status: EdgeStatus


@dataclass(frozen=True, slots=True)
class GraphSolution:
    """Per-node clocks relative to ``reference``, and how each edge fitted."""

    reference: str
    nodes: dict[str, NodeClock]
    unreachable: tuple[str, ...]
    """Nodes seen in the edges but with no path to the reference: no estimate."""
    edges: tuple[EdgeFit, ...]


@dataclass(frozen=True, slots=True)
class _Fit:
    values: FloatArray
    variances: FloatArray
    residuals: FloatArray
    z: FloatArray
    leverage: FloatArray
    birge: float
    """sqrt of the reduced χ², if above 1: loops that disagree more than the edges claim widen every node."""


def _wls(incidence: FloatArray, values: FloatArray, sigmas: FloatArray) -> _Fit:
    """Weighted least squares on the graph; sigmas rescaled to their median for conditioning."""
    scale = float(np.median(sigmas))
    s = np.clip(sigmas / scale, 1e-6, 1e6)  # beyond this, a weight only breaks the conditioning
    weighted = incidence / s[:, None]
    solution = np.linalg.lstsq(weighted, values / s, rcond=None)[0].astype(np.float64)
    cov = np.linalg.pinv(weighted.T @ weighted)
    residuals = values - incidence @ solution
    leverage = np.einsum("ij,jk,ik->i", weighted, cov, weighted)
    spread = s * np.sqrt(np.clip(1.0 - leverage, 0.0, None)) * scale
    z = np.divide(residuals, spread, out=np.zeros_like(residuals), where=leverage < _BRIDGE)
    dof = len(values) - incidence.shape[1]
    chi2 = float(np.sum((residuals / (s * scale)) ** 2))
    birge = math.sqrt(chi2 / dof) if dof > 0 and chi2 > dof else 1.0
    return _Fit(solution, np.diag(cov) * scale**2, residuals, z, leverage, birge)


def _robust(incidence: FloatArray, values: FloatArray, sigmas: FloatArray,
            outlier_z: float, max_drops: int) -> tuple[_Fit, npt.NDArray[np.bool_], npt.NDArray[np.bool_]]:
    """Fit, then drop the worst edge while its standardised residual exceeds ``outlier_z``.

    An edge the loops cannot tell from a neighbour in series is not dropped: the whole series
    group is down-weighted instead (its uncertainty widened by the loop's discrepancy), so the
    rest of the graph no longer leans on it and the node between gets an honest, wide bound.
    Returns the final fit with residuals and z (over each edge's own uncertainty) for every
    edge, and the dropped and suspect masks.
    """
    active = np.ones(len(values), dtype=bool)
    suspect = np.zeros(len(values), dtype=bool)
    sig = sigmas.copy()
    fit = _wls(incidence, values, sig)
    for _ in range(max_drops):
        rows = np.flatnonzero(active)
        candidates = np.where(suspect[rows], 0.0, np.abs(fit.z))
        worst_at = int(np.argmax(candidates))
        if candidates[worst_at] <= outlier_z:
            break
        worst = rows[worst_at]
        trial = active.copy()
        trial[worst] = False
        trial_fit = _wls(incidence[trial], values[trial], sig[trial])
        was_bridge = np.delete(fit.leverage, worst_at) >= _BRIDGE
        newly = np.flatnonzero(trial)[(trial_fit.leverage >= _BRIDGE) & ~was_bridge]
        if len(newly):
            discrepancy = abs(float(values[worst] - incidence[worst] @ trial_fit.values))
            group = [worst, *newly]
            suspect[group] = True
            sig[group] = np.hypot(sig[group], discrepancy)
            fit = _wls(incidence[active], values[active], sig[active])
        else:
            active, fit = trial, trial_fit
    residuals = values - incidence @ fit.values
    z = residuals / sigmas
    z[active & ~suspect] = fit.z[~suspect[active]]
    return _Fit(fit.values, fit.variances, residuals, z, fit.leverage, fit.birge), ~active, suspect


def _component(edges: Sequence[PairEdge], reference: str) -> set[str]:
    neighbours: dict[str, set[str]] = {}
    for e in edges:
        neighbours.setdefault(e.a, set()).add(e.b)
        neighbours.setdefault(e.b, set()).add(e.a)
    seen, todo = {reference}, [reference]
    while todo:
        for n in neighbours.get(todo.pop(), ()):
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


def _valid(e: PairEdge) -> bool:
    numbers = (e.offset_ns, e.drift_ppm, e.uncertainty_ns, e.drift_uncertainty_ppm)
    return e.a != e.b and all(math.isfinite(v) for v in numbers) and e.uncertainty_ns > 0 < e.drift_uncertainty_ppm


def solve(pairs: Sequence[PairEdge], *, reference: str, outlier_z: float = 3.0,
          max_drops: int | None = None) -> GraphSolution:
    """Per-node offsets and drifts against ``reference`` from all pairwise edges at once.

    Uncertainties come from the fit's covariance, inflated by the reduced χ² when the loops
    disagree more than the edges' own uncertainties allow. Never raises on odd input: invalid
    edges and nodes cut off from the reference are reported, not fitted.
    """
    valid = [e for e in pairs if _valid(e)]
    reach = _component(valid, reference)
    used = [e for e in valid if e.a in reach]
    others = sorted(n for e in pairs for n in (e.a, e.b) if n not in reach)
    index = {n: i for i, n in enumerate(sorted(reach - {reference}))}
    fits: dict[PairEdge, EdgeFit] = {}
    nodes = {reference: NodeClock(reference, 0.0, 0.0, 0.0, 0.0)}
    if used and index:
        incidence = np.zeros((len(used), len(index)))
        for row, e in enumerate(used):
            for node, sign in ((e.a, -1.0), (e.b, 1.0)):
                if node in index:
                    incidence[row, index[node]] = sign
        drops = len(used) if max_drops is None else max_drops
        offsets, off_dropped, off_suspect = _robust(
            incidence, np.array([e.offset_ns for e in used]), np.array([e.uncertainty_ns for e in used]),
            outlier_z, drops)
        drifts, dr_dropped, dr_suspect = _robust(
            incidence, np.array([e.drift_ppm for e in used]), np.array([e.drift_uncertainty_ppm for e in used]),
            outlier_z, drops)
        for name, i in index.items():
            nodes[name] = NodeClock(name, float(offsets.values[i]), math.sqrt(offsets.variances[i]) * offsets.birge,
                                    float(drifts.values[i]), math.sqrt(drifts.variances[i]) * drifts.birge)
        for row, e in enumerate(used):
            status = (EdgeStatus.DROPPED if off_dropped[row] or dr_dropped[row]
                      else EdgeStatus.SUSPECT if off_suspect[row] or dr_suspect[row] else EdgeStatus.USED)
            fits[e] = EdgeFit(e, float(offsets.residuals[row]), float(offsets.z[row]),
                              float(drifts.residuals[row]), float(drifts.z[row]), status)
    edges = tuple(fits.get(e) or _unfitted(e) for e in pairs)
    return GraphSolution(reference, nodes, tuple(dict.fromkeys(others)), edges)


def _unfitted(e: PairEdge) -> EdgeFit:
    status = EdgeStatus.UNREACHABLE if _valid(e) else EdgeStatus.INVALID
    return EdgeFit(e, math.nan, 0.0, math.nan, 0.0, status)


def loop_closure_error(pairs: Iterable[PairEdge], cycle: Sequence[str]) -> float | None:
    """Sum of offsets around ``cycle`` (n0 → n1 → … → n0): zero for perfect estimates.

    Each hop uses the inverse-variance mean of the edges between its two nodes (either
    direction, sign flipped for b → a); None when a hop has no edge.
    """
    by_hop: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for e in pairs:
        if _valid(e):
            by_hop.setdefault((e.a, e.b), []).append((e.offset_ns, e.uncertainty_ns))
            by_hop.setdefault((e.b, e.a), []).append((-e.offset_ns, e.uncertainty_ns))
    total = 0.0
    for a, b in zip(cycle, [*cycle[1:], *cycle[:1]], strict=True):
        hop = by_hop.get((a, b))
        if not hop:
            return None
        weights = [1.0 / u**2 for _, u in hop]
        total += sum(w * v for w, (v, _) in zip(weights, hop, strict=True)) / sum(weights)
    return total
