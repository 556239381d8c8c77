"""Async checkpoints and job snapshots: round trips, staging isolation, checksums, kill -9, refusals."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, wait_for

torch = pytest.importorskip("torch")

from ridethrough import checkpoint  # noqa: E402 - after the torch skip
from ridethrough.actuators.snapshot_store import (  # noqa: E402
    SnapshotIncompatible,
    SnapshotIncomplete,
    SnapshotMeta,
    SnapshotStore,
    TensorSpec,
    check_compatible,
    shapes_of,
)
from ridethrough.checkpoint import CheckpointCorrupt, Checkpointer, CheckpointWriteError  # noqa: E402

SLOW_BYTES_S = 2 << 20
"""A writer capped at 2 MiB/s takes seconds over a few MiB: long enough to act while it writes."""


def _trained_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": 7,
            "odd": {3: (1, 2.5, None), "$not_a_tag": [True, "x", float("inf")]},
            "bf16": torch.ones(3, dtype=torch.bfloat16), "mask": torch.tensor([True, False]),
            "scalar": torch.tensor(2.5), "empty": torch.empty(0, 3), "transposed": torch.arange(12).reshape(3, 4).t()}


def _assert_same(a: Any, b: Any) -> None:
    # dict subclasses (a module's OrderedDict) come back as plain dicts in the same order
    kind = (torch.Tensor, dict, tuple, list, float, int, str, type(None))
    assert next(k for k in kind if isinstance(a, k)) is next(k for k in kind if isinstance(b, k)), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("how", ["async", "sync"])
def test_round_trip_keeps_every_value_type_and_key(tmp_path: Path, how: str) -> None:
    state = _trained_state()
    path = tmp_path / "a.ckpt"
    if how == "async":
        handle = checkpoint.save_async(state, path)
        handle.wait(timeout_s=30)
        assert handle.done() and handle.error is None and handle.staged_s > 0
        assert handle.digest == checkpoint.digest(path)
    else:
        checkpoint.save(state, path)
    loaded = checkpoint.load(path)
    _assert_same(state, loaded)
    assert checkpoint.verify(path).tensors == 4 + 3 * 4 + 5  # model, Adam's step and moments per param, extras
    torch.optim.Adam(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                         torch.nn.Linear(16, 4)).parameters()).load_state_dict(loaded["optim"])
    assert sorted(os.listdir(tmp_path)) == ["a.ckpt"]  # no temp file left behind


def test_sync_and_async_write_the_same_bytes(tmp_path: Path) -> None:
    state = _trained_state()
    checkpoint.save(state, tmp_path / "sync.ckpt")
    checkpoint.save_async(state, tmp_path / "async.ckpt").wait(timeout_s=30)
    assert (tmp_path / "sync.ckpt").read_bytes() == (tmp_path / "async.ckpt").read_bytes()


def test_tensors_may_change_as_soon_as_save_async_returns(tmp_path: Path) -> None:
    weights = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB: ~2 s at the capped rate
    expected = weights.clone()
    ck = Checkpointer(io_bytes_per_s=SLOW_BYTES_S)
    handle = ck.save_async({"w": weights}, tmp_path / "w.ckpt")
    assert not handle.done()  # the write is still going on while the training loop moves on
    weights.fill_(-1.0)
    handle.wait(timeout_s=60)
    assert torch.equal(checkpoint.load(tmp_path / "w.ckpt")["w"], expected)


def test_a_full_staging_pool_waits_for_a_write_instead_of_growing(tmp_path: Path) -> None:
    ck = Checkpointer(max_buffers=1, io_bytes_per_s=SLOW_BYTES_S)
    first = ck.save_async({"w": torch.zeros(1 << 19)}, tmp_path / "1.ckpt")
    second = ck.save_async({"w": torch.ones(1 << 19)}, tmp_path / "2.ckpt")
    assert first.done()  # staging the second had to wait until the first write gave the only buffer back
    second.wait(timeout_s=60)
    assert torch.equal(checkpoint.load(tmp_path / "2.ckpt")["w"], torch.ones(1 << 19))


def test_state_dicts_of_changing_size_reuse_or_replace_the_buffer(tmp_path: Path) -> None:
    ck = Checkpointer(max_buffers=1)
    for i, n in enumerate((1000, 50_000, 10, 50_000)):
        ck.save_async({"w": torch.full((n,), float(i))}, tmp_path / f"{i}.ckpt").wait(timeout_s=30)
    for i, n in enumerate((1000, 50_000, 10, 50_000)):
        assert torch.equal(checkpoint.load(tmp_path / f"{i}.ckpt")["w"], torch.full((n,), float(i)))
    ck.close()


def test_bad_input_is_refused_at_the_call(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"cannot checkpoint object at model\.extra"):
        checkpoint.save_async({"model": {"extra": object()}}, tmp_path / "x.ckpt")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        checkpoint.save_async({"w": torch.zeros(2)}, tmp_path / "missing" / "x.ckpt")
    assert os.listdir(tmp_path) == []


def test_a_failed_background_write_is_reported_on_the_handle(tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()  # a directory where the file should go: the final rename fails
    handle = checkpoint.save_async({"w": torch.zeros(4)}, tmp_path / "taken")
    with pytest.raises(CheckpointWriteError, match="taken"):
        handle.wait(timeout_s=30)
    assert isinstance(handle.error, OSError)
    assert sorted(os.listdir(tmp_path)) == ["taken"]  # the temp file was removed


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("damage", "message"), [
    (lambda p: _flip(p, 64 + 5), r"tensor model\.0\.weight fails its checksum"),
    (lambda p: _flip(p, p.stat().st_size - 40), "index fails its checksum"),
    (lambda p: p.write_bytes(p.read_bytes()[:-100]), "cut short"),
    (lambda p: p.write_bytes(b"PK\x03\x04" + bytes(200)), "not a ridethrough checkpoint"),
])
def test_corruption_is_detected_and_names_the_file(tmp_path: Path, damage, message: str) -> None:
    path = tmp_path / "c.ckpt"
    checkpoint.save(_trained_state(), path)
    damage(path)
    for check in (checkpoint.load, checkpoint.verify):
        with pytest.raises(CheckpointCorrupt, match=message) as info:
            check(path)
        assert str(path) in str(info.value)


_KILLED_WRITER = r"""
import sys, torch
from ridethrough import checkpoint
from ridethrough.actuators.snapshot_store import SnapshotStore
mode, target = sys.argv[1], sys.argv[2]
ck = checkpoint.Checkpointer(io_bytes_per_s=2 << 20)
state = {"w": torch.full((2 << 20,), 2.0)}  # 8 MiB: about 4 s at 2 MiB/s
handle = (checkpoint.save_async(state, target, checkpointer=ck) if mode == "file"
          else SnapshotStore(target, checkpointer=ck).write_rank(2, 0, state))
handle.wait()
"""


def _kill_mid_write(mode: str, target: Path, watch: Path) -> None:
    """Run a writer, wait until its temp file in ``watch`` holds part of the data, then kill -9 it."""
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, mode, str(target)], cwd=ROOT)
    try:
        def partial() -> bool:
            temps = [p for p in watch.glob(".*.tmp-*")] if watch.is_dir() else []
            return any(p.stat().st_size > (1 << 20) for p in temps)
        wait_for(partial, timeout_s=60, what="a partly written temp file")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.integration
def test_kill_9_mid_write_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "job.ckpt"
    checkpoint.save({"w": torch.full((2 << 20,), 1.0)}, path)
    before = checkpoint.digest(path)
    _kill_mid_write("file", path, tmp_path)
    assert checkpoint.digest(path) == before
    assert checkpoint.verify(path).tensors == 1
    assert torch.equal(checkpoint.load(path)["w"], torch.full((2 << 20,), 1.0))
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == ["job.ckpt"]


def _meta(state: dict[str, Any], world_size: int = 1) -> SnapshotMeta:
    return SnapshotMeta(world_size=world_size, shapes=shapes_of(state), extra={"job": "test"})


@pytest.mark.integration
def test_kill_9_mid_snapshot_leaves_the_last_committed_one(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    state = {"w": torch.full((2 << 20,), 1.0)}
    store.write_rank(1, 0, state).wait(timeout_s=60)
    store.commit(1, _meta(state))
    _kill_mid_write("snapshot", tmp_path, tmp_path / ".partial-step-000000000002")
    latest = store.latest()
    assert latest is not None and latest.step == 1
    assert torch.equal(store.load_rank(latest, 0)["w"], state["w"])
    with pytest.raises(SnapshotIncomplete, match=r"missing for \[0\]"):
        store.commit(2, _meta(state))  # the killed rank never finished: step 2 cannot count
    store.write_rank(2, 0, {"w": torch.full((2 << 20,), 2.0)}).wait(timeout_s=60)
    assert store.commit(2, _meta(state)).step == 2
    assert sorted(p.name for p in (tmp_path / "step-000000000002").iterdir()) == ["manifest.json", "rank-00000.ckpt"]


def test_only_committed_snapshots_count(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    assert store.latest() is None
    shards = [{"w": torch.full((4,), float(r))} for r in range(2)]
    for rank, shard in enumerate(shards):
        store.write_rank(10, rank, shard).wait(timeout_s=30)
    committed = store.commit(10, _meta(shards[0], world_size=2))
    store.write_rank(20, 0, shards[0]).wait(timeout_s=30)  # written, never committed: the job died here
    latest = store.latest()
    assert latest == committed and latest.world_size == 2 and latest.extra == {"job": "test"}
    assert [store.load_rank(latest, r)["w"][0].item() for r in range(2)] == [0.0, 1.0]
    with pytest.raises(FileExistsError):
        store.write_rank(10, 0, shards[0])


def test_commit_refuses_missing_or_extra_ranks(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    state = {"w": torch.zeros(2)}
    store.write_rank(5, 0, state).wait(timeout_s=30)
    store.write_rank(5, 2, state).wait(timeout_s=30)
    with pytest.raises(SnapshotIncomplete, match=r"missing for \[1\], unexpected for \[2\]"):
        store.commit(5, _meta(state, world_size=2))
    assert store.latest() is None


def test_resume_with_another_world_size_or_model_is_refused(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    state = {"model": {"fc.weight": torch.zeros(4, 8), "fc.bias": torch.zeros(4)}}
    for rank in range(2):
        store.write_rank(3, rank, state).wait(timeout_s=30)
    snap = store.commit(3, _meta(state, world_size=2))
    store.check_compatible(snap, 2, state)  # the same job, by state dict: fine
    with pytest.raises(SnapshotIncompatible, match="written by 2 ranks, this job has 4"):
        check_compatible(snap, world_size=4, shapes=shapes_of(state))
    wider = {"model": {"fc.weight": torch.zeros(4, 16), "fc.bias": torch.zeros(4)}}
    with pytest.raises(SnapshotIncompatible, match=r"model\.fc\.weight: snapshot \[4, 8\] float32, job \[4, 16\]"):
        check_compatible(snap, world_size=2, shapes=shapes_of(wider))
    with pytest.raises(SnapshotIncompatible, match=r"model\.fc\.bias: snapshot \[4\] float32, job missing"):
        check_compatible(snap, world_size=2, shapes={"model.fc.weight": TensorSpec((4, 8), "float32")})


def test_damaged_snapshots_are_detected(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = SnapshotStore(tmp_path)
    for step in (1, 2):
        store.write_rank(step, 0, {"w": torch.full((4,), float(step))}).wait(timeout_s=30)
        store.commit(step, _meta({"w": torch.zeros(4)}))
    manifest = tmp_path / "step-000000000002" / "manifest.json"
    doc = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**doc, "world_size": 1, "step": 2, "extra": {"edited": True}}))
    with caplog.at_level(logging.WARNING):
        latest = store.latest()
    assert latest is not None and latest.step == 1  # the damaged newer one is skipped, loudly
    assert "manifest fails its checksum" in caplog.text
    rank_file = tmp_path / "step-000000000001" / "rank-00000.ckpt"
    checkpoint.save({"w": torch.full((4,), 9.0)}, rank_file)  # a sound file, but not the committed one
    with pytest.raises(CheckpointCorrupt, match="digest differs"):
        store.load_rank(latest, 0)


def test_old_snapshots_and_abandoned_partials_are_pruned(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, keep=2)
    state = {"w": torch.zeros(2)}
    store.write_rank(2, 0, state).wait(timeout_s=30)  # abandoned: step 3 commits past it
    for step in (1, 3, 4, 5):
        store.write_rank(step, 0, state).wait(timeout_s=30)
        if step != 5:
            store.commit(step, _meta(state))
    assert [s.step for s in store.snapshots()] == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".partial-step-000000000005", "step-000000000003",
                                                           "step-000000000004"]


def test_importing_the_api_does_not_import_torch() -> None:
    code = ("import sys, ridethrough.checkpoint, ridethrough.actuators.snapshot_store, "
            "ridethrough.actuators.publish; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)
