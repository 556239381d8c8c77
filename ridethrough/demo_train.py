"""The demo's training job: a plain DDP script (no ridethrough in it), as people write them.

A small MLP trained data-parallel on gloo, step after step until stopped (or ``--steps``), a short
sleep standing in for the compute a real step does. ``ridethrough run`` starts it per rank; its
shim reports every step to the host agent and moves ranks to spares, without a change here.

    ridethrough run --nproc-per-node 1 --spares 1 -- python -m ridethrough.demo_train --step-sleep 0.5
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main(argv: list[str] | None = None) -> None:
    """Train until stopped (or ``--steps``); one JSON line per step on stdout."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    ap = argparse.ArgumentParser(prog="python -m ridethrough.demo_train", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=0, help="Steps to train (0: until stopped).")
    ap.add_argument("--step-sleep", type=float, default=0.5, help="Seconds of stand-in compute per step.")
    ap.add_argument("--width", type=int, default=32)
    args = ap.parse_args(argv)

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = torch.Generator().manual_seed(1 + rank)
    model = torch.nn.Sequential(torch.nn.Linear(16, args.width), torch.nn.ReLU(), torch.nn.Linear(args.width, 1))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    step = 0
    while args.steps == 0 or step < args.steps:
        x = torch.randn(32, 16, generator=data)
        loss = torch.nn.functional.mse_loss(ddp(x), x.sum(dim=1, keepdim=True).tanh())
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
        opt.step()
        print(json.dumps({"rank": rank, "i": step, "loss": loss.item(), "pid": os.getpid(), "t": time.time()}),
              flush=True)
        step += 1
        time.sleep(args.step_sleep)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
