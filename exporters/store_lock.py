"""The lock calls into one store client take: inserts that wait go before queries that wait.

An embedded store is one engine in this process, and every call into it takes one lock: the
gateway's inserts, the controller's detector queries (two lanes, each running its queries one
after another), the read-only HTTP endpoint, the clock service. A plain lock has no order: the
controller releasing it after one query and taking it again for the next usually wins against
the batcher that has been waiting, so on a loaded machine an insert could wait out a whole round
of detector queries while the agents' calls waiting for it passed their deadlines. Here an
insert waits at most for the call in progress; queries never starve, since the gateway writes
in batches with gaps between them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType


class WritersFirstLock:
    """A reentrant mutex; among the threads waiting for it, writers take it before readers.

    ``with lock:`` takes it as a reader; ``with lock.hold(write=True):`` as a writer. A thread
    that holds it may take it again either way (as `threading.RLock`).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._owner: int | None = None
        self._depth = 0
        self._writers_waiting = 0

    def acquire(self, *, write: bool = False) -> None:
        """Take the lock, waiting behind its holder (and, as a reader, behind every waiting writer)."""
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return
            if write:
                self._writers_waiting += 1
            try:
                while self._owner is not None or (not write and self._writers_waiting):
                    self._cond.wait()
            finally:
                if write:
                    self._writers_waiting -= 1
            self._owner, self._depth = me, 1

    def release(self) -> None:
        """Give one level of the lock back; the last one lets the next thread in."""
        with self._cond:
            if self._owner != threading.get_ident():
                raise RuntimeError("cannot release a store lock this thread does not hold")
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._cond.notify_all()

    @contextmanager
    def hold(self, *, write: bool = False) -> Iterator[None]:
        """Hold the lock for a block, as a writer or a reader."""
        self.acquire(write=write)
        try:
            yield
        finally:
            self.release()

    def __enter__(self) -> WritersFirstLock:
        self.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()
