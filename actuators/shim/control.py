"""The shim's runtime in one rank: commands at agreed step boundaries, taking over a rank, recovering from a loss.

Commands (`ridethrough.actuators.migrate` and `ridethrough.actuators.snapshot` issue them) are
numbered in the store. At every boundary a rank checks whether the next one exists (one store
round trip). The first rank to see it fixes the step it applies at, ``T`` = its boundary + 1
(``compare_set``, so later readers get the same ``T``). Ranks of a data-parallel job are never
more than one boundary apart (a rank at boundary b+1 finished step b's all-reduce, which every
rank entered after its boundary b), so every rank sees the command by boundary ``T`` and acts
there, on the same step, with no pause and no extra collective.

* ``snapshot``: capture the state, hand it to `SnapshotStore.write_rank` (a copy, written in the
  background) and go on; a thread reports ``done``.
* ``migrate``: every rank arrives; on the coordinator's ``go`` a leaving rank sends its state to
  its spare and exits, the others and the spares answer the roll call of the next generation and
  form it. A failed send keeps everyone on the current generation.

A *replacement* (a spare given a rank, or every rank of a job resumed from a snapshot) runs the
script from the top. At its first batch it receives the state (from the leaving rank or a peer,
or from the snapshot), moves its data loaders there, and at the fetch where they arrive loads
the state, joins the group and carries on at the same step.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ridethrough.actuators.shim import keys, state
from ridethrough.actuators.shim.config import ShimConfig
from ridethrough.actuators.shim.discovery import Tracker, unwrap
from ridethrough.actuators.shim.group import ResilientGroup
from ridethrough.actuators.shim.loaders import LoaderTracker
from ridethrough.actuators.shim.recovery import Recovery

log = logging.getLogger("ridethrough.shim")


@dataclass(slots=True)
class Adoption:
    """Where a replacement's state comes from: a transfer (``tag``, then join ``gen``) or a snapshot."""

    tag: str = ""
    gen: int = -1
    snapshot: str = ""
    first_command: int = 0


class Runtime:
    """One rank's shim (see the module docstring); `boot` builds it and installs its hooks."""

    def __init__(self, cfg: ShimConfig, store: keys.Store, *, rank: int, reporter: Any = None) -> None:
        self.cfg, self.store, self.rank, self.world = cfg, store, rank, cfg.world_size
        self.tracker = Tracker(on_boundary=self._on_boundary, on_model=self._on_model, record=self._record,
                               before_root=self._before_root)
        self.loaders = LoaderTracker(on_next=self._on_next, on_fetch=self._on_fetch)
        self.recovery = Recovery(self)
        self.group: ResilientGroup | None = None
        self.backend = "gloo"
        self.adoption: Adoption | None = None
        self.reporter = reporter
        self._received: dict[str, Any] | None = None
        self._late_models: list[dict[str, Any]] = []
        self._next_command = 0
        self._command: tuple[int, dict[str, Any], int] | None = None
        self._writers: list[threading.Thread] = []
        self._wait_mark = 0.0
        self._step_start_ns = 0
        self._described = False
        self._resumed_at = -1
        """The step a snapshot resume began at (committed already: not saved again)."""

    # -- the process group ------------------------------------------------------------------

    def make_group(self, backend: str) -> ResilientGroup:
        """The script's default group; joins generation ``cfg.generation`` now unless this is a spare's."""
        self.backend = backend
        self.group = ResilientGroup(rank=self.rank, size=self.world, backend=backend, connect=self._connect,
                                    on_failure=self.recovery.on_failure, abandoned=self._abandoned,
                                    collective_timeout_s=self.cfg.collective_timeout_s)
        if self.adoption is None or self.adoption.gen < 0:
            self.group.swap(self.cfg.generation)
            if self.adoption is None:
                self._next_command = self.store.add(keys.CTL_SEQ, 0)
        return self.group

    def _connect(self, gen: int) -> Any:
        prefix = dist.PrefixStore(keys.group_prefix(gen), self.store)  # type: ignore[attr-defined, arg-type]  # (stub)
        # The backend's own timeout outlasts ours: a stalled collective is ours to call failed.
        timeout = timedelta(seconds=self.cfg.collective_timeout_s + 60)
        if self.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout  # what init_process_group sets too (the public field of the C++ options)
            return dist.ProcessGroupNCCL(prefix, self.rank, self.world, options)
        return dist.ProcessGroupGloo(prefix, self.rank, self.world, timeout)

    def _abandoned(self, gen: int) -> bool:
        return self.store.check([keys.lost(gen)])

    # -- boundaries and commands ------------------------------------------------------------

    def _record(self) -> dict[str, Any]:
        cycle = self.tracker.cycle
        return {"step": self.tracker.next_step(), "rng": state.rng_state(),
                "loaders": [p.state() for p in self.loaders.positions()],
                "cycle": None if cycle is None else sorted(cycle)}

    def _on_boundary(self, step: int) -> None:
        if self.group is not None:
            self.group.new_step()
        if not self._described:
            self._described = True
            log.info("found %s, %d data loader(s); step %d begins", self.tracker.describe(),
                     len(self.loaders.positions()), step)
        self._report(step)
        if self.adoption is None:
            self._poll_command(step)
            every = self.cfg.snapshot_every
            if every > 0 and step > 0 and step % every == 0 and step != self._resumed_at:
                self._periodic(step)

    def _periodic(self, step: int) -> None:
        from ridethrough.actuators.snapshot import PERIODIC_SEQ, periodic, periodic_part

        life = self.cfg.life
        if self.rank == 0:
            keys.append(self.store, PERIODIC_SEQ, periodic, {"life": life, "step": step})
        self._save(step, periodic_part(life, step, f"done/{self.rank}"), periodic_part(life, step, "shapes"))

    def _report(self, step: int) -> None:
        now = time.time_ns()
        if self.reporter is not None and step > 0 and self._step_start_ns:
            waited = self.group.waited_s if self.group is not None else 0.0
            wait_s = max(0.0, waited - self._wait_mark)
            total_s = (now - self._step_start_ns) / 1e9
            self.reporter.step(step - 1, self._step_start_ns, now,
                               phases={"compute_s": max(0.0, total_s - wait_s), "wait_s": wait_s})
        self._step_start_ns = now
        self._wait_mark = self.group.waited_s if self.group is not None else 0.0


    def _poll_command(self, step: int) -> None:
        if self._command is None:
            n = self._next_command
            if not self.store.check([keys.ctl(n)]):
                return
            at = int(self.store.compare_set(keys.ctl(n, "T"), "", str(step + 1)))
            self._command = (n, keys.get(self.store, keys.ctl(n)), at)
        n, cmd, at = self._command
        if step < at:
            return
        self._command, self._next_command = None, n + 1
        if step > at:  # cannot happen while ranks stay within a boundary of each other; say so if it does
            keys.put(self.store, keys.ctl(n, f"late/{self.rank}"), step)
            log.error("command %d was due at step %d, rank %d saw it at %d; skipped", n, at, self.rank, step)
            return
        if cmd.get("kind") == "snapshot":
            self._save(step, keys.ctl(n, f"done/{self.rank}"), keys.ctl(n, "shapes"))
        elif cmd.get("kind") == "migrate":
            self.recovery.migrate(n, cmd)

    def _save(self, step: int, done: str, shapes_key: str) -> None:
        """Write this rank's part of the snapshot of ``step``; report to ``done`` (rank 0 posts the shapes)."""
        if not self.cfg.snapshot_dir:
            keys.put(self.store, done, {"ok": False, "error": "the job was started without a snapshot directory"})
            return
        from ridethrough.actuators.snapshot_store import SnapshotStore, shapes_of

        try:
            captured = state.capture(self.tracker)
            if self.rank == 0:
                shapes = shapes_of({f"model{i}": m for i, m in enumerate(captured["models"])})
                keys.put(self.store, shapes_key, {k: [list(v.shape), v.dtype] for k, v in shapes.items()})
            handle = SnapshotStore(self.cfg.snapshot_dir).write_rank(step, self.rank, captured)
        except Exception as exc:  # the job goes on; the snapshot is the one that fails
            keys.put(self.store, done, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
            return

        def report() -> None:
            try:
                handle.wait()
                keys.put(self.store, done, {"ok": True, "stall_s": handle.staged_s})
            except Exception as exc:  # reported: the coordinator fails the snapshot, the job goes on
                keys.put(self.store, done, {"ok": False, "error": str(exc)})

        thread = threading.Thread(target=report, name=f"rt-snapshot-{step}")  # not a daemon: report before exit
        self._writers = [t for t in self._writers if t.is_alive()] + [thread]
        thread.start()

    def close(self) -> None:
        """At the process's exit: drop the group's backends while the interpreter is whole (see `shutdown`)."""
        if self.group is not None:
            self.group.shutdown()

    def wait_writes(self, timeout_s: float) -> None:
        """Let snapshot writes in flight finish (before this process leaves)."""
        for t in self._writers:
            t.join(timeout_s)

    # -- taking over a rank -----------------------------------------------------------------

    def _on_model(self, model: torch.nn.Module) -> None:
        if self._late_models:
            saved = self._late_models.pop(0)
            state.check_model(saved, model, len(self.tracker.models) - 1)
            unwrap(model).load_state_dict(saved)

    def _before_root(self) -> None:
        if self.adoption is not None:  # a script that makes its own batches: take over at the first forward
            self._on_next()
            if not self.loaders.seeking:  # (a forward while loaders spin through epochs is not the step yet)
                self._apply()

    def _on_next(self) -> None:
        if self.adoption is None or self._received is not None:
            return
        got = self._receive(self.adoption)
        state.check(got, self.tracker)
        self._received = got
        self.loaders.seek(state.positions(got))

    def _receive(self, adoption: Adoption) -> dict[str, Any]:
        if adoption.snapshot:
            return load_snapshot(adoption.snapshot, self.rank)
        keys.put(self.store, keys.adopted(self.cfg.spare_id), {"rank": self.rank, "pid": os.getpid()})
        return state.receive(store=self.store, tag=adoption.tag, rank=self.rank,
                             timeout_s=self.cfg.rendezvous_timeout_s)

    def _on_fetch(self) -> None:
        self._apply()  # the loader about to fetch is where the state says
        self.tracker.fetching()

    def _apply(self) -> None:
        if self._received is not None:
            got, self._received = self._received, None
            adoption = self.adoption
            assert adoption is not None
            state.apply(got, self.tracker)
            if adoption.snapshot:  # that step is committed already; a replacement saves its part like the rest
                self._resumed_at = int(got["small"]["step"])
            self._late_models = list(got["models"][len(self.tracker.models):])
            if adoption.gen >= 0:
                self.recovery.join(adoption.gen, superseded=None)
            self._next_command = adoption.first_command
            self.adoption = None
            log.info("rank %d continues at step %d", self.rank, int(got["small"]["step"]))

    def park(self) -> None:
        """A spare: wait (registered in the store) until the coordinator gives this process a rank."""
        keys.append(self.store, keys.SPARE_SEQ, keys.spare, {"id": self.cfg.spare_id, "node": self.cfg.node,
                                                              "pid": os.getpid()})
        while True:  # blocks in the store: the assignment wakes the spare the moment it is written
            plan = keys.wait(self.store, keys.assign(self.cfg.spare_id), timeout_s=3600.0)
            if plan is not None:
                break
        self.rank = int(plan["rank"])
        self.adoption = Adoption(tag=str(plan["tag"]), gen=int(plan["gen"]), first_command=int(plan["seq"]))
        os.environ["RANK"] = os.environ["ROLE_RANK"] = str(self.rank)
        log.info("spare %s takes rank %d (generation %d)", self.cfg.spare_id, self.rank, self.adoption.gen)


def load_snapshot(path: str, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s state from a committed snapshot directory (or the newest under a snapshot root)."""
    from ridethrough.actuators.snapshot_store import SnapshotStore

    where = Path(path)
    if (where / "manifest.json").is_file():
        found = [s for s in SnapshotStore(where.parent).snapshots() if s.path == where]
    else:
        latest = SnapshotStore(where).latest()
        found = [latest] if latest is not None else []
    if not found:
        raise state.StateMismatch(f"no committed snapshot at {where}")
    loaded = SnapshotStore(found[0].path.parent).load_rank(found[0], rank)
    if not isinstance(loaded, dict):
        raise state.StateMismatch(f"{found[0].path}: rank {rank}'s file does not hold a rank state")
    return loaded


def leave(code: int = 0) -> None:
    """End this process at once (a rank whose place was taken): flush output, skip the script's epilogue."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
