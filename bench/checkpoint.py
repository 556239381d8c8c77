"""Checkpoint stall and weight publishing: how long saving blocks training, how fast replicas get new weights.

Stall per save (the time the training loop is blocked) for an MLP of ``--layers`` Linear(``--hidden``,
``--hidden``) layers trained with Adam (weights + two moments: 403 MB of state at the defaults),
saved three ways:

* ``torch.save`` of the state dict to a file on local disk (synchronous: the stall is the whole save);
* ``torch.distributed.checkpoint.async_save`` in a single-process gloo group (the stall is its
  blocking staging; it writes in a background thread);
* ``ridethrough.checkpoint.save_async`` (the stall is the copy into staging buffers).

Before each save one training step changes every weight and moment; a round is one save of each
kind, in turn. Every save is on disk (its background write done, torch.save's file fsynced, both
outside the stall) before the next starts, so no save pays for another's I/O. A first round warms
every method up (ridethrough allocates its staging buffers there); its stalls are reported apart,
the medians come from the rounds after. Targets: ridethrough's stall <= 1/10 of torch.save's and
no worse than DCP's.

Publishing: ``--subscribers`` processes run a `WeightSubscriber` each; the trainer publishes the
model's weights (134 MB at the defaults); ``publish_s`` is the median time from ``publish()`` until
every subscriber has acknowledged that version as swapped in. The subscribers start first and get a
warm-up version during the warm-up save round; they are idle before the measured rounds begin.

Progress goes to stderr; the last line on stdout is one JSON object.
Run: ``.venv/bin/python bench/checkpoint.py [--quick]`` (quick: one layer, 201 MB of state, 67 MB
of weights; fewer rounds; under 60 s).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ridethrough import checkpoint
from ridethrough.actuators.publish import WeightPublisher

ROOT = Path(__file__).resolve().parents[1]
TARGET_RATIO_VS_TORCH_SAVE = 0.1
_SUBSCRIBER = r"""
import sys
from ridethrough.actuators.publish import WeightSubscriber
sub = WeightSubscriber(("127.0.0.1", int(sys.argv[1])), name=sys.argv[2])
sys.stdin.read()  # run until the bench closes our stdin
sub.close()
"""


_T0 = time.monotonic()


def say(text: str) -> None:
    print(f"[checkpoint {time.monotonic() - _T0:5.1f} s] {text}", file=sys.stderr, flush=True)


def _state_bytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_state_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(_state_bytes(v) for v in state)
    return 0


class Trainer:
    """A model and its optimizer; ``step`` changes every weight and moment."""

    def __init__(self, hidden: int, layers: int) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(layers)])
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.hidden = hidden
        self.step()

    def step(self) -> None:
        self.opt.zero_grad()
        self.model(torch.randn(8, self.hidden)).square().mean().backward()
        self.opt.step()

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}


def _save_round(trainer: Trainer, work: Path, round_no: int) -> dict[str, float]:
    """One save of each kind; the stall of each."""
    stalls: dict[str, float] = {}
    for method in ("torch_save", "dcp_async_save", "ridethrough"):
        trainer.step()
        state = trainer.state()
        started = time.perf_counter()
        if method == "torch_save":
            torch.save(state, work / "torch.pt")
            stalls[method] = time.perf_counter() - started
            with open(work / "torch.pt", "rb+") as f:  # its dirty pages must not slow the next save down
                os.fsync(f.fileno())
        elif method == "dcp_async_save":
            saving = dcp.async_save(state, checkpoint_id=work / f"dcp-{round_no}")  # type: ignore[attr-defined]
            stalls[method] = time.perf_counter() - started
            (saving if isinstance(saving, Future) else saving.upload_completion).result()
            shutil.rmtree(work / f"dcp-{round_no - 1}", ignore_errors=True)  # DCP fsyncs its files itself
        else:
            handle = checkpoint.save_async(state, work / "ridethrough.ckpt")
            stalls[method] = time.perf_counter() - started
            handle.wait()  # written and fsynced
            stalls["ridethrough_write_s"] = handle.written_s or 0.0
    return stalls


def measure_stalls(trainer: Trainer, work: Path, rounds: int, settled: Callable[[], None]) -> dict[str, Any]:
    """A warm-up round, ``settled()`` (the subscribers are up and idle), then the measured rounds."""
    dist.init_process_group("gloo", init_method=f"file://{work / 'pg'}", rank=0, world_size=1)
    try:
        first = _save_round(trainer, work, 0)
        say(f"warm-up round: {json.dumps({k: round(v, 3) for k, v in first.items()})}")
        settled()
        rows = []
        for r in range(1, rounds + 1):
            rows.append(_save_round(trainer, work, r))
            say(f"round {r}: {json.dumps({k: round(v, 3) for k, v in rows[-1].items()})}")
    finally:
        dist.destroy_process_group()
    medians = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    return {"first": first, "median": medians}


def start_subscribers(pub: WeightPublisher, count: int) -> list[subprocess.Popen[bytes]]:
    """Replica processes (started first: their start overlaps the warm-up round, not the measured ones)."""
    return [subprocess.Popen([sys.executable, "-c", _SUBSCRIBER, str(pub.address[1]), f"replica-{i}"],
                             stdin=subprocess.PIPE, cwd=ROOT) for i in range(count)]


def stop_subscribers(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.close()
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def wait_warm_up(pub: WeightPublisher, subscribers: int) -> None:
    """Until every subscriber has the warm-up version (then they sit idle in recv, using no CPU)."""
    if not pub.wait_delivered(1, count=subscribers, timeout_s=120):
        raise TimeoutError(f"warm-up version not delivered: acked {pub.acked()}, last error {pub.last_error}")


def measure_publish(trainer: Trainer, pub: WeightPublisher, subscribers: int, publishes: int) -> list[float]:
    times = []
    for _ in range(publishes):
        trainer.step()
        started = time.perf_counter()
        version = pub.publish(trainer.model.state_dict())
        if not pub.wait_delivered(version, count=subscribers, timeout_s=120):
            raise TimeoutError(f"version {version} not delivered: acked {pub.acked()}")
        times.append(time.perf_counter() - started)
        say(f"published version {version} to {subscribers} subscribers in {times[-1]:.3f} s")
    return times


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore", module=r"torch\.distributed.*")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="one layer (201 MB of state), 2 measured rounds, 2 publishes: under 60 s")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=None, help="Linear layers (default 2; 1 with --quick)")
    ap.add_argument("--rounds", type=int, default=7, help="measured save rounds (after one warm-up round)")
    ap.add_argument("--subscribers", type=int, default=4)
    ap.add_argument("--publishes", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir on local disk)")
    args = ap.parse_args(argv)
    rounds, publishes = (2, 2) if args.quick else (args.rounds, args.publishes)
    args.layers = args.layers or (1 if args.quick else 2)
    started = time.monotonic()
    pub = WeightPublisher()
    procs = start_subscribers(pub, args.subscribers)
    try:
        details, headline = run(args, pub, rounds, publishes)
    finally:
        stop_subscribers(procs)
        pub.close()
    print(json.dumps({"bench": "checkpoint", **details, "elapsed_s": round(time.monotonic() - started, 1),
                      **headline}))
    return 0


def run(args: argparse.Namespace, pub: WeightPublisher, rounds: int,
        publishes: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The measurements: details, and the three headline figures."""
    trainer = Trainer(args.hidden, args.layers)
    state_mb = _state_bytes(trainer.state()) / 1e6
    weights_mb = _state_bytes(trainer.model.state_dict()) / 1e6
    say(f"state {state_mb:.0f} MB (weights {weights_mb:.0f} MB), torch threads {torch.get_num_threads()}")
    pub.publish(trainer.model.state_dict())  # warm-up version 1: connections, first allocations
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-", dir=args.dir) as tmp:
        stalls = measure_stalls(trainer, Path(tmp), rounds, lambda: wait_warm_up(pub, args.subscribers))
    publish = measure_publish(trainer, pub, args.subscribers, publishes)
    med = stalls["median"]
    ratio_ts = med["ridethrough"] / med["torch_save"]
    ratio_dcp = med["ridethrough"] / med["dcp_async_save"]
    details = {
        "quick": args.quick, "state_mb": round(state_mb, 1), "rounds": rounds,
        "stall_s": {k: round(med[k], 4) for k in ("torch_save", "dcp_async_save", "ridethrough")},
        "first_round_stall_s": {k: round(stalls["first"][k], 4) for k in ("torch_save", "dcp_async_save",
                                                                          "ridethrough")},
        "ridethrough_write_s": round(med["ridethrough_write_s"], 3),
        "staging_gb_s": round(state_mb / 1e3 / med["ridethrough"], 2),
        "publish_mb": round(weights_mb, 1), "subscribers": args.subscribers,
        "publish_runs_s": [round(t, 3) for t in publish],
        "target_ratio_vs_torch_save_met": ratio_ts <= TARGET_RATIO_VS_TORCH_SAVE,
        "target_vs_dcp_met": ratio_dcp <= 1.0,
    }
    return details, {"stall_ratio_vs_torch_save": round(ratio_ts, 4), "stall_ratio_vs_dcp": round(ratio_dcp, 4),
                     "publish_s": round(statistics.median(publish), 3)}


if __name__ == "__main__":
    sys.exit(main())
