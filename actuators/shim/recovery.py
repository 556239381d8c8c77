"""Re-forming the group: a rank leaving at a boundary (proactive), and a rank lost mid-step (reactive).

Proactive, at command ``n``'s step (every rank is at the same boundary): each rank arrives; the
coordinator answers ``go`` once every rank and the spares are there (or ``abort``). The leaving
rank sends its state to its spare and exits; the others answer the roll call of the next
generation with the spares, then form it. If the send fails, the leaving rank stays and the
coordinator's ``final`` keeps everyone on the current generation; if a spare dies after the
leaving rank is gone, ``final`` is a reactive plan instead (a peer sends the state).

Reactive, from inside a failed collective (`ResilientGroup` calls `Recovery.on_failure`): report
where this rank was (step, and whether an optimizer had updated yet: a peer can give a lost rank
its state only from before the update), wait for the coordinator's plan for this generation and
follow it: the donor sends its state to each replacement, everyone answers the next generation's
roll call and forms it; the group then replays the step's collectives. A plan may be replaced
while it runs (a spare died on the way): the roll call watches for that. ``end`` means the job
finished while this rank was still going (a replacement runs its script's loop from its start,
so a loop bounded by its own counter overruns): the process ends with status 0. ``abort`` raises
into the script: the job cannot go on from here (the launcher may restore a snapshot).
"""

from __future__ import annotations

import contextlib
import logging
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ridethrough.actuators.shim import keys, state

if TYPE_CHECKING:
    from ridethrough.actuators.shim.control import Runtime
    from ridethrough.actuators.shim.group import ResilientGroup

log = logging.getLogger("ridethrough.shim")


class RecoveryFailed(RuntimeError):
    """The job cannot go on from this rank's position; the message says why."""


class Recovery:
    """The re-forming half of a rank's `Runtime`."""

    def __init__(self, runtime: Runtime) -> None:
        self._rt = runtime

    def migrate(self, n: int, cmd: dict[str, Any]) -> None:
        """Act on migrate command ``n`` at its boundary (see the module docstring)."""
        rt = self._rt
        rt.store.add(keys.ctl(n, "arrived"), 1)
        decision = keys.wait(rt.store, keys.ctl(n, "decision"), timeout_s=rt.cfg.rendezvous_timeout_s)
        if decision != "go":
            log.warning("migration %d not done (%s); staying in generation %d", n, decision or "no decision",
                        rt.group.generation if rt.group else -1)
            return
        if str(rt.rank) in cmd["ranks"]:
            self._leave(n, cmd)
            return
        self.join(int(cmd["gen"]), superseded=keys.ctl(n, "final"))

    def _leave(self, n: int, cmd: dict[str, Any]) -> None:
        rt = self._rt
        rt.wait_writes(rt.cfg.rendezvous_timeout_s)  # a snapshot part still being written must land first
        try:
            sent = state.send(state.capture(rt.tracker), store=rt.store, tag=str(cmd["tag"]), rank=rt.rank,
                              timeout_s=rt.cfg.rendezvous_timeout_s)
        except Exception as exc:  # the spare died or never came: reported, and this rank stays
            keys.put(rt.store, keys.ctl(n, f"left/{rt.rank}"), {"ok": False, "error": str(exc)[:500]})
            log.error("rank %d could not hand over its state (%s); it stays", rt.rank, exc)
            keys.wait(rt.store, keys.ctl(n, "final"), timeout_s=rt.cfg.rendezvous_timeout_s)
            return
        keys.put(rt.store, keys.ctl(n, f"left/{rt.rank}"), {"ok": True, "bytes": sent})
        log.info("rank %d handed over %d bytes at step %d and leaves", rt.rank, sent, rt.tracker.step)
        from ridethrough.actuators.shim.control import leave

        leave(0)

    def join(self, gen: int, *, superseded: str | None) -> None:
        """Answer ``gen``'s roll call and form it; follow a plan posted at ``superseded`` instead, if one comes."""
        rt = self._rt
        outcome = self._roll_call(gen, superseded)
        if outcome is None:
            assert rt.group is not None
            rt.group.swap(gen)
            return
        if outcome.get("kind") == "stay":
            return
        self.follow(outcome)

    def _roll_call(self, gen: int, superseded: str | None) -> dict[str, Any] | None:
        rt = self._rt
        if rt.store.add(keys.ready(gen), 1) >= rt.world:
            rt.store.set(keys.wake(gen), "formed")  # the last member in wakes the others
        deadline = time.monotonic() + rt.cfg.rendezvous_timeout_s
        while True:
            if superseded is not None and (plan := keys.peek(rt.store, superseded)) is not None:
                return dict(plan)
            if (plan := keys.peek(rt.store, keys.recover(gen))) is not None:
                return dict(plan)
            if rt.store.add(keys.ready(gen), 0) >= rt.world:
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                break
            # Set only once one of the above holds (complete, or a plan posted): no polling.
            with contextlib.suppress(RuntimeError):  # DistStoreError at the deadline: checked once more above
                rt.store.wait([keys.wake(gen)], timedelta(seconds=left))
        raise RecoveryFailed(f"generation {gen} did not form within {rt.cfg.rendezvous_timeout_s:g} s "
                             f"({rt.store.add(keys.ready(gen), 0)} of {rt.world} members ready)")

    def on_failure(self, group: ResilientGroup, reason: str) -> None:
        """A collective failed: report, wait for the plan, follow it (returns with a new generation formed)."""
        rt = self._rt
        gen = group.generation
        log.warning("rank %d: %s", rt.rank, reason)
        keys.put(rt.store, keys.fail(gen, rt.rank), {"step": rt.tracker.step, "phase": "post" if rt.tracker.updated
                                                     else "pre", "reason": reason[:300]})
        rt.store.add(keys.fail_count(gen), 1)
        plan = keys.wait(rt.store, keys.recover(gen), timeout_s=rt.cfg.recovery_timeout_s)
        if plan is None:
            raise RecoveryFailed(f"{reason}; no recovery plan came within {rt.cfg.recovery_timeout_s:g} s")
        self.follow(dict(plan))

    def follow(self, plan: dict[str, Any]) -> None:
        """Carry out a coordinator's plan (replace, end or abort), and any plan that supersedes it."""
        rt = self._rt
        while True:
            kind = plan.get("kind")
            if kind == "end":
                log.warning("the job ended at step %s while rank %d was at step %d; this process stops",
                            plan.get("step"), rt.rank, rt.tracker.step)
                from ridethrough.actuators.shim.control import leave

                leave(0)
            if kind != "replace":
                raise RecoveryFailed(f"the coordinator stopped the job: {plan.get('why', plan)}")
            gen = int(plan["gen"])
            if int(plan["donor"]) == rt.rank:
                self._donate(plan)
            outcome = self._roll_call(gen, None)
            if outcome is None:
                assert rt.group is not None
                rt.group.swap(gen)
                log.info("rank %d formed generation %d", rt.rank, gen)
                return
            plan = outcome

    def _donate(self, plan: dict[str, Any]) -> None:
        rt = self._rt
        packed = state.pack(state.capture(rt.tracker))  # once, whatever the number of ranks to give it to
        tags = plan.get("tags") or {}  # a rank whose first spare died before the plan has its own tag
        for rank in plan["ranks"]:
            try:
                state.send_packed(packed, store=rt.store, tag=str(tags.get(str(rank), plan["tag"])), rank=int(rank),
                                  timeout_s=rt.cfg.rendezvous_timeout_s)
            except Exception as exc:  # the spare died: the coordinator posts a plan with another one
                log.error("rank %d could not give rank %s its state: %s", rt.rank, rank, exc)
