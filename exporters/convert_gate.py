"""Turns at converting OTLP requests, for the calls that can still finish in time.

Converting a request into rows is Python under the GIL. Requests converted side by side share
one core's time: on a busy machine each takes N times as long, all of them miss their senders'
deadlines together, the senders retry (with their backlog joined, larger), and the gateway
spends its time converting requests nobody waits for any more, storing nothing (a congestion
collapse, seen with eight agents and a training job on two loaded cores). Taking turns, a few
at a time, each request is converted about as fast as the process can; one that would still be
converting when its call's deadline passes is refused before the work starts, so the gateway's
time goes to calls that can succeed and their senders hear "busy" at once, with time left to
send less.

Two slots, not one: measured with `bench/ingest.py`, one slot fed the batcher so evenly that it
wrote batches of a third the size, and the store's merges of the extra parts cost about 40 %
more CPU per point; two kept the batches and the CPU per point of unlimited conversion.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

RATE_DECAY = 0.8
"""Weight of the conversions before the newest in the recent rate (about the last five count)."""


class ConvertGate:
    """At most ``slots`` conversions at once; each turn must leave time to convert the request."""

    def __init__(self, *, slots: int = 2) -> None:
        if slots < 1:
            raise ValueError(f"slots must be at least 1, not {slots}")
        self._slots = threading.BoundedSemaphore(slots)
        self._lock = threading.Lock()
        # decayed sums of the bytes converted and the seconds it took: their ratio weighs each
        # conversion by its size, so many small requests' fixed costs do not inflate a large one's estimate
        self._bytes = 0.0
        self._seconds = 0.0
        self._converting = 0
        self.refused = 0

    @property
    def converting(self) -> int:
        """Conversions in progress."""
        with self._lock:
            return self._converting

    def estimate_s(self, size_bytes: int) -> float:
        """Seconds to convert ``size_bytes`` at the recent rate; 0 before the first conversion."""
        with self._lock:
            return size_bytes * self._seconds / self._bytes if self._bytes else 0.0

    @contextmanager
    def turn(self, size_bytes: int, time_left_s: float | None) -> Iterator[bool]:
        """Wait for a turn to convert ``size_bytes`` that ends within ``time_left_s`` (None: no deadline).

        Yields True inside the turn (the body's time updates the rate), False when no turn could
        start in time: the caller answers "busy" without converting. While nothing is being
        converted the estimate is not asked: a rate measured in a busy spell would otherwise refuse
        every request of that size for good, since only conversions measure it again.
        """
        if time_left_s is None:
            self._slots.acquire()
        else:
            wait_s = time_left_s if self.converting == 0 else time_left_s - self.estimate_s(size_bytes)
            if wait_s <= 0 or not self._slots.acquire(timeout=wait_s):
                with self._lock:
                    self.refused += 1
                yield False
                return
        with self._lock:
            self._converting += 1
        started = time.monotonic()
        try:
            yield True
        finally:
            took_s = time.monotonic() - started
            with self._lock:
                self._converting -= 1
                self._bytes = self._bytes * RATE_DECAY + size_bytes
                self._seconds = self._seconds * RATE_DECAY + took_s
            self._slots.release()
