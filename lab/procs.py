"""Processes a lab runs: identity that survives pid reuse, who lives in a namespace, stopping them.

A process is recorded as (pid, start time in clock ticks since boot, from ``/proc/PID/stat``):
a recycled pid has another start time, so ``lab down`` never signals a stranger.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class ProcRef:
    """One process, by pid and start time."""

    pid: int
    start: int

    def to_json(self) -> dict[str, int]:
        """For the state file."""
        return {"pid": self.pid, "start": self.start}

    @classmethod
    def from_json(cls, data: Any) -> ProcRef:
        """From the state file."""
        return cls(int(data["pid"]), int(data["start"]))


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time) of a pid, or None if there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = text[text.rindex(")") + 2:].split()
    return fields[0], int(fields[19])


def ref(pid: int) -> ProcRef | None:
    """The identity of a running process, or None if it is gone."""
    st = _stat(pid)
    return None if st is None else ProcRef(pid, st[1])


def state(pid: int) -> str | None:
    """The process state letter (``R``, ``S``, ``T`` stopped, ``Z`` zombie …) or None."""
    st = _stat(pid)
    return None if st is None else st[0]


def alive(proc: ProcRef) -> bool:
    """Whether that very process still runs (a zombie does not)."""
    st = _stat(proc.pid)
    return st is not None and st[1] == proc.start and st[0] not in ("Z", "X")


def cpu_time_s(pid: int) -> float:
    """User plus system CPU time of a process, in seconds (0 if it is gone)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    fields = text[text.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def netns_pids(ns_path: str | os.PathLike[str]) -> list[int]:
    """Pids whose network namespace is the one bound at ``ns_path`` (``ip netns pids``)."""
    try:
        target = os.stat(ns_path)
    except FileNotFoundError:
        return []
    out: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{entry}/ns/net")
        except (FileNotFoundError, PermissionError, ProcessLookupError):
            continue
        if (st.st_ino, st.st_dev) == (target.st_ino, target.st_dev):
            out.append(int(entry))
    return out


def send(procs: Iterable[ProcRef], sig: signal.Signals) -> list[ProcRef]:
    """Signal the processes that are still the recorded ones; returns those signalled."""
    sent: list[ProcRef] = []
    for p in procs:
        if alive(p):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, sig)
                sent.append(p)
    return sent


def wait_gone(procs: Iterable[ProcRef], timeout_s: float) -> list[ProcRef]:
    """Wait until the processes exit; returns those still alive at the deadline."""
    left = [p for p in procs if alive(p)]
    deadline = time.monotonic() + timeout_s
    while left and time.monotonic() < deadline:
        time.sleep(0.02)
        left = [p for p in left if alive(p)]
    return left


def stop(procs: Iterable[ProcRef], *, grace_s: float) -> list[ProcRef]:
    """SIGTERM (and SIGCONT, so stopped ones can act on it), then SIGKILL what outlives ``grace_s``.

    Returns the processes that survived even SIGKILL for a second (normally none).
    """
    targets = send(procs, signal.SIGTERM)
    send(targets, signal.SIGCONT)
    left = wait_gone(targets, grace_s)
    send(left, signal.SIGKILL)
    return wait_gone(left, 1.0)
