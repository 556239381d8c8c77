"""``ridethrough run``: its options, the environment contract every rank gets, and how it ends."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ridethrough.actuators.launcher import LaunchConfig, argv
from ridethrough.actuators.shim.config import ShimConfig, torchrun_env
from ridethrough.actuators.shim.control_socket import request, socket_path

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize(("kw", "error"), [
    ({"command": ()}, "nothing to run: give the command after --"),
    ({"nproc_per_node": 0}, "--nnodes and --nproc-per-node must be at least 1"),
    ({"node_rank": 2, "nnodes": 2, "master_port": 29500}, "--node-rank 2 is outside 0..1"),
    ({"nnodes": 2}, "a job on several nodes needs --master-port"),
    ({"snapshot_every": 5}, "--snapshot-every needs --snapshot-dir"),
])
def test_bad_options_are_refused_with_the_reason(kw: dict[str, object], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        LaunchConfig(**{"command": ("python", "train.py"), **kw})  # type: ignore[arg-type]


def test_python_and_scripts_run_under_this_interpreter_and_anything_else_as_given() -> None:
    assert argv(("python", "train.py", "--lr", "3")) == [sys.executable, "train.py", "--lr", "3"]
    assert argv(("/opt/venv/bin/python3.12", "x.py")) == ["/opt/venv/bin/python3.12", "x.py"]
    assert argv(("train.py", "--lr", "3")) == [sys.executable, "train.py", "--lr", "3"]  # as torchrun takes it


def test_every_rank_gets_torchruns_variables() -> None:
    env = torchrun_env(rank=5, local_rank=1, nproc_per_node=4, node=1, nnodes=2, world_size=8,
                       master_addr="10.0.0.1", master_port=29500, run_id="llm7")
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                                "MASTER_PORT", "TORCHELASTIC_RUN_ID")} == {
        "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "llm7"}


def test_the_shim_contract_round_trips_and_names_what_is_wrong() -> None:
    cfg = ShimConfig(job="llm7", customer="acme", role="spare", spare_id="n1s0", world_size=8, store_port=29500,
                     collective_timeout_s=12.5, snapshot_every=100)
    assert ShimConfig.from_env(cfg.env()) == cfg
    with pytest.raises(ValueError, match="RIDETHROUGH_SHIM_WORLD_SIZE='eight' is not a int"):
        ShimConfig.from_env({**cfg.env(), "RIDETHROUGH_SHIM_WORLD_SIZE": "eight"})
    with pytest.raises(ValueError, match="RIDETHROUGH_SHIM_JOB is not set"):
        ShimConfig.from_env({})
    with pytest.raises(ValueError, match="a spare needs a spare_id"):
        ShimConfig(job="j", role="spare", store_port=1)


# -- the launcher running ------------------------------------------------------------------

def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@pytest.mark.integration
@pytest.mark.slow
def test_ranks_get_the_contract_and_the_launcher_leaves_nothing_behind(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="the torch extra (torch==2.13.0) is not installed")
    from tests.test_migrate import FinishedJob, start_job

    hold = tmp_path / "hold"
    job = start_job(tmp_path, "train_env.py", "--hold", str(hold), spares=1, job="envjob")
    for rank in (0, 1):
        job.wait_for('"backend"', f"rank-{rank}")
    job.wait_spare("n0s0")
    status = job.ask({"cmd": "status"})
    records = [FinishedJob(0, job.logs, "").records(f"rank-{r}")[0] for r in (0, 1)]
    port = records[0]["env"]["MASTER_PORT"]
    for rank, rec in enumerate(records):
        assert rec["env"] == {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
                              "GROUP_RANK": "0", "ROLE_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                              "MASTER_PORT": port, "TORCHELASTIC_RUN_ID": "envjob",
                              "TORCHELASTIC_RESTART_COUNT": "0", "OMP_NUM_THREADS": "1",
                              "RIDETHROUGH_SHIM": None}  # the shim's own variables are not left to the script
        assert (rec["rank"], rec["world_size"], rec["backend"]) == (rank, 2, "ridethrough")
    pids = [rec["pid"] for rec in records] + [status["spares"]["n0s0"]["pid"]]
    assert sorted(status["ranks"]) == ["0", "1"] and status["spares"]["n0s0"]["state"] == "ready"

    job.proc.send_signal(signal.SIGTERM)
    job.proc.wait(60)
    assert not socket_path(job.run_dir, "envjob", 0).exists()
    done = job.finish(timeout_s=60)
    assert done.code == 128 + signal.SIGTERM
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], "the launcher left processes behind"


@pytest.mark.integration
@pytest.mark.slow
def test_a_rank_that_fails_without_a_spare_fails_the_job_with_the_reason(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="the torch extra (torch==2.13.0) is not installed")
    from tests.test_migrate import start_job

    done = start_job(tmp_path, "train_env.py", "--fail", "3").finish(timeout_s=180)
    assert done.code == 1, done.tail()
    assert "no spare ready for ranks" in done.output


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.integration
@pytest.mark.slow
def test_a_job_on_two_nodes_rides_through_a_frozen_node(tmp_path: Path) -> None:
    """Two launchers (--nnodes 2), the second frozen (SIGSTOP, as a hung host): node 0 notices its
    silence and a spare on node 0 takes its rank; every step is trained once, one final model.
    (The same across lab hosts, in their own namespaces: tests/test_migrate_lab.py.)"""
    pytest.importorskip("torch", reason="the torch extra (torch==2.13.0) is not installed")
    from tests.test_migrate import FinishedJob

    logs, port, procs = tmp_path / "logs", _free_port(), []
    for node, spares in ((0, 1), (1, 0)):
        run_dir = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # a Unix socket path must stay short
        argv = [sys.executable, "-m", "ridethrough.actuators.run_cli", "run", "--nnodes", "2", "--node-rank",
                str(node), "--nproc-per-node", "1", "--spares", str(spares), "--master-port", str(port),
                "--job-id", "two", "--log-dir", str(logs), "--run-dir", run_dir, "--rendezvous-timeout", "180",
                "--heartbeat-timeout", "15", "--", "python", str(FIXTURES / "train_plain.py"), "--epochs", "6",
                "--step-sleep", "0.2"]
        with open(tmp_path / f"launcher-{node}.out", "wb") as out:  # the launcher holds its own descriptor
            procs.append((subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT), run_dir))
    (lead, lead_dir), (follower, _) = procs
    frozen: list[int] = []
    try:
        deadline = time.monotonic() + 300
        rank1 = logs / "rank-1.log"
        while not (rank1.exists() and '"i": 3,' in rank1.read_text()):
            assert time.monotonic() < deadline and lead.poll() is None, "the job did not reach step 3"
            time.sleep(0.2)
        status = request(socket_path(lead_dir, "two", 0), {"cmd": "status"}, timeout_s=30)
        assert status["ranks"]["1"]["node"] == 1 and status["spares"]["n0s0"]["node"] == 0, status
        frozen = [follower.pid, int(status["ranks"]["1"]["pid"])]
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        lead.wait(600)
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
        for proc, run_dir in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(60)
            shutil.rmtree(run_dir, ignore_errors=True)
    out = (tmp_path / "launcher-0.out").read_text()
    done = FinishedJob(lead.returncode, logs, out)
    assert done.code == 0, done.tail()
    assert "node_lost {'node': 1, 'ranks': [1]}" in out and "recovered {'ranks': [1], 'spares': {'1': 'n0s0'}" in out
    for rank in (0, 1):
        steps = []
        for name in done.holders(rank):  # a spare counts its loop from 0 at the step it continues at
            offset = 0
            for line in (logs / f"{name}.log").read_text().splitlines():
                if m := re.search(r"continues at step (\d+)", line):
                    offset = int(m[1])
                elif line.startswith("{") and '"loss"' in line:
                    steps.append(offset + json.loads(line)["i"])
        assert sorted(set(steps)) == list(range(6 * 64 // 4 // 2)), done.tail()  # the redone step at most twice
        assert len(steps) - len(set(steps)) <= 1
    assert len(done.digests()) == 1, done.tail()
