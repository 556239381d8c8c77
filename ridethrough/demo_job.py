"""The demo's training job: ``ridethrough run`` on each of its hosts, DDP on gloo, hot spares on one.

One launcher per host (``--nnodes N --node-rank i``), the first host's stable address as the
job's store, steps reported to each host's agent through its job socket, each launcher's control
socket under the host's own ``run`` directory (where that host's agent finds the jobs it may
migrate). Launchers are lab processes (``Lab.exec``), so ``lab down`` stops whatever is left.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ridethrough.lab.hostops import LabBase

JOB_ID = "demo-train"
CUSTOMER = "demo"
MASTER_PORT = 29750
STEP_SLEEP_S = 0.5


def run_dir(lab: LabBase, host: str) -> Path:
    """Where a host's launchers put their control sockets (the host agent's job commands look there)."""
    return Path(lab.host_dir(host)) / "run"


@dataclass
class DemoJob:
    """The job's launchers: ``hosts[i]`` is node ``i``; ``spare_host`` also runs ``spares`` hot spares."""

    lab: LabBase
    hosts: tuple[str, ...]
    spare_host: str
    spares: int
    log_dir: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def argv(self, node: int) -> list[str]:
        """``ridethrough run`` for node ``node``."""
        host = self.hosts[node]
        master = str(self.lab.host_info(self.hosts[0])["stable_ip"])
        return [sys.executable, "-m", "ridethrough", "run", "--nnodes", str(len(self.hosts)), "--node-rank",
                str(node), "--nproc-per-node", "1", "--master-addr", master, "--master-port", str(MASTER_PORT),
                "--spares", str(self.spares if host == self.spare_host else 0), "--job-id", JOB_ID,
                "--customer", CUSTOMER, "--log-dir", str(self.log_dir / host), "--run-dir",
                str(run_dir(self.lab, host)), "--job-socket", str(self.lab.host_dir(host) / "job.sock"),
                # a loaded 2-core machine forms groups slowly and delays heartbeats: 15 s before a silent node is lost
                "--rendezvous-timeout", "180", "--heartbeat-timeout", "15",
                "--", "python", "-m", "ridethrough.demo_train", "--step-sleep", str(STEP_SLEEP_S)]

    def start(self) -> None:
        """Start every host's launcher."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # Gloo binds to the interface of the host's stable address: across the fabric in namespaces,
        # loopback in the degraded mode.
        env_if = "stab" if self.lab.mode == "netns" else "lo"
        for node, host in enumerate(self.hosts):
            run_dir(self.lab, host).mkdir(parents=True, exist_ok=True)
            with (self.log_dir / f"launcher-{host}.log").open("ab") as out:
                self.procs.append(self.lab.exec(host, self.argv(node), job=True, env=_env(env_if),
                                                stdout=out, stderr=subprocess.STDOUT))

    def exited(self) -> list[tuple[str, int]]:
        """Launchers that exited, with their status."""
        return [(h, p.returncode) for h, p in zip(self.hosts, self.procs, strict=False) if p.poll() is not None]

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate the launchers (they stop their ranks and spares); kill what is still there after the grace."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def _env(gloo_if: str) -> dict[str, Any]:
    return {**os.environ, "GLOO_SOCKET_IFNAME": gloo_if, "PYTHONUNBUFFERED": "1"}
