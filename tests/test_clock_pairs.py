"""The agent's pairwise clocks: synthetic probes between two known clocks → estimates → catalogued gauges."""

from __future__ import annotations

import random
import threading
from dataclasses import replace

from ridethrough.catalogue import metric
from ridethrough.collector.clock_pairs import PAIR, PairwiseClocks, estimate_samples
from ridethrough.collector.huygens import HuygensConfig
from ridethrough.collector.probe_sample import ProbeSample

T0 = 1_764_480_000_000_000_000
WINDOW = HuygensConfig(window_ns=1_000_000_000)


def exchanges(src: str, dst: str, *, offset_ns: int, drift_ppm: float, seconds: float,
              every_ns: int = 20_000_000, seed: int = 1) -> list[ProbeSample]:
    """Coded pairs from ``src`` (true clock) to ``dst`` (clock = true + offset + drift), 50 µs each way plus noise."""
    rng = random.Random(seed)
    out: list[ProbeSample] = []

    def dst_clock(t: int) -> int:
        return t + offset_ns + round(drift_ppm * 1e-6 * (t - T0))

    for pair in range(int(seconds * 1e9 / every_ns)):
        for index in (0, 1):
            t1 = T0 + pair * every_ns + index * 20_000
            queued = rng.random() < 0.3  # a third of the probes meet a queue one way: the separator ignores them
            fwd = 50_000 + rng.randint(0, 300) + (rng.randint(10_000, 200_000) if queued else 0)
            t2 = dst_clock(t1 + fwd)
            t3 = t2 + 5_000
            t4 = t1 + fwd + 5_000 + 50_000 + rng.randint(0, 300)
            out.append(ProbeSample(src, "nic0", dst, "nic0", len(out), pair, index, t1, t2, t3, t4))
    return out


def test_each_peer_gets_its_own_estimator_and_finished_windows_match_the_truth() -> None:
    clocks = PairwiseClocks(node="a", config=WINDOW)
    b = exchanges("a", "b", offset_ns=2_500_000, drift_ppm=-40.0, seconds=3.5)
    c = exchanges("a", "c", offset_ns=-700_000, drift_ppm=25.0, seconds=3.5, seed=2)
    for s in sorted(b + c, key=lambda s: s.t1_ns):
        clocks.add(s)
    clocks.add(ProbeSample("x", "nic0", "a", "nic0", 0, 0, 0, T0, T0, T0, T0))  # another node's: ignored
    latest = {e.dst: e for e in clocks.latest()}
    assert set(latest) == {"b", "c"} and clocks.estimates == 6  # windows 0, 1, 2 per peer closed
    for peer, (offset, drift) in {"b": (2_500_000, -40.0), "c": (-700_000, 25.0)}.items():
        est = latest[peer]
        truth = offset + drift * 1e-6 * (est.reference_ns - T0)
        assert abs(est.offset_ns - truth) < 2_000, (peer, est.offset_ns, truth)
        assert abs(est.drift_ppm - drift) < 5, (peer, est.drift_ppm)
        assert est.src == "a" and est.dst == peer and est.reference_ns == T0 + 2_500_000_000


def test_the_latest_window_is_reported_at_every_collection_as_catalogued() -> None:
    clocks = PairwiseClocks(node="a", config=WINDOW)
    assert clocks.samples() == []
    for s in exchanges("a", "b", offset_ns=1_000_000, drift_ppm=10.0, seconds=1.5):
        clocks.add(s)
    first, again = clocks.samples(), clocks.samples()
    assert first == again and {s.name for s in first} == {PAIR + f for f in
                                                        ("offset", "drift", "uncertainty", "step", "reference")}
    for s in first:
        spec = metric(s.name)
        assert (spec.source, spec.unit, spec.kind) == ("probe", s.unit, s.kind), s.name
        assert sorted(s.attributes) == sorted(spec.attributes) and s.attributes["clock.dst.node"] == "b"
    values = {s.name: s.value for s in first}
    assert abs(values[PAIR + "offset"] - (1e-3 + 10e-6 * 0.5)) < 2e-6 and values[PAIR + "step"] == 0  # 0.5 s in
    assert values[PAIR + "reference"] == (T0 + 500_000_000) / 1e9 and 0 < values[PAIR + "uncertainty"] < 1e-4


def test_a_peer_no_longer_probed_is_forgotten_and_a_step_shows_as_one() -> None:
    clocks = PairwiseClocks(node="a", config=WINDOW)
    samples = exchanges("a", "b", offset_ns=0, drift_ppm=0.0, seconds=1.5)
    samples += exchanges("a", "c", offset_ns=0, drift_ppm=0.0, seconds=7.5, seed=2)
    for s in sorted(samples, key=lambda s: s.t1_ns):
        clocks.add(s)
    [latest] = clocks.latest()  # b's last window is over 3 windows older than c's
    assert latest.dst == "c"
    stepped = estimate_samples(replace(latest, step_detected=True, step_ns=5e6))
    assert [s.value for s in stepped if s.name == PAIR + "step"] == [1.0]


def test_adding_from_the_prober_thread_while_collecting_is_safe() -> None:
    clocks = PairwiseClocks(node="a", config=WINDOW)
    samples = exchanges("a", "b", offset_ns=0, drift_ppm=0.0, seconds=5.0)
    feeder = threading.Thread(target=lambda: [clocks.add(s) for s in samples])
    feeder.start()
    while feeder.is_alive():
        clocks.samples()
    feeder.join()
    assert clocks.estimates == 4 and len(clocks.samples()) == 5
