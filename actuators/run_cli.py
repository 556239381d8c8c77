"""Typer commands ``run``, ``snapshot``, ``migrate`` and ``status`` (mounted on the ``ridethrough`` app).

    ridethrough run --nproc-per-node 4 --spares 1 --job-id llm7 -- python train.py --lr 3e-4
    ridethrough snapshot llm7
    ridethrough migrate llm7 --rank 3 --reason "gpu3 ECC errors rising"
    ridethrough run --nproc-per-node 4 --resume /snapshots/llm7/step-000000001200 -- python train.py --lr 3e-4
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from ridethrough.actuators.shim.config import ShimConfig
from ridethrough.actuators.shim.control_socket import find_socket, request
from ridethrough.actuators.shim.coordinator import Timeouts

RunDir = Annotated[str, typer.Option("--run-dir", envvar="RIDETHROUGH_RUN_DIR",
                                     help="Directory of the jobs' control sockets (default: a per-user one).")]
Timeout = Annotated[float, typer.Option("--timeout", help="Seconds to wait for the answer.")]


def default_run_dir() -> str:
    """``$XDG_RUNTIME_DIR/ridethrough``, else a per-user directory under the temp dir."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    return str(Path(base) / "ridethrough") if base else str(Path(tempfile.gettempdir()) / f"ridethrough-{os.getuid()}")


def run(
    command: Annotated[list[str], typer.Argument(help="The training command, after --.")],
    nnodes: Annotated[int, typer.Option("--nnodes", help="Nodes in the job.")] = 1,
    nproc_per_node: Annotated[int, typer.Option("--nproc-per-node", "--nproc_per_node",
                                                help="Ranks per node.")] = 1,
    node_rank: Annotated[int, typer.Option("--node-rank", "--node_rank", help="This node's index.")] = 0,
    master_addr: Annotated[str, typer.Option("--master-addr", "--master_addr",
                                             help="Node 0's address (the job store).")] = "127.0.0.1",
    master_port: Annotated[int, typer.Option("--master-port", "--master_port",
                                             help="The job store's port (0: any free one, one node only).")] = 0,
    spares: Annotated[int, typer.Option("--spares", help="Hot-spare processes on this node.")] = 0,
    job_id: Annotated[str, typer.Option("--job-id", help="The job's id (steps are reported under it).")] = "job",
    customer: Annotated[str, typer.Option("--customer", help="Who the job runs for (goodput reports).")] = "default",
    resume: Annotated[str, typer.Option("--resume", help="Start every rank from this snapshot (a step-N "
                                                         "directory, or a snapshot root: its newest).")] = "",
    snapshot_dir: Annotated[str, typer.Option("--snapshot-dir", help="Where snapshots are written "
                                                                     "(shared by every node).")] = "",
    snapshot_every: Annotated[int, typer.Option("--snapshot-every", help="Snapshot every N steps (0: on "
                                                                         "request only).")] = 0,
    log_dir: Annotated[str, typer.Option("--log-dir", help="Write each process's output to a file here "
                                                           "(default: this terminal).")] = "",
    run_dir: RunDir = "",
    job_socket: Annotated[str, typer.Option("--job-socket", envvar="RIDETHROUGH_JOB_SOCKET",
                                            help="The node agent's job socket for step events.")] = "",
    collective_timeout: Annotated[float, typer.Option(help="A collective stalled this long failed (s).")] = 300.0,
    rendezvous_timeout: Annotated[float, typer.Option(help="Longest wait to form a group (s).")] = 60.0,
    heartbeat_timeout: Annotated[float, typer.Option(help="A node silent this long is lost (s).")] = 5.0,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False,
) -> None:
    """Run a training command on this node's ranks, torchrun-style, with hot spares and the ridethrough shim."""
    from ridethrough.actuators.launcher import LaunchConfig, Launcher
    from ridethrough.collector.job_protocol import ProtocolError, validate

    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        validate({"v": 1, "type": "start", "job": job_id, "customer": customer, "rank": 0,
                  "world_size": nnodes * nproc_per_node, "time_ns": 1})
        shim = ShimConfig(job=job_id, store_port=1, collective_timeout_s=collective_timeout,
                          rendezvous_timeout_s=rendezvous_timeout)
        cfg = LaunchConfig(command=tuple(command), nnodes=nnodes, node_rank=node_rank, nproc_per_node=nproc_per_node,
                           spares=spares, job_id=job_id, customer=customer, master_addr=master_addr,
                           master_port=master_port, run_dir=run_dir or default_run_dir(), log_dir=log_dir,
                           snapshot_dir=snapshot_dir, snapshot_every=snapshot_every,
                           resume=_checked_resume(resume, nnodes * nproc_per_node), job_socket=job_socket, shim=shim,
                           timeouts=replace(Timeouts(), heartbeat_s=heartbeat_timeout, arrive_s=rendezvous_timeout,
                                            form_s=rendezvous_timeout))
    except (ValueError, ProtocolError, FileNotFoundError) as exc:
        typer.echo(f"ridethrough run: {exc}", err=True)
        raise typer.Exit(2) from exc
    raise typer.Exit(Launcher(cfg).run())


def _checked_resume(path: str, world_size: int) -> str:
    """The snapshot directory to resume from ('' for none); errors before any rank starts."""
    if not path:
        return ""
    from ridethrough.actuators.snapshot import find
    from ridethrough.actuators.snapshot_store import check_compatible

    snap = find(path)
    check_compatible(snap, world_size=world_size, shapes=snap.shapes)  # shapes: each rank checks its own model
    return str(snap.path)


def _ask(job: str, doc: dict[str, object], run_dir: str, timeout: float) -> None:
    try:
        reply = request(find_socket(run_dir or default_run_dir(), job), doc, timeout_s=timeout)
    except (OSError, ValueError) as exc:
        typer.echo(f"ridethrough: job {job}: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(json.dumps(reply, indent=1))
    raise typer.Exit(0 if reply.get("ok") else 1)


def snapshot(job: Annotated[str, typer.Argument(help="The job's id.")], run_dir: RunDir = "",
             timeout: Timeout = 600.0) -> None:
    """Have every rank of a running job save a consistent snapshot at the same step; print where it is."""
    _ask(job, {"cmd": "snapshot"}, run_dir, timeout)


def migrate(job: Annotated[str, typer.Argument(help="The job's id.")],
            rank: Annotated[list[int], typer.Option("--rank", help="A rank to move to a spare (repeat for more).")],
            reason: Annotated[str, typer.Option("--reason", help="Why (recorded).")] = "operator request",
            run_dir: RunDir = "", timeout: Timeout = 600.0) -> None:
    """Move ranks of a running job to hot spares at the next step boundary, without a restart."""
    _ask(job, {"cmd": "migrate", "ranks": list(rank), "reason": reason}, run_dir, timeout)


def status(job: Annotated[str, typer.Argument(help="The job's id.")], run_dir: RunDir = "",
           timeout: Timeout = 10.0) -> None:
    """Show a running job's ranks, spares, generation and recent events."""
    _ask(job, {"cmd": "status"}, run_dir, timeout)


def register(app: typer.Typer) -> None:
    """Mount the commands on ``app`` (the ``ridethrough`` command line)."""
    app.command("run")(run)
    app.command("snapshot")(snapshot)
    app.command("migrate")(migrate)
    app.command("job-status")(status)


if __name__ == "__main__":  # python -m ridethrough.actuators.run_cli run ... (before the commands are mounted)
    _app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False)
    register(_app)
    _app()
