"""Where the launcher, its coordinator and the ranks meet: the job store's keys, listed once.

The job store is the TCPStore the node-0 launcher hosts at ``MASTER_ADDR:MASTER_PORT`` (the one
torchrun's agent would host). Values are small JSON documents; tensors never travel through it
(the store caps a value at 8 MiB), they go over a process group.

    gen                    the job's current generation (process groups are re-formed under g<gen>/)
    ctl/seq, ctl/<n>       commands to every rank (snapshot, migrate), in order; ctl/<n>/... their replies
    spare/seq, spare/<n>   spares as they park; spare/<id>/assign: the rank a spare is to take
    fail/<gen>/<rank>      a rank whose collective failed in <gen>, and where it was (fail/<gen>/count: how many)
    lost/<gen>             a member of <gen> is gone: collectives stalled on it give up
    recover/<gen>          the coordinator's plan for leaving <gen> (replace ranks, end, or abort)
    g<gen>/ready           roll call of the members forming <gen>; g<gen>/wake: set once the roll call
                           is complete or superseded (members block on it instead of polling)
    ev/seq, ev/<n>         what follower launchers saw (a rank or spare exited), for the coordinator
    req/seq, req/<n>       requests from any node's control socket; req/<n>/reply the answer
    hb/<node>              each launcher's heartbeat (time.time())
    end                    a rank completed its script (the job is finishing)
    restart                the job restarts from a snapshot: {"life", "gen", "snapshot"} (every launcher acts)
    shutdown               the node-0 launcher is done: {"code"}; the others stop too
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any, Protocol

GEN = "gen"
CTL_SEQ = "ctl/seq"
SPARE_SEQ = "spare/seq"
EV_SEQ = "ev/seq"
REQ_SEQ = "req/seq"
END = "end"
RESTART = "restart"
SHUTDOWN = "shutdown"


class Store(Protocol):
    """The part of ``torch.distributed.Store`` used here (a TCPStore in practice, a HashStore in tests)."""

    def set(self, key: str, value: str, /) -> None:
        """Set ``key``."""

    def get(self, key: str, /) -> bytes:
        """The value of ``key`` (blocks until it is set, up to the store's timeout)."""
        ...

    def add(self, key: str, value: int, /) -> int:
        """Add to the counter ``key``; the new value."""
        ...

    def check(self, keys: list[str], /) -> bool:
        """Whether every key is set (never blocks)."""
        ...

    def compare_set(self, key: str, expected_value: str, desired_value: str, /) -> bytes:
        """Set ``key`` if it holds ``expected_value`` ('' for unset); the value it holds afterwards."""
        ...

    def wait(self, keys: list[str], timeout: timedelta, /) -> None:
        """Block until every key is set (the store answers when it is: no polling); raises at ``timeout``."""


def ctl(n: int, what: str = "") -> str:
    """Command ``n`` (or one of its reply keys, e.g. ``ctl(3, "T")``)."""
    return f"ctl/{n}/{what}" if what else f"ctl/{n}"


def spare(n: int) -> str:
    """The n-th registered spare's record."""
    return f"spare/{n}"


def assign(spare_id: str) -> str:
    """Where a spare finds the rank it is to take."""
    return f"spare/{spare_id}/assign"


def adopted(spare_id: str) -> str:
    """Set by a spare that reached its adoption point (its script is built and at its first batch)."""
    return f"spare/{spare_id}/adopted"


def fail(gen: int, rank: int) -> str:
    """A rank's failure report in ``gen``."""
    return f"fail/{gen}/{rank}"


def lost(gen: int) -> str:
    """Set by the coordinator as soon as it knows a member of ``gen`` is gone: stalled collectives give up."""
    return f"lost/{gen}"


def fail_count(gen: int) -> str:
    """How many ranks reported a failed collective in ``gen``."""
    return f"fail/{gen}/count"


def recover(gen: int) -> str:
    """The coordinator's plan for leaving ``gen``."""
    return f"recover/{gen}"


def ready(gen: int) -> str:
    """Roll call of the members that will form ``gen``'s process group."""
    return f"g{gen}/ready"


def wake(gen: int) -> str:
    """Set when ``gen``'s roll call is complete or superseded by a plan: its members re-check then."""
    return f"g{gen}/wake"


def post_plan(store: Store, gen: int, doc: Any) -> None:
    """Post the coordinator's plan for leaving ``gen`` and wake whoever is in ``gen``'s roll call."""
    put(store, recover(gen), doc)
    store.set(wake(gen), "plan")


def group_prefix(gen: int) -> str:
    """The store prefix ``gen``'s process group rendezvouses under."""
    return f"g{gen}/pg/"


def xfer_prefix(tag: str, rank: int) -> str:
    """The store prefix of one state transfer to the process that takes ``rank``."""
    return f"xfer/{tag}/{rank}/"


def event(n: int) -> str:
    """A follower launcher's n-th event."""
    return f"ev/{n}"


def request(n: int, what: str = "") -> str:
    """The n-th control request (or its ``reply``)."""
    return f"req/{n}/{what}" if what else f"req/{n}"


def heartbeat(node: int) -> str:
    """A launcher's heartbeat."""
    return f"hb/{node}"


def put(store: Store, key: str, doc: Any) -> None:
    """Write ``doc`` as JSON."""
    store.set(key, json.dumps(doc, separators=(",", ":")))


def get(store: Store, key: str) -> Any:
    """Read a JSON value that exists (the store blocks until its timeout for one that does not)."""
    return json.loads(store.get(key))


def peek(store: Store, key: str) -> Any | None:
    """A JSON value, or None if the key is not set (never blocks)."""
    return get(store, key) if store.check([key]) else None


def append(store: Store, seq_key: str, key_of: Any, doc: Any) -> int:
    """Append ``doc`` to the list counted by ``seq_key`` (``key_of(n)`` names item n); returns n."""
    n = store.add(seq_key, 1) - 1
    put(store, key_of(n), doc)
    return n


def wait(store: Store, key: str, *, timeout_s: float) -> Any | None:
    """The JSON at ``key`` once it is set, blocking in the store (woken as it is set); None at the timeout."""
    try:
        store.wait([key], timedelta(seconds=max(timeout_s, 0.001)))
    except RuntimeError:  # DistStoreError: the timeout (a lost store fails the get below, or the next call)
        return peek(store, key)
    return get(store, key)


def poll(store: Store, key: str, *, timeout_s: float, interval_s: float = 0.02,
         stop: Any = None) -> Any | None:
    """The JSON at ``key`` once it is set, polling until ``timeout_s``; None at the timeout.

    ``stop`` (a callable) ends the wait early when it returns True (the value is then None).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = peek(store, key)
        if value is not None:
            return value
        if time.monotonic() >= deadline or (stop is not None and stop()):
            return None
        time.sleep(interval_s)
