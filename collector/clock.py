"""The agent's clock, injectable: the system clock, or a scripted one the lab controls.

In the lab every host runs on one physical clock, so each host gets a *scripted* clock:
true time plus an offset, a drift and any steps, read from a small JSON file that the
lab writes (``clock.json``). The lab knows the truth; clock sync is scored against it.

    {"offset_ns": 2500000, "drift_ppm": -40.0, "epoch_ns": 1764480000000000000,
     "steps": [[1764480030000000000, 5000000]]}

local(t) = t + offset_ns + drift_ppm·1e-6·(t - epoch_ns) + Σ step_ns for steps at ≤ t
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

Clock = Callable[[], int]
"""A clock is a function returning nanoseconds since the epoch, as it reads them."""

MAX_OFFSET_NS = 10_000_000
MAX_DRIFT_PPM = 100.0


@dataclass(frozen=True, slots=True)
class ClockSpec:
    """How one scripted clock differs from true time."""

    offset_ns: int = 0
    drift_ppm: float = 0.0
    epoch_ns: int = 0
    steps: tuple[tuple[int, int], ...] = ()

    def local(self, true_ns: int) -> int:
        """What this clock reads at true time ``true_ns``."""
        drift = round(self.drift_ppm * (true_ns - self.epoch_ns) / 1e6)
        stepped = sum(step for at, step in self.steps if at <= true_ns)
        return true_ns + self.offset_ns + drift + stepped


class ClockScript:
    """The lab's side: write a host's clock file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def read(self) -> ClockSpec:
        """The current spec (an absent file is a perfect clock)."""
        return read_spec(self.path)

    def set(self, offset_ns: int, drift_ppm: float, *, epoch_ns: int | None = None) -> None:
        """Give the clock an offset and a drift (steps are kept)."""
        if abs(offset_ns) > MAX_OFFSET_NS or abs(drift_ppm) > MAX_DRIFT_PPM:
            raise ValueError(f"clock offset must be within ±{MAX_OFFSET_NS} ns and drift within "
                             f"±{MAX_DRIFT_PPM} ppm, got {offset_ns} ns, {drift_ppm} ppm")
        spec = self.read()
        epoch = time.time_ns() if epoch_ns is None else epoch_ns
        self._write(ClockSpec(offset_ns, drift_ppm, epoch, spec.steps))

    def step(self, step_ns: int, *, at_ns: int) -> None:
        """Step the clock by ``step_ns`` at true time ``at_ns``."""
        spec = self.read()
        self._write(ClockSpec(spec.offset_ns, spec.drift_ppm, spec.epoch_ns, (*spec.steps, (at_ns, step_ns))))

    def _write(self, spec: ClockSpec) -> None:
        data = {"offset_ns": spec.offset_ns, "drift_ppm": spec.drift_ppm, "epoch_ns": spec.epoch_ns,
                "steps": [list(s) for s in spec.steps]}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".clock-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, self.path)


def read_spec(path: Path) -> ClockSpec:
    """Parse a clock file; ValueError naming the file if it is malformed."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return ClockSpec()
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"clock script {path}: {exc}") from exc
    try:
        steps = tuple((int(at), int(step)) for at, step in data.get("steps", []))
        return ClockSpec(int(data.get("offset_ns", 0)), float(data.get("drift_ppm", 0.0)),
                         int(data.get("epoch_ns", 0)), steps)
    except (TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"clock script {path}: malformed: {exc}") from exc


class ScriptedClock:
    """The agent's side: true time bent by the host's clock file (re-read when it changes).

    The file is looked at no more than every ``recheck_s`` (default 0.1 s): an agent reads its clock for every
    probe it sends and answers, and a stat per read was a tenth of a lab agent's CPU. A scripted step or
    drift therefore takes effect within that time.
    """

    def __init__(self, path: str | os.PathLike[str], *, true_clock: Clock = time.time_ns,
                 recheck_s: float = 0.1) -> None:
        self._path = Path(path)
        self._true = true_clock
        self._lock = threading.Lock()
        self._mtime_ns = -1
        self._spec = ClockSpec()
        self._recheck_s = recheck_s
        self._checked_s = float("-inf")

    def __call__(self) -> int:
        """Nanoseconds since the epoch, as this host's clock reads them."""
        return self.spec().local(self._true())

    def spec(self) -> ClockSpec:
        """The spec in force (a malformed file keeps the last good one)."""
        if time.monotonic() - self._checked_s < self._recheck_s:
            return self._spec  # one reference read: a spec is immutable, and a stale one by <recheck_s is fine
        with self._lock:
            now_s = time.monotonic()
            if now_s - self._checked_s < self._recheck_s:
                return self._spec  # another thread looked while we waited
            try:
                mtime = self._path.stat().st_mtime_ns
            except FileNotFoundError:
                mtime = 0
            if mtime != self._mtime_ns:
                try:
                    self._spec = read_spec(self._path) if mtime else ClockSpec()
                    self._mtime_ns = mtime
                except ValueError:
                    pass  # half-written by hand, or hostile: keep the last good spec
            # Marked checked only now, with the spec in place: a thread on the fast path meanwhile would
            # otherwise take the spec from before the file was read (true time, on the first read).
            self._checked_s = now_s
            return self._spec
