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
