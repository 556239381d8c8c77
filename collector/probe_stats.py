"""Per-path aggregates of probe samples over one collection interval: pure code, no sockets.

`PathWindow` gathers a path's samples between two collections: round-trip times, one-way
delays (clock-corrected where the offsets of both ends are known), and the purity of each
coded pair, i.e. whether the second probe arrived the same gap after the first as it was sent
(a queue on the way stretches or squeezes the gap). `quantiles` summarises a list as
min/p50/p99/max.

A clock correction says how far a node's clock is from the reference: at local time ``t``,
``node clock - reference = offset_ns + drift_ppm * 1e-6 * (t - at_ns)`` (no drift term when
``at_ns`` is 0). With both ends corrected::

    forward one-way delay = (t2 - off_dst(t2)) - (t1 - off_src(t1))
    reverse one-way delay = (t4 - off_src(t4)) - (t3 - off_dst(t3))

Without, each direction is estimated as half the round trip, and marked uncorrected.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from ridethrough.collector.probe_sample import ProbeSample, TimestampKind

MAX_PER_WINDOW = 10_000
"""Most samples one path keeps per interval (probing at the defaults gives a few per second)."""
QUANTILES: tuple[tuple[str, float], ...] = (("min", 0.0), ("p50", 0.5), ("p99", 0.99), ("max", 1.0))
_RANK = {TimestampKind.HARDWARE: 0, TimestampKind.KERNEL: 1, TimestampKind.USER: 2}


class Correction(NamedTuple):
    """How far one node's clock is from the reference (see the module docstring)."""

    offset_ns: int
    drift_ppm: float = 0.0
    at_ns: int = 0

    def at(self, local_ns: int) -> int:
        """The node's offset from the reference at its local time ``local_ns`` (an int: ns since the epoch
        do not fit a float's 53 bits)."""
        if not self.at_ns:
            return int(self.offset_ns)
        return int(self.offset_ns) + round(self.drift_ppm * 1e-6 * (local_ns - self.at_ns))


Corrections = Mapping[str, Correction]


def quantiles(values: Sequence[float]) -> list[tuple[str, float]]:
    """(name, value) for min, p50, p99 and max (nearest rank); empty for no values."""
    if not values:
        return []
    ordered = sorted(values)
    top = len(ordered) - 1
    return [(name, ordered[min(top, max(0, math.ceil(q * len(ordered)) - 1))]) for name, q in QUANTILES]


def pair_purity(a: ProbeSample, b: ProbeSample, tolerance_ns: int) -> tuple[bool, bool]:
    """(forward pure, reverse pure) for the two probes of one coded pair."""
    forward = abs((b.t2_ns - a.t2_ns) - (b.t1_ns - a.t1_ns)) <= tolerance_ns
    reverse = abs((b.t4_ns - a.t4_ns) - (b.t3_ns - a.t3_ns)) <= tolerance_ns
    return forward, reverse


def one_way_delays(s: ProbeSample, corrections: Corrections) -> tuple[int, int] | None:
    """(forward, reverse) one-way delays in ns, or None unless both ends have a correction."""
    src, dst = corrections.get(s.src_node), corrections.get(s.dst_node)
    if src is None or dst is None:
        return None
    forward = (s.t2_ns - dst.at(s.t2_ns)) - (s.t1_ns - src.at(s.t1_ns))
    reverse = (s.t4_ns - src.at(s.t4_ns)) - (s.t3_ns - dst.at(s.t3_ns))
    return forward, reverse


@dataclass(slots=True)
class PathWindow:
    """One path's samples since the last collection."""

    rtt_ns: list[float] = field(default_factory=list)
    forward_ns: list[float] = field(default_factory=list)
    reverse_ns: list[float] = field(default_factory=list)
    corrected: bool = True
    """False once any sample had to fall back to half the round trip."""
    rx_kind: TimestampKind = TimestampKind.HARDWARE
    """The least precise receive stamp among the samples."""
    pairs: int = 0
    pure_forward: int = 0
    pure_reverse: int = 0

    def add(self, s: ProbeSample, corrections: Corrections) -> None:
        """Fold in one sample."""
        if len(self.rtt_ns) >= MAX_PER_WINDOW:
            return
        rtt = float(s.rtt_ns)
        self.rtt_ns.append(rtt)
        delays = one_way_delays(s, corrections)
        if delays is None:
            self.corrected = False
        forward, reverse = (rtt / 2, rtt / 2) if delays is None else (float(delays[0]), float(delays[1]))
        self.forward_ns.append(forward)
        self.reverse_ns.append(reverse)
        self.rx_kind = max(self.rx_kind, s.rx_kind, key=_RANK.__getitem__)

    def add_pair(self, forward_pure: bool, reverse_pure: bool) -> None:
        """Fold in one complete coded pair."""
        self.pairs += 1
        self.pure_forward += forward_pure
        self.pure_reverse += reverse_pure


class PairMatcher:
    """Holds the first probe of each pair until its partner arrives; forgets halves after two rounds."""

    def __init__(self) -> None:
        self._current: dict[tuple[tuple[str, str, str, str], int], ProbeSample] = {}
        self._previous: dict[tuple[tuple[str, str, str, str], int], ProbeSample] = {}

    def match(self, s: ProbeSample) -> tuple[ProbeSample, ProbeSample] | None:
        """The pair (index 0, index 1) that ``s`` completes, or None if its partner has not come."""
        key = (s.path, s.pair_id)
        other = self._current.pop(key, None) or self._previous.pop(key, None)
        if other is None:
            self._current[key] = s
            return None
        if other.pair_index == s.pair_index:
            return None  # the prober never sends this; a matched reply is never matched twice
        return (other, s) if other.pair_index < s.pair_index else (s, other)

    def next_round(self) -> None:
        """A collection happened: halves older than the previous round are forgotten (their partner was lost)."""
        self._previous, self._current = self._current, {}


class SampleAggregator:
    """Thread-safe: the prober's thread adds samples, the collecting thread takes each interval's windows."""

    def __init__(self, *, pure_tolerance_ns: int) -> None:
        self.pure_tolerance_ns = pure_tolerance_ns
        self.corrections: Corrections = {}
        """The clock corrections applied to samples from now on (replace the mapping to update)."""
        self._lock = threading.Lock()
        self._windows: dict[tuple[str, str, str, str], PathWindow] = {}
        self._pairs = PairMatcher()

    def add(self, sample: ProbeSample) -> None:
        """Fold one sample into its path's window (and its pair's purity once both probes are in)."""
        with self._lock:
            window = self._windows.get(sample.path)
            if window is None:
                window = self._windows[sample.path] = PathWindow()
            window.add(sample, self.corrections)
            pair = self._pairs.match(sample)
            if pair is not None:
                window.add_pair(*pair_purity(*pair, self.pure_tolerance_ns))

    def take(self) -> dict[tuple[str, str, str, str], PathWindow]:
        """Every path's window since the last take (and start new ones)."""
        with self._lock:
            windows, self._windows = self._windows, {}
            self._pairs.next_round()
        return windows
