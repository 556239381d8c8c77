"""The lock calls into one store client take, handed out in the order they were asked for.

An embedded store is one engine in this process, and every call into it takes one lock: the
gateway's inserts, the controller's detector queries (two lanes, each running its queries one
after another), the read-only HTTP endpoint, the clock service. A plain lock has no order: the
controller releasing it after one query and taking it again for the next usually wins against
the batcher that has been waiting, so on a loaded machine an insert could wait out a whole round
of detector queries while the agents' calls waiting for it passed their deadlines. First come,
first served, each caller waits only for the calls asked for before its own. (Inserts first
instead starved the readers: a gateway working off a backlog always has its next batch waiting,
and the controller and the read-only endpoint waited minutes.)
"""

from __future__ import annotations

import threading
from types import TracebackType


class FifoLock:
    """A reentrant mutex that lets waiting threads in in the order they asked (as `threading.RLock`,
    a thread that holds it may take it again)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._owner: int | None = None
        self._depth = 0
        self._next_ticket = 0
        self._serving = 0

    def acquire(self) -> None:
        """Take the lock once every thread that asked before has had it."""
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return
            ticket = self._next_ticket
            self._next_ticket += 1
            while self._owner is not None or self._serving != ticket:
                self._cond.wait()
            self._owner, self._depth = me, 1

    def release(self) -> None:
        """Give one level of the lock back; the last one lets the next ticket in."""
        with self._cond:
            if self._owner != threading.get_ident():
                raise RuntimeError("cannot release a store lock this thread does not hold")
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._serving += 1
                self._cond.notify_all()

    def __enter__(self) -> FifoLock:
        self.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()
