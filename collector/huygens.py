"""Huygens-style pairwise clock estimation: offset and drift between two clocks, from probes.

Geng et al., "Exploiting a Natural Network Effect for Scalable, Fine-grained Clock
Synchronization" (NSDI 2018). Two of the paper's ideas live here (the third, loops, lives in
``clock_graph``):

1. **Coded probes.** Two probes sent a small gap apart arrive the same gap apart only if neither
   met a queue; such *pure* pairs carry the propagation delay alone.
2. **The separator.** In the plane (x = A-clock time, y = timestamp difference) forward probes,
   y = t2 - t1 = OWD_f + θ(x), lie *above* the line θ(x) = offset + drift·(x - x0) and reverse
   probes, y = t3 - t4 = θ(x) - OWD_r, lie *below* it, because delays are positive. The widest
   slab between the two clouds (a 2-D support-vector machine, or the equivalent linear
   programme) gives the line. Queued probes sit far from the slab and cannot move it: that is
   what makes the fit immune to queueing in one direction, where NTP's ((t2-t1)+(t3-t4))/2 is
   biased by half the queue.

The slab's centre assumes the *minimum* delays are symmetric (Huygens and NTP both do); its
half-width is the honest bound when they are not, and is reported as the uncertainty.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from ridethrough.collector.probe_sample import ProbeSample

FloatArray = npt.NDArray[np.float64]

_SLOPE_GRID = 129
_SEARCH_ITERS = 40
_TIE_NS = 1e-3
"""Gaps this close count as equal: a flat top of the margin is split down the middle."""


@dataclass(frozen=True, slots=True)
class HuygensConfig:
    """Knobs of the pairwise estimator (defaults suit software timestamps)."""

    window_ns: int = 2_000_000_000
    gap_tolerance_ns: int = 2_000
    """A pair is pure when its gap changed by at most this (several timestamps' jitter)."""
    min_pure_points: int = 8
    """Below this many pure probes in a direction, fit that direction's probes unfiltered."""
    max_drift_ppm: float = 500.0
    """Slopes searched: two clocks within ±100 ppm each, with room to spare."""
    trim_fractions: tuple[float, ...] = (0.01, 0.02, 0.05, 0.1)
    """Soft margin: when no line separates the clouds, ignore this share of each side's most
    intruding points, the smallest that separates (the last is used regardless)."""
    uncertainty_floor_ns: float = 100.0
    step_k: float = 2.0
    step_floor_ns: float = 20_000.0
    step_drift_slack_ppm: float = 10.0
    """How far a prediction may wander per second from an error in the drift estimate."""
    step_min_points: int = 3
    trust_max_drift_uncertainty_ppm: float = 100.0
    """A window predicts the next only if its drift is pinned this well (not a window's sliver)."""

    def __post_init__(self) -> None:
        if self.window_ns <= 0 or self.gap_tolerance_ns < 0 or self.max_drift_ppm <= 0:
            raise ValueError("huygens: window_ns and max_drift_ppm must be > 0, gap_tolerance_ns >= 0")
        if any(not 0.0 < f < 0.5 for f in self.trim_fractions):
            raise ValueError(f"huygens: trim_fractions must lie in (0, 0.5), got {self.trim_fractions}")


DEFAULT_CONFIG = HuygensConfig()


class PureProbes(NamedTuple):
    """Probes whose coded pair crossed undisturbed, per direction (the pair's first probe)."""

    forward: list[ProbeSample]
    reverse: list[ProbeSample]
    n_pairs: int
    """Complete pairs examined (both probes present)."""


def pure_pairs(samples: Iterable[ProbeSample], *, gap_tolerance_ns: int) -> PureProbes:
    """Coded-pair filter: forward pure if the gap survived A→B, reverse pure if it survived B→A.

    |(t2b - t2a) - (t1b - t1a)| <= tolerance (forward), |(t4b - t4a) - (t3b - t3a)| (reverse).
    """
    halves: dict[tuple[tuple[str, str, str, str], int], list[ProbeSample | None]] = {}
    for s in samples:
        if s.pair_index in (0, 1):
            halves.setdefault((s.path, s.pair_id), [None, None])[s.pair_index] = s
    forward: list[ProbeSample] = []
    reverse: list[ProbeSample] = []
    n_pairs = 0
    for a, b in halves.values():
        if a is None or b is None:
            continue
        n_pairs += 1
        if abs((b.t2_ns - a.t2_ns) - (b.t1_ns - a.t1_ns)) <= gap_tolerance_ns:
            forward.append(a)
        if abs((b.t4_ns - a.t4_ns) - (b.t3_ns - a.t3_ns)) <= gap_tolerance_ns:
            reverse.append(a)
    return PureProbes(forward, reverse, n_pairs)


@dataclass(frozen=True, slots=True)
class Separator:
    """The widest slab between forward points (above) and reverse points (below)."""

    offset_ns: float
    """The slab's centre line at x = 0."""
    slope: float
    """Its slope (ns per ns: drift as a fraction)."""
    half_width_ns: float
    """The margin; negative when even the soft margin could not separate the clouds."""
    slope_lo: float
    slope_hi: float
    """Slopes at which a slab at least as good as the accepted bound still exists."""
    trimmed: int
    """Points ignored (both sides) by the soft margin; 0 for the hard margin."""
    separable: bool


def _kth_low(values: FloatArray, k: int) -> float:
    return float(values.min()) if k == 0 else float(np.partition(values, k)[k])


def _golden_max(f: Callable[[float], float], lo: float, hi: float) -> float:
    """Maximiser of a unimodal ``f`` on [lo, hi]."""
    r = (math.sqrt(5.0) - 1.0) / 2.0
    a, b = lo + (1 - r) * (hi - lo), lo + r * (hi - lo)
    fa, fb = f(a), f(b)
    for _ in range(_SEARCH_ITERS):
        if fa >= fb:
            hi, b, fb = b, a, fa
            a = lo + (1 - r) * (hi - lo)
            fa = f(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + r * (hi - lo)
            fb = f(b)
    return a if fa >= fb else b


def _reach(f: Callable[[float], float], start: float, end: float, level: float) -> float:
    """The farthest point from ``start`` toward ``end`` where ``f`` stays >= level (f concave)."""
    if f(end) >= level:
        return end
    good, bad = start, end
    for _ in range(_SEARCH_ITERS):
        mid = (good + bad) / 2
        good, bad = (mid, bad) if f(mid) >= level else (good, mid)
    return good


def _slab(xf: FloatArray, yf: FloatArray, xr: FloatArray, yr: FloatArray,
          kf: int, kr: int, max_slope: float) -> Separator:
    """Maximise the gap between the forward lower and reverse upper envelope over the slope.

    For a fixed slope b the best offset is halfway between min(yf - b·xf) and max(yr - b·xr);
    the gap is concave in b (a minimum of lines minus a maximum of lines), so a grid then a
    golden-section search finds the exact optimum of this LP. With k > 0 the k most intruding
    points per side are ignored (a soft margin; then only nearly concave, which the grid covers).
    """
    def ends(b: float) -> tuple[float, float]:
        return _kth_low(yf - b * xf, kf), -_kth_low(b * xr - yr, kr)

    def gap(b: float) -> float:
        low, high = ends(b)
        return low - high

    grid = np.linspace(-max_slope, max_slope, _SLOPE_GRID)
    i = int(np.argmax([gap(float(b)) for b in grid]))
    best = _golden_max(gap, float(grid[max(i - 1, 0)]), float(grid[min(i + 1, _SLOPE_GRID - 1)]))
    if gap(best) < gap(float(grid[i])):
        best = float(grid[i])
    top = gap(best)
    # The slopes still consistent with positive delays bound the drift; when the clouds overlap,
    # accept twice the overlap instead.
    level = min(0.0, 2 * top) - _TIE_NS
    slope_lo, slope_hi = _reach(gap, best, -max_slope, level), _reach(gap, best, max_slope, level)
    if slope_hi - slope_lo >= 2 * max_slope * (1 - 1e-9):
        # Any slope will do (probes bunched in time): the margin would buy nanoseconds with an
        # absurd drift, so assume none.
        slope = 0.0
    else:
        # A flat top is split down the middle.
        slope = (_reach(gap, best, -max_slope, top - _TIE_NS) + _reach(gap, best, max_slope, top - _TIE_NS)) / 2
    low, high = ends(slope)
    margin = (low - high) / 2
    return Separator(offset_ns=(low + high) / 2, slope=slope, half_width_ns=margin, slope_lo=slope_lo,
                     slope_hi=slope_hi, trimmed=kf + kr, separable=margin > 0)


def fit_separator(xf: FloatArray, yf: FloatArray, xr: FloatArray, yr: FloatArray, *,
                  max_drift_ppm: float = DEFAULT_CONFIG.max_drift_ppm,
                  trim_fractions: Sequence[float] = DEFAULT_CONFIG.trim_fractions) -> Separator | None:
    """The max-margin line between forward points (xf, yf) and reverse points (xr, yr).

    Hard margin first; if the clouds overlap (timestamp noise, a glitch), the smallest soft
    margin that separates them, else the widest-trimmed one flagged ``separable=False``.
    None when a side has no points.
    """
    if len(xf) == 0 or len(xr) == 0:
        return None
    max_slope = max_drift_ppm * 1e-6
    fit = _slab(xf, yf, xr, yr, 0, 0, max_slope)
    tried = {(0, 0)}
    for fraction in trim_fractions:
        if fit.separable:
            break
        ks = (int(fraction * len(xf)), int(fraction * len(xr)))
        if ks not in tried:
            tried.add(ks)
            fit = _slab(xf, yf, xr, yr, *ks, max_slope)
    return fit


@dataclass(frozen=True, slots=True)
class PairEstimate:
    """Clock B minus clock A over one window, as seen from A's probes."""

    src: str
    dst: str
    offset_ns: float
    """θ = clock_dst - clock_src at ``reference_ns`` (A-clock)."""
    drift_ppm: float
    uncertainty_ns: float
    """Bound on the offset error: the slab's half-width (widened when the clouds overlap)."""
    drift_uncertainty_ppm: float
    n_forward: int
    n_reverse: int
    n_pure: int
    """Pure pairs (either direction) among the window's coded pairs."""
    fwd_owd_min_ns: float
    rev_owd_min_ns: float
    window_start_ns: int
    window_end_ns: int
    reference_ns: int
    separable: bool = True
    step_detected: bool = False
    step_ns: float = 0.0
    """When a step was detected: the offset's jump from the previous window's prediction."""

    def offset_at(self, t_ns: int) -> float:
        """θ at A-clock time ``t_ns``, extrapolated along the drift."""
        return self.offset_ns + self.drift_ppm * 1e-6 * (t_ns - self.reference_ns)


def _xy(samples: Sequence[ProbeSample], x0: int, forward: bool) -> tuple[FloatArray, FloatArray]:
    """Points in the separator's plane, differences taken in integers (absolute ns overflow floats)."""
    n = len(samples)
    t = np.array([(s.t1_ns, s.t2_ns, s.t3_ns, s.t4_ns) for s in samples], dtype=np.int64).reshape(n, 4)
    if forward:
        return (t[:, 0] - x0).astype(np.float64), (t[:, 1] - t[:, 0]).astype(np.float64)
    return (t[:, 3] - x0).astype(np.float64), (t[:, 2] - t[:, 3]).astype(np.float64)


def estimate_pair(samples: Iterable[ProbeSample], *, window_start_ns: int, window_end_ns: int | None = None,
                  config: HuygensConfig = DEFAULT_CONFIG) -> PairEstimate | None:
    """Offset and drift of the destination's clock against the source's, from one window's probes.

    Fits pure probes (falling back to all probes of a direction that has too few), referenced to
    the window's midpoint. None only without probes; degenerate input yields a wide uncertainty.
    """
    every = list(samples)
    if not every:
        return None
    end = window_start_ns + config.window_ns if window_end_ns is None else window_end_ns
    x0 = window_start_ns + (end - window_start_ns) // 2
    pure = pure_pairs(every, gap_tolerance_ns=config.gap_tolerance_ns)
    fwd = pure.forward if len(pure.forward) >= config.min_pure_points else every
    rev = pure.reverse if len(pure.reverse) >= config.min_pure_points else every
    xf, yf = _xy(fwd, x0, forward=True)
    xr, yr = _xy(rev, x0, forward=False)
    fit = fit_separator(xf, yf, xr, yr, max_drift_ppm=config.max_drift_ppm,
                        trim_fractions=config.trim_fractions)
    if fit is None:
        return None
    margin = abs(fit.half_width_ns)
    drift_bound = max(fit.slope_hi - fit.slope, fit.slope - fit.slope_lo)
    # The bound holds where the probes are; carried to x0 it widens with the drift's own bound.
    reach_ns = abs(float(np.mean(np.concatenate([xf, xr]))))
    uncertainty = (margin if fit.separable else 2 * margin) + drift_bound * reach_ns
    return PairEstimate(
        src=every[0].src_node, dst=every[0].dst_node, offset_ns=fit.offset_ns, drift_ppm=fit.slope * 1e6,
        uncertainty_ns=max(uncertainty, config.uncertainty_floor_ns),
        drift_uncertainty_ppm=drift_bound * 1e6,
        n_forward=len(fwd), n_reverse=len(rev), n_pure=len({id(s) for s in (*pure.forward, *pure.reverse)}),
        fwd_owd_min_ns=float(np.min(yf - fit.offset_ns - fit.slope * xf)),
        rev_owd_min_ns=float(np.min(fit.offset_ns + fit.slope * xr - yr)),
        window_start_ns=window_start_ns, window_end_ns=end, reference_ns=x0, separable=fit.separable)


def _onset(x: FloatArray, violates: npt.NDArray[np.bool_], min_points: int) -> float | None:
    """Earliest violating x from which at least half the later points violate too (a step, not a glitch)."""
    order = np.argsort(x, kind="stable")
    xs, vs = x[order], violates[order]
    later = np.cumsum(vs[::-1])[::-1]
    total = np.arange(len(vs), 0, -1)
    hits = np.flatnonzero(vs & (2 * later >= total) & (later >= min_points))
    return float(xs[hits[0]]) if len(hits) else None


def step_onset_ns(samples: Sequence[ProbeSample], last: PairEstimate, config: HuygensConfig) -> int | None:
    """When (A-clock) probes started contradicting ``last``'s prediction, if they did.

    Positive delays mean no forward point may sit below θ and no reverse point above it; a clock
    step breaks that for every probe after it. All probes are used: queued ones sit far from the
    line and can only fail to violate, never violate falsely.
    """
    if not samples:
        return None
    tolerance = max(config.step_floor_ns, config.step_k * last.uncertainty_ns)
    slack = config.step_drift_slack_ppm * 1e-6
    onsets = []
    for forward in (True, False):
        x, y = _xy(samples, last.reference_ns, forward)
        predicted = last.offset_ns + last.drift_ppm * 1e-6 * x
        allowed = tolerance + slack * np.abs(x)
        violates = y < predicted - allowed if forward else y > predicted + allowed
        onset = _onset(x, violates, config.step_min_points)
        if onset is not None:
            onsets.append(onset)
    return last.reference_ns + math.floor(min(onsets)) if onsets else None


def _jumped(est: PairEstimate, last: PairEstimate, config: HuygensConfig) -> bool:
    """The window's offset disagrees with the last window's prediction beyond both uncertainties."""
    allowed = max(config.step_floor_ns, config.step_k * math.hypot(est.uncertainty_ns, last.uncertainty_ns))
    allowed += config.step_drift_slack_ppm * 1e-6 * abs(est.reference_ns - last.reference_ns)
    return abs(est.offset_ns - last.offset_at(est.reference_ns)) > allowed


class PairEstimator:
    """One peer pair's probes, windowed; one estimate per window, with clock-step detection.

    A step found inside a window is located, the window refitted from the step on (and
    referenced there), and the history dropped, so the estimate is right again in that window or
    the next. A step smaller than about the minimum round trip plus the detection threshold
    (``step_floor_ns``, ``step_k``) can pass for a change of drift within one window and is not
    flagged; the next window is right again regardless.
    """

    def __init__(self, *, config: HuygensConfig = DEFAULT_CONFIG, origin_ns: int = 0) -> None:
        self._cfg = config
        self._origin = origin_ns
        self._window: int | None = None
        self._pending: list[ProbeSample] = []
        self._last: PairEstimate | None = None
        self.late_samples = 0
        """Samples for a window already closed: dropped, counted."""

    def add(self, sample: ProbeSample) -> PairEstimate | None:
        """Take one sample; returns the previous window's estimate when this sample closes it."""
        index = (sample.t1_ns - self._origin) // self._cfg.window_ns
        done = None
        if self._window is not None and index < self._window:
            self.late_samples += 1
            return None
        if self._window is not None and index > self._window:
            done = self.flush()
        self._window = index
        self._pending.append(sample)
        return done

    def flush(self) -> PairEstimate | None:
        """Close the open window now (at shutdown, or when probes stop)."""
        if self._window is None or not self._pending:
            return None
        start = self._origin + self._window * self._cfg.window_ns
        samples, self._pending = self._pending, []
        return self._judge(samples, start, start + self._cfg.window_ns)

    def _judge(self, samples: list[ProbeSample], start: int, end: int) -> PairEstimate | None:
        est = estimate_pair(samples, window_start_ns=start, window_end_ns=end, config=self._cfg)
        last = self._last
        if est is None:
            return None
        if last is not None:
            onset = step_onset_ns(samples, last, self._cfg)
            if onset is not None:
                # Refit from the step on, referenced inside that stretch: the window's midpoint
                # may precede the step, where the new line does not hold.
                after = [s for s in samples if s.t1_ns >= onset]
                refit = estimate_pair(after, window_start_ns=onset, window_end_ns=end, config=self._cfg)
                est = replace(refit or est, window_start_ns=start, step_detected=True)
            elif est.separable and _jumped(est, last, self._cfg):
                est = replace(est, step_detected=True)
            if est.step_detected:
                est = replace(est, step_ns=est.offset_ns - last.offset_at(est.reference_ns))
        trusted = est.separable and est.drift_uncertainty_ppm <= self._cfg.trust_max_drift_uncertainty_ppm
        if est.step_detected or trusted:
            # After a step the old line predicts nothing: start over from this window.
            self._last = est if trusted else None
        return est


def estimate_windows(samples: Iterable[ProbeSample], *, config: HuygensConfig = DEFAULT_CONFIG,
                     origin_ns: int = 0) -> list[PairEstimate]:
    """Every window's estimate for one pair's samples (in send order)."""
    estimator = PairEstimator(config=config, origin_ns=origin_ns)
    out = [est for s in samples if (est := estimator.add(s)) is not None]
    last = estimator.flush()
    return [*out, last] if last is not None else out
