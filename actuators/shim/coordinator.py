"""The job coordinator: who holds each rank, which spares wait, and the operation in flight.

The launcher-side end of the store protocol the shim speaks (`keys`; the ranks' side is
`recovery`). One per job, in the node-0 launcher, driven by its loop (`Coordinator.tick`, one
thread: no locks). It hears of processes that exit (`exited`, from every node's launcher), of
nodes that fall silent (`node_lost`) and of requests (`migrate`; snapshots), and runs one
operation at a time (`ridethrough.actuators.migrate`, `ridethrough.actuators.snapshot`):

* `Migration` (proactive): a command every rank applies at the same step boundary. Once every
  rank arrived and every spare reached its first batch, ``go``: the leaving ranks hand their state
  to their spares and exit, the next generation forms with the spares in their places. No step is
  lost or redone. A spare that dies on the way: before the hand-over, the leaving rank stays (the
  generation is kept) and the request is tried again with another ready spare, if any; after it,
  another spare takes the rank from a peer's copy.
* `Recovery` (reactive): a rank died or its node fell silent. The other ranks report where their
  collective failed; a rank that had not yet updated its model gives its state to a spare, the
  next generation forms, and the interrupted step is replayed: at most one step is redone.
* when neither works (no spare, ranks stopped at different steps), the fallback: restart every
  rank from the newest snapshot if the launcher can, else stop the job with the reason.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ridethrough.actuators.shim import keys

log = logging.getLogger(__name__)
Reply = Callable[[dict[str, Any]], None]


@dataclass(frozen=True, slots=True)
class Timeouts:
    """How long the coordinator waits for each stage (seconds)."""

    arrive_s: float = 60.0
    """Ranks to reach a command's step, and spares their first batch."""
    reports_s: float = 20.0
    """The other ranks to report after a loss."""
    form_s: float = 60.0
    """A new generation to form (state hand-over included)."""
    heartbeat_s: float = 5.0
    """A follower launcher silent this long is lost, with its ranks."""


@dataclass(slots=True)
class Slot:
    """The process holding a rank."""

    node: int
    pid: int
    spare: str = ""
    """The spare id when a spare took the rank ('' for the original)."""
    done: bool = False


@dataclass(slots=True)
class Spare:
    """A parked spare."""

    id: str
    node: int
    pid: int
    state: str = "ready"
    """``ready``, ``assigned`` or ``dead``."""


class Op(Protocol):
    """One operation in flight."""

    name: str

    def tick(self, c: Coordinator) -> bool:
        """Advance; True when finished (well or not)."""
        ...

    def spare_died(self, c: Coordinator, spare: Spare) -> None:
        """An assigned spare exited."""
        ...

    def abandon(self, c: Coordinator, why: str) -> bool:
        """A rank was lost while this ran: wind down; True to run it again once the ranks are back."""
        ...


@dataclass
class Coordinator:
    """See the module docstring."""

    store: keys.Store
    world_size: int
    generation: int = 0
    timeouts: Timeouts = field(default_factory=Timeouts)
    restart: Callable[[str], bool] | None = None
    """Restart every rank from a snapshot (returns False if there is none); None: stop the job instead."""
    clock: Callable[[], float] = time.monotonic
    slots: dict[int, Slot] = field(default_factory=dict)
    spares: dict[str, Spare] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    op: Op | None = None
    queue: list[Op] = field(default_factory=list)
    failed: str = ""
    """Why the job cannot go on ('' while it can)."""
    failed_at_end: list[str] = field(default_factory=list)
    """Ranks that failed after the training completed (the job's exit status says so)."""
    alarmed: bool = False
    """A rank reported a failed collective and no operation handles it yet (the loop ticks faster)."""
    _failing_since: dict[int, float] = field(default_factory=dict)
    _spare_cursor: int = 0
    _max_gen: int = 0
    _commands_done: int = 0

    def __post_init__(self) -> None:
        self._max_gen = self.generation

    # -- what happens ---------------------------------------------------------------------------

    def note(self, kind: str, **detail: Any) -> None:
        """Record an event (kept for `status` and the benchmark; logged)."""
        self.events.append({"event": kind, "t": time.time(), **detail})
        del self.events[:-200]
        log.info("%s %s", kind, detail)

    def placed(self, rank: int, *, node: int, pid: int) -> None:
        """A launcher started ``rank``'s original process."""
        self.slots[rank] = Slot(node, pid)

    def exited(self, *, node: int, pid: int, code: int) -> None:
        """A rank or spare process on ``node`` exited with ``code`` (negative: killed by that signal)."""
        rank = next((r for r, s in self.slots.items() if (s.node, s.pid) == (node, pid)), None)
        spare = next((s for s in self.spares.values() if (s.node, s.pid) == (node, pid)), None)
        if spare is not None and spare.state != "dead" and rank is None:
            was, spare.state = spare.state, "dead"
            self.note("spare_exited", spare=spare.id, code=code)
            if was == "assigned" and self.op is not None:
                self.op.spare_died(self, spare)
            return
        if rank is None:
            return
        if isinstance(self.op, Migration) and self.op.leaving_ok(self, rank):
            return  # handed over and left, as planned
        if code == 0:
            self.slots[rank].done = True
            if not self.store.check([keys.END]):
                keys.put(self.store, keys.END, {"rank": rank, "t": time.time()})
            self.note("rank_completed", rank=rank)
            return
        if any(s.done for s in self.slots.values()):
            # Its peers completed the training: nothing to migrate, but its own end (an epilogue, a
            # final save) failed, and the job says so in its exit status.
            self.slots[rank].done = True
            self.failed_at_end.append(f"rank {rank} exited with {code} after other ranks completed")
            self.note("rank_failed_at_end", rank=rank, code=code)
            return
        self.note("rank_lost", rank=rank, node=node, code=code)
        self.lose({rank})

    def node_lost(self, node: int) -> None:
        """A follower launcher fell silent: its ranks and spares are gone."""
        for s in self.spares.values():
            if s.node == node:
                s.state = "dead"
        ranks = {r for r, s in self.slots.items() if s.node == node and not s.done}
        self.note("node_lost", node=node, ranks=sorted(ranks))
        if ranks:
            self.lose(ranks)

    def lose(self, ranks: set[int]) -> None:
        """Start (or widen) a reactive recovery for ``ranks``."""
        if isinstance(self.op, Recovery) and self.op.stage == "reports":
            self.op.lost |= ranks
            return
        op = self.op
        if op is not None and not isinstance(op, Recovery) and op.abandon(self, f"rank {sorted(ranks)} lost"):
            self.queue.insert(0, op)
        keys.put(self.store, keys.lost(self.generation), sorted(ranks))
        self.op = Recovery(self, set(ranks))

    # -- requests -------------------------------------------------------------------------------

    def migrate(self, ranks: list[int], *, reason: str, reply: Reply | None = None) -> dict[str, Any]:
        """Queue a proactive migration of ``ranks`` to spares; the answer says whether it was accepted."""
        bad = [r for r in ranks if r not in self.slots or self.slots[r].done]
        if not ranks or bad:
            return {"ok": False, "error": f"no running rank {bad or ranks} in this job of {self.world_size}"}
        self.queue.append(Migration(ranks=sorted(set(ranks)), reason=reason, reply=reply))
        return {"ok": True, "queued": len(self.queue) + (self.op is not None)}

    def submit(self, op: Op) -> None:
        """Queue an operation (a snapshot)."""
        self.queue.append(op)

    # -- the loop -------------------------------------------------------------------------------

    def tick(self) -> None:
        """Read new spares and failure reports, and advance the operation in flight."""
        self._read_spares()
        self.alarmed = self.op is None and bool(self.store.add(keys.fail_count(self.generation), 0))
        if self.alarmed:
            self._unexplained_failure()
        if self.op is None and self.queue:
            self.op = self.queue.pop(0)
        if self.op is not None and self.op.tick(self):
            self.op = None

    def _read_spares(self) -> None:
        while self.store.check([keys.spare(self._spare_cursor)]):
            doc = keys.get(self.store, keys.spare(self._spare_cursor))
            self._spare_cursor += 1
            self.spares[str(doc["id"])] = Spare(str(doc["id"]), int(doc["node"]), int(doc["pid"]))
            self.note("spare_ready", spare=str(doc["id"]), node=int(doc["node"]))

    def _unexplained_failure(self) -> None:
        if any(s.done for s in self.slots.values()):
            # A replacement ran its loop past the job's end (its loop counter started at its own 0).
            keys.post_plan(self.store, self.generation, {"kind": "end", "step": -1})
            self.note("job_ended_under_replacement", generation=self.generation)
            self.generation = self._max_gen = self._max_gen + 1
        elif self.store.add(keys.fail_count(self.generation), 0) >= self.world_size:
            self.note("transient_failure", generation=self.generation)  # every rank alive: re-form as they are
            self.op = Recovery(self, set())
        elif self.clock() - self._failing_since.setdefault(self.generation, self.clock()) > self.timeouts.reports_s:
            # Some ranks report a failed collective, the others neither report nor exit: hung (a
            # stopped process, a GPU stuck in a kernel). They are replaced; the group fences them out.
            silent = {r for r in range(self.world_size) if not self.store.check([keys.fail(self.generation, r)])}
            self.note("ranks_hung", ranks=sorted(silent), generation=self.generation)
            self.lose(silent)

    @property
    def busy(self) -> bool:
        """An operation is in flight or queued, or a failure was reported: the loop should tick fast."""
        return self.op is not None or bool(self.queue) or self.alarmed

    def next_generation(self) -> int:
        """A generation number never used before."""
        self._max_gen += 1
        return self._max_gen

    def formed(self, gen: int, moves: dict[int, Spare]) -> None:
        """Generation ``gen`` formed, with ``moves`` (rank -> spare) in place."""
        self.generation = gen
        keys.put(self.store, keys.GEN, gen)
        for rank, spare in moves.items():
            spare.state = "taken"
            self.slots[rank] = Slot(spare.node, spare.pid, spare.id)

    def pick(self, n: int, *, avoid: set[int]) -> list[Spare] | None:
        """``n`` ready spares (those on other nodes than ``avoid`` first), marked assigned; None if too few."""
        ready = sorted((s for s in self.spares.values() if s.state == "ready"), key=lambda s: (s.node in avoid, s.id))
        if len(ready) < n:
            return None
        for s in ready[:n]:
            s.state = "assigned"
        return ready[:n]

    def assign(self, spare: Spare, *, rank: int, gen: int, tag: str, seq: int) -> None:
        """Tell ``spare`` to take ``rank`` (state under ``tag``, then join ``gen``, commands from ``seq``)."""
        keys.put(self.store, keys.assign(spare.id), {"rank": rank, "gen": gen, "tag": tag, "seq": seq})

    def command(self, doc: dict[str, Any]) -> int:
        """Issue a command to every rank; returns its number."""
        return keys.append(self.store, keys.CTL_SEQ, keys.ctl, doc)

    def command_done(self, n: int) -> None:
        """Command ``n`` is over: replacements need not see it."""
        self._commands_done = max(self._commands_done, n + 1)

    @property
    def oldest_open_command(self) -> int:
        """The first command a replacement must still act on."""
        return self._commands_done

    def fallback(self, why: str, *, gen: int) -> None:
        """No migration can save the step: restart from the newest snapshot, or stop the job, and say which."""
        if self.restart is not None and self.restart(why):
            self.note("restarted_from_snapshot", why=why)
            return
        keys.post_plan(self.store, gen, {"kind": "abort", "why": why})
        self.failed = why
        self.note("job_failed", why=why)

    def close(self, why: str) -> None:
        """The job is over: answer every request still waiting (in flight or queued) with ``why``."""
        for op in [self.op, *self.queue]:
            reply = getattr(op, "reply", None)
            if reply is not None:
                reply({"ok": False, "error": why})
                op.reply = None  # type: ignore[union-attr]  # an op with a reply
        self.op, self.queue = None, []

    def status(self) -> dict[str, Any]:
        """The job as the coordinator sees it."""
        return {"generation": self.generation, "world_size": self.world_size, "failed": self.failed,
                "ranks": {str(r): {"node": s.node, "pid": s.pid, "spare": s.spare, "done": s.done}
                          for r, s in sorted(self.slots.items())},
                "spares": {s.id: {"node": s.node, "pid": s.pid, "state": s.state} for s in self.spares.values()},
                "op": getattr(self.op, "name", ""), "queued": len(self.queue), "events": self.events[-20:]}


from ridethrough.actuators.migrate import Migration, Recovery  # noqa: E402  (they build on the classes above)
