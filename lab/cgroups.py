"""The lab's cgroups (v1 ``cpu`` controller): one per lab, one per host, one for a host's jobs.

Everything a lab runs joins its tree, so ``lab down`` finds every process (even one a
crashed supervisor left behind), and a straggler is a CPU quota on ``{host}/jobs``::

    /sys/fs/cgroup/cpu/ridethrough-lab/{lab}/              supervisor, switch agent, load generators
    /sys/fs/cgroup/cpu/ridethrough-lab/{lab}/server/       the server (gateway, store, controller)
    /sys/fs/cgroup/cpu/ridethrough-lab/{lab}/{host}/       the host's agent, lab exec
    /sys/fs/cgroup/cpu/ridethrough-lab/{lab}/{host}/jobs/  lab exec --job (and stragglers)
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from pathlib import Path

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
PARENT = "ridethrough-lab"
PERIOD_US = 100_000
STARVE_PERIOD_US = 1_000_000
"""The longest CFS period: a starved host's quota comes once a second."""
SERVER_SHARES = 4096
"""The server's ``cpu.shares``: as many as four hosts' (1024 each). It stands for machines of its own; in one
cgroup with the supervisor it weighed as much as one host, and with every host of the demo busy (a load of 25
on two cores) a batch insert took 1.5 s and a link_down query 3.3 s (0.1 s on a quiet machine). At 8192 the
hosts' probers starved instead."""

JOB_SHARES = 256
"""A host's jobs' ``cpu.shares`` beside its agent's threads (1024 each): the agent measures the fabric for the job,
and a probe answered late because the job's data loaders held the CPU reads as a network fault. As a production
agent gets its CPU through its systemd unit's ``CPUWeight`` or a Guaranteed pod, the lab's gets it here; the job
still has every cycle the agent leaves."""


def available(root: Path = CPU_ROOT) -> bool:
    """Whether this process can make cgroups under the v1 cpu controller."""
    return (root / "cgroup.procs").exists() and os.access(root, os.W_OK)


def lab_dir(name: str, root: Path = CPU_ROOT) -> Path:
    """A lab's cgroup."""
    return root / PARENT / name


def host_dir(name: str, host: str, *, jobs: bool = False, root: Path = CPU_ROOT) -> Path:
    """A host's cgroup, or its jobs' cgroup."""
    base = lab_dir(name, root) / host
    return base / "jobs" if jobs else base


def server_dir(lab: Path) -> Path:
    """The server's cgroup inside a lab's."""
    return lab / "server"


def set_shares(path: Path, shares: int) -> None:
    """Weigh a cgroup against its siblings when the CPUs are contended (``cpu.shares``, 1024 by default)."""
    (path / "cpu.shares").write_text(str(shares))


def make(path: Path) -> None:
    """Create a cgroup and its parents."""
    path.mkdir(parents=True, exist_ok=True)


def join(path: Path, pid: int = 0) -> None:
    """Move a process (0: the caller) into a cgroup."""
    fd = os.open(path / "cgroup.procs", os.O_WRONLY)
    try:
        os.write(fd, str(pid).encode())
    finally:
        os.close(fd)


def procs(path: Path) -> list[int]:
    """Every pid in a cgroup and the cgroups below it."""
    out: list[int] = []
    if not path.is_dir():
        return out
    for dirpath, _dirs, _files in os.walk(path):
        with contextlib.suppress(FileNotFoundError, OSError):
            out += [int(x) for x in (Path(dirpath) / "cgroup.procs").read_text().split()]
    return out


def remove_tree(path: Path, *, wait_s: float = 5.0) -> list[str]:
    """Remove a cgroup and those below it (deepest first); returns the ones that would not go.

    A cgroup whose last processes are still exiting refuses removal (EBUSY) for a moment,
    longer on a busy machine: those are retried for up to ``wait_s``.
    """
    deadline = time.monotonic() + wait_s
    while True:
        failed, busy = _remove_once(path)
        if not busy or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    with contextlib.suppress(OSError):  # the shared parent goes with the last lab (busy otherwise)
        os.rmdir(path.parent)
    return failed


def _remove_once(path: Path) -> tuple[list[str], bool]:
    failed: list[str] = []
    busy = False
    if not path.is_dir():
        return failed, busy
    for dirpath, _dirs, _files in sorted(os.walk(path), key=lambda w: -len(w[0])):
        try:
            os.rmdir(dirpath)
        except FileNotFoundError:
            pass
        except OSError as exc:
            busy = busy or exc.errno == errno.EBUSY
            failed.append(f"{dirpath}: {exc.strerror}")
    return failed, busy


def set_cpu_fraction(path: Path, fraction: float | None, *, period_us: int = PERIOD_US) -> None:
    """Cap a cgroup to ``fraction`` of one CPU in each ``period_us`` (None: no cap)."""
    if fraction is None:  # lift the quota first: the kernel refuses a period that leaves a child's quota above it
        (path / "cpu.cfs_quota_us").write_text("-1")
    (path / "cpu.cfs_period_us").write_text(str(period_us))
    quota = -1 if fraction is None else max(1000, round(fraction * period_us))
    (path / "cpu.cfs_quota_us").write_text(str(quota))


def throttled(path: Path) -> int:
    """How many periods the cgroup was throttled in (``cpu.stat nr_throttled``)."""
    for line in (path / "cpu.stat").read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "nr_throttled":
            return int(value)
    return 0

