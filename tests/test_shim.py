"""The shim inside one process: what it finds in a script, data loader positions, state trees, the
re-formable group and its step replay, and DDP under it. Unmodified scripts under the real launcher
are at the end (integration), reporting their steps to an agent's job socket."""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch extra (torch==2.13.0) is not installed")
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from ridethrough.actuators.shim import state  # noqa: E402
from ridethrough.actuators.shim.ddp import ddp_class  # noqa: E402
from ridethrough.actuators.shim.discovery import Tracker, track_constructors  # noqa: E402
from ridethrough.actuators.shim.group import CollectiveFailed, ResilientGroup  # noqa: E402
from ridethrough.actuators.shim.loaders import LoaderTracker  # noqa: E402

nn = torch.nn
FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture
def tracked() -> Iterator[tuple[Tracker, list[int]]]:
    boundaries: list[int] = []
    tracker = Tracker(on_boundary=boundaries.append, on_model=lambda m: None, record=dict, before_root=lambda: None)
    remove, restore = tracker.install(), track_constructors(tracker)
    yield tracker, boundaries
    remove()
    restore()


def _mlp() -> Any:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


# -- discovery and step boundaries -----------------------------------------------------------

def test_plain_loop_has_one_boundary_per_step_and_evaluation_none(tracked: tuple[Tracker, list[int]]) -> None:
    tracker, boundaries = tracked
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(5, 4)
    for _ in range(3):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            model(x)
        model.eval()
        model(x)
        model.train()
    assert boundaries == [0, 1, 2]
    assert tracker.models == [model] and tracker.optimizers == [opt]


def test_gradient_accumulation_counts_updates_not_forwards(tracked: tuple[Tracker, list[int]]) -> None:
    _, boundaries = tracked
    model = _mlp()
    opt = torch.optim.Adam(model.parameters())
    for _ in range(3):
        for _ in range(4):
            model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert boundaries == [0, 1, 2]


def test_two_models_two_optimizers_make_one_step(tracked: tuple[Tracker, list[int]]) -> None:
    tracker, boundaries = tracked
    gen, disc = nn.Linear(3, 4), nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.1)
    opt_g = torch.optim.Adam(gen.parameters())
    for _ in range(3):
        fake = gen(torch.randn(2, 3))
        d_loss = disc(torch.randn(2, 4)).mean() - disc(fake.detach()).mean()
        opt_d.zero_grad()
        d_loss.backward()
        opt_d.step()
        g_loss = disc(fake).mean()  # a forward after one update, mid-step: not a boundary
        opt_g.zero_grad()
        g_loss.backward()
        opt_g.step()
    assert boundaries == [0, 1, 2]
    assert tracker.models == [gen, disc] and tracker.optimizers == [opt_d, opt_g]
    assert "2 model(s) [Linear, Sequential], 2 optimizer(s) [SGD, Adam]" in tracker.describe()


def test_a_submodule_called_alone_is_not_another_model(tracked: tuple[Tracker, list[int]]) -> None:
    tracker, _ = tracked
    model = _mlp()
    model(torch.randn(1, 4))
    model[0](torch.randn(1, 4))  # e.g. activation checkpointing re-running a block
    assert tracker.models == [model]


def test_an_optimizer_that_never_updates_is_learnt_out_of_the_step(tracked: tuple[Tracker, list[int]]) -> None:
    _, boundaries = tracked
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    idle = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)  # built, never stepped
    for _ in range(5):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    # the second step's boundary is missed while the step is learnt; every rank misses the same one
    assert boundaries == [0, 1, 2, 3]
    assert idle in tracked[0].optimizers


# -- data loader positions -------------------------------------------------------------------

def _batches(it: Any) -> list[list[float]]:
    return [b[0].tolist() for b in it]


def test_seek_reproduces_a_shuffled_loader_from_the_middle_of_an_epoch() -> None:
    dataset = TensorDataset(torch.arange(20.0))
    tracker = LoaderTracker(on_next=lambda: None, on_fetch=lambda: None)
    restore = tracker.install(DataLoader)
    try:
        torch.manual_seed(0)
        loader = DataLoader(dataset, batch_size=3, shuffle=True)  # RandomSampler draws from the global generator
        original = [_batches(loader)]
        it = iter(loader)
        mid = [next(it)[0].tolist(), next(it)[0].tolist()]
        at = tracker.positions()[0]
        original.append(mid + _batches(it))
        original.append(_batches(loader))
        assert (at.epoch, at.index) == (1, 2)
    finally:
        restore()
    again = LoaderTracker(on_next=lambda: None, on_fetch=lambda: None)
    restore = again.install(DataLoader)
    try:
        torch.manual_seed(123)  # another process: another generator state
        loader = DataLoader(dataset, batch_size=3, shuffle=True)
        again.seek([at])
        epochs = [_batches(loader) for _ in range(3)]
    finally:
        restore()
    assert epochs[0] == []  # the epoch the taken-over rank had finished
    assert epochs[1] == original[1][2:]
    assert epochs[2] == original[2]


def test_a_loader_cannot_be_moved_back() -> None:
    tracker = LoaderTracker(on_next=lambda: None, on_fetch=lambda: None)
    restore = tracker.install(DataLoader)
    try:
        loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2)
        it = iter(loader)
        next(it), next(it), next(it)
        tracker.seek([state.Position(0, 1, torch.get_rng_state())])
        with pytest.raises(RuntimeError, match="cannot go back to epoch 0 batch 1"):
            next(it)
    finally:
        restore()


# -- state trees -----------------------------------------------------------------------------

def test_a_tree_survives_flatten_and_unflatten() -> None:
    tree = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(2, 3)}},
            "groups": [{"lr": 0.1, "params": [0, 1], "nesterov": False, "fused": None}],
            "rng": (3, torch.arange(5, dtype=torch.int64), None), "flags": torch.tensor([True, False]),
            "half": torch.randn(4, dtype=torch.bfloat16), "empty": torch.empty(0, 7)}
    tensors: list[torch.Tensor] = []
    back = state.unflatten(state.flatten(tree, tensors), tensors)
    assert back["groups"] == tree["groups"] and back["rng"][0] == 3 and back["rng"][2] is None
    assert torch.equal(back["state"][0]["exp_avg"], tree["state"][0]["exp_avg"])
    assert back["half"].dtype == torch.bfloat16 and back["empty"].shape == (0, 7)
    with pytest.raises(TypeError, match=r"cannot move object at \.x"):
        state.flatten({"x": object()}, [])


def test_a_state_that_does_not_fit_the_script_is_refused_before_anything_changes(
        tracked: tuple[Tracker, list[int]]) -> None:
    tracker, _ = tracked
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(1, 4))
    assert tracker.optimizers == [opt]
    other = nn.Sequential(nn.Linear(4, 9), nn.ReLU(), nn.Linear(9, 1))
    saved = {"format": state.FORMAT, "models": [other.state_dict()], "optimizers": [opt.state_dict()],
             "schedulers": [], "small": {}}
    with pytest.raises(state.StateMismatch, match=r"other shapes \[\('0.weight', \[8, 4\], \[9, 4\]\)"):
        state.check(saved, tracker)
    with pytest.raises(state.StateMismatch, match="holds 0 optimizers, this script built 1"):
        state.check({**saved, "optimizers": []}, tracker)


# -- the re-formable group -------------------------------------------------------------------

class _Work:
    def __init__(self, error: str = "", stalls: int = 0) -> None:
        self.error, self.stalls = error, stalls

    def wait(self, timeout: Any = None) -> bool:
        if self.stalls:
            self.stalls -= 1
            raise RuntimeError("Operation timed out!")
        if self.error:
            raise RuntimeError(self.error)
        return True


class _Backend:
    """A generation's backend: every all-reduce multiplies by ``members`` (their sum), unless told to fail."""

    def __init__(self, gen: int, members: int, fail: str = "", stalls: int = 0) -> None:
        self.gen, self.members, self.fail, self.stalls, self.calls = gen, members, fail, stalls, 0

    def allreduce(self, tensors: list[Any], opts: Any) -> _Work:
        self.calls += 1
        if self.fail:
            for t in tensors:
                t.fill_(-1.0)  # a failed ring leaves garbage behind
            return _Work(self.fail)
        for t in tensors:
            t.mul_(self.members)
        return _Work(stalls=self.stalls)

    def broadcast(self, tensors: list[Any], opts: Any) -> _Work:
        self.calls += 1
        return _Work(self.fail)


def _group(backends: dict[int, _Backend], on_failure: Any, *, abandoned: Any = lambda gen: False) -> ResilientGroup:
    group = ResilientGroup(rank=0, size=2, backend="gloo", connect=lambda gen: backends[gen], on_failure=on_failure,
                           abandoned=abandoned, collective_timeout_s=30.0, slice_s=0.01)
    group.swap(0)
    return group


def test_a_failed_collective_replays_the_step_on_the_next_generation() -> None:
    backends = {0: _Backend(0, 2), 1: _Backend(1, 2)}
    seen: list[str] = []

    def on_failure(group: ResilientGroup, reason: str) -> None:
        seen.append(reason)
        group.swap(1)

    group = _group(backends, on_failure)
    first, second = torch.ones(3), torch.full((2,), 5.0)
    group.allreduce([first])
    backends[0].fail = "Connection closed by peer [127.0.0.1]:1234"
    group.allreduce([second])
    assert "allreduce in generation 0 failed: Connection closed by peer" in seen[0]
    assert group.generation == 1 and group.replays == 1
    # both of the step's collectives ran again from their inputs: nothing is reduced twice or from garbage
    assert first.tolist() == [2.0, 2.0, 2.0] and second.tolist() == [10.0, 10.0]
    assert backends[1].calls == 2
    group.new_step()
    group.allreduce([torch.ones(1)])
    assert backends[1].calls == 3  # a new step: nothing left to replay


def test_a_stalled_collective_gives_up_when_the_coordinator_says_a_member_is_gone() -> None:
    backends = {0: _Backend(0, 2, stalls=10**6), 1: _Backend(1, 2)}
    lost: set[int] = set()
    reasons: list[str] = []

    def on_failure(group: ResilientGroup, reason: str) -> None:
        reasons.append(reason)
        group.swap(1)

    group = _group(backends, on_failure, abandoned=lambda gen: gen in lost)
    lost.add(0)
    t = torch.ones(2)
    group.allreduce([t])
    assert reasons == ["allreduce in generation 0: the coordinator is replacing a rank"]
    assert t.tolist() == [2.0, 2.0]


def test_shutdown_drops_finished_backends_and_keeps_one_a_collective_is_stuck_on() -> None:
    # A backend left to the interpreter's finalisation can abort the process at exit; one whose
    # collective never finished must not be destroyed (its destructor would wait on the frozen peer).
    backends = {0: _Backend(0, 2, stalls=10**6), 1: _Backend(1, 2), 2: _Backend(2, 2)}
    lost: set[int] = set()
    group = _group(backends, lambda g, reason: g.swap(g.generation + 1), abandoned=lambda gen: gen in lost)
    lost.add(0)
    group.allreduce([torch.ones(1)])  # stuck on generation 0, replayed on 1
    group.swap(2)  # a later, clean re-forming
    refs = {gen: weakref.ref(b) for gen, b in backends.items()}
    backends.clear()
    gc.collect()
    assert all(r() is not None for r in refs.values())  # in use or retired: nothing destroyed mid-job
    group.shutdown()
    gc.collect()
    assert refs[0]() is not None and refs[1]() is None and refs[2]() is None
    group.shutdown()  # again, at exit: harmless
    assert group.local


def test_a_backend_whose_collective_failed_is_let_go_before_the_failure_is_reported() -> None:
    # Its destructor closes its connections: peers blocked on this rank fail at once (see ring_cascade).
    backends = {0: _Backend(0, 2, fail="Connection closed by peer [127.0.0.1]:1"), 1: _Backend(1, 2)}
    ref = weakref.ref(backends[0])
    group = ResilientGroup(rank=0, size=2, backend="gloo", connect=backends.pop, abandoned=lambda gen: False,
                           on_failure=lambda g, reason: (_wait_gone(ref), g.swap(1)), collective_timeout_s=30.0)
    group.swap(0)
    t = torch.ones(2)
    group.allreduce([t])
    assert t.tolist() == [2.0, 2.0] and group.generation == 1 and group.replays == 1


def _wait_gone(ref: weakref.ref[Any]) -> None:
    deadline = time.monotonic() + 30
    while ref() is not None:
        gc.collect()
        assert time.monotonic() < deadline, "the failed generation's backend is still referenced"
        time.sleep(0.01)


@pytest.mark.integration
@pytest.mark.slow
def test_in_a_real_ring_every_survivor_fails_fast_without_the_coordinator(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, str(FIXTURES / "ring_cascade.py"), str(rank), str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(4)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    rows = [json.loads(line) for out in outs for line in out.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in rows) == [0, 1, 2], outs
    # the collective timeout is 100 s and nobody posts the lost key: only the cascade ends the waits
    assert all(r["failed_after_s"] < 60 and "failed: " in r["reason"] for r in rows), rows


def test_when_the_job_cannot_go_on_the_script_sees_the_error() -> None:
    def on_failure(group: ResilientGroup, reason: str) -> None:
        raise RuntimeError(f"the coordinator stopped the job ({reason})")

    group = _group({0: _Backend(0, 2, fail="Connection reset by peer")}, on_failure)
    with pytest.raises(RuntimeError, match="the coordinator stopped the job"):
        group.allreduce([torch.ones(1)])
    assert isinstance(CollectiveFailed("x"), RuntimeError)


def test_a_group_that_has_not_joined_acts_alone() -> None:
    group = ResilientGroup(rank=1, size=4, backend="gloo", connect=lambda gen: None, on_failure=lambda g, r: None,
                           abandoned=lambda gen: False, collective_timeout_s=1.0)
    t = torch.tensor([3.0])
    out = [torch.zeros(1) for _ in range(4)]
    group.allreduce([t])
    group.allgather([out], [t])
    assert group.local and t.tolist() == [3.0] and [o.item() for o in out] == [3.0] * 4
    assert group.size() == 4 and group.rank() == 1


# -- DDP under the shim ----------------------------------------------------------------------

@pytest.fixture
def world_of_one() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    yield
    dist.destroy_process_group()


class _Recorder(_Backend):
    def __init__(self) -> None:
        super().__init__(0, 1)
        self.sizes: list[int] = []

    def allreduce(self, tensors: list[Any], opts: Any) -> _Work:
        self.sizes.append(sum(t.numel() for t in tensors))
        return super().allreduce(tensors, opts)


def test_ddp_reduces_every_gradient_once_in_parameter_order(world_of_one: None) -> None:
    recorder = _Recorder()
    group = ResilientGroup(rank=0, size=1, backend="gloo", connect=lambda gen: recorder,
                           on_failure=lambda g, r: None, abandoned=lambda gen: False, collective_timeout_s=5.0)
    group.swap(0)
    built: list[Any] = []
    DDP = ddp_class(torch.nn.parallel.DistributedDataParallel, default_group=lambda: group, register=built.append)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 200), nn.ReLU(), nn.Linear(200, 300), nn.Linear(300, 2))
    plain = nn.Sequential(nn.Linear(300, 200), nn.ReLU(), nn.Linear(200, 300), nn.Linear(300, 2))
    plain.load_state_dict(model.state_dict())
    ddp = DDP(model, bucket_cap_mb=0.1)  # several buckets, rebuilt in another order after the first step
    assert built == [ddp] and type(ddp).__name__ == "DistributedDataParallel"
    for _ in range(3):
        x = torch.randn(4, 300)
        ddp(x).sum().backward()
        plain(x).sum().backward()
    total = sum(p.numel() for p in model.parameters())
    assert recorder.sizes[-3:] == [total] * 3  # one all-reduce per step, whatever the buckets
    for mine, ref in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.allclose(mine.grad, ref.grad, atol=1e-5)


# -- unmodified scripts under the launcher ---------------------------------------------------

@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize(("script", "found"), [
    ("train_plain.py", "1 model(s) [Sequential], 1 optimizer(s) [Adam], 0 LR scheduler(s) [], 1 data loader(s)"),
    ("train_trainer.py", "1 model(s) [Net], 1 optimizer(s) [SGD], 1 LR scheduler(s) [StepLR], 1 data loader(s)"),
    ("train_two_opt.py", "2 model(s) [Sequential, Linear], 2 optimizer(s) [SGD, AdamW], 0 LR scheduler(s) [], "
                         "1 data loader(s)"),
])
def test_the_shim_finds_models_and_optimizers_in_unmodified_scripts(tmp_path: Path, script: str, found: str) -> None:
    from tests.test_migrate import start_job

    agent_dir = Path(tempfile.mkdtemp(prefix="rta", dir="/tmp"))  # the agent's job socket, short enough
    agent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    agent.bind(str(agent_dir / "job.sock"))
    agent.settimeout(0.2)
    messages: list[dict[str, Any]] = []
    done = threading.Event()

    def receive() -> None:  # as the agent does: drain as they come (a full queue drops reports)
        while not done.is_set():
            with contextlib.suppress(TimeoutError):
                messages.append(json.loads(agent.recv(4096)))

    receiver = threading.Thread(target=receive)
    receiver.start()
    try:
        job = start_job(tmp_path, script, "--step-sleep", "0", extra=("--job-socket", str(agent_dir / "job.sock"),
                                                                      "--customer", "acme")).finish(timeout_s=240)
    finally:
        done.set()
        receiver.join()
        agent.close()
        shutil.rmtree(agent_dir, ignore_errors=True)
    assert job.code == 0, job.tail()
    for rank in (0, 1):
        text = (job.logs / f"rank-{rank}.log").read_text()
        assert f"[ridethrough rank {rank}] found {found}; step 0 begins" in text
        steps = [m for m in messages if m["type"] == "step" and m["rank"] == rank]
        assert [m["step"] for m in steps] == list(range(len(steps))) and len(steps) >= 5
        assert {(m["job"], m["customer"], m["world_size"]) for m in steps} == {("t", "acme", 2)}
        assert all(m["end_ns"] > m["start_ns"] and set(m["phases"]) == {"compute_s", "wait_s"} for m in steps)
    assert len(job.digests()) == 1  # both replicas ended the same
    assert not re.search(r"Traceback", (job.logs / "rank-0.log").read_text())
