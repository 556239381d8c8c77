"""The agent's job commands: ``job.migrate`` and ``job.status`` for the training jobs on its node.

The controller's `migrate` plugin sends them, signed and traced, to a node's agent; the agent
finds every job launcher on the node by its control socket under ``run_dir``
(``<job>-node<N>.sock``, `ridethrough.actuators.shim.control_socket`) and asks it:

* ``job.migrate {gpu, reason}``: move the ranks that run on GPU ``gpu`` of this node (-1: every
  GPU) to hot spares at their next step boundary. Which rank runs where is the launcher's
  placement: rank ``N * nproc + g`` starts on GPU ``g`` of node ``N``; a spare that took a rank
  runs on the GPU its launcher gave it (``LOCAL_RANK`` ``nproc + serial % spares``).
* ``job.status {gpu}``: ok when no rank on that GPU is still its original process (the check
  after a migration).

Both fail with a line that says why: no job on this node (a socket whose launcher is gone is
named; beside a live job it is only mentioned), no rank of any job on that GPU, or the
coordinator's answer (no spare ready, a spare that died on the way and what the job did about
it). A repeated ``job.migrate`` for ranks already on spares succeeds and says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ridethrough.actuators.command_auth import Scalar
from ridethrough.actuators.commands import Args, CommandRegistry, Outcome, Param
from ridethrough.actuators.shim.control_socket import request

STATUS_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class Launcher:
    """One job launcher on this node, as its socket and status describe it."""

    path: Path
    job: str
    node: int
    status: Mapping[str, Any]

    def on_gpu(self, gpu: int, *, original_only: bool = False) -> list[int]:
        """The running ranks on GPU ``gpu`` of this node (-1: any GPU), optionally only their original processes."""
        nproc = int(self.status.get("nproc_per_node", 1))
        spares = max(1, int(self.status.get("spares_per_node", 1)))
        found = []
        for rank_text, slot in dict(self.status.get("ranks", {})).items():
            rank, spare = int(rank_text), str(slot.get("spare", ""))
            if slot.get("done") or int(slot.get("node", -1)) != self.node:
                continue
            if spare and original_only:
                continue
            where = rank - self.node * nproc if not spare else nproc + _serial(spare) % spares
            if gpu < 0 or where == gpu:
                found.append(rank)
        return sorted(found)

    def moved_from(self, gpu: int) -> list[int]:
        """Ranks that started on GPU ``gpu`` of this node (-1: any) and now run on a spare."""
        nproc = int(self.status.get("nproc_per_node", 1))
        first = self.node * nproc
        slots = dict(self.status.get("ranks", {}))
        return sorted(r for r in range(first, first + nproc) if (gpu < 0 or r - first == gpu)
                      and str(slots.get(str(r), {}).get("spare", "")))


def _serial(spare_id: str) -> int:
    """A spare's serial number on its node (ids are ``n<node>s<serial>``)."""
    tail = spare_id.rsplit("s", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def _check_gpu(gpu: int) -> None:
    if gpu < -1:
        raise ValueError(f"gpu must be a GPU index or -1 for all, got {gpu}")


class JobCommands:
    """The handlers, over the launchers' sockets in ``run_dir``."""

    def __init__(self, run_dir: str, *, timeout_s: float = 600.0) -> None:
        self.run_dir = Path(run_dir)
        self.timeout_s = timeout_s

    def launchers(self) -> tuple[list[Launcher], list[str]]:
        """The launchers that answer, and a line for each socket that does not (its launcher is gone)."""
        found, gone = [], []
        for path in sorted(self.run_dir.glob("*-node*.sock")):
            job, _, node = path.stem.rpartition("-node")
            if not job or not node.isdigit():
                continue
            try:
                doc = request(path, {"cmd": "status"}, timeout_s=STATUS_TIMEOUT_S)
            except (OSError, ValueError) as exc:  # refused, vanished, timed out, not JSON
                gone.append(f"{path.name}: socket gone ({type(exc).__name__}: {exc})")
                continue
            if not doc.get("ok"):
                gone.append(f"{path.name}: {doc.get('error') or doc.get('detail') or 'status refused'}")
                continue
            found.append(Launcher(path, str(doc.get("job", job)), int(node), doc))
        return found, gone

    def _none_here(self, gone: list[str]) -> Outcome:
        why = f" ({'; '.join(gone)})" if gone else ""
        return Outcome(False, f"no job runs on this node: no launcher answers in {self.run_dir}{why}",
                       {"jobs": 0, "moved": 0})

    def migrate(self, args: Args) -> Outcome:
        """Move the ranks on GPU ``gpu`` (-1: all) of every job here to hot spares; data: jobs, ranks moved."""
        gpu, reason = int(args["gpu"]), str(args["reason"])
        found, gone = self.launchers()
        if not found:
            return self._none_here(gone)
        moved, failed, notes = 0, [], []
        for launcher in found:
            ranks = launcher.on_gpu(gpu)  # a spare that took a rank there earlier moves too: the GPU is failing
            if not ranks:
                notes.append(f"{launcher.job}: no rank on {_where(gpu)}")
                continue
            try:
                reply = request(launcher.path, {"cmd": "migrate", "ranks": ranks, "reason": reason},
                                timeout_s=self.timeout_s)
            except (OSError, ValueError) as exc:
                failed.append(f"{launcher.job}: socket gone during the migration ({type(exc).__name__}: {exc})")
                continue
            line = f"{launcher.job} ranks {ranks}: {reply.get('detail') or reply.get('error') or reply}"
            if reply.get("ok"):
                moved += len(ranks)
                notes.append(line)
            else:
                failed.append(line)
        # A socket whose launcher is gone is said, not failed on: that job's processes died with it.
        stale = [f"ignored {g}" for g in gone]
        data: dict[str, Scalar] = {"jobs": len(found), "moved": moved}
        if not moved and not failed:
            already = [f"{x.job} ranks {x.moved_from(gpu)}" for x in found if x.moved_from(gpu)]
            if already:  # a retried request: done before
                return Outcome(True, "; ".join([f"already on spares: {', '.join(already)}", *stale]), data)
            return Outcome(False, "; ".join([f"no job has a rank on {_where(gpu)}", *notes, *stale]), data)
        return Outcome(not failed, "; ".join(failed + notes + stale), data)

    def status(self, args: Args) -> Outcome:
        """Ok when no rank on GPU ``gpu`` (-1: any) of this node is still its original process."""
        gpu = int(args["gpu"])
        found, gone = self.launchers()
        if not found:
            return self._none_here(gone)
        left = [f"{launcher.job} rank {r}" for launcher in found for r in launcher.on_gpu(gpu, original_only=True)]
        detail = (f"still on their original process on {_where(gpu)}: {', '.join(left)}" if left
                  else f"no original rank left on {_where(gpu)} ({len(found)} job(s) here)")
        if gone:
            detail += "; ignored " + "; ignored ".join(gone)
        return Outcome(not left, detail, {"jobs": len(found), "left": len(left)})


def _where(gpu: int) -> str:
    return f"GPU {gpu} of this node" if gpu >= 0 else "any GPU of this node"


def register_job_commands(registry: CommandRegistry, *, run_dir: str, timeout_s: float = 600.0) -> None:
    """Register ``job.migrate`` and ``job.status`` on an agent's registry, for the launchers under ``run_dir``."""
    if not run_dir:
        raise ValueError("register_job_commands needs the launchers' run directory (ridethrough run --run-dir)")
    commands = JobCommands(run_dir, timeout_s=timeout_s)
    gpu = Param(int, check=_check_gpu)
    registry.register("job.migrate", commands.migrate, params={"gpu": gpu, "reason": Param(str, "")},
                      help=JobCommands.migrate.__doc__ or "")
    registry.register("job.status", commands.status, params={"gpu": gpu}, help=JobCommands.status.__doc__ or "")
