"""The store's lock: reentrant, exclusive, and an insert waiting goes before queries waiting."""

from __future__ import annotations

import threading
import time

import pytest

from ridethrough.exporters.store_lock import WritersFirstLock
from tests.conftest import wait_for


def test_a_waiting_writer_goes_before_readers_that_were_waiting_first() -> None:
    lock = WritersFirstLock()
    order: list[str] = []
    lock.acquire()  # a query in progress

    def take(name: str, write: bool) -> None:
        with lock.hold(write=write):
            order.append(name)

    readers = [threading.Thread(target=take, args=(f"query{i}", False)) for i in range(3)]
    for t in readers:
        t.start()
    time.sleep(0.2)  # the queries queue first (nothing to poll: they are blocked inside acquire)
    writer = threading.Thread(target=take, args=("insert", True))
    writer.start()
    wait_for(lambda: lock._writers_waiting == 1, timeout_s=10, what="the insert waiting")
    lock.release()
    for t in [*readers, writer]:
        t.join(10)
    assert order[0] == "insert" and sorted(order[1:]) == ["query0", "query1", "query2"]


def test_the_lock_is_reentrant_and_exclusive() -> None:
    lock = WritersFirstLock()
    got = threading.Event()

    def take() -> None:
        with lock:
            got.set()

    other = threading.Thread(target=take)
    with lock, lock.hold(write=True), lock:
        other.start()
        assert not got.wait(0.2), "another thread waits while this one holds it, at any depth"
    assert got.wait(10), "the last release let it in"
    other.join(10)


def test_only_the_holder_can_release() -> None:
    lock = WritersFirstLock()
    with pytest.raises(RuntimeError, match="does not hold"):
        lock.release()
