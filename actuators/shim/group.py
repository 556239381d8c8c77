"""The process group a rank's script gets: one that can be re-formed under it, and replays a lost step.

`ResilientGroup` is the default group of every rank under the shim (``dist.init_process_group``
with the script's backend makes one). It delegates each collective to an inner gloo or NCCL
backend of the current *generation*, formed under the store prefix ``g<gen>/pg/``. Re-forming
(`ResilientGroup.swap`) builds the next generation's inner backend while the script, its DDP
modules and their references to this group stay as they are.

Collectives complete before they return (the shim's DDP hook does the gradient all-reduce as one
call after the last bucket, so nothing is lost by that), and each one of the current step is
logged with a copy of its input. When one fails (a peer died: gloo reports a closed connection
within milliseconds; a peer froze: the wait outlasts ``collective_timeout_s`` or the coordinator
posts a plan first) the group calls ``on_failure``, which returns once the next generation is
formed with a replacement rank in the lost one's place, and then replays the step's logged
collectives, inputs restored, on the new group: the replacement computes the same step from the
same state, so every member sees the collectives it expects, in order, and the script never
notices. ``on_failure`` raises instead when the job cannot go on; the script then sees the error.

Before it has joined a generation (a hot spare building the script's objects), the group is
*local*: collectives act as in a group of one, so a script's start-up calls (DDP's checks) cannot
reach ranks that are busy training.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions  # type: ignore[attr-defined]  # not in the stub
from torch.futures import Future

_TIMED_OUT = ("timed out", "Timed out", "Timeout")


class Done(dist.Work):
    """Work that has already finished (every collective here completes before it returns)."""

    def __init__(self, result: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self._result = list(result)

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> None:
        return None

    def result(self) -> list[torch.Tensor]:
        return self._result

    def synchronize(self) -> None:
        return None

    def get_future(self) -> Future[list[torch.Tensor]]:
        fut: Future[list[torch.Tensor]] = Future()
        fut.set_result(self._result)
        return fut


class LocalGroup(dist.ProcessGroup):
    """A group of one: what the shim gives DDP, whose gradients it all-reduces itself (see `ddp`).

    Collectives are overridden in the form torch calls from C++ (a list and an options object);
    the stub's other overloads are the Python API's, hence the ``override`` ignores here and below.
    """

    def __init__(self) -> None:
        super().__init__(0, 1)  # type: ignore[call-arg]  # the (rank, size) form exists; the stub lists another

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Done:  # type: ignore[override]
        return Done(tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Done:  # type: ignore[override]
        return Done(tensors)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Done:  # type: ignore[override]
        for outs, inp in zip(outputs, inputs, strict=True):
            for out in outs:
                out.copy_(inp)
        return Done(inputs)

    def barrier(self, opts: Any = None) -> Done:
        return Done([])

    def getBackendName(self) -> str:
        return "ridethrough-local"


class CollectiveFailed(RuntimeError):
    """A collective of the current generation failed or stalled; the message says how."""


@dataclass(slots=True)
class _Op:
    name: str
    issue: Callable[[Any], Any]
    """Start the collective on an inner backend; returns its work."""
    saved: list[tuple[torch.Tensor, torch.Tensor]]
    """(tensor the collective changes in place, a copy of its input) to restore before a replay."""
    local: Callable[[], None]
    """What the collective does in a group of one."""

    def restore(self) -> None:
        for target, copy in self.saved:
            target.copy_(copy)


Connect = Callable[[int], Any]
"""Form generation ``gen``'s inner backend (blocks until every member joined, or raises)."""


class ResilientGroup(dist.ProcessGroup):
    """The default group under the shim (see the module docstring)."""

    def __init__(self, *, rank: int, size: int, backend: str, connect: Connect,
                 on_failure: Callable[[ResilientGroup, str], None], abandoned: Callable[[int], bool],
                 collective_timeout_s: float, slice_s: float = 0.5, first_slice_s: float = 0.02) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # as in LocalGroup
        self.backend = backend
        self.generation = -1
        """The generation joined; -1 while local."""
        self._connect = connect
        self._on_failure = on_failure
        self._abandoned = abandoned
        self._timeout_s = collective_timeout_s
        self._slice_s = slice_s
        self._first_slice_s = min(first_slice_s, slice_s)
        self._inner: Any = None
        self._log: list[_Op] = []
        self._retired: list[Any] = []
        self._unfinished: set[int] = set()
        """``id``s of backends left with a collective that did not finish (kept alive until exit)."""
        self._lock = threading.RLock()
        self.replays = 0
        """Steps replayed after a failure (for tests and logs)."""
        self.waited_s = 0.0
        """Seconds spent waiting for collectives to finish, all together (the step's ``wait`` phase)."""

    # -- generations ------------------------------------------------------------------------

    @property
    def local(self) -> bool:
        """True until the group joined a generation."""
        return self._inner is None

    def swap(self, generation: int) -> None:
        """Form ``generation`` and make it the one collectives go to (the old backend is dropped)."""
        inner = self._connect(generation)
        with self._lock:
            old, self._inner, self.generation = self._inner, inner, generation
        self._retire(old)

    def new_step(self) -> None:
        """A step boundary: the collectives logged so far can no longer need a replay."""
        with self._lock:
            self._log.clear()

    def shutdown(self) -> None:
        """Drop the backends now, while the interpreter is whole (``destroy_process_group``, or at exit).

        A gloo backend left for the interpreter's finalisation can abort the process
        ("terminate called without an active exception") as its worker threads let go of their
        last objects. Each backend whose collectives all finished is destroyed here (its idle
        workers join at once); one left with an unfinished collective stays: its destructor would
        wait on a frozen peer until the backend's own timeout.
        """
        with self._lock:
            old, self._inner = self._inner, None
            self._retire(old)
            self._retired = [b for b in self._retired if id(b) in self._unfinished]
            self._log.clear()

    def _retire(self, backend: Any) -> None:
        # Kept, not destroyed, until `shutdown`: a backend's destructor joins its worker threads, and
        # one stuck on a frozen peer's socket would block the step until the backend's own timeout.
        if backend is not None:
            self._retired.append(backend)

    # -- collectives ------------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Done:  # type: ignore[override]
        opts = opts if opts is not None else dist.AllreduceOptions()
        return self._run(_Op("allreduce", lambda pg: pg.allreduce(tensors, opts), _copies(tensors), _nothing),
                         tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Done:  # type: ignore[override]
        opts = opts if opts is not None else dist.BroadcastOptions()
        saved = _copies(tensors) if opts.rootRank == self.rank() else []
        return self._run(_Op("broadcast", lambda pg: pg.broadcast(tensors, opts), saved, _nothing), tensors)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Done:  # type: ignore[override]
        opts = opts if opts is not None else AllgatherOptions()

        def local() -> None:
            for outs, inp in zip(outputs, inputs, strict=True):
                for out in outs:
                    out.copy_(inp)
        return self._run(_Op("allgather", lambda pg: pg.allgather(outputs, inputs, opts), [], local), inputs)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Done:
        opts = opts if opts is not None else AllgatherOptions()

        def local() -> None:
            output.copy_(input.reshape(1, -1).expand(self.size(), -1).reshape(output.shape))
        return self._run(_Op("allgather", lambda pg: pg._allgather_base(output, input, opts), [], local), [output])

    def barrier(self, opts: Any = None) -> Done:
        opts = opts if opts is not None else dist.BarrierOptions()
        return self._run(_Op("barrier", lambda pg: pg.barrier(opts), [], _nothing), [])

    def getBackendName(self) -> str:
        return self.backend

    def _run(self, op: _Op, result: Sequence[torch.Tensor]) -> Done:
        with self._lock:
            if self._inner is None:
                op.local()
                return Done(result)
            self._log.append(op)
            try:
                self._complete(op)
            except CollectiveFailed as exc:
                self._recover(str(exc))
        return Done(result)

    def _recover(self, reason: str) -> None:
        """Have the next generation formed (``on_failure``), then replay the step; again if that fails too."""
        while True:
            self._on_failure(self, reason)  # returns with a new generation swapped in, or raises
            self.replays += 1
            try:
                for op in list(self._log):
                    op.restore()
                    self._complete(op)
                return
            except CollectiveFailed as exc:
                reason = str(exc)

    def _complete(self, op: _Op) -> None:
        """Issue ``op`` on the current backend and wait for it in slices; `CollectiveFailed` if it cannot finish.

        The slices start short and double up to ``slice_s``: a collective that waits on a peer the
        coordinator already knows is lost gives up within ``first_slice_s`` (the usual case: the
        loss is noticed while the ranks compute), and a long wait on a straggler costs few store
        round trips.
        """
        gen, inner = self.generation, self._inner
        try:
            work = op.issue(inner)
        except RuntimeError as exc:
            raise CollectiveFailed(f"{op.name} in generation {gen} could not start: {exc}") from exc
        started, slice_s = time.monotonic(), self._first_slice_s
        while True:
            why = ""
            try:
                work.wait(timedelta(seconds=slice_s))
                self.waited_s += time.monotonic() - started
                return
            except RuntimeError as exc:
                if not any(s in str(exc) for s in _TIMED_OUT):
                    why = _first_line(exc)
            if why:
                # The work finished with an error: the backend has nothing in flight. Dropping it now
                # closes its connections, so peers blocked on this rank (not on the dead one: a ring
                # all-reduce waits on its neighbour) fail at once instead of waiting for the lost key.
                work = inner = None
                self._drop_failed(gen)
                raise CollectiveFailed(f"{op.name} in generation {gen} failed: {why}")
            waited = time.monotonic() - started
            if self._abandoned(gen):
                self._unfinished.add(id(inner))
                raise CollectiveFailed(f"{op.name} in generation {gen}: the coordinator is replacing a rank")
            if waited > self._timeout_s:
                self._unfinished.add(id(inner))
                raise CollectiveFailed(f"{op.name} in generation {gen} stalled for {waited:.0f} s")
            slice_s = min(slice_s * 2, self._slice_s)

    def _drop_failed(self, gen: int) -> None:
        """Let go of generation ``gen``'s backend after a failed collective (see `_complete`).

        The last reference goes in a short thread: the backend's destructor joins its workers
        (tens of milliseconds, without the GIL), and the failure report need not wait for that.
        """
        with self._lock:  # against a swap or shutdown from another thread
            if self.generation != gen or self._inner is None or isinstance(self._inner, _Failed):
                return
            holder: list[Any] = [self._inner]
            self._inner = _Failed(gen)
        # not a daemon: the interpreter joins it before finalising (a backend destroyed then aborts the process)
        threading.Thread(target=holder.clear, name=f"rt-drop-g{gen}").start()


class _Failed:
    """Stands for a generation's backend dropped after a failure, until the next generation is swapped in."""

    def __init__(self, gen: int) -> None:
        self.gen = gen

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"generation {self.gen}'s backend was closed after a failed collective")


def _copies(tensors: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(t, t.detach().clone()) for t in tensors]


def _nothing() -> None:
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
