"""Waiting in a main thread that must still hear its signals.

CPython runs a Python signal handler only in the main thread, when that thread next executes
bytecode. The kernel hands a process-directed signal to any thread that does not block it: in a
process with gRPC's, chDB's or an HTTP server's threads, often not the main one, and then a main
thread asleep in ``Event.wait()`` with no timeout is never interrupted and the handler waits until
something else wakes it. A gateway told to switch stores (SIGHUP) went on writing to the old one for
minutes that way. `wait_for_stop` sleeps in short slices so that a handler runs within one slice.
"""

from __future__ import annotations

import threading
import time

SLICE_S = 0.2
"""The longest a signal handler waits to run (the main thread's longest sleep)."""


def wait_for_stop(stop: threading.Event, duration_s: float | None = None) -> bool:
    """Block until ``stop`` is set or ``duration_s`` has passed; True when ``stop`` was set."""
    deadline = None if duration_s is None else time.monotonic() + duration_s
    while True:
        left = SLICE_S if deadline is None else min(SLICE_S, deadline - time.monotonic())
        if left <= 0:
            return stop.is_set()
        if stop.wait(left):
            return True
