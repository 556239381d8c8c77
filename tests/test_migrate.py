"""Migration to hot spares: the coordinator's decisions on a store (fast), then real jobs across local
processes (integration): a proactive move and a killed rank, each checked against an uninterrupted run.

The jobs here run as local processes on one machine (``--nproc-per-node 2``), not in the lab's host
namespaces: the protocol is the same (every rank and spare meets the others only through the job
store and gloo over TCP), and bench/migrate.py runs across lab hosts when it can.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch extra (torch==2.13.0) is not installed")
import torch.distributed as dist  # noqa: E402

from ridethrough.actuators.shim import keys  # noqa: E402
from ridethrough.actuators.shim.control_socket import request, socket_path  # noqa: E402
from ridethrough.actuators.shim.coordinator import Coordinator, Timeouts  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"


# -- running a job (also used by test_shim and test_snapshot_resume) -----------------------------

@dataclass
class FinishedJob:
    """A job that ended: its exit status, its processes' logs and the launcher's own output."""

    code: int
    logs: Path
    output: str

    def tail(self) -> str:
        """The launcher's last lines and every log's last lines, for an assertion message."""
        parts = [self.output[-3000:]]
        parts += [f"== {p.name}\n{p.read_text()[-1500:]}" for p in sorted(self.logs.glob("*.log"))]
        return "\n".join(parts)

    def records(self, name: str) -> list[dict[str, Any]]:
        """The JSON lines a process printed."""
        path = self.logs / f"{name}.log"
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(line) for line in lines if line.startswith("{")]

    def holders(self, rank: int) -> list[str]:
        """The logs of every process that held ``rank``, in order: the original, then spares that took it."""
        spares = sorted(self.logs.glob("spare-*.log"), key=lambda p: int(p.stem.rsplit("s", 1)[1]))
        return [f"rank-{rank}"] + [p.stem for p in spares if f"takes rank {rank} " in p.read_text()]

    def losses(self, rank: int) -> list[float]:
        """Rank ``rank``'s loss at each step, across every process that held it."""
        return [r["loss"] for name in self.holders(rank) for r in self.records(name) if "loss" in r]

    def digests(self) -> set[str]:
        """The final model digests printed by every process that completed."""
        names = [p.stem for p in self.logs.glob("*.log")]
        return {r["digest"] for n in names for r in self.records(n) if r.get("done")}


@dataclass
class RunningJob:
    """A job started by `start_job`."""

    proc: subprocess.Popen[str]
    logs: Path
    run_dir: Path
    job: str
    started: float = field(default_factory=time.monotonic)

    def wait_for(self, pattern: str, name: str, timeout_s: float = 180.0) -> None:
        """Block until ``name``'s log matches ``pattern`` (AssertionError if the job ends or time runs out)."""
        path, deadline = self.logs / f"{name}.log", time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if path.exists() and re.search(pattern, path.read_text()):
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"the job ended ({self.proc.returncode}) before {name} printed {pattern!r}")
            time.sleep(0.1)
        raise AssertionError(f"{name} did not print {pattern!r} within {timeout_s} s")

    def pid_of(self, name: str) -> int:
        """The pid a process printed in its first JSON line."""
        return int(next(r["pid"] for r in FinishedJob(0, self.logs, "").records(name) if "pid" in r))

    def wait_spare(self, spare: str, timeout_s: float = 120.0) -> None:
        """Block until ``spare`` is parked and known to the coordinator."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:  # the launcher may not serve its socket yet
                if self.ask({"cmd": "status"}, timeout_s=30)["spares"].get(spare, {}).get("state") == "ready":
                    return
            except (FileNotFoundError, ConnectionRefusedError):
                assert self.proc.poll() is None, f"the job ended ({self.proc.returncode}) before spare {spare}"
            assert time.monotonic() < deadline, f"spare {spare} not ready within {timeout_s} s"
            time.sleep(0.2)

    def ask(self, doc: dict[str, Any], timeout_s: float = 240.0) -> dict[str, Any]:
        """A control request to the job's node-0 socket."""
        return request(socket_path(self.run_dir, self.job, 0), doc, timeout_s=timeout_s)

    def finish(self, timeout_s: float = 240.0) -> FinishedJob:
        """Wait for the launcher to exit (killing it at the timeout)."""
        try:
            out, _ = self.proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGTERM)
            out, _ = self.proc.communicate(timeout=30)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        return FinishedJob(self.proc.returncode, self.logs, out)


def start_job(tmp: Path, script: str, *args: str, nproc: int = 2, spares: int = 0, job: str = "t",
              extra: tuple[str, ...] = ()) -> RunningJob:
    """Start ``ridethrough run`` on a fixture script; logs under ``tmp/logs``."""
    logs = tmp / "logs"
    run_dir = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # a Unix socket path must stay short
    argv = [sys.executable, "-m", "ridethrough.actuators.run_cli", "run", "--nproc-per-node", str(nproc),
            "--spares", str(spares), "--job-id", job, "--log-dir", str(logs), "--run-dir", str(run_dir),
            "--rendezvous-timeout", "90", *extra, "--", "python", str(FIXTURES / script), *args]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return RunningJob(proc, logs, run_dir, job)


# -- the coordinator's decisions (on an in-memory store) ------------------------------------------

def _coordinator(world: int = 2, **kw: Any) -> tuple[Coordinator, Any]:
    store = dist.HashStore()
    c = Coordinator(store, world, timeouts=Timeouts(arrive_s=5, reports_s=5, form_s=5), **kw)
    for rank in range(world):
        c.placed(rank, node=0, pid=100 + rank)
    return c, store


def _spare(store: Any, spare_id: str, pid: int, node: int = 0) -> None:
    keys.append(store, keys.SPARE_SEQ, keys.spare, {"id": spare_id, "node": node, "pid": pid})


def test_a_migration_needs_a_spare() -> None:
    c, _ = _coordinator()
    replies: list[dict[str, Any]] = []
    assert c.migrate([1], reason="test", reply=replies.append)["ok"]
    c.tick()
    assert replies == [{"ok": False, "detail": "no spare ready for ranks [1]", "generation": 0, "seconds": 0.0}]
    assert not c.migrate([7], reason="test")["ok"]


def test_a_migration_goes_when_every_rank_and_spare_is_there_and_ends_when_the_generation_forms() -> None:
    c, store = _coordinator()
    _spare(store, "a", 200)
    replies: list[dict[str, Any]] = []
    c.migrate([1], reason="gpu1 failing", reply=replies.append)
    c.tick()
    cmd = keys.get(store, keys.ctl(0))
    assert cmd["kind"] == "migrate" and cmd["ranks"] == {"1": "a"}
    assert keys.get(store, keys.assign("a")) == {"rank": 1, "gen": 1, "tag": "m1", "seq": 1}
    store.add(keys.ctl(0, "arrived"), 2)
    c.tick()
    assert not store.check([keys.ctl(0, "decision")])  # the spare is not at its first batch yet
    keys.put(store, keys.adopted("a"), {"rank": 1})
    c.tick()
    assert keys.get(store, keys.ctl(0, "decision")) == "go"
    keys.put(store, keys.ctl(0, "left/1"), {"ok": True})
    c.exited(node=0, pid=101, code=0)  # the leaving rank's exit is the plan, not a completion
    assert not c.slots[1].done
    store.add(keys.ready(1), 2)
    c.tick()
    assert replies[0]["ok"] and c.generation == 1 and c.slots[1].spare == "a"
    assert keys.get(store, keys.GEN) == 1


def test_a_spare_that_dies_after_the_hand_over_is_replaced_from_a_peer() -> None:
    c, store = _coordinator(3)
    _spare(store, "a", 200)
    _spare(store, "b", 201)
    c.migrate([2], reason="test")
    c.tick()
    store.add(keys.ctl(0, "arrived"), 3)
    keys.put(store, keys.adopted("a"), {})
    c.tick()
    keys.put(store, keys.ctl(0, "left/2"), {"ok": True})
    c.tick()
    c.exited(node=0, pid=200, code=-9)
    plan = keys.get(store, keys.recover(1))
    assert plan == {"kind": "replace", "gen": 2, "ranks": {"2": "b"}, "donor": 0, "tag": "m2", "step": -1}
    assert keys.get(store, keys.assign("b"))["gen"] == 2
    store.add(keys.ready(2), 3)
    c.tick()
    assert c.generation == 2 and c.slots[2].spare == "b"
    assert [e["event"] for e in c.events if "spare" in e["event"]][-2:] == ["spare_exited", "migration_spare_replaced"]


def test_a_spare_that_dies_before_the_hand_over_changes_nothing() -> None:
    c, store = _coordinator()
    _spare(store, "a", 200)
    replies: list[dict[str, Any]] = []
    c.migrate([0], reason="test", reply=replies.append)
    c.tick()
    c.exited(node=0, pid=200, code=1)
    c.tick()
    assert keys.get(store, keys.ctl(0, "decision")) == "abort"
    assert not replies[0]["ok"] and "nothing changed" in replies[0]["detail"]
    assert c.generation == 0 and c.slots[0].pid == 100


def test_a_spare_that_dies_before_the_hand_over_is_replaced_by_another_ready_one() -> None:
    c, store = _coordinator()
    _spare(store, "a", 200)
    _spare(store, "b", 201)
    replies: list[dict[str, Any]] = []
    c.migrate([0], reason="test", reply=replies.append)
    c.tick()
    c.exited(node=0, pid=200, code=-9)
    c.tick()  # the first try ends (nothing changed), the second starts with spare b
    assert keys.get(store, keys.ctl(0, "decision")) == "abort" and not replies
    c.tick()
    cmd = keys.get(store, keys.ctl(1))
    assert cmd["kind"] == "migrate" and cmd["ranks"] == {"0": "b"}
    store.add(keys.ctl(1, "arrived"), 2)
    keys.put(store, keys.adopted("b"), {})
    c.tick()
    keys.put(store, keys.ctl(1, "left/0"), {"ok": True})
    store.add(keys.ready(cmd["gen"]), 2)
    c.tick()
    assert replies[0]["ok"] and "spare a died before the hand-over" in replies[0]["detail"], replies
    assert c.slots[0].spare == "b" and c.generation == cmd["gen"]
    assert "migration_retried" in [e["event"] for e in c.events]


def test_a_second_spare_death_before_the_hand_over_is_the_answer_when_none_is_left() -> None:
    c, store = _coordinator()
    _spare(store, "a", 200)
    _spare(store, "b", 201)
    replies: list[dict[str, Any]] = []
    c.migrate([0], reason="test", reply=replies.append)
    c.tick()
    c.exited(node=0, pid=200, code=-9)
    c.tick()
    c.tick()
    c.exited(node=0, pid=201, code=-9)
    c.tick()
    assert len(replies) == 1 and not replies[0]["ok"], replies
    assert "spare b died before the hand-over; nothing changed" in replies[0]["detail"]
    assert "spare a died" in replies[0]["detail"] and c.slots[0].pid == 100 and c.generation == 0


def _report(store: Any, gen: int, rank: int, step: int, phase: str) -> None:
    keys.put(store, keys.fail(gen, rank), {"step": step, "phase": phase, "reason": "closed"})
    store.add(keys.fail_count(gen), 1)


def test_a_lost_rank_is_recovered_from_a_peer_that_had_not_updated() -> None:
    c, store = _coordinator(3)
    _spare(store, "a", 200)
    c.tick()
    c.exited(node=0, pid=101, code=-9)
    assert keys.get(store, keys.lost(0)) == [1]  # stalled collectives give up at once
    _report(store, 0, 0, 7, "post")
    c.tick()
    assert not store.check([keys.recover(0)])  # rank 2 has not reported yet
    _report(store, 0, 2, 7, "pre")
    c.tick()
    plan = keys.get(store, keys.recover(0))
    assert plan == {"kind": "replace", "gen": 1, "ranks": {"1": "a"}, "donor": 2, "tag": "r1", "step": 7}
    store.add(keys.ready(1), 3)
    c.tick()
    assert c.generation == 1 and c.slots[1].spare == "a"
    assert c.events[-1]["event"] == "recovered" and c.events[-1]["step"] == 7


def test_a_spare_is_given_the_lost_rank_at_once_and_the_plan_follows_the_reports() -> None:
    # The spare builds the script's objects while the other ranks are still on their way to the failure.
    c, store = _coordinator(3)
    _spare(store, "a", 200)
    c.tick()
    c.exited(node=0, pid=101, code=-9)
    c.tick()
    assert keys.get(store, keys.assign("a")) == {"rank": 1, "gen": 1, "tag": "r1", "seq": 0}
    assert not store.check([keys.recover(0)]) and c.busy
    _report(store, 0, 0, 7, "pre")
    _report(store, 0, 2, 7, "pre")
    c.tick()
    assert keys.get(store, keys.recover(0)) == {"kind": "replace", "gen": 1, "ranks": {"1": "a"}, "donor": 0,
                                                "tag": "r1", "step": 7}
    assert store.check([keys.wake(0)])  # a member waiting in a roll call of generation 0 would re-check
    store.add(keys.ready(1), 3)
    c.tick()
    assert c.generation == 1 and c.slots[1].spare == "a" and not c.busy


def test_a_spare_that_dies_before_the_plan_is_replaced_under_its_own_transfer_tag() -> None:
    c, store = _coordinator(3)
    _spare(store, "a", 200)
    _spare(store, "b", 201)
    c.tick()
    c.exited(node=0, pid=101, code=-9)
    c.tick()
    first = keys.get(store, keys.assign("a"))
    c.exited(node=0, pid=200, code=-9)  # it may have begun receiving under the plan's tag
    c.tick()
    assert keys.get(store, keys.assign("b")) == {**first, "tag": "r1-b"}
    _report(store, 0, 0, 3, "pre")
    _report(store, 0, 2, 3, "pre")
    c.tick()
    plan = keys.get(store, keys.recover(0))
    assert plan["ranks"] == {"1": "b"} and plan["tags"] == {"1": "r1-b"} and plan["gen"] == 1
    store.add(keys.ready(1), 3)
    c.tick()
    assert c.slots[1].spare == "b"


def test_with_too_few_spares_none_is_assigned_and_the_job_falls_back() -> None:
    c, store = _coordinator(3)
    _spare(store, "a", 200)
    c.tick()
    c.lose({0, 1})
    c.tick()
    assert not store.check([keys.assign("a")]) and c.spares["a"].state == "ready"
    _report(store, 0, 2, 3, "pre")
    c.tick()
    assert keys.get(store, keys.recover(0))["kind"] == "abort" and "no spare ready for ranks [0, 1]" in c.failed


@pytest.mark.parametrize(("reports", "why"), [
    ([(0, 5, "pre"), (2, 6, "pre")], "the ranks stopped at different steps [5, 6]"),
    ([(0, 5, "post"), (2, 5, "post")], "every surviving rank had already updated its model"),
])
def test_without_a_consistent_peer_the_job_falls_back(reports: list[tuple[int, int, str]], why: str) -> None:
    c, store = _coordinator(3)
    _spare(store, "a", 200)
    c.tick()
    c.exited(node=0, pid=101, code=-9)
    for rank, step, phase in reports:
        _report(store, 0, rank, step, phase)
    c.tick()
    assert keys.get(store, keys.recover(0))["kind"] == "abort"
    assert why in c.failed


def test_no_spare_falls_back_to_the_snapshot_restart_when_there_is_one() -> None:
    asked: list[str] = []
    c, store = _coordinator(restart=lambda why: asked.append(why) or True)
    c.exited(node=0, pid=100, code=-9)
    _report(store, 0, 1, 3, "pre")
    c.tick()
    assert asked == ["cannot recover ranks [0]: no spare ready for ranks [0]"]
    assert not c.failed and c.events[-1]["event"] == "restarted_from_snapshot"


def test_a_replacement_that_runs_past_the_end_is_told_the_job_ended() -> None:
    c, store = _coordinator()
    c.exited(node=0, pid=100, code=0)
    assert c.slots[0].done and store.check([keys.END])
    _report(store, 0, 1, 12, "pre")  # its peers are gone: its next collective failed
    c.tick()
    assert keys.get(store, keys.recover(0))["kind"] == "end"


# -- real jobs --------------------------------------------------------------------------------

def _finish(job: RunningJob) -> FinishedJob:
    done = job.finish()
    assert done.code == 0, done.tail()
    return done


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> FinishedJob:
    """train_plain.py, two ranks, uninterrupted."""
    return _finish(start_job(tmp_path_factory.mktemp("base"), "train_plain.py", "--epochs", "2"))


def _same_run(done: FinishedJob, base: FinishedJob, ranks: int = 2) -> None:
    for rank in range(ranks):
        steps = len(base.losses(rank))
        assert done.losses(rank)[:steps] == base.losses(rank), f"rank {rank}\n{done.tail()}"
    assert done.digests() == base.digests() and len(base.digests()) == 1


@pytest.mark.integration
@pytest.mark.slow
def test_proactive_migration_continues_at_the_same_step(tmp_path: Path, baseline: FinishedJob) -> None:
    job = start_job(tmp_path, "train_plain.py", "--epochs", "2", "--step-sleep", "0.15", spares=1)
    job.wait_spare("n0s0")  # a loaded machine may still be warming the spare up
    job.wait_for(r'"i": 3,', "rank-1")
    reply = job.ask({"cmd": "migrate", "ranks": [1], "reason": "gpu1 predicted to fail"})
    assert reply["ok"], reply
    done = _finish(job)
    _same_run(done, baseline)  # every step once: none lost, none redone
    assert "handed over" in (done.logs / "rank-1.log").read_text()
    assert done.holders(1) == ["rank-1", "spare-n0s0"]


@pytest.mark.integration
@pytest.mark.slow
def test_a_killed_rank_is_replaced_and_the_step_redone(tmp_path: Path, baseline: FinishedJob) -> None:
    job = start_job(tmp_path, "train_plain.py", "--epochs", "2", "--step-sleep", "0.15", spares=1)
    job.wait_spare("n0s0")
    job.wait_for(r'"i": 3,', "rank-1")
    os.kill(job.pid_of("rank-1"), signal.SIGKILL)
    done = _finish(job)
    _same_run(done, baseline)
    assert re.search(r"recovered \{'ranks': \[1\], 'spares': \{'1': 'n0s0'\}, 'donor': 0", done.output)
    assert "formed generation 1" in (done.logs / "rank-0.log").read_text()


@pytest.mark.integration
@pytest.mark.slow
def test_a_spare_that_dies_during_a_migration_leaves_the_job_as_it_was(tmp_path: Path,
                                                                       baseline: FinishedJob) -> None:
    # a longer run (its first two epochs are the baseline's): a new spare needs time to start
    job = start_job(tmp_path, "train_plain.py", "--epochs", "12", "--step-sleep", "0.3", spares=1)
    job.wait_for(r'"i": 2,', "rank-0")
    first: list[dict[str, Any]] = []
    asking = threading.Thread(target=lambda: first.append(job.ask({"cmd": "migrate", "ranks": [0]})))
    asking.start()
    job.wait_for("takes rank 0", "spare-n0s0")
    os.kill(job.ask({"cmd": "status"})["spares"]["n0s0"]["pid"], signal.SIGKILL)
    asking.join(240)
    assert not first[0]["ok"] and ("n0s0" in first[0]["detail"] or "could not hand over" in first[0]["detail"])
    job.wait_spare("n0s1")  # the launcher started another spare
    second = job.ask({"cmd": "migrate", "ranks": [0], "reason": "retry"})
    assert second["ok"], second
    done = _finish(job)
    for rank in (0, 1):
        assert done.losses(rank)[:16] == baseline.losses(rank), done.tail()
    assert len(done.digests()) == 1
    assert done.holders(0) == ["rank-0", "spare-n0s0", "spare-n0s1"] and not done.records("spare-n0s0")


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize(("script", "args", "victim"), [
    ("train_trainer.py", ("--steps", "14"), "migrate-1"),
    ("train_two_opt.py", ("--epochs", "1"), "kill-0"),
])
def test_other_script_styles_ride_through(tmp_path: Path, script: str, args: tuple[str, ...], victim: str) -> None:
    base = _finish(start_job(tmp_path / "base", script, *args))
    job = start_job(tmp_path / "run", script, *args, "--step-sleep", "0.15", spares=1)
    how, rank = victim.split("-")
    job.wait_for(r'"i": 3,', f"rank-{rank}")
    if how == "kill":
        os.kill(job.pid_of(f"rank-{rank}"), signal.SIGKILL)
    else:
        job.wait_spare("n0s0")  # a loaded machine may still be warming the spare up
        reply = job.ask({"cmd": "migrate", "ranks": [int(rank)]})
        assert reply["ok"], reply
    _same_run(_finish(job), base)


# -- the actuator plugin and the agent's commands ---------------------------------------------

class _Jobs:
    """A `JobControl` that records what it was asked (and the trace it was asked in)."""

    def __init__(self, *, left: bool = False) -> None:
        self.calls: list[tuple[str, str, int, str | None]] = []
        self.left = left

    def migrate(self, *, node: str, gpu: int, reason: str, key: str, timeout_s: float) -> Any:
        from ridethrough.actuators.contract import Result
        from ridethrough.actuators.tracing import current_traceparent

        self.calls.append(("migrate", node, gpu, current_traceparent()))
        return Result.success(f"{node}: job t: ranks [{gpu}] moved")

    def remaining(self, *, node: str, gpu: int, key: str, timeout_s: float) -> Any:
        from ridethrough.actuators.contract import Result

        self.calls.append(("remaining", node, gpu, None))
        return Result.failure("rank 1 still there") if self.left else Result.success("no original rank left there")


def _incident(kind: str, entity_type: str, entity: str) -> Any:
    from ridethrough.detectors.contract import Severity
    from ridethrough.detectors.incidents import Incident, State, new_trace_id

    now = time.time_ns()
    return Incident(f"inc-{entity}-{now}", f"{kind}:{entity_type}:{entity}", kind, entity_type, entity, "c1", "gpu",
                    Severity.ERROR, State.OPEN, now - 10**10, now, 0, now, 1, 0, "", "{}", new_trace_id(), 1)


def test_the_plugin_plans_for_failing_gpus_and_hosts_only() -> None:
    from ridethrough.actuators.contract import FleetState
    from ridethrough.actuators.migrate_plugin import MigratePlugin
    from ridethrough.actuators.plugins import load_plugins

    plugin = MigratePlugin(_Jobs())
    fleet = FleetState(taken_at_ns=0)
    gpu = plugin.plan(_incident("gpu_failing", "gpu", "h2/gpu3"), fleet)
    assert gpu is not None and gpu.params["node"] == "h2" and gpu.params["gpu"] == "3" and not gpu.drains_hosts
    host = plugin.plan(_incident("agent_silent", "host", "h5"), fleet)
    assert host is not None and host.params["gpu"] == "-1" and host.drains_hosts == frozenset({"h5"})
    assert plugin.plan(_incident("link_down", "link", "h2-leaf0r0"), fleet) is None
    assert plugin.plan(_incident("gpu_failing", "gpu", "h2/nvme0"), fleet) is None
    # honours the contract (validated alone: the installed entry point is another instance of it)
    assert [p.name for p in load_plugins([plugin], entry_points=lambda group: [])] == ["migrate"]
    assert "migrate" in [p.name for p in load_plugins()]  # and the package registers it


def test_the_runner_applies_and_verifies_a_migration_in_the_incidents_trace(tmp_path: Path) -> None:
    from ridethrough.actuators.contract import FleetState
    from ridethrough.actuators.migrate_plugin import MigratePlugin
    from ridethrough.actuators.policy import RunnerPolicy
    from ridethrough.actuators.runner import Runner
    from ridethrough.exporters.store import Store

    store = Store(f"chdb://{tmp_path / 'store'}")
    store.init_schema()
    try:
        jobs = _Jobs()
        policy = RunnerPolicy(dry_run=False, hysteresis_s=0.0)
        runner = Runner(store=store, plugins=[MigratePlugin(jobs)], policy=policy,
                        fleet=lambda: FleetState(taken_at_ns=time.time_ns()))
        inc = _incident("gpu_failing", "gpu", "h2/gpu1")
        [decision] = runner.consider([inc])
        assert runner.wait_idle(20)
        assert [c[:3] for c in jobs.calls] == [("migrate", "h2", 1), ("remaining", "h2", 1)]
        parent = jobs.calls[0][3]
        assert parent is not None and parent.split("-")[1] == inc.trace_id  # the agent's span joins this trace
        _, rows = store.query("SELECT argMax(Status, Version) FROM actions WHERE ActionId = {a:String}",
                              parameters={"a": decision.action_id})
        assert rows[0][0] == "succeeded"
        _, spans = store.query("SELECT SpanName, SpanAttributes['step.name'] FROM otel_traces "
                               "WHERE TraceId = {t:String} ORDER BY Timestamp", parameters={"t": inc.trace_id})
        assert ("action.step", "migrate ranks") in [tuple(s) for s in spans]
    finally:
        store.close()


def test_a_rank_that_dies_after_the_others_completed_is_not_migrated_but_reported() -> None:
    c, store = _coordinator()
    c.exited(node=0, pid=101, code=0)
    c.exited(node=0, pid=100, code=-9)  # e.g. killed while saving its final checkpoint
    assert c.op is None and not store.check([keys.lost(0)])
    assert c.failed_at_end == ["rank 0 exited with -9 after other ranks completed"]


def test_a_rank_lost_while_its_peers_complete_is_reported_not_recovered() -> None:
    c, store = _coordinator()
    _spare(store, "a", 200)
    c.exited(node=0, pid=100, code=-9)  # killed after its last step, before its peer exited
    c.exited(node=0, pid=101, code=0)
    c.tick()
    assert c.op is None and not c.failed and not store.check([keys.assign("a")])
    assert c.failed_at_end == ["rank 0 was lost while its peers completed"] and all(s.done for s in c.slots.values())


def test_ranks_that_neither_report_nor_exit_are_taken_as_hung_and_replaced() -> None:
    now = [0.0]
    c, store = _coordinator(3, clock=lambda: now[0])
    _spare(store, "a", 200)
    _report(store, 0, 0, 4, "pre")
    _report(store, 0, 2, 4, "pre")
    c.tick()
    assert c.op is None  # a peer may still be on its way to the same failure
    now[0] = 6.0
    c.tick()
    assert keys.get(store, keys.lost(0)) == [1]
    assert [e["event"] for e in c.events][-3:] == ["ranks_hung", "recovery_spares_assigned", "recovery_planned"]
    c.tick()
    assert keys.get(store, keys.recover(0))["ranks"] == {"1": "a"}


def test_requests_still_waiting_when_the_job_ends_get_an_answer() -> None:
    c, _ = _coordinator()
    replies: list[dict[str, Any]] = []
    c.migrate([0], reason="late", reply=replies.append)
    c.close("the job ended (exit status 0) before this request was done")
    assert replies == [{"ok": False, "error": "the job ended (exit status 0) before this request was done"}]
