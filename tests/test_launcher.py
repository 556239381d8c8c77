"""``ridethrough run``: its options, the environment contract every rank gets, and how it ends."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from ridethrough.actuators.launcher import LaunchConfig, argv
from ridethrough.actuators.shim.config import ShimConfig, torchrun_env
from ridethrough.actuators.shim.control_socket import socket_path


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
