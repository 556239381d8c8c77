"""Moving ranks to hot spares: the coordinator's two operations (the ranks' side is `shim.recovery`).

`Migration` (proactive: a GPU or host predicted to fail, an operator's request)::

    start   pick a spare per leaving rank, assign it, issue the command (ranks fix its step T)
    arrive  every rank at T, every spare at its first batch  -> "go"   (else "abort": nothing changed)
    hand    each leaving rank sends its state to its spare and exits
    form    the next generation's roll call completes: training goes on at step T, nothing redone

`Recovery` (reactive: a rank died, a node fell silent)::

    reports a spare per lost rank is assigned at once (its script builds while the others report);
            the other ranks report the step (and update phase) where their collective failed
    plan    a rank that had not updated gives its state to those spares
    form    the next generation forms; the ranks replay the interrupted step (at most one step redone)

A spare that dies on the way is replaced by another one (before the hand-over: the migration is
aborted, nothing changed, and tried again with another ready spare; after it: from a peer's copy
of the state, the leaving rank being gone); when no spare is left, or no peer holds the state, the
coordinator falls back (`Coordinator.fallback`: restart from the newest snapshot, or stop the
job) and says which, in its events and its reply.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ridethrough.actuators.shim import keys

if TYPE_CHECKING:
    from ridethrough.actuators.shim.coordinator import Coordinator, Reply, Spare


MAX_RETRIES = 2
"""Tries of a proactive migration whose spare dies before the hand-over, beyond the first."""


def _moves_doc(moves: dict[int, Spare]) -> dict[str, str]:
    return {str(r): s.id for r, s in sorted(moves.items())}


@dataclass(eq=False)
class Migration:
    """A proactive migration of ``ranks`` (see the module docstring)."""

    ranks: list[int]
    reason: str
    reply: Reply | None = None
    name: str = "migrate"
    stage: str = "start"
    n: int = -1
    gen: int = -1
    moves: dict[int, Spare] = field(default_factory=dict)
    deadline: float = 0.0
    started: float = 0.0
    redone_by_peer: list[int] = field(default_factory=list)
    ended: dict[str, str] = field(default_factory=dict)
    """Stages that end the migration, with why (set when a spare dies)."""
    retries: int = 0
    """How many earlier tries of this request ended with their spare's death before the hand-over."""
    retried: list[str] = field(default_factory=list)
    """Why each earlier try ended (said in the answer)."""

    def tick(self, c: Coordinator) -> bool:
        now = c.clock()
        if self.stage == "start":
            return self._start(c, now)
        if self.stage in self.ended:
            return self._finish(c, False, self.ended[self.stage])
        if self.stage == "arrive":
            arrived = c.store.add(keys.ctl(self.n, "arrived"), 0)
            adopted = [s.id for s in self.moves.values() if c.store.check([keys.adopted(s.id)])]
            if arrived >= c.world_size and len(adopted) == len(self.moves):
                keys.put(c.store, keys.ctl(self.n, "decision"), "go")
                self.stage, self.deadline = "hand", now + c.timeouts.form_s
            elif now > self.deadline:
                keys.put(c.store, keys.ctl(self.n, "decision"), "abort")
                return self._finish(c, False, f"not all there in {c.timeouts.arrive_s:g} s: {arrived} of "
                                              f"{c.world_size} ranks at the step, spares ready {adopted}; "
                                              "nothing changed")
            return False
        if self.stage == "hand":
            for rank in self.ranks:
                left = keys.peek(c.store, keys.ctl(self.n, f"left/{rank}"))
                if left is not None and not left.get("ok"):
                    keys.put(c.store, keys.ctl(self.n, "final"), {"kind": "stay"})
                    c.store.set(keys.wake(self.gen), "stay")  # the others wait in the roll call of gen
                    return self._finish(c, False, f"rank {rank} could not hand over its state "
                                                  f"({left.get('error')}); it stays, the generation is kept")
            if all(self.leaving_ok(c, r) for r in self.ranks):
                self.stage = "form"
        if c.store.add(keys.ready(self.gen), 0) >= c.world_size:
            c.formed(self.gen, self.moves)
            via = f"; rank {self.redone_by_peer} from a peer after a spare died" if self.redone_by_peer else ""
            return self._finish(c, True, f"ranks {self.ranks} moved to spares {_moves_doc(self.moves)} at the same "
                                         f"step (generation {self.gen}){via}")
        if now > self.deadline:
            c.fallback(f"migration of ranks {self.ranks}: generation {self.gen} did not form in "
                       f"{c.timeouts.form_s:g} s", gen=self.gen)
            return self._finish(c, False, f"generation {self.gen} did not form; fell back")
        return False

    def _start(self, c: Coordinator, now: float) -> bool:
        spares = c.pick(len(self.ranks), avoid={c.slots[r].node for r in self.ranks})
        if spares is None:
            return self._finish(c, False, f"no spare ready for ranks {self.ranks}")
        self.started, self.deadline = now, now + c.timeouts.arrive_s
        self.gen = c.next_generation()
        self.n = c.store.add(keys.CTL_SEQ, 0)  # the number the command gets: only the coordinator issues them
        self.moves = dict(zip(self.ranks, spares, strict=True))
        for rank, spare in self.moves.items():
            c.assign(spare, rank=rank, gen=self.gen, tag=f"m{self.gen}", seq=self.n + 1)
        got = c.command({"kind": "migrate", "ranks": _moves_doc(self.moves), "gen": self.gen, "tag": f"m{self.gen}",
                         "reason": self.reason})
        assert got == self.n
        c.note("migration_started", ranks=self.ranks, spares=_moves_doc(self.moves), generation=self.gen,
               reason=self.reason)
        self.stage = "arrive"
        return False

    def leaving_ok(self, c: Coordinator, rank: int) -> bool:
        """True once ``rank`` handed its state over (its exit is then the plan)."""
        if rank not in self.ranks or self.n < 0:
            return False
        left = keys.peek(c.store, keys.ctl(self.n, f"left/{rank}"))
        return bool(left and left.get("ok"))

    def spare_died(self, c: Coordinator, spare: Spare) -> None:
        rank = next((r for r, s in self.moves.items() if s is spare), None)
        if rank is None:
            return
        if self.stage == "arrive":
            keys.put(c.store, keys.ctl(self.n, "decision"), "abort")
            self.stage = "aborted"
            why = f"spare {spare.id} died before the hand-over; nothing changed"
            ready = sum(1 for s in c.spares.values() if s.state == "ready")
            if ready >= len(self.ranks) and self.retries < MAX_RETRIES:
                # Another spare waits: the same request again, next; its answer is the caller's.
                c.queue.insert(0, Migration(ranks=self.ranks, reason=self.reason, reply=self.reply,
                                            retries=self.retries + 1, retried=[*self.retried, why]))
                self.reply = None
                c.note("migration_retried", ranks=self.ranks, dead=spare.id)
            self.ended["aborted"] = why
            return
        if not self.leaving_ok(c, rank):
            return  # the leaving rank's send fails and it stays ("hand" sees that)
        # The state left with the rank and died with the spare: a peer at the same boundary has it.
        others = c.pick(1, avoid={spare.node})
        if others is None:
            why = f"spare {spare.id} died after rank {rank} handed over, and no other spare is ready"
            c.fallback(why, gen=self.gen)
            self.stage = "fallen_back"
            self.ended["fallen_back"] = why
            return
        old, self.gen = self.gen, c.next_generation()
        self.moves[rank] = others[0]
        self.redone_by_peer.append(rank)
        donor = min(r for r in range(c.world_size) if r not in self.ranks)
        tag = f"m{self.gen}"
        c.assign(others[0], rank=rank, gen=self.gen, tag=tag, seq=self.n + 1)
        keys.post_plan(c.store, old, {"kind": "replace", "gen": self.gen, "ranks": {str(rank): others[0].id},
                                      "donor": donor, "tag": tag, "step": -1})
        self.deadline = c.clock() + c.timeouts.form_s
        c.note("migration_spare_replaced", rank=rank, dead=spare.id, spare=others[0].id, donor=donor,
               generation=self.gen)

    def abandon(self, c: Coordinator, why: str) -> bool:
        """A rank was lost while this ran; returns whether to run it again later (never: the caller decides)."""
        if self.stage in ("start", "arrive") and self.n >= 0:
            keys.put(c.store, keys.ctl(self.n, "decision"), "abort")
        elif self.stage in ("hand", "form"):
            c.fallback(f"migration of ranks {self.ranks} interrupted: {why}", gen=self.gen)
        self._finish(c, False, f"interrupted: {why}")
        return False

    def _finish(self, c: Coordinator, ok: bool, detail: str) -> bool:
        if self.n >= 0:
            c.command_done(self.n)
        seconds = c.clock() - self.started if self.started else 0.0
        c.note("migrated" if ok else "migration_failed", ranks=self.ranks, detail=detail, seconds=round(seconds, 3))
        if self.retried:
            detail = f"{detail} (after: {'; '.join(self.retried)}; retried with another spare)"
        if self.reply is not None:
            self.reply({"ok": ok, "detail": detail, "generation": c.generation, "seconds": seconds})
            self.reply = None
        return True


@dataclass(eq=False)
class Recovery:
    """A reactive recovery of the ``lost`` ranks of the current generation (see the module docstring).

    Spares are assigned at the first tick, while the other ranks still report: a spare's script
    then builds its objects and waits for the state in parallel with the reports, not after the
    plan. The plan (the donor, the step) follows once every report is in.
    """

    c: Coordinator = field(repr=False)
    lost: set[int]
    name: str = "recover"
    stage: str = "reports"
    gen: int = -1
    plan_gen: int = -1
    moves: dict[int, Spare] = field(default_factory=dict)
    tags: dict[int, str] = field(default_factory=dict)
    """Ranks whose transfer has its own tag (their first spare died before the plan), not the plan's."""
    donor: int = -1
    deadline: float = 0.0
    started: float = 0.0
    step: int = -1

    def __post_init__(self) -> None:
        self.gen, self.started = self.c.generation, self.c.clock()
        self.deadline = self.started + self.c.timeouts.reports_s

    def tick(self, c: Coordinator) -> bool:
        if self.stage == "reports":
            return self._plan(c)
        if self.stage == "done":
            return True
        if c.store.add(keys.ready(self.plan_gen), 0) >= c.world_size:
            c.formed(self.plan_gen, self.moves)
            c.note("recovered", ranks=sorted(self.lost), spares=_moves_doc(self.moves), donor=self.donor,
                   step=self.step, generation=self.plan_gen, seconds=round(c.clock() - self.started, 3))
            return True
        if c.clock() > self.deadline:
            c.fallback(f"generation {self.plan_gen} did not form in {c.timeouts.form_s:g} s after losing ranks "
                       f"{sorted(self.lost)}", gen=self.plan_gen)
            return True
        return False

    def _held(self, rank: int) -> bool:
        spare = self.moves.get(rank)
        return spare is not None and spare.state == "assigned"

    def _assign_spares(self, c: Coordinator) -> None:
        """Give every lost rank without a live spare one (all or none: too few waits for the decision)."""
        need = [r for r in sorted(self.lost) if not self._held(r)]
        if not need:
            return
        spares = c.pick(len(need), avoid={c.slots[r].node for r in self.lost if r in c.slots})
        if spares is None:
            return
        if self.plan_gen < 0:
            self.plan_gen = c.next_generation()
        for rank, spare in zip(need, spares, strict=True):
            tag = f"r{self.plan_gen}"
            if rank in self.moves:  # its first spare died: that one may have begun the transfer under the tag
                tag = self.tags[rank] = f"{tag}-{spare.id}"
            self.moves[rank] = spare
            c.assign(spare, rank=rank, gen=self.plan_gen, tag=tag, seq=c.oldest_open_command)
        c.note("recovery_spares_assigned", ranks=need, spares={str(r): self.moves[r].id for r in need},
               generation=self.plan_gen, at=time.time())

    def _plan(self, c: Coordinator) -> bool:
        survivors = [r for r in range(c.world_size) if r not in self.lost]
        if any(c.slots[r].done for r in survivors if r in c.slots):
            # A peer completed the training meanwhile: the lost ranks had finished theirs too (ranks
            # step together) and died in their epilogue; nothing to recover, and the exit status says so.
            for rank in sorted(self.lost):
                c.slots[rank].done = True
                c.failed_at_end.append(f"rank {rank} was lost while its peers completed")
            c.note("lost_at_end", ranks=sorted(self.lost))
            self.stage = "done"
            return True
        self._assign_spares(c)
        reports = {r: keys.peek(c.store, keys.fail(self.gen, r)) for r in survivors}
        missing = sorted(r for r, doc in reports.items() if doc is None)
        spared = all(self._held(r) for r in self.lost)
        if missing and c.clock() < self.deadline and spared:
            return False
        why = ""
        steps = sorted({int(doc["step"]) for doc in reports.values() if doc is not None})
        donors = sorted(r for r, doc in reports.items() if doc is not None and doc["phase"] == "pre")
        if not spared:
            why = f"no spare ready for ranks {sorted(self.lost)}"
        elif not survivors:
            why = "every rank is lost: no peer holds the state"
        elif missing:
            why = f"ranks {missing} did not report within {c.timeouts.reports_s:g} s"
        elif len(steps) > 1:
            why = f"the ranks stopped at different steps {steps}: no single step to redo"
        elif self.lost and not donors:
            why = "every surviving rank had already updated its model: no peer holds the lost ranks' state"
        if why:
            c.fallback(f"cannot recover ranks {sorted(self.lost)}: {why}", gen=self.gen)
            self.stage = "done"
            return True
        self.step, self.donor = steps[0], donors[0] if donors else -1
        if self.plan_gen < 0:  # nobody lost (a transient failure): the same ranks form the next generation
            self.plan_gen = c.next_generation()
        self._post(c, self.gen, dict(self.moves))
        return False

    def _post(self, c: Coordinator, leaving: int, moves: dict[int, Spare]) -> None:
        """Post the plan for leaving generation ``leaving``: ``moves``' spares (assigned) take their ranks."""
        doc: dict[str, Any] = {"kind": "replace", "gen": self.plan_gen, "ranks": _moves_doc(moves),
                               "donor": self.donor, "tag": f"r{self.plan_gen}", "step": self.step}
        tags = {str(r): self.tags[r] for r in sorted(moves) if r in self.tags}
        if tags:
            doc["tags"] = tags
        keys.post_plan(c.store, leaving, doc)
        self.stage, self.deadline = "form", c.clock() + c.timeouts.form_s
        c.note("recovery_planned", ranks=sorted(self.lost), spares=_moves_doc(self.moves), donor=self.donor,
               step=self.step, generation=self.plan_gen, at=time.time())

    def spare_died(self, c: Coordinator, spare: Spare) -> None:
        rank = next((r for r, s in self.moves.items() if s is spare), None)
        if rank is None or self.stage != "form":
            return  # before the plan, the next tick assigns another spare (`_assign_spares`)
        others = c.pick(1, avoid={spare.node})
        if others is None:
            c.fallback(f"spare {spare.id} died while taking rank {rank}, and no other spare is ready",
                       gen=self.plan_gen)
            self.stage = "done"
            return
        self.moves[rank] = others[0]
        self.tags.pop(rank, None)
        c.note("recovery_spare_replaced", rank=rank, dead=spare.id, spare=others[0].id)
        leaving, self.plan_gen = self.plan_gen, c.next_generation()
        c.assign(others[0], rank=rank, gen=self.plan_gen, tag=f"r{self.plan_gen}", seq=c.oldest_open_command)
        self._post(c, leaving, {rank: others[0]})

    def abandon(self, c: Coordinator, why: str) -> bool:
        """Never called: a recovery widens instead (`Coordinator.lose`)."""
        return False
