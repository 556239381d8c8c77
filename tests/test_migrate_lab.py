"""Migration across lab hosts: ``ridethrough run`` with one launcher per host (network namespaces),
gloo over the fabric, checked against an uninterrupted run of the same job.

* a rank SIGKILLed: a spare on the other host takes it over (reactive), then a proactive move
  through the agent's ``job.migrate`` (`ridethrough.actuators.job_commands`) on the host whose
  GPU is failing: its rank moves to a spare on the other host at a step boundary;
* reactive on a frozen host (SIGSTOP of everything in it): the job's launchers notice its silence
  and a spare on the other host takes its rank.

Every step's loss equals the uninterrupted run's (the job is deterministic), every step is there,
the final models are the same, and the job's first launcher never restarted it.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ridethrough.lab import netns

REASON = netns.unavailable_reason()
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=REASON or "")]
pytest.importorskip("torch", reason="the torch extra (torch==2.13.0) is not installed")

from ridethrough.actuators.commands import CommandRegistry, Outcome  # noqa: E402
from ridethrough.actuators.job_commands import register_job_commands  # noqa: E402
from ridethrough.actuators.shim.control_socket import request, socket_path  # noqa: E402
from ridethrough.lab.fabric import Lab  # noqa: E402
from ridethrough.lab.jobs import LabRun  # noqa: E402
from ridethrough.lab.topology import TopologySpec  # noqa: E402

SCRIPT = Path(__file__).parent / "fixtures" / "train_plain.py"
EPOCHS = 8  # long enough that both moves happen well before the end
STEPS = EPOCHS * 64 // 4 // 2  # the fixture's 64 samples, batch 4, over 2 ranks
# Generous: a busy 2-core machine; a follower silent this long is lost (the frozen host).
EXTRA = ("--rendezvous-timeout", "180", "--heartbeat-timeout", "15")


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    spec = TopologySpec(hosts=2, racks=2, rails=1, spines=1, gpus=2)
    with Lab.up(spec, name=f"tmig{os.getpid() % 100000}", agents=False) as running:
        yield running


@dataclass
class Ran:
    """A finished lab job's logs: per rank, each step's losses (a redone step has several)."""

    logs: Path
    code: int

    def tail(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                         for p in sorted(self.logs.glob("*.log")))

    def steps(self) -> dict[int, dict[int, list[float]]]:
        """rank -> step -> the losses printed for it, by every process that held the rank."""
        out: dict[int, dict[int, list[float]]] = {}
        for path in sorted(self.logs.glob("*.log")):
            if path.stem.startswith("launcher"):
                continue
            offset = 0
            for line in path.read_text(errors="replace").splitlines():
                if m := re.search(r"continues at step (\d+)", line):
                    offset = int(m[1])
                elif line.startswith("{") and '"loss"' in line:
                    rec = json.loads(line)
                    out.setdefault(rec["rank"], {}).setdefault(offset + rec["i"], []).append(rec["loss"])
        return out

    def digests(self) -> set[str]:
        return {json.loads(x)["digest"] for p in self.logs.glob("*.log") for x in p.read_text().splitlines()
                if x.startswith("{") and '"digest"' in x}

    def launcher(self, host: str) -> str:
        return (self.logs / f"launcher-{host}.log").read_text(errors="replace")


def _start(lab: Lab, tmp: Path, name: str, spares: list[int]) -> LabRun:
    job = LabRun(lab, ["h0", "h1"], ["python", str(SCRIPT), "--epochs", str(EPOCHS), "--step-sleep", "0.3"],
                 job_id=name, log_dir=tmp / name, spares=spares, extra=EXTRA,
                 master_port=29700 + sum(map(ord, name)) % 200)
    job.start()
    return job


def _wait(job: LabRun, pattern: str, name: str, timeout_s: float = 300.0) -> None:
    path, deadline = job.log_dir / f"{name}.log", time.monotonic() + timeout_s
    while not (path.exists() and re.search(pattern, path.read_text(errors="replace"))):
        assert job.procs[0].poll() is None, f"the job ended before {name} printed {pattern!r}"
        assert time.monotonic() < deadline, f"{name} did not print {pattern!r} within {timeout_s} s"
        time.sleep(0.2)


def _ask(job: LabRun, doc: dict[str, Any]) -> dict[str, Any]:
    return request(socket_path(job.run_dir("h0"), job.job_id, 0), doc, timeout_s=60)


def _wait_spares(job: LabRun, n: int, timeout_s: float = 300.0) -> None:
    deadline, status = time.monotonic() + timeout_s, {}
    while True:
        try:  # the launcher may not serve its socket yet
            status = _ask(job, {"cmd": "status"})
            if sum(s["state"] == "ready" for s in status["spares"].values()) >= n:
                return
        except (FileNotFoundError, ConnectionRefusedError):
            assert job.procs[0].poll() is None, f"the job ended before {n} spares were ready"
        assert time.monotonic() < deadline, f"{n} spares not ready within {timeout_s} s: {status}"
        time.sleep(0.3)


def _finish(job: LabRun) -> Ran:
    try:
        code = job.wait(0, timeout_s=600)
    finally:
        job.stop()
    return Ran(job.log_dir, code)


def _same_as(done: Ran, base: Ran) -> None:
    """Every step of every rank, with the uninterrupted run's loss (a redone step: the same each time)."""
    want, got = base.steps(), done.steps()
    assert sorted(want) == [0, 1] and all(sorted(want[r]) == list(range(STEPS)) for r in want), base.tail()
    for rank, steps in want.items():
        assert sorted(got.get(rank, {})) == list(range(STEPS)), f"rank {rank}: steps missing\n{done.tail()}"
        for step, [loss] in steps.items():
            assert set(got[rank][step]) == {loss}, f"rank {rank} step {step}: {got[rank][step]} != {loss}"
    assert len(base.digests()) == 1 and done.digests() == base.digests(), done.tail()
    assert "restarting every rank" not in done.launcher("h0")  # never restarted: rode through


@pytest.fixture(scope="module")
def baseline(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Ran:
    done = _finish(_start(lab, tmp_path_factory.mktemp("base"), "base", [0, 0]))
    assert done.code == 0, done.tail()
    return done


def _agent_call(job: LabRun, host: str, name: str, **args: Any) -> Outcome:
    registry = CommandRegistry()
    register_job_commands(registry, run_dir=str(job.run_dir(host)), timeout_s=300)
    spec, bound = registry.bind(name, args)
    return spec.handler(bound)


def _holder(job: LabRun, rank: int) -> dict[str, Any]:
    return dict(_ask(job, {"cmd": "status"})["ranks"][str(rank)])


def test_a_killed_rank_then_a_proactive_move_across_hosts(lab: Lab, tmp_path: Path, baseline: Ran) -> None:
    job = _start(lab, tmp_path, "ride", [1, 1])
    try:
        _wait_spares(job, 2)
        _wait(job, r'"i": 3,', "rank-1")
        os.kill(int(_holder(job, 0)["pid"]), 9)  # rank 0 runs in h0 (a network namespace: same pids)
        deadline = time.monotonic() + 300
        while _holder(job, 0)["spare"] != "n1s0":  # the spare on the other host took it
            assert time.monotonic() < deadline and job.procs[0].poll() is None, _ask(job, {"cmd": "status"})
            time.sleep(0.2)
        assert not _agent_call(job, "h1", "job.status", gpu=0).ok  # rank 1 still runs on h1's GPU 0
        moved = _agent_call(job, "h1", "job.migrate", gpu=0, reason="gpu_failing h1/gpu0")  # as the controller asks
        assert moved.ok and moved.data == {"jobs": 1, "moved": 1}, moved
        assert _agent_call(job, "h1", "job.status", gpu=0).ok
        assert _holder(job, 1)["spare"] == "n0s0"  # the spare on the other host
        done = _finish(job)
    finally:
        job.stop()
    assert done.code == 0, done.tail()
    _same_as(done, baseline)
    assert re.search(r"recovered \{'ranks': \[0\], 'spares': \{'0': 'n1s0'\}", done.launcher("h0")), done.tail()
    assert "handed over" in (done.logs / "rank-1.log").read_text()


def test_a_frozen_host_is_replaced_by_a_spare_on_another(lab: Lab, tmp_path: Path, baseline: Ran) -> None:
    job = _start(lab, tmp_path, "freeze", [1, 0])
    try:
        _wait(job, r'"i": 3,', "rank-1")
        _wait_spares(job, 1)
        lab.freeze_host("h1")
        try:
            code = job.wait(0, timeout_s=600)
        finally:
            lab.thaw_host("h1")
    finally:
        job.stop()
    done = Ran(job.log_dir, code)
    assert done.code == 0, done.tail()
    _same_as(done, baseline)
    assert re.search(r"node_lost \{'node': 1, 'ranks': \[1\]\}", done.launcher("h0")), done.tail()
    assert re.search(r"recovered \{'ranks': \[1\], 'spares': \{'1': 'n0s0'\}", done.launcher("h0")), done.tail()
