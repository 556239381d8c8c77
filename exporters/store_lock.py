"""The lock calls into one store client take: inserts and queries take turns.

An embedded store is one engine in this process, and every call into it takes one lock: the
gateway's inserts, the controller's detector queries (two lanes, each running its queries one
after another), the read-only HTTP endpoint, the clock service. On a loaded machine each query
can take a second or more, so who goes next decides whether the agents' calls, which wait for
their rows' insert, meet their deadlines:

* a plain lock has no order, and the controller releasing it after one query and taking it
  again for the next usually wins against the batcher that has been waiting: an insert could
  wait out a whole round of detector queries;
* first come, first served makes an insert wait for every query asked for before it (one per
  reader thread): still several seconds;
* inserts first starved the readers: a gateway working off a backlog always has its next batch
  waiting, and the controller and the read-only endpoint waited minutes.

So writers and readers alternate: a waiting insert goes next unless the last holder was a
writer and a query is waiting; readers go in the order they asked. An insert waits for at most
the call in progress and one query; a query for at most one insert per query ahead of it.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType


class TurnLock:
    """A reentrant mutex (as `threading.RLock`) whose waiting writers and readers take turns.

    ``with lock:`` takes it as a reader; ``with lock.hold(write=True):`` as a writer. A thread that
    holds it may take it again either way.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._owner: int | None = None
        self._depth = 0
        self._owner_writes = False
        self._last_wrote = False
        self._readers: deque[object] = deque()
        self._writers: deque[object] = deque()

    def _next(self) -> object | None:
        """The waiting caller whose turn comes next."""
        if self._writers and not (self._last_wrote and self._readers):
            return self._writers[0]
        if self._readers:
            return self._readers[0]
        return None

    def acquire(self, *, write: bool = False) -> None:
        """Take the lock when it is this caller's turn."""
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return
            ticket, queue = object(), self._writers if write else self._readers
            queue.append(ticket)
            while self._owner is not None or self._next() is not ticket:
                self._cond.wait()
            queue.popleft()
            self._owner, self._depth, self._owner_writes = me, 1, write

    def release(self) -> None:
        """Give one level of the lock back; the last one lets the next caller in."""
        with self._cond:
            if self._owner != threading.get_ident():
                raise RuntimeError("cannot release a store lock this thread does not hold")
            self._depth -= 1
            if self._depth == 0:
                self._owner, self._last_wrote = None, self._owner_writes
                self._cond.notify_all()

    @property
    def waiting(self) -> tuple[int, int]:
        """(writers, readers) waiting for the lock."""
        with self._cond:
            return len(self._writers), len(self._readers)

    @contextmanager
    def hold(self, *, write: bool = False) -> Iterator[None]:
        """Hold the lock for a block, as a writer or a reader."""
        self.acquire(write=write)
        try:
            yield
        finally:
            self.release()

    def __enter__(self) -> TurnLock:
        self.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()
