"""A main thread waiting for a stop signal hears it even when the kernel hands it to another thread."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import pytest

from ridethrough.signals import wait_for_stop


@pytest.fixture
def stop_on_usr1() -> Iterator[threading.Event]:
    stop = threading.Event()
    old = signal.signal(signal.SIGUSR1, lambda *_: stop.set())
    yield stop
    signal.signal(signal.SIGUSR1, old)


def _signal_another_thread(after_s: float) -> threading.Thread:
    """A thread that sleeps, and is sent SIGUSR1 itself (as the kernel may pick it for a process signal)."""
    sleeper = threading.Thread(target=time.sleep, args=(after_s + 3.0,), daemon=True)
    sleeper.start()
    assert sleeper.ident is not None
    ident = sleeper.ident
    threading.Timer(after_s, lambda: signal.pthread_kill(ident, signal.SIGUSR1)).start()
    return sleeper


def test_the_handler_runs_within_a_slice_of_the_signal(stop_on_usr1: threading.Event) -> None:
    _signal_another_thread(0.2)
    started = time.monotonic()
    assert wait_for_stop(stop_on_usr1, 30.0), "the stop signal was heard"
    assert time.monotonic() - started < 10.0, "long before the deadline"


def test_a_plain_wait_sleeps_through_it(stop_on_usr1: threading.Event) -> None:
    """The failure `wait_for_stop` exists for: the handler waits for the main thread to wake."""
    _signal_another_thread(0.2)
    assert not stop_on_usr1.wait(1.5), "the handler did not run while the main thread slept"
    time.sleep(0.01)  # any bytecode runs it now
    assert stop_on_usr1.is_set()


def test_the_duration_ends_the_wait() -> None:
    started = time.monotonic()
    assert wait_for_stop(threading.Event(), 0.5) is False
    assert time.monotonic() - started >= 0.5
    stop = threading.Event()
    stop.set()
    assert wait_for_stop(stop, 0.0) is True, "an already-set event wins over a spent duration"
