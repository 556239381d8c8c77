"""Start a scenario's jobs in lab hosts, with torchrun's environment contract.

Every rank gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR`` (the first host's stable address) and ``MASTER_PORT``, so any
torchrun-style program runs unchanged; ``ridethrough.lab.allreduce`` reads them too.
Ranks run as job processes (the host's job cgroup), so ``straggle`` and ``freeze`` reach them.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from ridethrough.lab.control import LabError
from ridethrough.lab.fabric import Lab
from ridethrough.lab.scenario import Job

FIRST_PORT = 29600


class LabJobLauncher:
    """`ridethrough.lab.runner.JobLauncher` for a namespace lab; rank output goes to ``log_dir``."""

    def __init__(self, lab: Lab, *, log_dir: Path) -> None:
        self._lab = lab
        self._log_dir = log_dir
        self._procs: list[subprocess.Popen[bytes]] = []
        self._ports = itertools.count(FIRST_PORT)

    def start(self, jobs: Sequence[Job]) -> None:
        """Start every rank of every job."""
        self._log_dir.mkdir(parents=True, exist_ok=True)
        for job in jobs:
            self._start_job(job, port=next(self._ports))

    def _start_job(self, job: Job, *, port: int) -> None:
        world = len(job.hosts) * job.ranks_per_host
        master = self._lab.topology.stable_ip(job.hosts[0])
        for host_index, host in enumerate(job.hosts):
            for local in range(job.ranks_per_host):
                rank = host_index * job.ranks_per_host + local
                env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
                       "LOCAL_WORLD_SIZE": str(job.ranks_per_host), "MASTER_ADDR": master,
                       "MASTER_PORT": str(port), "RIDETHROUGH_JOB": job.name,
                       # the host agent's job endpoint: steps and phases reach the store (straggler, goodput)
                       "RIDETHROUGH_JOB_SOCKET": str(self._lab.host_dir(host) / "job.sock")}
                log = (self._log_dir / f"{job.name}-rank{rank}.log").open("wb")
                try:
                    proc = self._lab.exec(host, _argv(job.command), job=True, env=env, stdout=log,
                                          stderr=subprocess.STDOUT)
                except OSError as exc:
                    raise LabError(f"job {job.name}: cannot start rank {rank} on {host}: {exc}") from exc
                finally:
                    log.close()  # the child holds its own descriptor
                self._procs.append(proc)

    def stop(self) -> None:
        """Terminate every rank (kill what does not exit within 5 s)."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self._procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self._procs.clear()


def _argv(command: Sequence[str]) -> list[str]:
    # A scenario says "python3"; the lab runs the interpreter ridethrough itself runs under,
    # which has ridethrough and torch installed (the system one may have neither).
    if command and command[0] in ("python", "python3"):
        return [sys.executable, *command[1:]]
    return list(command)


class LabRun:
    """A job under ``ridethrough run`` across lab hosts: one launcher per host, in the host's namespace.

    Node ``i`` is ``hosts[i]``; node 0 hosts the job store at its stable address. Each host's
    launcher serves its control socket in the host's own run directory (``<host dir>/run``, where
    the host's agent finds it for ``job.migrate``), and every process's output goes to ``log_dir``
    (ranks and spares have distinct names across nodes; each launcher's own to ``launcher-<host>.log``).
    Gloo binds the host's stable address, so ranks talk across the fabric.
    """

    def __init__(self, lab: Lab, hosts: Sequence[str], command: Sequence[str], *, job_id: str, log_dir: Path,
                 nproc_per_node: int = 1, spares: Sequence[int] | int = 0, master_port: int = FIRST_PORT + 50,
                 extra: Sequence[str] = (), iface: str = "stab") -> None:
        if not hosts:
            raise LabError(f"job {job_id}: no hosts")
        per_host = [spares] * len(hosts) if isinstance(spares, int) else list(spares)
        if len(per_host) != len(hosts):
            raise LabError(f"job {job_id}: {len(per_host)} spare counts for {len(hosts)} hosts")
        self.lab, self.hosts, self.command, self.job_id = lab, list(hosts), list(command), job_id
        self.log_dir, self.nproc_per_node, self.spares = log_dir, nproc_per_node, per_host
        self.master_port, self.extra, self.iface = master_port, list(extra), iface
        self.procs: list[subprocess.Popen[bytes]] = []

    def run_dir(self, host: str) -> Path:
        """Where ``host``'s launcher serves the job's control socket."""
        return Path(self.lab.host_dir(host)) / "run"

    def start(self) -> None:
        """Start every host's launcher (node 0 first: it hosts the store the others join)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        master = self.lab.topology.stable_ip(self.hosts[0])
        for node, host in enumerate(self.hosts):
            argv = [sys.executable, "-m", "ridethrough.actuators.run_cli", "run", "--nnodes", str(len(self.hosts)),
                    "--node-rank", str(node), "--nproc-per-node", str(self.nproc_per_node), "--spares",
                    str(self.spares[node]), "--master-addr", master, "--master-port", str(self.master_port),
                    "--job-id", self.job_id, "--log-dir", str(self.log_dir), "--run-dir", str(self.run_dir(host)),
                    *self.extra, "--", *self.command]
            env = {**os.environ, "GLOO_SOCKET_IFNAME": self.iface, "PYTHONUNBUFFERED": "1"}
            log = (self.log_dir / f"launcher-{host}.log").open("ab")
            try:
                self.procs.append(self.lab.exec(host, argv, job=True, env=env, stdout=log, stderr=subprocess.STDOUT))
            except OSError as exc:
                raise LabError(f"job {self.job_id}: cannot start the launcher on {host}: {exc}") from exc
            finally:
                log.close()  # the launcher holds its own descriptor

    def wait(self, node: int = 0, *, timeout_s: float) -> int:
        """Node ``node``'s launcher's exit status (LabError if it still runs after ``timeout_s``)."""
        try:
            return self.procs[node].wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise LabError(f"job {self.job_id}: the launcher on {self.hosts[node]} still runs after "
                           f"{timeout_s:g} s") from None

    def stop(self) -> None:
        """Stop every launcher (they stop their ranks and spares); kill one that does not exit within 20 s."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()  # also reaches a stopped (frozen) launcher; its children die with it
                proc.wait(10)
