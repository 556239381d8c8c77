"""DistributedDataParallel under the shim: DDP's bookkeeping stays local, the shim does the communication.

The script's ``DistributedDataParallel(model)`` builds `ddp_class`'s subclass (the shim puts it in
``torch.nn.parallel`` before the script imports it). For a module on the default group it:

* gives DDP a group of one (`LocalGroup`), so DDP's own collectives (the shape check and state
  broadcast at construction, the bucket rebuild after the first step) never leave the process. A
  replacement rank builds a fresh DDP while the others are mid-training: those collectives would
  pair with nothing;
* broadcasts the module's state from rank 0 itself at construction (what DDP would have done), and
  the buffers before each forward when ``broadcast_buffers`` (likewise);
* all-reduces gradients with a communication hook that waits for the last bucket and reduces all
  gradients at once, in the module's parameter order (`canonical_hook`): the bucket layout is DDP's
  private affair and differs between a fresh DDP and one that rebuilt its buckets after the first
  step (it does: registration order first, then the order gradients became ready), so only a
  layout-free reduction lets a replacement rank pair with the rest. The cost: gradients are not
  reduced while backward still runs (no overlap), and one copy in and out of a flat buffer.

A DDP on an explicit, other process group is left to plain DDP (and a job with one cannot migrate).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import GradBucket  # type: ignore[attr-defined]  # exported at runtime, not in the stub
from torch.futures import Future

from ridethrough.actuators.shim.group import LocalGroup, ResilientGroup


def broadcast_flat(group: ResilientGroup, tensors: Iterable[torch.Tensor], *, root: int = 0) -> None:
    """Broadcast ``tensors`` from ``root`` as one flat buffer per dtype and device (few collectives, same result)."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    for same in by_kind.values():
        flat = torch.cat([t.detach().reshape(-1) for t in same])
        group.broadcast([flat], opts)
        _scatter_back(flat, same)


def _scatter_back(flat: torch.Tensor, targets: list[torch.Tensor]) -> None:
    offset = 0
    with torch.no_grad():
        for t in targets:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view_as(t))
            offset += n


def canonical_hook(module: torch.nn.Module, group: ResilientGroup) -> Callable[..., Future[torch.Tensor]]:
    """A DDP communication hook that averages all gradients at the last bucket, in ``module``'s parameter order."""
    order = {id(p): i for i, p in enumerate(module.parameters())}
    pending: list[tuple[GradBucket, Future[torch.Tensor]]] = []

    def ridethrough_allreduce(state: object, bucket: GradBucket) -> Future[torch.Tensor]:
        fut: Future[torch.Tensor] = Future()
        pending.append((bucket, fut))
        if bucket.is_last():
            buckets = list(pending)
            pending.clear()
            _reduce(buckets, order, group)
            for b, f in buckets:
                f.set_result(b.buffer())
        return fut

    # DDP checks the hook's annotations as objects; this module's are strings (postponed evaluation)
    ridethrough_allreduce.__annotations__ = {"state": object, "bucket": GradBucket,
                                             "return": Future[torch.Tensor]}
    return ridethrough_allreduce


def _reduce(buckets: list[tuple[GradBucket, Future[torch.Tensor]]], order: dict[int, int],
            group: ResilientGroup) -> None:
    slots: list[tuple[int, torch.Tensor]] = []
    for bucket, _ in buckets:
        buffer, offset = bucket.buffer(), 0
        for p in bucket.parameters():  # the buffer holds the bucket's gradients back to back, in this order
            n = p.numel()
            slots.append((order[id(p)], buffer[offset:offset + n]))
            offset += n
    slots.sort(key=lambda s: s[0])
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for _, view in slots:
        by_kind.setdefault((view.dtype, view.device), []).append(view)
    for views in by_kind.values():
        flat = torch.cat(views)
        flat.div_(group.size())
        group.allreduce([flat])
        _scatter_back(flat, views)


def ddp_class(base: type[Any], *, default_group: Callable[[], ResilientGroup | None],
              register: Callable[[torch.nn.Module], None]) -> type[Any]:
    """A subclass of ``base`` (DDP) that does the above; ``register`` hears of every DDP built."""
    signature = inspect.signature(base.__init__)

    class RideThroughDDP(base):  # type: ignore[misc]  # a subclass of whatever DDP class is given
        """DistributedDataParallel whose communication the ridethrough shim owns (see its module docstring)."""

        def __init__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
            bound = signature.bind(self, module, *args, **kwargs)
            chosen = bound.arguments.get("process_group")
            group = default_group()
            self._rt_group = group if group is not None and (chosen is None or chosen is group) else None
            if self._rt_group is not None:
                bound.arguments["process_group"] = LocalGroup()
            super().__init__(**{k: v for k, v in bound.arguments.items() if k != "self"})
            if self._rt_group is not None:
                if bound.arguments.get("init_sync", True):
                    broadcast_flat(self._rt_group, self.module.state_dict().values())
                self.register_comm_hook(None, canonical_hook(self.module, self._rt_group))
            register(self)

        def forward(self, *inputs: Any, **kwargs: Any) -> Any:
            group = self._rt_group
            if group is not None and self.broadcast_buffers and group.size() > 1:
                buffers = [b for b in self.module.buffers() if b.numel()]
                if buffers:
                    broadcast_flat(group, buffers)
            return super().forward(*inputs, **kwargs)

    RideThroughDDP.__name__ = RideThroughDDP.__qualname__ = base.__name__
    RideThroughDDP.__module__ = base.__module__
    return RideThroughDDP
