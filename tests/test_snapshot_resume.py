"""Whole-job snapshots and resuming from them: a resumed run reproduces the uninterrupted one exactly.

In one process first (the shim's real resume path against a committed snapshot), then across
processes under the launcher (integration): ``ridethrough snapshot`` on a running job, ``--resume``,
and the fallback that restarts every rank from the newest periodic snapshot.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch extra (torch==2.13.0) is not installed")
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from ridethrough.actuators import snapshot  # noqa: E402
from ridethrough.actuators.shim import keys  # noqa: E402
from ridethrough.actuators.shim.config import ShimConfig  # noqa: E402
from ridethrough.actuators.shim.control import Adoption, Runtime  # noqa: E402
from ridethrough.actuators.shim.coordinator import Coordinator  # noqa: E402
from ridethrough.actuators.shim.discovery import track_constructors  # noqa: E402
from ridethrough.actuators.snapshot_store import SnapshotStore  # noqa: E402
from tests.test_migrate import FinishedJob, start_job  # noqa: E402


def _script(stop_after: int, on_step: Any = None) -> list[float]:
    """A training script (built from the top, as a process would): two epochs over a shuffled loader."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(20, 3, generator=torch.Generator().manual_seed(1)), torch.randn(20, 1))
    loader = DataLoader(data, batch_size=4, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(3, 6), torch.nn.Dropout(0.3), torch.nn.Linear(6, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    losses: list[float] = []
    for _ in range(2):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
            if on_step is not None:
                on_step(len(losses))
            if len(losses) == stop_after:
                return losses
    return losses


@pytest.fixture
def shimmed() -> Iterator[Any]:
    undo: list[Any] = []

    def make(cfg: ShimConfig, store: Any, adoption: Adoption | None = None) -> Runtime:
        for u in reversed(undo):
            u()
        undo.clear()
        runtime = Runtime(cfg, store, rank=0)
        runtime.adoption = adoption
        undo.extend([runtime.tracker.install(), track_constructors(runtime.tracker),
                     runtime.loaders.install(DataLoader)])
        return runtime

    yield make
    for u in reversed(undo):
        u()


def test_resuming_a_snapshot_reproduces_the_uninterrupted_losses(tmp_path: Path, shimmed: Any) -> None:
    store = dist.HashStore()
    cfg = ShimConfig(job="t", store_port=1, snapshot_dir=str(tmp_path))
    first = shimmed(cfg, store)

    def ask_at(step: int) -> None:
        if step == 5:  # after step 4: noticed at the next boundary (5), applied at the one after (6): mid epoch 1
            keys.append(store, keys.CTL_SEQ, keys.ctl, {"kind": "snapshot"})

    uninterrupted = _script(10, ask_at)
    first.wait_writes(30)
    assert keys.get(store, keys.ctl(0, "done/0"))["ok"]
    step = int(store.get(keys.ctl(0, "T")))
    snap = snapshot.commit(str(tmp_path), step=step, world_size=1, shapes=keys.get(store, keys.ctl(0, "shapes")),
                           extra={})
    assert step == 6 and snap.path.name == "step-000000000006"

    shimmed(cfg, dist.HashStore(), Adoption(snapshot=str(snap.path)))
    torch.manual_seed(999)  # nothing of the first run's process is left
    resumed = _script(10)
    assert resumed[:4] == uninterrupted[6:]


def test_a_snapshot_of_another_model_is_refused_by_name(tmp_path: Path, shimmed: Any) -> None:
    store = dist.HashStore()
    cfg = ShimConfig(job="t", store_port=1, snapshot_dir=str(tmp_path))
    first = shimmed(cfg, store)
    keys.append(store, keys.CTL_SEQ, keys.ctl, {"kind": "snapshot"})
    _script(3)
    first.wait_writes(30)
    step = int(store.get(keys.ctl(0, "T")))
    snap = snapshot.commit(str(tmp_path), step=step, world_size=1, shapes=keys.get(store, keys.ctl(0, "shapes")),
                           extra={})
    shimmed(cfg, dist.HashStore(), Adoption(snapshot=str(snap.path)))
    model = torch.nn.Linear(3, 2)  # not the snapshot's model
    opt = torch.optim.Adam(model.parameters())
    loader = DataLoader(TensorDataset(torch.randn(8, 3)), batch_size=2)
    with pytest.raises(ValueError, match="holds 1 LR schedulers, this script built 0"):
        next(iter(loader))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    with pytest.raises(ValueError, match=r"optimizer 0 \(Adam\) has parameter groups of \[2\] parameters, the "
                                         r"state \[4\]"):
        for (x,) in DataLoader(TensorDataset(torch.randn(8, 3)), batch_size=2):
            model(x).sum().backward()
    assert sched.last_epoch == 0  # nothing was loaded into the script's objects


# -- the coordinator's side -----------------------------------------------------------------

def _rank_writes(root: Path, step: int, world: int) -> None:
    for rank in range(world):
        SnapshotStore(root).write_rank(step, rank, {"models": [{"w": torch.full((2,), float(rank))}]}).wait(30)


def test_a_snapshot_commits_once_every_rank_saved(tmp_path: Path) -> None:
    store = dist.HashStore()
    c = Coordinator(store, 2)
    replies: list[dict[str, Any]] = []
    c.submit(snapshot.SnapshotOp(str(tmp_path), "t", reply=replies.append))
    c.tick()
    assert keys.get(store, keys.ctl(0)) == {"kind": "snapshot"}
    store.set(keys.ctl(0, "T"), "12")
    keys.put(store, keys.ctl(0, "shapes"), {"model0.w": [[2], "float32"]})
    _rank_writes(tmp_path, 12, 2)
    keys.put(store, keys.ctl(0, "done/0"), {"ok": True, "stall_s": 0.01})
    c.tick()
    assert not replies  # rank 1 has not reported
    keys.put(store, keys.ctl(0, "done/1"), {"ok": True, "stall_s": 0.02})
    c.tick()
    assert replies[0]["ok"] and replies[0]["step"] == 12 and replies[0]["stall_s"] == 0.02
    assert SnapshotStore(tmp_path).latest().step == 12  # type: ignore[union-attr]


def test_a_rank_that_cannot_save_fails_the_snapshot_and_commits_nothing(tmp_path: Path) -> None:
    store = dist.HashStore()
    c = Coordinator(store, 2)
    replies: list[dict[str, Any]] = []
    c.submit(snapshot.SnapshotOp(str(tmp_path), "t", reply=replies.append))
    c.tick()
    keys.put(store, keys.ctl(0, "done/1"), {"ok": False, "error": "No space left on device"})
    c.tick()
    assert replies == [{"ok": False, "error": "rank 1: No space left on device"}]
    assert SnapshotStore(tmp_path).latest() is None
    c.submit(snapshot.SnapshotOp("", "t", reply=replies.append))
    c.tick()
    assert replies[-1] == {"ok": False, "error": "the job was started without --snapshot-dir"}


# -- across processes -------------------------------------------------------------------------

def _ok(done: FinishedJob) -> FinishedJob:
    assert done.code == 0, done.tail()
    return done


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> FinishedJob:
    return _ok(start_job(tmp_path_factory.mktemp("base"), "train_plain.py", "--epochs", "2").finish())


@pytest.mark.integration
@pytest.mark.slow
def test_a_platform_snapshot_resumes_exactly(tmp_path: Path, baseline: FinishedJob) -> None:
    snaps = tmp_path / "snaps"
    job = start_job(tmp_path / "a", "train_plain.py", "--epochs", "2", "--step-sleep", "0.1",
                    extra=("--snapshot-dir", str(snaps)))
    job.wait_for(r'"i": 5,', "rank-1")
    reply = job.ask({"cmd": "snapshot"})
    assert reply["ok"], reply
    _ok(job.finish())
    step = reply["step"]
    resumed = _ok(start_job(tmp_path / "b", "train_plain.py", "--epochs", "2",
                            extra=("--resume", reply["path"])).finish())
    for rank in (0, 1):
        assert resumed.losses(rank) == baseline.losses(rank)[step:]
        assert f"rank {rank} continues at step {step}" in (resumed.logs / f"rank-{rank}.log").read_text()
    assert resumed.digests() == baseline.digests()

    wrong = start_job(tmp_path / "c", "train_plain.py", nproc=3, extra=("--resume", str(snaps))).finish()
    assert wrong.code == 2 and "was written by 2 ranks, this job has 3" in wrong.output


@pytest.mark.integration
@pytest.mark.slow
def test_without_a_spare_a_lost_rank_restarts_the_job_from_the_newest_snapshot(tmp_path: Path,
                                                                               baseline: FinishedJob) -> None:
    job = start_job(tmp_path, "train_plain.py", "--epochs", "2", "--step-sleep", "0.1",
                    extra=("--snapshot-dir", str(tmp_path / "snaps"), "--snapshot-every", "4"))
    job.wait_for(r'"i": 9,', "rank-1")
    import os

    os.kill(job.pid_of("rank-1"), signal.SIGKILL)
    done = _ok(job.finish())
    assert "restarting every rank from snapshot" in done.output
    for rank in (0, 1):
        text = (done.logs / f"rank-{rank}.log").read_text()
        step = int(re.findall(rf"rank {rank} continues at step (\d+)", text)[-1])
        assert step in (4, 8)
        after = [r["loss"] for r in done.records(f"rank-{rank}")[-(16 - step) - 1:-1]]
        assert after == baseline.losses(rank)[step:]
    assert done.digests() == baseline.digests()
