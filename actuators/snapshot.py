"""Whole-job snapshots: every rank saves at the same step boundary, the coordinator commits the set.

``ridethrough snapshot JOB`` (or the agent's ``job.snapshot``) reaches the job's coordinator,
which issues a ``snapshot`` command (`SnapshotOp`): every rank applies it at the same boundary
``T`` (see `ridethrough.actuators.shim.control`), hands its state to
`SnapshotStore.write_rank` (one copy into staging memory, the write in the background) and
trains on; once every rank's part is durable the coordinator commits step ``T``
(`SnapshotStore.commit`: manifest last, rename into place). A rank lost meanwhile does not void
the snapshot: its replacement applies the same command at the same step.

``ridethrough run --snapshot-every K`` has every rank save at each step divisible by ``K``
without a command (the ranks agree on step numbers); `PeriodicSnapshots` commits each complete set.

``ridethrough run --resume SNAPSHOT`` starts every rank from a committed snapshot; the resumed run
reproduces the uninterrupted one's losses exactly (the data loaders, generators and optimizers
are where they were).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ridethrough.actuators.shim import keys
from ridethrough.actuators.snapshot_store import Snapshot, SnapshotMeta, SnapshotStore, TensorSpec

if TYPE_CHECKING:
    from ridethrough.actuators.shim.coordinator import Coordinator, Reply, Spare

PERIODIC_SEQ = "psnap/seq"


def periodic(i: int) -> str:
    """The i-th periodic snapshot begun: ``{"life": L, "step": S}`` (rank 0 appends it)."""
    return f"psnap/{i}"


def periodic_part(life: int, step: int, what: str) -> str:
    """A reply key of the periodic snapshot of ``step`` taken by the ranks of restart ``life``."""
    return f"psnap/l{life}/s{step}/{what}"


def commit(root: str, *, step: int, world_size: int, shapes: dict[str, Any], extra: dict[str, Any]) -> Snapshot:
    """Commit the rank files of ``step`` under ``root`` (shapes as the ranks posted them)."""
    meta = SnapshotMeta(world_size=world_size, extra=extra,
                        shapes={k: TensorSpec(tuple(int(d) for d in v[0]), str(v[1])) for k, v in shapes.items()})
    return SnapshotStore(root).commit(step, meta)


def find(path: str) -> Snapshot:
    """The committed snapshot at ``path`` (a ``step-N`` directory, or a snapshot root: its newest).

    Raises:
        FileNotFoundError: nothing committed there.
    """
    where = Path(path)
    if (where / "manifest.json").is_file():
        found = [s for s in SnapshotStore(where.parent).snapshots() if s.path == where]
        if found:
            return found[0]
        raise FileNotFoundError(f"{where} is not a sound committed snapshot (see the log for why)")
    latest = SnapshotStore(where).latest()
    if latest is None:
        raise FileNotFoundError(f"no committed snapshot under {where}")
    return latest


@dataclass(eq=False)
class SnapshotOp:
    """One ``ridethrough snapshot`` request (see the module docstring)."""

    root: str
    job: str
    reply: Reply | None = None
    timeout_s: float = 600.0
    name: str = "snapshot"
    n: int = -1
    started: float = 0.0

    def tick(self, c: Coordinator) -> bool:
        if self.n < 0:
            if not self.root:
                return self._finish(c, {"ok": False, "error": "the job was started without --snapshot-dir"})
            self.n, self.started = c.command({"kind": "snapshot"}), c.clock()
            c.note("snapshot_started", command=self.n)
            return False
        done = [keys.peek(c.store, keys.ctl(self.n, f"done/{r}")) for r in range(c.world_size)]
        errors = [f"rank {r}: {d.get('error')}" for r, d in enumerate(done) if d is not None and not d.get("ok")]
        if errors:
            return self._finish(c, {"ok": False, "error": "; ".join(errors)})
        if all(d is not None for d in done):
            step = int(c.store.get(keys.ctl(self.n, "T")))
            try:
                snap = commit(self.root, step=step, world_size=c.world_size,
                              shapes=keys.get(c.store, keys.ctl(self.n, "shapes")),
                              extra={"job": self.job, "generation": c.generation})
            except (OSError, ValueError) as exc:
                return self._finish(c, {"ok": False, "error": f"commit failed: {exc}"})
            stall = max(float(d.get("stall_s", 0.0)) for d in done if d is not None)
            return self._finish(c, {"ok": True, "step": step, "path": str(snap.path), "stall_s": stall,
                                    "seconds": c.clock() - self.started})
        if c.clock() - self.started > self.timeout_s:
            missing = [r for r, d in enumerate(done) if d is None]
            return self._finish(c, {"ok": False, "error": f"ranks {missing} did not save in {self.timeout_s:g} s"})
        return False

    def spare_died(self, c: Coordinator, spare: Spare) -> None:
        return None

    def abandon(self, c: Coordinator, why: str) -> bool:
        """A rank was lost: keep waiting once the ranks are back (its replacement saves the same step)."""
        return self.n >= 0

    def _finish(self, c: Coordinator, result: dict[str, Any]) -> bool:
        if self.n >= 0:
            c.command_done(self.n)
        c.note("snapshot_committed" if result.get("ok") else "snapshot_failed",
               **{k: v for k, v in result.items() if k != "ok"})
        if self.reply is not None:
            self.reply(result)
            self.reply = None
        return True


@dataclass(eq=False)
class PeriodicSnapshots:
    """Commits the snapshots ranks take on their own every K steps (``--snapshot-every``)."""

    root: str
    job: str
    timeout_s: float = 600.0
    cursor: int = 0
    pending: dict[tuple[int, int], float] | None = None

    def tick(self, c: Coordinator) -> None:
        """Commit every periodic snapshot whose rank files are all written; note those that failed."""
        pending = self.pending if self.pending is not None else {}
        self.pending = pending
        while c.store.check([periodic(self.cursor)]):
            doc = keys.get(c.store, periodic(self.cursor))
            pending[(int(doc["life"]), int(doc["step"]))] = c.clock()
            self.cursor += 1
        for (life, step), since in sorted(pending.items()):
            done = [keys.peek(c.store, periodic_part(life, step, f"done/{r}")) for r in range(c.world_size)]
            if any(d is None for d in done):
                if c.clock() - since > self.timeout_s:
                    del pending[(life, step)]
                    c.note("snapshot_failed", step=step, error=f"not every rank saved in {self.timeout_s:g} s")
                continue
            del pending[(life, step)]
            errors = [f"rank {r}: {d.get('error')}" for r, d in enumerate(done) if d and not d.get("ok")]
            if errors:
                c.note("snapshot_failed", step=step, error="; ".join(errors))
                continue
            try:
                snap = commit(self.root, step=step, world_size=c.world_size,
                              shapes=keys.get(c.store, periodic_part(life, step, "shapes")),
                              extra={"job": self.job, "generation": c.generation})
                c.note("snapshot_committed", step=step, path=str(snap.path))
            except (OSError, ValueError) as exc:
                c.note("snapshot_failed", step=step, error=f"commit failed: {exc}")
