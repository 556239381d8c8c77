"""Finding a script's models, optimizers and schedulers, and its step boundaries, without its help.

* Optimizers and LR schedulers: the shim wraps ``Optimizer.__init__`` and ``LRScheduler.__init__``
  and keeps each instance (construction order). A global optimizer-step hook sees every update.
* Models: every ``DistributedDataParallel`` the script builds (construction order), and any other
  module called at the top of the call stack (a *root* forward) that owns parameters no known
  model owns (found with global module forward hooks, in the order first called).
* Step boundary: a root forward, in training mode with gradients on, once every optimizer of a
  step has updated since the previous boundary. Which optimizers make a step is learnt: at first
  all those built; when one updates twice before a boundary, those that updated before it. So a
  plain loop, gradient accumulation (several forwards, one update) and a GAN (two models, two
  optimizers, several forwards) each get one boundary per step, at the same point on every rank.
  Evaluation forwards (``eval()`` or ``no_grad``) are never boundaries.

At the first batch fetch (or boundary) after an update, the tracker records the step's *small
state*: the random generators and the data loader positions as they were before the step used
them; `state` captures and restores it with the tensors.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook


class Tracker:
    """What the shim knows of the script (see the module docstring); ``on_boundary(step)`` at each boundary."""

    def __init__(self, *, on_boundary: Callable[[int], None], on_model: Callable[[torch.nn.Module], None],
                 record: Callable[[], dict[str, Any]], before_root: Callable[[], None], first_step: int = 0) -> None:
        self._on_boundary = on_boundary
        self._before_root = before_root
        self._on_model = on_model
        self._record = record
        self.models: list[torch.nn.Module] = []
        """Known models (a DDP is kept as itself; `inner` unwraps it)."""
        self._owned: set[int] = set()
        self._optimizers: list[weakref.ref[torch.optim.Optimizer]] = []
        self._schedulers: list[weakref.ref[Any]] = []
        self.step = first_step
        """The step in progress (the last boundary's), or the first one before any boundary."""
        self.started = False
        self.boundary_ns = 0
        """When the current step began (``time.time_ns()``)."""
        self.cycle: set[int] | None = None
        """Indices of the optimizers that make up a step, once learnt."""
        self._stepped: list[int] = []
        self._depth = 0
        self.small: dict[str, Any] | None = None
        """The small state recorded for the next step (None until the first fetch or boundary)."""
        self._record_due = True

    # -- what the script built --------------------------------------------------------------

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Live optimizers, in construction order."""
        return [o for o in (r() for r in self._optimizers) if o is not None]

    @property
    def schedulers(self) -> list[Any]:
        """Live LR schedulers, in construction order."""
        return [s for s in (r() for r in self._schedulers) if s is not None]

    def add_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer was built."""
        self._optimizers.append(weakref.ref(optimizer))

    def add_scheduler(self, scheduler: Any) -> None:
        """An LR scheduler was built."""
        self._schedulers.append(weakref.ref(scheduler))

    def add_model(self, module: torch.nn.Module) -> None:
        """A model to save and restore (a DDP when built, other roots when first called)."""
        inner = unwrap(module)
        params = {id(p) for p in inner.parameters()}
        if params and params <= self._owned:
            return  # part of a model already known (a block a checkpoint re-runs, a sub-model called alone)
        self._owned |= params
        self.models.append(module)
        self._on_model(module)

    # -- hooks ------------------------------------------------------------------------------

    def install(self) -> Callable[[], None]:
        """Install the global hooks; returns what removes them."""
        mod = torch.nn.modules.module
        handles = [mod.register_module_forward_pre_hook(self._pre_forward),
                   mod.register_module_forward_hook(self._post_forward, always_call=True),
                   register_optimizer_step_post_hook(self._stepped_hook)]

        def remove() -> None:
            for handle in handles:
                handle.remove()
        return remove

    def describe(self) -> str:
        """What was found, in one line (logged at the first boundary)."""
        def names(objs: list[Any]) -> str:
            return ", ".join(type(unwrap(o) if isinstance(o, torch.nn.Module) else o).__name__ for o in objs)
        return (f"{len(self.models)} model(s) [{names(self.models)}], {len(self.optimizers)} optimizer(s) "
                f"[{names(self.optimizers)}], {len(self.schedulers)} LR scheduler(s) [{names(self.schedulers)}]")

    def _pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        self._depth += 1
        if self._depth != 1:
            return
        if module not in self.models:
            if not any(True for _ in module.parameters()):
                return
            self.add_model(module)
            if module not in self.models:
                return
        self._before_root()
        if module.training and torch.is_grad_enabled() and self._boundary_due():
            self._boundary()

    def _post_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._depth = max(0, self._depth - 1)

    def _boundary_due(self) -> bool:
        if not self.started:
            return True
        if not self._stepped:
            return False
        alive = {i for i, r in enumerate(self._optimizers) if r() is not None}
        wanted = self.cycle if self.cycle is not None else alive
        return wanted <= set(self._stepped)

    def _stepped_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        index = next((i for i, r in enumerate(self._optimizers) if r() is optimizer), -1)
        if index < 0:
            return  # built before the shim (not the script's)
        if index in self._stepped and self.cycle is None:
            # An optimizer updated twice before a boundary: the step is made of those before it.
            self.cycle = set(self._stepped)
            self._stepped = []
        self._stepped.append(index)
        self._record_due = True

    def fetching(self) -> None:
        """A batch is about to be fetched (from `loaders`)."""
        if self._record_due:
            self.small = self._record()
            self._record_due = False

    def _boundary(self) -> None:
        if self._record_due:  # no batch fetched since the update (the script makes its own data)
            self.small = self._record()
            self._record_due = False
        if self.started:
            if self.cycle is None and self._stepped:
                self.cycle = set(self._stepped)
            self.step += 1
        self.started = True
        self._stepped = []
        self.boundary_ns = time.time_ns()
        self._on_boundary(self.step)

    @property
    def updated(self) -> bool:
        """True once an optimizer updated in the current step (its collectives after that are past the update)."""
        return bool(self._stepped)

    def next_step(self) -> int:
        """The step the next boundary begins."""
        return self.step + 1 if self.started else self.step

    def adopt(self, *, step: int, cycle: set[int] | None) -> None:
        """Continue from a taken-over rank or a snapshot: the next boundary begins ``step``."""
        self.step, self.started, self.cycle, self._stepped = step, False, cycle, []
        self._record_due = True


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The module inside a DDP wrapper (or the module itself)."""
    inner = getattr(module, "module", None)
    return inner if isinstance(inner, torch.nn.Module) and type(module).__name__ == "DistributedDataParallel" \
        else module


def track_constructors(tracker: Tracker) -> Callable[[], None]:
    """Wrap ``Optimizer.__init__`` and ``LRScheduler.__init__`` so the tracker hears of every instance.

    Returns what puts the originals back.
    """
    optim_init = torch.optim.Optimizer.__init__
    sched_cls = torch.optim.lr_scheduler.LRScheduler
    sched_init = sched_cls.__init__

    def optimizer_init(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        optim_init(self, *args, **kwargs)
        tracker.add_optimizer(self)

    def scheduler_init(self: Any, *args: Any, **kwargs: Any) -> None:
        sched_init(self, *args, **kwargs)
        tracker.add_scheduler(self)

    torch.optim.Optimizer.__init__ = optimizer_init  # type: ignore[method-assign]  # the shim's one patch point
    sched_cls.__init__ = scheduler_init  # type: ignore[method-assign]  # likewise

    def restore() -> None:
        torch.optim.Optimizer.__init__ = optim_init  # type: ignore[method-assign]  # undoing the above
        sched_cls.__init__ = sched_init  # type: ignore[method-assign]  # likewise
    return restore
