"""The store's lock: reentrant, exclusive, and taken in the order it was asked for."""

from __future__ import annotations

import threading

import pytest

from ridethrough.exporters.store_lock import FifoLock
from tests.conftest import wait_for


def _waiting(lock: FifoLock) -> int:
    return lock._next_ticket - lock._serving - 1  # tickets handed out beyond the holder's


def test_waiting_threads_take_the_lock_in_the_order_they_asked_and_the_holder_asking_again_goes_last() -> None:
    lock = FifoLock()
    order: list[str] = []
    lock.acquire()  # a query in progress

    def take(name: str) -> None:
        with lock:
            order.append(name)

    threads = []
    for name in ("insert", "query1", "query2"):
        threads.append(threading.Thread(target=take, args=(name,)))
        threads[-1].start()
        asked = len(threads)
        wait_for(lambda: _waiting(lock) == asked, timeout_s=10, what=f"{name} waiting")  # noqa: B023 - used at once
    # the controller's next query: released and asked again at once, it goes behind the three
    lock.release()
    with lock:
        order.append("next query")
    for t in threads:
        t.join(10)
    assert order == ["insert", "query1", "query2", "next query"]


def test_the_lock_is_reentrant_and_exclusive() -> None:
    lock = FifoLock()
    got = threading.Event()

    def take() -> None:
        with lock:
            got.set()

    other = threading.Thread(target=take)
    with lock, lock, lock:
        other.start()
        assert not got.wait(0.2), "another thread waits while this one holds it, at any depth"
    assert got.wait(10), "the last release let it in"
    other.join(10)


def test_only_the_holder_can_release() -> None:
    lock = FifoLock()
    with pytest.raises(RuntimeError, match="does not hold"):
        lock.release()
