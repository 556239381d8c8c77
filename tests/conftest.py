"""Shared fixtures: real ridethrough processes on port 0, and polling with a deadline."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
T = TypeVar("T")


def wait_for(predicate: Callable[[], T], *, timeout_s: float = 30.0, interval_s: float = 0.1,
             what: str = "condition") -> T:
    """Poll ``predicate`` until it returns something truthy; fail the test at the deadline."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what} (last: {last!r})")


def store_sql(store_http: str, sql: str) -> list[list[Any]]:
    """Rows of ``sql`` on a lab server's read-only ClickHouse HTTP endpoint."""
    url = f"{store_http}/?query={urllib.parse.quote(sql + ' FORMAT JSONCompact')}"
    with urllib.request.urlopen(url, timeout=30) as r:
        return list(json.loads(r.read())["data"])


class Proc:
    """A ridethrough command running in the background, with its output kept in a file."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.popen = subprocess.Popen([sys.executable, "-m", "ridethrough", *args], stdout=self._log,
                                      stderr=subprocess.STDOUT, env=full_env, cwd=ROOT)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(10)

    def stop(self, timeout_s: float = 20.0) -> int:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        self._log.close()
        return self.popen.returncode


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., Proc]]:
    """Start ``ridethrough ARGS...`` processes; all are stopped when the test ends."""
    procs: list[Proc] = []

    def start(*args: str, env: dict[str, str] | None = None, name: str = "proc") -> Proc:
        proc = Proc(list(args), tmp_path / f"{name}-{len(procs)}.log", env)
        procs.append(proc)
        return proc

    yield start
    for p in procs:
        p.stop()


def read_ready(path: Path, proc: Proc, *, timeout_s: float = 60.0) -> dict[str, str]:
    """The addresses a server wrote to its ready file (fails early if it died)."""
    def ready() -> dict[str, str] | None:
        if not proc.alive():
            raise AssertionError(f"process exited early:\n{proc.output()}")
        return json.loads(path.read_text()) if path.exists() else None
    return wait_for(ready, timeout_s=timeout_s, what=f"ready file {path}")


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--update-golden``: rewrite the golden cases' expected findings (`tests/test_detector_golden.py`)."""
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="Rewrite tests/fixtures/golden/detectors/*.json expected findings from this run.")
