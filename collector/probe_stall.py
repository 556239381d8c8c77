"""How long a probe thread was not running: the union of the intervals it should have run but did not.

A prober or responder on a host whose CPUs are saturated (a training job's data loaders, a
cgroup quota) runs late. Its peers then see replies come late, or not within their timeout,
and would blame the network. Each probe thread therefore measures its own stalls from two
clocks that keep running while it does not:

* its loop: a wake-up that came later than the poll asked for (``note_wake``);
* its sockets: a datagram the kernel stamped on arrival but the thread read later
  (``note_read``: the kernel's receive stamp against the time it was read).

Both give an interval ``[should have run, did run]`` on the wall clock; `StallMeter` adds up
their union, so a stall seen by both the loop and a queue of datagrams counts once. Gaps shorter
than ``min_gap_s`` are ordinary scheduling and not counted. ``stalled_s`` is what the agent
exports as ``ridethrough.probe.stalled``; ``stalled_since`` tells the prober whether a probe's
life overlapped a stall.
"""

from __future__ import annotations

import collections
import threading

_MAX_GAP_NS = 600_000_000_000  # a longer "stall" is a clock step (or a suspended VM): not counted
_KEEP = 256  # stall intervals remembered for `stalled_since`


class StallMeter:
    """Seconds a thread was held off, as the union of its late intervals (see the module docstring)."""

    def __init__(self, *, min_gap_s: float = 0.05) -> None:
        self._min_gap_ns = round(min_gap_s * 1e9)
        self._lock = threading.Lock()
        self._total_ns = 0
        self._covered_until_ns = 0
        self._intervals: collections.deque[tuple[int, int]] = collections.deque(maxlen=_KEEP)

    def note(self, due_ns: int, ran_ns: int) -> None:
        """The thread should have run at ``due_ns`` and ran at ``ran_ns`` (wall-clock ns)."""
        gap = ran_ns - due_ns
        if gap < self._min_gap_ns or gap > _MAX_GAP_NS:
            return
        with self._lock:
            start = max(due_ns, self._covered_until_ns)
            if ran_ns <= start:
                return
            self._total_ns += ran_ns - start
            self._covered_until_ns = ran_ns
            self._intervals.append((start, ran_ns))

    def note_read(self, rx_true_ns: int, read_ns: int) -> None:
        """A datagram that arrived at ``rx_true_ns`` (kernel stamp) was read at ``read_ns``."""
        self.note(rx_true_ns, read_ns)

    def note_wake(self, asked_s: float, started_ns: int, woke_ns: int) -> None:
        """A poll started at ``started_ns`` for at most ``asked_s`` returned at ``woke_ns``."""
        self.note(started_ns + round(asked_s * 1e9), woke_ns)

    @property
    def stalled_s(self) -> float:
        """Seconds stalled so far (a counter: it only grows)."""
        with self._lock:
            return self._total_ns / 1e9

    def stalled_since(self, since_ns: int) -> bool:
        """Whether any stall ended after ``since_ns`` (wall-clock ns)."""
        with self._lock:
            return bool(self._intervals) and self._intervals[-1][1] > since_ns
