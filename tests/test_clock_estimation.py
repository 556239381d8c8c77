"""Clock estimation on synthetic probe streams: Huygens pairs vs NTP, clock steps, loop correction.

The generator below plays two clocks (``ClockSpec``: offset, drift, steps) against a link with
base one-way delays, queueing and timestamp jitter, and emits coded pairs as the prober would.
Truth is known, so every test scores errors against it. All randomness is seeded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from ridethrough.collector.clock import ClockSpec
from ridethrough.collector.clock_graph import EdgeStatus, PairEdge, loop_closure_error, solve
from ridethrough.collector.huygens import (
    HuygensConfig,
    PairEstimate,
    PairEstimator,
    estimate_pair,
    estimate_windows,
    fit_separator,
    pure_pairs,
)
from ridethrough.collector.ntp import ntp_offset
from ridethrough.collector.probe_sample import ProbeSample

T0 = 1_764_480_000_000_000_000
WINDOW = 2_000_000_000


@dataclass(frozen=True)
class Link:
    """One path between A and B, each way: base delay, how often a probe meets a queue, jitter."""

    base_fwd_ns: int = 20_000
    base_rev_ns: int = 21_000
    fwd_busy: float = 0.0
    rev_busy: float = 0.0
    queue_mean_ns: float = 150_000.0
    jitter_ns: int = 0
    """Each timestamp is off by a uniform ±jitter (software timestamps)."""


def simulate(rng: np.random.Generator, link: Link, *, a: ClockSpec, b: ClockSpec, duration_s: float,
             period_ns: int = 2_000_000, pair_gap_ns: int = 20_000) -> list[ProbeSample]:
    """Coded pairs from A to B every ``period_ns`` of true time, as A's prober would record them."""
    samples: list[ProbeSample] = []

    def queue(busy: float) -> int:
        if rng.random() >= busy:
            return 0
        heavy = rng.random() < 0.05  # now and then a much longer queue (heavy tail)
        return int(rng.exponential(link.queue_mean_ns * (10 if heavy else 1))) + 1_000

    def jitter() -> int:
        return int(rng.integers(-link.jitter_ns, link.jitter_ns + 1)) if link.jitter_ns else 0

    for pair_id in range(int(duration_s * 1e9 / period_ns)):
        for index in (0, 1):
            send = T0 + 100_000 + pair_id * period_ns + index * pair_gap_ns
            arrive = send + link.base_fwd_ns + queue(link.fwd_busy)
            reply = arrive + int(rng.integers(5_000, 30_000))
            back = reply + link.base_rev_ns + queue(link.rev_busy)
            samples.append(ProbeSample(
                "a", "eth0", "b", "eth0", seq=2 * pair_id + index, pair_id=pair_id, pair_index=index,
                t1_ns=a.local(send) + jitter(), t2_ns=b.local(arrive) + jitter(),
                t3_ns=b.local(reply) + jitter(), t4_ns=a.local(back) + jitter()))
    return samples


def true_offset(a: ClockSpec, b: ClockSpec, a_time_ns: int) -> float:
    """clock_b - clock_a at the true instant when A's clock reads ``a_time_ns``."""
    t = a_time_ns
    for _ in range(3):  # invert A's clock: a fixed point, a few ns after three rounds
        t -= a.local(t) - a_time_ns
    return float(b.local(t) - a.local(t))


def errors(estimates: list[PairEstimate], a: ClockSpec, b: ClockSpec) -> np.ndarray:
    """Each window's offset error; the estimator's own bound must hold on every one."""
    out = np.array([abs(e.offset_ns - true_offset(a, b, e.reference_ns)) for e in estimates])
    assert all(err <= e.uncertainty_ns for err, e in zip(out, estimates, strict=True)), "the bound holds"
    return out


def ntp_errors(samples: list[ProbeSample], a: ClockSpec, b: ClockSpec) -> np.ndarray:
    return np.array([abs(off - true_offset(a, b, t)) for t, off in ntp_offset(samples)])


PERFECT = ClockSpec(epoch_ns=T0)
SKEWED = ClockSpec(offset_ns=2_500_000, drift_ppm=-40.0, epoch_ns=T0)


# -- the pairwise estimator --------------------------------------------------------------------


def test_asymmetric_queueing_leaves_huygens_unbiased_where_ntp_is_not() -> None:
    rng = np.random.default_rng(7)
    link = Link(fwd_busy=0.8)  # queues build A→B only; B→A idle
    samples = simulate(rng, link, a=PERFECT, b=SKEWED, duration_s=20)
    ours = errors(estimate_windows(samples, origin_ns=T0), PERFECT, SKEWED)
    ntp = ntp_errors(samples, PERFECT, SKEWED)
    ours_p99, ntp_p99 = np.percentile(ours, 99), np.percentile(ntp, 99)
    print(f"asymmetric: ours p50 {np.median(ours):.0f} p99 {ours_p99:.0f} ns; "
          f"NTP p50 {np.median(ntp):.0f} p99 {ntp_p99:.0f} ns")
    assert len(ours) == 10
    assert not any(e.step_detected for e in estimate_windows(samples, origin_ns=T0)), "queues are not steps"
    assert ours_p99 <= 3_000, "a few µs: half the base-delay asymmetry (500 ns) plus noise"
    assert ntp_p99 >= 5 * ours_p99


def test_idle_link_with_software_jitter_is_within_a_few_microseconds() -> None:
    rng = np.random.default_rng(11)
    samples = simulate(rng, Link(jitter_ns=1_500), a=PERFECT, b=SKEWED, duration_s=10)
    estimates = estimate_windows(samples, origin_ns=T0)
    ours = errors(estimates, PERFECT, SKEWED)
    assert np.median(ours) < 20_000
    assert np.max(ours) < 3_000
    assert all(e.separable and 10_000 < e.uncertainty_ns < 25_000 for e in estimates), \
        "the bound is half the minimum round trip"


@pytest.mark.parametrize("drift_ppm", [100.0, -100.0])
def test_drift_is_recovered_within_a_few_ppm(drift_ppm: float) -> None:
    rng = np.random.default_rng(3)
    a = ClockSpec(offset_ns=-1_000_000, drift_ppm=-drift_ppm / 4, epoch_ns=T0)
    b = ClockSpec(offset_ns=4_000_000, drift_ppm=drift_ppm * 3 / 4, epoch_ns=T0)
    samples = simulate(rng, Link(fwd_busy=0.5, rev_busy=0.3, jitter_ns=1_000), a=a, b=b, duration_s=8)
    estimates = estimate_windows(samples, origin_ns=T0)
    errors(estimates, a, b)  # A's clock starts 1 ms behind: a sliver of a first window, widely bounded
    full = [e for e in estimates if e.n_forward > 100]
    assert len(full) == 4
    assert all(abs(e.drift_ppm - drift_ppm) < 3.0 for e in full), [e.drift_ppm for e in full]
    assert np.max(errors(full, a, b)) < 3_000


def test_overlapping_clouds_fall_back_to_a_soft_margin() -> None:
    """Base delays below the timestamp jitter: no line separates the clouds; estimate anyway, widely."""
    rng = np.random.default_rng(5)
    link = Link(base_fwd_ns=500, base_rev_ns=500, jitter_ns=2_000)
    samples = simulate(rng, link, a=PERFECT, b=SKEWED, duration_s=4)
    estimates = estimate_windows(samples, origin_ns=T0)
    assert estimates and not any(e.separable for e in estimates)
    assert np.max(errors(estimates, PERFECT, SKEWED)) < 2_000
    assert all(e.uncertainty_ns >= 1_000 for e in estimates)


@pytest.mark.parametrize(("host", "at_s", "step_ns", "flagged"), [
    ("b", 7.3, 5_000_000, 3),  # inside window 3, [6 s, 8 s): located and refitted in that window
    ("b", 8.0, -3_000_000, 4),  # on a window boundary
    ("a", 7.3, 250_000, 3),  # the prober's own clock
    ("b", 7.999, 2_000_000, 4),  # too late in window 3 to tell from a glitch: the next window has it
])
def test_a_clock_step_is_detected_and_the_estimate_recovers(host: str, at_s: float, step_ns: int,
                                                            flagged: int) -> None:
    rng = np.random.default_rng(13)
    step = ((T0 + int(at_s * 1e9), step_ns),)
    a = ClockSpec(epoch_ns=T0, steps=step if host == "a" else ())
    b = ClockSpec(offset_ns=2_500_000, drift_ppm=-40.0, epoch_ns=T0, steps=step if host == "b" else ())
    samples = simulate(rng, Link(fwd_busy=0.3, jitter_ns=1_000), a=a, b=b, duration_s=16)
    estimates = estimate_windows(samples, origin_ns=T0)
    assert [i for i, e in enumerate(estimates) if e.step_detected] == [flagged]
    jump = step_ns if host == "b" else -step_ns
    assert estimates[flagged].step_ns == pytest.approx(jump, abs=abs(jump) / 50)
    assert np.max(errors(estimates, a, b)) < 3_000, "every window right, the step's too"


def test_pure_pairs_keep_only_undisturbed_pairs() -> None:
    rng = np.random.default_rng(17)
    samples = simulate(rng, Link(fwd_busy=0.5), a=PERFECT, b=SKEWED, duration_s=1)
    pure = pure_pairs(samples, gap_tolerance_ns=500)
    assert pure.n_pairs == 500
    assert len(pure.reverse) == 500, "B→A is idle: every pair survives"
    assert 100 < len(pure.forward) < 160, "both probes unqueued: 0.5² of pairs"
    assert all(s.pair_index == 0 for s in pure.forward)


@pytest.mark.parametrize("count", [0, 1, 2])
def test_few_probes_never_raise(count: int) -> None:
    samples = simulate(np.random.default_rng(1), Link(), a=PERFECT, b=SKEWED, duration_s=0.004)[:count]
    est = estimate_pair(samples, window_start_ns=T0)
    if count == 0:
        assert est is None
        return
    assert est is not None
    assert abs(est.offset_ns - true_offset(PERFECT, SKEWED, est.reference_ns)) <= est.uncertainty_ns + 1_000
    assert est.drift_uncertainty_ppm > 100, "one instant says nothing about drift"


def test_all_probes_at_one_instant_give_no_drift() -> None:
    x = np.zeros(5)
    fit = fit_separator(x, np.full(5, 120.0), x, np.full(5, 80.0))
    assert fit is not None and fit.separable
    assert fit.offset_ns == pytest.approx(100.0)
    assert fit.half_width_ns == pytest.approx(20.0)
    assert fit.slope == pytest.approx(0.0, abs=1e-9)
    assert fit.slope_hi - fit.slope_lo > 1e-4
    assert fit_separator(x[:0], x[:0], x, x) is None


def test_hard_margin_is_the_exact_lp_optimum() -> None:
    """Points chosen so the best slab is known: lines y = 10 + 0.001x (above) and y = -10 + 0.001x."""
    xf = np.array([-1e6, 0.0, 1e6, 5e5])
    yf = 10 + 1e-3 * xf + np.array([0.0, 0.0, 0.0, 300.0])
    xr = np.array([-5e5, 5e5, 9e5])
    yr = -10 + 1e-3 * xr - np.array([0.0, 0.0, 40.0])
    fit = fit_separator(xf, yf, xr, yr, max_drift_ppm=2_000.0)
    assert fit is not None and fit.separable
    assert fit.slope == pytest.approx(1e-3, rel=1e-6)
    assert fit.offset_ns == pytest.approx(0.0, abs=1e-3)
    assert fit.half_width_ns == pytest.approx(10.0, abs=1e-3)


def test_probes_bunched_in_time_claim_no_drift() -> None:
    sample = simulate(np.random.default_rng(2), Link(), a=PERFECT, b=SKEWED, duration_s=0.002)[0]
    est = estimate_pair([sample] * 6, window_start_ns=T0)
    assert est is not None and est.drift_ppm == 0.0 and est.drift_uncertainty_ppm == pytest.approx(500.0)


def test_late_samples_are_counted_not_fitted() -> None:
    samples = simulate(np.random.default_rng(2), Link(), a=PERFECT, b=SKEWED, duration_s=4)
    estimator = PairEstimator(origin_ns=T0)
    emitted = [e for s in samples if (e := estimator.add(s)) is not None]
    assert len(emitted) == 1 and estimator.add(samples[0]) is None
    assert estimator.late_samples == 1
    assert estimator.flush() is not None and estimator.flush() is None


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="trim_fractions"):
        HuygensConfig(trim_fractions=(0.7,))


# -- NTP ---------------------------------------------------------------------------------------


def _exchange(t1: int, fwd: int, rev: int, offset: int, turnaround: int = 10_000) -> ProbeSample:
    return ProbeSample("a", "e", "b", "e", seq=t1, pair_id=t1, pair_index=0, t1_ns=t1, t2_ns=t1 + fwd + offset,
                       t3_ns=t1 + fwd + offset + turnaround, t4_ns=t1 + fwd + turnaround + rev)


def test_ntp_takes_the_minimum_delay_exchange_of_the_last_eight() -> None:
    queued = [_exchange(i * 1000, 20_000 + (0 if i == 2 else 100_000), 20_000, 7_000) for i in range(12)]
    result = ntp_offset(queued)
    assert [off for _, off in result[:2]] == [57_000.0, 57_000.0], "queued one way: off by half the queue"
    assert all(off == 7_000.0 for _, off in result[2:10]), "the clean exchange rules while in the register"
    assert result[10][1] == 57_000.0, "and is forgotten after eight more"
    assert result[0][0] == (queued[0].t1_ns + queued[0].t4_ns) // 2


# -- the network effect ------------------------------------------------------------------------


TRUTH = {"n0": 0.0, "n1": 1_500_000.0, "n2": -800_000.0, "n3": 3_200_000.0}
DRIFT = {"n0": 0.0, "n1": 20.0, "n2": -35.0, "n3": 60.0}


def _edges(pairs: list[tuple[str, str]], *, corrupt: dict[tuple[str, str], float], seed: int = 2) -> list[PairEdge]:
    rng = np.random.default_rng(seed)
    return [PairEdge(a, b, TRUTH[b] - TRUTH[a] + corrupt.get((a, b), 0.0) + rng.normal(0, 300),
                     DRIFT[b] - DRIFT[a] + rng.normal(0, 0.3), uncertainty_ns=500.0, drift_uncertainty_ppm=0.5)
            for a, b in pairs]


RING_AND_CHORD = [("n0", "n1"), ("n1", "n2"), ("n2", "n3"), ("n3", "n0"), ("n0", "n2")]


def test_loops_correct_a_corrupted_edge_and_flag_it() -> None:
    edges = _edges(RING_AND_CHORD, corrupt={("n0", "n2"): 60_000.0})
    loop = loop_closure_error(edges, ["n0", "n1", "n2"])
    assert loop is not None and abs(loop + 60_000) < 2_000, "the chord breaks the loop it is in"
    result = solve(edges, reference="n0")
    assert result.nodes["n0"].offset_ns == 0.0 and result.nodes["n0"].offset_uncertainty_ns == 0.0
    for node, truth in TRUTH.items():
        assert abs(result.nodes[node].offset_ns - truth) < 1_500, node
        assert abs(result.nodes[node].drift_ppm - DRIFT[node]) < 1.5, node
    status = {(f.edge.a, f.edge.b): f.status for f in result.edges}
    assert status[("n0", "n2")] is EdgeStatus.DROPPED
    assert [s for k, s in status.items() if k != ("n0", "n2")] == [EdgeStatus.USED] * 4
    bad = next(f for f in result.edges if f.edge.a == "n0" and f.edge.b == "n2")
    assert abs(bad.offset_residual_ns - 60_000) < 2_000
    assert 0 < result.nodes["n1"].offset_uncertainty_ns < 1_000


def test_an_edge_in_series_is_suspect_not_dropped() -> None:
    """n1 has two edges only: the loops cannot tell which of them is wrong, so neither is dropped."""
    edges = _edges(RING_AND_CHORD, corrupt={("n0", "n1"): 60_000.0})
    result = solve(edges, reference="n0")
    suspects = {(f.edge.a, f.edge.b) for f in result.edges if f.status is EdgeStatus.SUSPECT}
    assert suspects == {("n0", "n1"), ("n1", "n2")}
    assert abs(result.nodes["n2"].offset_ns - TRUTH["n2"]) < 1_500, "the rest of the graph stays right"
    n1 = result.nodes["n1"]
    assert n1.offset_uncertainty_ns > 20_000 > result.nodes["n2"].offset_uncertainty_ns, "n1 is honestly unsure"
    assert abs(n1.offset_ns - TRUTH["n1"]) < n1.offset_uncertainty_ns


def test_disconnected_nodes_and_bad_edges_are_reported_not_fitted() -> None:
    edges = [*_edges(RING_AND_CHORD, corrupt={}),
             PairEdge("x", "y", 5.0, 0.0, 100.0), PairEdge("n1", "n3", float("nan"), 0.0, 100.0)]
    result = solve(edges, reference="n0")
    assert result.unreachable == ("x", "y")
    assert "x" not in result.nodes and set(result.nodes) == set(TRUTH)
    assert [f.status for f in result.edges[-2:]] == [EdgeStatus.UNREACHABLE, EdgeStatus.INVALID]
    lonely = solve([], reference="n0")
    assert list(lonely.nodes) == ["n0"] and lonely.unreachable == ()


def test_pairwise_estimates_feed_the_graph() -> None:
    """Three hosts probing one another, clocks known: the loop-corrected offsets land on the truth."""
    clocks = {"h0": PERFECT, "h1": SKEWED, "h2": ClockSpec(offset_ns=-700_000, drift_ppm=25.0, epoch_ns=T0)}
    rng = np.random.default_rng(23)
    edges = []
    for src, dst in (("h0", "h1"), ("h1", "h2"), ("h2", "h0")):
        samples = [_renamed(s, src, dst) for s in simulate(
            rng, Link(fwd_busy=0.5), a=clocks[src], b=clocks[dst], duration_s=2)]
        est = estimate_windows(samples, origin_ns=T0)[0]
        edges.append(PairEdge.from_estimate(est, at_ns=T0 + WINDOW // 2))
    result = solve(edges, reference="h0")
    for node in ("h1", "h2"):
        want = true_offset(PERFECT, clocks[node], T0 + WINDOW // 2)
        assert abs(result.nodes[node].offset_ns - want) < 3_000
        assert abs(result.nodes[node].drift_ppm - clocks[node].drift_ppm) < 3.0


def _renamed(s: ProbeSample, src: str, dst: str) -> ProbeSample:
    return ProbeSample(src, s.src_nic, dst, s.dst_nic, s.seq, s.pair_id, s.pair_index,
                       s.t1_ns, s.t2_ns, s.t3_ns, s.t4_ns)
