"""A data-parallel-shaped job for the lab: ranks all-reduce a tensor over gloo, step after step.

Each rank is one process in a lab host, bound to the host's stable address (the ``stab``
interface) so that its traffic crosses the fabric and routing picks the path. Every step
checks the result (the sum of the ranks' contributions), so a fabric fault that corrupts
or stalls the collective shows up as a failed or slow step, not as silence. Steps are
reported to the local agent's job endpoint when a socket is given.

    python -m ridethrough.lab.allreduce --rank 0 --world-size 2 --master-addr 10.200.0.1 \\
        --master-port 29500 --steps 50

The last stdout line is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from typing import Any


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m ridethrough.lab.allreduce", description=__doc__.splitlines()[0])
    env = os.environ
    # Defaults from torchrun's environment contract, so launchers need not pass flags.
    ap.add_argument("--rank", type=int, default=int(env.get("RANK", "0")))
    ap.add_argument("--world-size", type=int, default=int(env.get("WORLD_SIZE", "1")))
    ap.add_argument("--master-addr", default=env.get("MASTER_ADDR", "127.0.0.1"))
    ap.add_argument("--master-port", type=int, default=int(env.get("MASTER_PORT", "29500")))
    ap.add_argument("--iface", default="stab", help="Interface gloo binds to (the host's stable address).")
    ap.add_argument("--steps", type=int, default=0, help="Steps to run (0: run for --duration).")
    ap.add_argument("--duration", type=float, default=3600.0,
                    help="Seconds to run when --steps is 0 (a launcher stops the job sooner).")
    ap.add_argument("--elements", type=int, default=1 << 18, help="float32 elements all-reduced per step.")
    ap.add_argument("--job", default=env.get("RIDETHROUGH_JOB", "lab-allreduce"), help="Job id reported to the agent.")
    ap.add_argument("--job-socket", default=env.get("RIDETHROUGH_JOB_SOCKET", ""),
                    help="The local agent's job socket; empty reports nothing.")
    ap.add_argument("--compute-matmuls", type=int, default=16,
                    help="256x256 matrix products per step before the all-reduce: a fixed amount of work standing "
                         "in for forward and backward, so a slow rank computes longer and the others wait.")
    ap.add_argument("--timeout-s", type=float, default=60.0, help="Collective timeout.")
    return ap.parse_args(argv)


def _reporter(args: argparse.Namespace) -> Any:
    if not args.job_socket:
        return None
    from ridethrough.collector.job_client import JobReporter

    return JobReporter(socket_path=args.job_socket, job=args.job, customer="lab", rank=args.rank,
                       world_size=args.world_size)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Join the group, all-reduce until done, and summarise."""
    # Importing torch costs seconds: only the job pays it, never the CLI.
    import torch
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", args.iface)
    torch.set_num_threads(1)  # one core's worth per rank: the lab packs many ranks on few cores
    dist.init_process_group("gloo", init_method=f"tcp://{args.master_addr}:{args.master_port}",
                            rank=args.rank, world_size=args.world_size,
                            timeout=timedelta(seconds=args.timeout_s))
    reporter = _reporter(args)
    expected = args.world_size * (args.world_size + 1) / 2
    step_s: list[float] = []
    wrong = 0
    deadline = time.monotonic() + args.duration
    step = 0
    weights = torch.rand(256, 256)
    try:
        while (step < args.steps) if args.steps else (time.monotonic() < deadline):
            start_ns = time.time_ns()
            activations = weights
            for _ in range(args.compute_matmuls):
                activations = torch.tanh(activations @ weights)
            tensor = torch.full((args.elements,), float(args.rank + 1))
            computed_ns = time.time_ns()
            dist.all_reduce(tensor)
            end_ns = time.time_ns()
            wrong += int(not torch.all(tensor == expected).item())
            step_s.append((end_ns - start_ns) / 1e9)
            if reporter is not None:
                phases = {"compute_s": (computed_ns - start_ns) / 1e9, "wait_s": (end_ns - computed_ns) / 1e9}
                reporter.step(step, start_ns, end_ns, samples=args.elements, phases=phases)
            step += 1
    finally:
        dist.destroy_process_group()
    return {"job": "allreduce", "rank": args.rank, "world_size": args.world_size, "steps": step,
            "wrong_results": wrong, "mean_step_s": sum(step_s) / len(step_s) if step_s else None,
            "max_step_s": max(step_s, default=None)}


def main(argv: list[str] | None = None) -> int:
    """Run one rank; exit status 0 only if every step's result was right."""
    summary = run(_args(argv))
    print(json.dumps(summary), flush=True)
    return 0 if summary["steps"] and not summary["wrong_results"] else 1


if __name__ == "__main__":
    sys.exit(main())
