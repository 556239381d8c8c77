"""``ridethrough run``: a torchrun-compatible launcher that also keeps hot spares and coordinates the job.

One launcher per node starts that node's ranks with torchrun's environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``, ...) and ``--spares`` hot-spare
processes, each with the shim on its ``PYTHONPATH`` (`ridethrough.actuators.shim`): the training
script is not changed. The node-0 launcher hosts the job store (a TCPStore at
``MASTER_ADDR:MASTER_PORT``, as torchrun's agent does) and the `Coordinator`; the others report to
it through the store (process exits, heartbeats) and follow its restarts. Every launcher serves
the job's local control socket (`control_socket`).

The launcher reaps every child as it exits (no zombies), replaces spares that were used or
died, and stops everything it started on the way out: the job's end, a signal, or its own death
(children get SIGKILL with their parent, ``PR_SET_PDEATHSIG``). Exit status: 0 when every rank
completed, 1 when the job failed (the reason is logged), 128+N on signal N.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

from ridethrough.actuators.shim import keys
from ridethrough.actuators.shim.config import ShimConfig, torchrun_env
from ridethrough.actuators.shim.control_socket import Forwarder, Server, socket_path
from ridethrough.actuators.shim.coordinator import Coordinator, Timeouts

log = logging.getLogger(__name__)
SITE_DIR = Path(__file__).resolve().parent / "shim" / "site"
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchConfig:
    """What ``ridethrough run`` was asked (see run_cli for each option's help)."""

    command: tuple[str, ...]
    nnodes: int = 1
    node_rank: int = 0
    nproc_per_node: int = 1
    spares: int = 0
    job_id: str = "job"
    customer: str = "default"
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    run_dir: str = ""
    log_dir: str = ""
    snapshot_dir: str = ""
    snapshot_every: int = 0
    resume: str = ""
    job_socket: str = ""
    shim: ShimConfig | None = None
    """Timeouts for the ranks (job, ranks and addresses are filled in per process)."""
    timeouts: Timeouts = field(default_factory=Timeouts)

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("nothing to run: give the command after --, e.g. -- python train.py")
        if self.nnodes < 1 or self.nproc_per_node < 1 or self.spares < 0 or self.snapshot_every < 0:
            raise ValueError("--nnodes and --nproc-per-node must be at least 1, --spares and --snapshot-every "
                             "at least 0")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} is outside 0..{self.nnodes - 1}")
        if self.nnodes > 1 and self.master_port == 0:
            raise ValueError("a job on several nodes needs --master-port (every node must find the store)")
        if self.snapshot_every and not self.snapshot_dir:
            raise ValueError("--snapshot-every needs --snapshot-dir")

    @property
    def world_size(self) -> int:
        """Ranks in the job."""
        return self.nnodes * self.nproc_per_node


@dataclass(slots=True)
class Child:
    """A process this launcher started."""

    proc: subprocess.Popen[bytes]
    kind: str
    """``rank`` or ``spare``."""
    rank: int = -1
    spare: str = ""
    log: IO[bytes] | None = None


def argv(command: tuple[str, ...]) -> list[str]:
    """The command to start: a bare ``python``/``python3`` is the interpreter ridethrough runs under
    (it has ridethrough and torch; the shim needs both), a script (``train.py ...``, as torchrun
    takes it) runs under it too, anything else as given."""
    if command and command[0] in ("python", "python3"):
        return [sys.executable, *command[1:]]
    if command and command[0].endswith(".py"):
        return [sys.executable, *command]
    return list(command)


# Resolved here, not in the child: between fork and exec a child may only call what needs no lock
# (the launcher has threads), so the child makes one plain C call and nothing else.
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl


def _die_with_parent() -> None:
    """In the child, before exec: get SIGKILL when the launcher dies, whatever kills it."""
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class Launcher:
    """One node's launcher (see the module docstring); `run` returns the exit status."""

    def __init__(self, cfg: LaunchConfig, *, environ: dict[str, str] | None = None) -> None:
        self.cfg = cfg
        self._environ = dict(os.environ if environ is None else environ)
        self.children: dict[int, Child] = {}
        self.store: Any = None
        self.coordinator: Coordinator | None = None
        self._master: Any = None
        self._server: Server | None = None
        self._spare_serial = 0
        self._spare_starts = 0
        self._life = 0
        self._generation = 0
        self._resume = cfg.resume
        self._stopping = 0
        self._ev_cursor = 0
        self._req_cursor = 0
        self._beats: dict[int, tuple[Any, float]] = {}
        self._periodic: Any = None
        self.port = cfg.master_port

    # -- start ------------------------------------------------------------------------------

    def start(self) -> None:
        """Open (or host) the store, start the ranks and spares, serve the control socket."""
        import torch.distributed as dist

        cfg = self.cfg
        timeout = timedelta(seconds=max(cfg.timeouts.form_s, 30.0))
        if cfg.node_rank == 0:
            self._master = dist.TCPStore("0.0.0.0", cfg.master_port, is_master=True,  # type: ignore[attr-defined]
                                         wait_for_workers=False, timeout=timeout)
            self.port = self._master.port
        self.store = dist.TCPStore(cfg.master_addr, self.port, is_master=False,  # type: ignore[attr-defined]
                                   wait_for_workers=False, timeout=timeout)
        if cfg.node_rank == 0:
            self.coordinator = Coordinator(self.store, cfg.world_size, generation=self._generation,
                                           timeouts=cfg.timeouts, restart=self._restart_all)
            if cfg.snapshot_every and cfg.snapshot_dir:
                from ridethrough.actuators.snapshot import PeriodicSnapshots

                self._periodic = PeriodicSnapshots(cfg.snapshot_dir, cfg.job_id)
        if cfg.run_dir:
            forward = Forwarder(self.store, node=cfg.node_rank, nproc_per_node=cfg.nproc_per_node,
                                world_size=cfg.world_size, timeout_s=cfg.timeouts.form_s * 10)
            self._server = Server(socket_path(cfg.run_dir, cfg.job_id, cfg.node_rank), forward)
        self._start_all()

    def _start_all(self) -> None:
        for local in range(self.cfg.nproc_per_node):
            self._spawn_rank(self.cfg.node_rank * self.cfg.nproc_per_node + local, local)
        for _ in range(self.cfg.spares):
            self._spawn_spare()

    def _shim(self, **over: Any) -> ShimConfig:
        base = self.cfg.shim or ShimConfig(job=self.cfg.job_id, store_port=1)
        return replace(base, job=self.cfg.job_id, customer=self.cfg.customer, node=self.cfg.node_rank,
                       nproc_per_node=self.cfg.nproc_per_node, world_size=self.cfg.world_size,
                       store_host=self.cfg.master_addr, store_port=self.port, generation=self._generation,
                       snapshot_dir=self.cfg.snapshot_dir, snapshot_every=self.cfg.snapshot_every, life=self._life,
                       job_socket=self.cfg.job_socket, **over)

    def _env(self, *, rank: int, local: int, shim: ShimConfig) -> dict[str, str]:
        cfg = self.cfg
        path = [str(SITE_DIR)]
        old = self._environ.get("PYTHONPATH", "")
        env = {**self._environ, **shim.env(),
               **torchrun_env(rank=rank, local_rank=local, nproc_per_node=cfg.nproc_per_node, node=cfg.node_rank,
                              nnodes=cfg.nnodes, world_size=cfg.world_size, master_addr=cfg.master_addr,
                              master_port=self.port, run_id=cfg.job_id, restarts=self._life),
               "PYTHONPATH": os.pathsep.join(p for p in [*path, old] if p)}
        # As torchrun: one thread per rank unless the user chose, so ranks do not oversubscribe the cores.
        env.setdefault("OMP_NUM_THREADS", "1")
        return env

    def _open_log(self, name: str) -> IO[bytes] | None:
        if not self.cfg.log_dir:
            return None
        Path(self.cfg.log_dir).mkdir(parents=True, exist_ok=True)
        return open(Path(self.cfg.log_dir) / f"{name}.log", "ab")  # the child holds it; closed when reaped

    def _popen(self, env: dict[str, str], log_file: IO[bytes] | None) -> subprocess.Popen[bytes]:
        # Its own process group: a stop reaches the rank's data loader workers too (killpg).
        return subprocess.Popen(argv(self.cfg.command), env=env, stdout=log_file, process_group=0,
                                stderr=subprocess.STDOUT if log_file else None, preexec_fn=_die_with_parent)

    def _spawn_rank(self, rank: int, local: int) -> None:
        log_file = self._open_log(f"rank-{rank}")
        proc = self._popen(self._env(rank=rank, local=local, shim=self._shim(resume=self._resume)), log_file)
        self.children[proc.pid] = Child(proc, "rank", rank=rank, log=log_file)
        self._placed(rank, proc.pid)

    def _spawn_spare(self) -> None:
        spare_id = f"n{self.cfg.node_rank}s{self._spare_serial}"
        self._spare_serial += 1
        self._spare_starts += 1
        log_file = self._open_log(f"spare-{spare_id}")
        local = self.cfg.nproc_per_node + (self._spare_serial - 1) % max(1, self.cfg.spares)
        proc = self._popen(self._env(rank=-1, local=local, shim=self._shim(role="spare", spare_id=spare_id)),
                           log_file)
        self.children[proc.pid] = Child(proc, "spare", spare=spare_id, log=log_file)

    def _placed(self, rank: int, pid: int) -> None:
        if self.coordinator is not None:
            self.coordinator.placed(rank, node=0, pid=pid)
        else:
            keys.append(self.store, keys.EV_SEQ, keys.event, {"kind": "placed", "node": self.cfg.node_rank,
                                                              "rank": rank, "pid": pid})

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> int:
        """Start, supervise until the job ends, stop everything; the exit status."""
        handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.start()
            return self._loop()
        finally:
            self.stop()
            for s, h in handlers.items():
                signal.signal(s, h)

    def _on_signal(self, signum: int, frame: object) -> None:
        self._stopping = signum

    def _loop(self) -> int:
        from ridethrough.actuators.shim.supervisor import supervise

        return supervise(self)

    def stop(self, grace_s: float = 5.0) -> None:
        """Terminate every child still running (SIGTERM to its group, SIGKILL after ``grace_s``) and reap it."""
        for child in self.children.values():
            if child.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in self.children.values():
            try:
                child.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.proc.pid, signal.SIGKILL)
                child.proc.wait()
            if child.log is not None:
                child.log.close()
        if self._server is not None:
            self._server.close()
            self._server = None

    def kill_all(self) -> None:
        """Kill every child now (a restart), reaping them."""
        for child in self.children.values():
            if child.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.proc.pid, signal.SIGKILL)
        for child in self.children.values():
            child.proc.wait()
            if child.log is not None:
                child.log.close()
        self.children.clear()

    # -- restart from a snapshot (the coordinator's fallback) -------------------------------

    def _restart_all(self, why: str) -> bool:
        if not self.cfg.snapshot_dir:
            return False
        from ridethrough.actuators.snapshot import find

        try:
            snap = find(self.cfg.snapshot_dir)
        except FileNotFoundError:
            return False
        assert self.coordinator is not None
        gen = self.coordinator.next_generation()
        keys.put(self.store, keys.RESTART, {"life": self._life + 1, "gen": gen, "snapshot": str(snap.path)})
        log.warning("restarting every rank from snapshot %s (step %d): %s", snap.path, snap.step, why)
        self.restart_local(self._life + 1, gen, str(snap.path))
        return True

    def restart_local(self, life: int, gen: int, snapshot: str) -> None:
        """Kill this node's ranks and spares and start them again from ``snapshot`` as generation ``gen``."""
        self.kill_all()
        self._life, self._generation, self._resume = life, gen, snapshot
        if self.coordinator is not None:
            c = self.coordinator
            c.slots.clear()
            c.spares.clear()
            c.op = None
            c.generation = gen
            keys.put(self.store, keys.GEN, gen)
        self._start_all()
