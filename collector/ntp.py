"""The NTP estimator on the same probes: the baseline the Huygens fit is judged against.

RFC 5905 §10 (clock filter), reduced to its core: each exchange gives an offset
θ = ((t2 - t1) + (t3 - t4)) / 2 and a delay δ = (t4 - t1) - (t3 - t2); the estimate after each
exchange is the θ of the minimum-δ exchange among the last eight. The reduction drops what only
matters to a running daemon (sample ageing by dispersion, the popcorn-spike suppressor, the rule
that a sample is used once): it can only make the baseline look better on a steady stream.
θ is clock_dst - clock_src, the same sign as ``PairEstimate.offset_ns``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from ridethrough.collector.probe_sample import ProbeSample

FILTER_DEPTH = 8
"""RFC 5905's clock-filter register holds eight samples."""


def exchange_offset_ns(sample: ProbeSample) -> float:
    """One exchange's offset: exact when the two one-way delays are equal, else off by half their difference."""
    return ((sample.t2_ns - sample.t1_ns) + (sample.t3_ns - sample.t4_ns)) / 2


def ntp_offset(samples_in_order: Iterable[ProbeSample], *, depth: int = FILTER_DEPTH) -> list[tuple[int, float]]:
    """(A-clock time, offset) after each exchange: the minimum-delay filter over the last ``depth``.

    The time is the midpoint (t1 + t4) / 2 of the exchange just completed: when the estimate is
    claimed to hold.
    """
    if depth < 1:
        raise ValueError(f"ntp: filter depth must be >= 1, got {depth}")
    register: deque[tuple[int, float]] = deque(maxlen=depth)
    out: list[tuple[int, float]] = []
    for s in samples_in_order:
        register.append((s.rtt_ns, exchange_offset_ns(s)))
        _, offset = min(register, key=lambda entry: entry[0])
        out.append(((s.t1_ns + s.t4_ns) // 2, offset))
    return out
