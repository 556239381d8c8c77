"""The store's lock: reentrant, exclusive, and inserts and queries take turns."""

from __future__ import annotations

import threading

import pytest

from ridethrough.exporters.store_lock import TurnLock
from tests.conftest import wait_for


class Callers:
    """Threads that each take the lock once (as a writer or a reader) and note their turn."""

    def __init__(self, lock: TurnLock) -> None:
        self.lock = lock
        self.order: list[str] = []
        self.threads: list[threading.Thread] = []

    def ask(self, name: str, *, write: bool) -> None:
        """Start a caller and return once it waits for the lock."""
        before = sum(self.lock.waiting)

        def take() -> None:
            with self.lock.hold(write=write):
                self.order.append(name)

        self.threads.append(threading.Thread(target=take))
        self.threads[-1].start()
        wait_for(lambda: sum(self.lock.waiting) == before + 1, timeout_s=10, what=f"{name} waiting")

    def join(self) -> list[str]:
        for t in self.threads:
            t.join(10)
        return self.order


def test_an_insert_waits_for_the_query_in_progress_not_for_the_queries_asked_before_it() -> None:
    lock = TurnLock()
    callers = Callers(lock)
    lock.acquire()  # a query in progress
    callers.ask("query1", write=False)
    callers.ask("query2", write=False)
    callers.ask("insert", write=True)
    lock.release()
    assert callers.join() == ["insert", "query1", "query2"]


def test_back_to_back_inserts_let_a_waiting_query_in_between() -> None:
    """A gateway working off a backlog always has its next batch waiting: queries still get turns."""
    lock = TurnLock()
    callers = Callers(lock)
    lock.acquire(write=True)  # an insert in progress
    callers.ask("query1", write=False)
    callers.ask("insert2", write=True)
    callers.ask("query2", write=False)
    callers.ask("insert3", write=True)
    lock.release()
    assert callers.join() == ["query1", "insert2", "query2", "insert3"]


def test_a_query_asked_again_at_once_goes_behind_the_waiting_insert() -> None:
    lock = TurnLock()
    callers = Callers(lock)
    lock.acquire()
    callers.ask("insert", write=True)
    lock.release()  # the controller's next query, asked as soon as the last returned
    with lock:
        callers.order.append("next query")
    assert callers.join() == ["insert", "next query"]


def test_the_lock_is_reentrant_and_exclusive() -> None:
    lock = TurnLock()
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
    lock = TurnLock()
    with pytest.raises(RuntimeError, match="does not hold"):
        lock.release()
