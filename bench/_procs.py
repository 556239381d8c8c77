"""/proc readers, a Prometheus scrape and a poll, for benchmarks that watch other processes."""

from __future__ import annotations

import os
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def stat_cpu_s(stat_path: Path) -> float:
    """User + system CPU seconds from a /proc ``stat`` file (a process's counts all its threads)."""
    stat = stat_path.read_text()
    fields = stat[stat.rindex(")") + 2:].split()  # fields from 3 (state) on; comm may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of every thread of ``pid`` so far."""
    return stat_cpu_s(Path(f"/proc/{pid}/stat"))


def machine_busy_cpu_s() -> float:
    """CPU seconds every process on this machine has used since boot (all of /proc/stat's busy time)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = (
        int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds so far of ``pid``'s live threads, summed by thread name (Python's are all 'python')."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            out[name] = out.get(name, 0.0) + stat_cpu_s(task / "stat")
        except OSError:  # the thread ended between listing and reading
            continue
    return out


def cpu_by_thread(before: dict[str, float], after: dict[str, float], total_s: float) -> dict[str, float]:
    """Where the window's CPU went, by thread name; 'ended threads' is what live threads do not explain."""
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    shown = {name: round(v, 2) for name, v in sorted(delta.items(), key=lambda kv: -kv[1]) if v >= 0.01}
    shown["ended threads"] = round(max(0.0, total_s - sum(delta.values())), 2)
    return shown


def scrape(url: str) -> dict[str, float]:
    """Unlabelled samples and per-label sums of a Prometheus text page, by metric name."""
    out: dict[str, float] = {}
    with urllib.request.urlopen(url, timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line and not line.startswith("#"):
                sample, _, value = line.rpartition(" ")
                name = sample.split("{", 1)[0]
                out[name] = out.get(name, 0.0) + float(value)
    return out


def poll(predicate: Callable[[], T | None], *, timeout_s: float, what: str, interval_s: float = 0.05) -> T:
    """The first truthy result of ``predicate``, polled until ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
