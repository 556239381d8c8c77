"""The agent's ``job.migrate`` and ``job.status``: over real control sockets (each answering as a
launcher does), then against a real job started by ``ridethrough run``."""

from __future__ import annotations

import json
import re
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ridethrough.actuators.commands import BadArgs, CommandRegistry, Outcome
from ridethrough.actuators.job_commands import register_job_commands
from ridethrough.actuators.shim.control_socket import Server, socket_path

Handle = Callable[[dict[str, Any]], dict[str, Any]]


@pytest.fixture
def run_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # a Unix socket path must stay short
    yield path
    shutil.rmtree(path, ignore_errors=True)


class FakeJob:
    """A launcher's answers for a job of 2 nodes x 2 ranks, 1 spare per node, seen from node 1."""

    def __init__(self) -> None:
        self.asked: list[dict[str, Any]] = []
        self.ranks: dict[str, dict[str, Any]] = {
            str(r): {"node": r // 2, "pid": 100 + r, "spare": "", "done": False} for r in range(4)}
        self.migrate_reply: dict[str, Any] = {"ok": True, "detail": "ranks [3] moved to spares {'3': 'n0s0'}"}

    def __call__(self, doc: dict[str, Any]) -> dict[str, Any]:
        self.asked.append(doc)
        if doc["cmd"] == "status":
            return {"ok": True, "job": "llm7", "nproc_per_node": 2, "spares_per_node": 1, "ranks": self.ranks}
        return self.migrate_reply


def _call(registry: CommandRegistry, name: str, **args: Any) -> Outcome:
    spec, bound = registry.bind(name, args)
    return spec.handler(bound)


def _registry(run_dir: Path) -> CommandRegistry:
    registry = CommandRegistry()
    register_job_commands(registry, run_dir=str(run_dir), timeout_s=30.0)
    return registry


def test_migrate_asks_for_the_rank_on_that_gpu_of_this_node_and_status_checks_it(run_dir: Path) -> None:
    job = FakeJob()
    server = Server(socket_path(run_dir, "llm7", 1), job)
    try:
        registry = _registry(run_dir)
        assert not _call(registry, "job.status", gpu=1).ok  # rank 3 (node 1, GPU 1) is its original process
        outcome = _call(registry, "job.migrate", gpu=1, reason="gpu_failing h1/gpu1")
        assert outcome.ok and outcome.data == {"jobs": 1, "moved": 1}, outcome
        assert job.asked[-1] == {"cmd": "migrate", "ranks": [3], "reason": "gpu_failing h1/gpu1"}
        job.ranks["3"] = {"node": 0, "pid": 300, "spare": "n0s0", "done": False}  # taken by node 0's spare
        status = _call(registry, "job.status", gpu=1)
        assert status.ok and status.data == {"jobs": 1, "left": 0}, status
        assert not _call(registry, "job.status", gpu=-1).ok  # rank 2 on GPU 0 is still there
        retry = _call(registry, "job.migrate", gpu=1, reason="retry")
        assert retry.ok and "already on spares" in retry.detail and retry.data["moved"] == 0
        outcome = _call(registry, "job.migrate", gpu=-1, reason="host h1 failing")
        assert outcome.ok and job.asked[-1]["ranks"] == [2]
    finally:
        server.close()


def test_a_spare_on_this_node_that_took_a_rank_runs_on_its_own_gpu(run_dir: Path) -> None:
    job = FakeJob()
    job.ranks["0"] = {"node": 1, "pid": 400, "spare": "n1s3", "done": False}  # LOCAL_RANK 2 + 3 % 1 = 2
    server = Server(socket_path(run_dir, "llm7", 1), job)
    try:
        registry = _registry(run_dir)
        assert _call(registry, "job.status", gpu=2).ok  # no original process there
        assert _call(registry, "job.migrate", gpu=2, reason="gpu2").ok  # but the GPU fails: its rank moves on
        assert job.asked[-1] == {"cmd": "migrate", "ranks": [0], "reason": "gpu2"}
        _call(registry, "job.migrate", gpu=-1, reason="host")
        assert job.asked[-1]["ranks"] == [0, 2, 3]
    finally:
        server.close()


def test_the_coordinators_refusal_is_the_outcome(run_dir: Path) -> None:
    job = FakeJob()
    job.migrate_reply = {"ok": False, "detail": "no spare ready for ranks [3]"}
    server = Server(socket_path(run_dir, "llm7", 1), job)
    try:
        outcome = _call(_registry(run_dir), "job.migrate", gpu=1, reason="r")
        assert not outcome.ok and "no spare ready for ranks [3]" in outcome.detail
        assert outcome.data == {"jobs": 1, "moved": 0}
    finally:
        server.close()


def test_no_job_no_rank_there_and_a_socket_left_by_a_dead_launcher_are_errors(run_dir: Path) -> None:
    registry = _registry(run_dir)
    for name in ("job.migrate", "job.status"):
        outcome = _call(registry, name, gpu=0)
        assert not outcome.ok and outcome.detail.startswith("no job runs on this node"), outcome
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(socket_path(run_dir, "old", 0)))  # bound, never listening: as a killed launcher leaves it
    stale.close()
    outcome = _call(registry, "job.migrate", gpu=0)
    assert not outcome.ok and "old-node0.sock: socket gone" in outcome.detail, outcome
    job = FakeJob()
    server = Server(socket_path(run_dir, "llm7", 1), job)
    try:
        outcome = _call(registry, "job.migrate", gpu=5)
        assert not outcome.ok and "no job has a rank on GPU 5" in outcome.detail and "socket gone" in outcome.detail
        outcome = _call(registry, "job.migrate", gpu=0)
        assert outcome.ok and "ignored old-node0.sock: socket gone" in outcome.detail  # said, not failed on
        assert outcome.data == {"jobs": 1, "moved": 1}
    finally:
        server.close()


def test_bad_arguments_are_refused_before_any_launcher_is_asked(run_dir: Path) -> None:
    registry = _registry(run_dir)
    with pytest.raises(BadArgs, match="gpu must be a GPU index or -1"):
        registry.bind("job.migrate", {"gpu": -2})
    with pytest.raises(BadArgs, match="missing argument 'gpu'"):
        registry.bind("job.status", {})
    with pytest.raises(BadArgs, match="gpu must be int"):
        registry.bind("job.migrate", {"gpu": "1"})
    with pytest.raises(ValueError, match="run directory"):
        register_job_commands(CommandRegistry(), run_dir="")


@pytest.mark.integration
@pytest.mark.slow
def test_a_real_job_moves_the_rank_on_a_gpu_to_its_spare(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="the torch extra is not installed")
    from tests.test_migrate import start_job

    job = start_job(tmp_path, "train_plain.py", "--epochs", "3", "--step-sleep", "0.15", spares=1)
    try:
        job.wait_spare("n0s0", timeout_s=180)
        registry = _registry(job.run_dir)
        assert not _call(registry, "job.status", gpu=1).ok
        outcome = _call(registry, "job.migrate", gpu=1, reason="gpu_failing node0/gpu1")
        assert outcome.ok and outcome.data == {"jobs": 1, "moved": 1}, outcome
        assert "moved to spares" in outcome.detail
        status = _call(registry, "job.status", gpu=1)
        assert status.ok, status
        assert not _call(registry, "job.status", gpu=0).ok  # rank 0 stays where it was
    finally:
        done = job.finish()
    assert done.code == 0, done.tail()
    assert done.holders(1) == ["rank-1", "spare-n0s0"]
    steps = []
    for name in done.holders(1):  # a spare counts its loop from 0 at the step it continues at
        offset = 0
        for line in (done.logs / f"{name}.log").read_text().splitlines():
            if m := re.search(r"continues at step (\d+)", line):
                offset = int(m[1])
            elif line.startswith("{") and '"loss"' in line:
                steps.append(offset + json.loads(line)["i"])
    assert steps == list(range(3 * 64 // 2 // 4)), steps  # every step once: none lost, none redone
    assert not (job.run_dir / "t-node0.sock").exists()
