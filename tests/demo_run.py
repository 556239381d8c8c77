"""Running ``ridethrough demo`` for the e2e tests and reading back what it left in its store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.conftest import ROOT


def run_demo(data: Path, name: str, *, duration_s: float, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """One ``ridethrough demo --duration S --no-dashboard`` run: its status, output, run record and namespaces left."""
    out = subprocess.run([sys.executable, "-m", "ridethrough", "demo", "--duration", str(duration_s),
                          "--no-dashboard", "--name", name, "--data-dir", str(data), *extra], cwd=ROOT,
                         capture_output=True, text=True, timeout=duration_s + 360, env={**os.environ, "COLUMNS": "160"})
    leftover = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    record = json.loads((data / "demo-run.json").read_text()) if (data / "demo-run.json").exists() else {}
    return {"rc": out.returncode, "stdout": out.stdout, "stderr": out.stderr, "record": record, "data": data,
            "name": name, "leftover": leftover}


def query(story: dict[str, Any], sql: str) -> list[dict[str, Any]]:
    """Rows of a query on the demo's kept store (through the CLI: an embedded store opens in one process)."""
    out = subprocess.run([sys.executable, "-m", "ridethrough", "query", "--store", story["record"]["store"],
                          "--format", "json", sql], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return list(json.loads(out.stdout))


def act(story: dict[str, Any], key: str) -> dict[str, Any]:
    """The run record of one act."""
    return next(a for a in story["record"]["acts"] if a["key"] == key)


def tail(story: dict[str, Any]) -> str:
    """The end of the demo's output, for assertion messages."""
    return story["stdout"][-4000:] + "\n--- stderr ---\n" + story["stderr"][-3000:]


def steps_reported(story: dict[str, Any], job: str = "demo-train") -> set[int]:
    """Every step some rank of ``job`` reported."""
    rows = query(story, "SELECT toInt64(LogAttributes['job.step']) AS step FROM otel_logs "
                        "WHERE LogAttributes['event.name'] = 'job.step' "
                        f"AND LogAttributes['job.id'] = '{job}'")
    return {r["step"] for r in rows}
