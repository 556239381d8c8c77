"""Boot the shim in a rank process: read the launcher's contract, connect to the job store, patch torch.

Patches, all made before the script imports anything:

* ``torch.distributed.init_process_group``: builds the default group as a `ResilientGroup` over
  the script's backend (gloo or nccl), whatever ``init_method`` the script names;
* ``torch.nn.parallel.DistributedDataParallel``: the shim's subclass (`ddp`);
* ``Optimizer.__init__``, ``LRScheduler.__init__``, ``DataLoader.__iter__`` and global module and
  optimizer hooks: `discovery` and `loaders`.

A spare parks here, before its script starts, until it is given a rank.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from collections.abc import MutableMapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.parallel
import torch.nn.parallel.distributed

from ridethrough.actuators.shim import keys
from ridethrough.actuators.shim.config import ShimConfig
from ridethrough.actuators.shim.control import Adoption, Runtime
from ridethrough.actuators.shim.ddp import ddp_class
from ridethrough.actuators.shim.discovery import track_constructors

BACKEND = "ridethrough"
_SUPPORTED = ("gloo", "nccl")


def inner_backend(requested: str | None, *, cuda: bool) -> str:
    """The backend the shim's group delegates to for what the script asked (None: torch's default)."""
    if requested is None:
        return "nccl" if cuda else "gloo"
    name = str(requested).lower()
    if name in _SUPPORTED:
        return name
    if "nccl" in name and "gloo" in name:  # "cpu:gloo,cuda:nccl"
        return "nccl" if cuda else "gloo"
    raise ValueError(f"ridethrough's shim runs gloo and nccl process groups, not {requested!r}")


def boot(environ: MutableMapping[str, str]) -> Runtime:
    """Build and install the runtime from ``environ`` (its shim variables are removed from it)."""
    cfg = ShimConfig.from_env(environ)
    for name in cfg.variables():
        environ.pop(name, None)  # the script's own subprocesses (loader workers) must not boot a shim
    store: Any = dist.TCPStore(cfg.store_host, cfg.store_port, is_master=False,  # type: ignore[attr-defined]
                               wait_for_workers=False, timeout=timedelta(seconds=cfg.rendezvous_timeout_s))
    first = store.add(keys.CTL_SEQ, 0)
    rank = int(environ.get("RANK", "-1"))
    runtime = Runtime(cfg, store, rank=rank)
    _logging(runtime)
    if cfg.role == "spare":
        warm_up()
    install(runtime)
    # Registered before the script runs, so it runs after the script's own exit handlers.
    atexit.register(runtime.close)
    if cfg.role == "spare":
        runtime.park()
    elif cfg.resume:
        runtime.adoption = Adoption(snapshot=cfg.resume, first_command=first)
    if cfg.job_socket:
        from ridethrough.collector.job_client import JobReporter

        runtime.reporter = JobReporter(socket_path=cfg.job_socket, job=cfg.job, customer=cfg.customer,
                                       rank=runtime.rank, world_size=cfg.world_size)
        runtime.reporter.started()
    return runtime


def warm_up() -> None:
    """Run one tiny DDP training step in a private group of one, before the shim's hooks exist.

    A spare's script starts only when the spare is given a rank, on the critical path. Its first
    DDP step would import hundreds of torch modules lazily (dynamo, inductor utilities,
    functional collectives: seconds of CPU); doing it here, while the spare waits, takes that
    off the path. Nothing of it remains: the group is destroyed, and the script seeds and builds
    its own objects (the taken-over state replaces the generators anyway).
    """
    from ridethrough.actuators.shim.group import LocalGroup

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,  # type: ignore[attr-defined]
                            timeout=timedelta(seconds=30))
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1))
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=LocalGroup())
        opt = torch.optim.Adam(ddp.parameters())
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
        data = torch.utils.data.TensorDataset(torch.randn(4, 4))
        for (x,) in torch.utils.data.DataLoader(data, batch_size=2, shuffle=True):
            ddp(x).sum().backward()
            opt.step()
            sched.step()
    finally:
        dist.destroy_process_group()


def install(runtime: Runtime) -> None:
    """Install the hooks and patches (see the module docstring)."""
    runtime.tracker.install()
    track_constructors(runtime.tracker)
    runtime.loaders.install(torch.utils.data.DataLoader)
    wanted: dict[str, str] = {}

    def create(store: Any, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup:
        if rank != runtime.rank or size != runtime.world:
            raise ValueError(f"init_process_group(rank={rank}, world_size={size}) disagrees with the launcher "
                             f"(rank {runtime.rank} of {runtime.world})")
        return runtime.make_group(wanted["backend"])

    dist.Backend.register_backend(BACKEND, create, devices=["cpu", "cuda"])
    original = dist.init_process_group

    def init_process_group(backend: str | None = None, init_method: str | None = None,
                           timeout: timedelta | None = None, world_size: int = -1, rank: int = -1,
                           store: Any = None, group_name: str = "", pg_options: Any = None,
                           device_id: Any = None) -> None:
        wanted["backend"] = inner_backend(backend, cuda=torch.cuda.is_available())
        original(backend=BACKEND, store=runtime.store, timeout=timeout,  # type: ignore[arg-type]  # a TCPStore
                 world_size=runtime.world if world_size == -1 else world_size,
                 rank=runtime.rank if rank == -1 else rank, group_name=group_name)

    init_process_group.__doc__ = original.__doc__
    dist.init_process_group = init_process_group  # type: ignore[assignment]  # same call, fewer declared types
    ddp = ddp_class(torch.nn.parallel.distributed.DistributedDataParallel, default_group=lambda: runtime.group,
                    register=runtime.tracker.add_model)
    torch.nn.parallel.DistributedDataParallel = ddp  # type: ignore[misc]  # what `from torch.nn.parallel import` sees
    torch.nn.parallel.distributed.DistributedDataParallel = ddp  # type: ignore[misc]  # and the module itself


def _logging(runtime: Runtime) -> None:
    logger = logging.getLogger("ridethrough.shim")
    handler = logging.StreamHandler(sys.stderr)

    class _Rank(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            record.rt_rank = runtime.rank if runtime.rank >= 0 else f"spare {runtime.cfg.spare_id}"
            return True

    handler.addFilter(_Rank())
    handler.setFormatter(logging.Formatter("[ridethrough rank %(rt_rank)s] %(message)s (%(asctime)s)"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def boot_from_site() -> None:
    """`boot` from ``sitecustomize``; a shim that cannot start stops the process with a one-line reason."""
    try:
        boot(os.environ)
    except Exception as exc:  # a rank without its shim would desynchronise the job: stop, saying why
        print(f"ridethrough shim: cannot start: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        os._exit(1)  # not SystemExit: raised while `site` imports, it becomes a fatal interpreter error
