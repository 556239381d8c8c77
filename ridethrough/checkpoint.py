"""Application checkpoints that barely stall training: copy to staging memory, write in the background.

    handle = ridethrough.checkpoint.save_async({"model": model.state_dict(), "optim": opt.state_dict()}, path)
    ...                      # train on; the originals may change the moment save_async returns
    handle.wait()            # or poll handle.done() / handle.error at a safe point
    state = ridethrough.checkpoint.load(path)

The only blocking part is one copy of every tensor into reusable host buffers (page-locked when
CUDA exists). A background thread checksums and writes the copy to a temporary file beside
``path``, fsyncs it, renames it over ``path`` and fsyncs the directory: a save cut short (kill -9,
power loss) leaves the previous checkpoint whole and the partial one under a hidden temp name.

File format: blobs first, the index last, so the writer streams the staging buffer once::

    b"RTCKPT01" + 56 zero bytes | blob | pad to 64 | blob | ... | index JSON | trailer (32 bytes)
    trailer = index_offset u64, index_len u64, index_crc32 u32, 4 zero bytes, b"RTCKEND1"

The index holds the tree (dicts, lists, tuples, str/int/float/bool/None, tensors as
``{"$tensor": i}``; a dict subclass such as a module's OrderedDict comes back a dict, same order)
and per tensor its key, dtype, shape, file offset, size and crc32. Why this and not ``torch.save``:
loading never unpickles (a checkpoint cannot run code), each tensor's bytes are written verbatim
(no serialisation pass), and a crc32 per blob (zlib, GIL released, ~3 GB/s) names the tensor that
went bad. crc32 detects accidental damage (torn or truncated writes, bit rot), not tampering.
torch is imported inside functions: ``import ridethrough`` never needs it.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from ridethrough.checkpoint_format import (
    ALIGN,
    Blob,
    BlobEntry,
    CheckpointCorrupt,
    CheckpointInfo,
    aligned,
    byte_view,
    decode_tree,
    dtype_name,
    encode_tree,
    fsync_dir,
    read_blob,
    read_index,
    write_file,
)

__all__ = ["ALIGN", "BlobEntry", "CheckpointCorrupt", "CheckpointInfo", "CheckpointWriteError", "Checkpointer",
           "SaveHandle", "aligned", "digest", "dtype_name", "fsync_dir", "load", "save", "save_async", "verify"]


def save(state_dict: object, path: str | os.PathLike[str]) -> None:
    """Write ``state_dict`` to ``path`` now (same format and atomic replace as `save_async`)."""
    tensors: list[tuple[str, torch.Tensor]] = []
    tree = encode_tree(state_dict, "", tensors)
    blobs = [(key, t, byte_view(t.detach().cpu())) for key, t in tensors]
    write_file(_checked_path(path), tree, blobs, None)


def _checked_path(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    if not p.parent.is_dir():  # fail at the call, not later in a background thread
        raise FileNotFoundError(f"checkpoint directory {p.parent} does not exist")
    return p


# ---- saving in the background ----

class CheckpointWriteError(RuntimeError):
    """The background write of a checkpoint failed; the previous file at its path is untouched."""


class SaveHandle:
    """One background save. ``staged_s``: how long the caller was blocked (the stall)."""

    def __init__(self, path: Path, nbytes: int, staged_s: float) -> None:
        self.path = path
        self.nbytes = nbytes
        self.staged_s = staged_s
        self.written_s: float | None = None
        """Seconds the background write took, once done."""
        self.digest: str | None = None
        """The written file's `digest`, once done."""
        self._done = threading.Event()
        self._error: Exception | None = None

    def done(self) -> bool:
        """True once the write finished, well or not (see `error`)."""
        return self._done.is_set()

    @property
    def error(self) -> Exception | None:
        """Why the write failed, or None: a training loop can check this at a safe point instead of waiting."""
        return self._error

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until the file is durable at `path`; `CheckpointWriteError` if it failed, TimeoutError if slow."""
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"checkpoint {self.path} not written within {timeout_s} s")
        if self._error is not None:
            raise CheckpointWriteError(f"writing checkpoint {self.path} failed: {self._error}") from self._error

    def _finish(self, error: Exception | None, digest: str | None, written_s: float) -> None:
        self._error, self.digest, self.written_s = error, digest, written_s
        self._done.set()


class Checkpointer:
    """Staging buffers and a writer thread for `save_async` (one per process is usual: `save_async` keeps one).

    At most ``max_buffers`` staging buffers exist (each as large as one state dict): with the default
    2, one save can stage while the previous still writes; a third blocks until a write finishes
    (saving faster than the disk can take it waits instead of growing memory without bound).
    ``io_bytes_per_s`` caps the writer's bandwidth so a checkpoint does not starve the job's own I/O.
    The writer thread is not a daemon: a process that exits normally finishes its last save first.
    """

    def __init__(self, *, max_buffers: int = 2, pin_memory: bool | None = None,
                 io_bytes_per_s: float | None = None) -> None:
        if max_buffers < 1:
            raise ValueError(f"max_buffers must be at least 1, not {max_buffers}")
        self._max_buffers = max_buffers
        self._pin = pin_memory
        self._io_bytes_per_s = io_bytes_per_s
        self._cond = threading.Condition()
        self._free: list[torch.Tensor] = []
        self._lent = 0
        self._jobs: deque[Callable[[], None]] = deque()
        self._worker: threading.Thread | None = None

    def save_async(self, state_dict: object, path: str | os.PathLike[str]) -> SaveHandle:
        """Copy ``state_dict``'s tensors to staging memory and write them to ``path`` in the background."""
        started = time.perf_counter()
        target = _checked_path(path)
        tensors: list[tuple[str, torch.Tensor]] = []
        tree = encode_tree(state_dict, "", tensors)
        offsets, total = [], 0
        for _, t in tensors:
            offsets.append(total)
            total = aligned(total + t.numel() * t.element_size())
        buf = self._acquire(total)
        try:
            blobs = _stage(tensors, offsets, buf)
        except BaseException:
            self._release(buf)
            raise
        handle = SaveHandle(target, total, time.perf_counter() - started)
        self._submit(lambda: self._write(handle, tree, blobs, buf))
        return handle

    def close(self, timeout_s: float | None = None) -> None:
        """Wait for pending writes (up to ``timeout_s``) and free the staging buffers."""
        with self._cond:
            worker = self._worker
        if worker is not None:
            worker.join(timeout_s)
        with self._cond:
            self._free.clear()

    def _write(self, handle: SaveHandle, tree: Any, blobs: list[Blob], buf: torch.Tensor) -> None:
        started = time.perf_counter()
        try:
            digest = write_file(handle.path, tree, blobs, self._io_bytes_per_s)
            handle._finish(None, digest, time.perf_counter() - started)
        except Exception as exc:  # recorded on the handle, never thrown into the training loop
            handle._finish(exc, None, time.perf_counter() - started)
        finally:
            self._release(buf)

    def _submit(self, job: Callable[[], None]) -> None:
        with self._cond:
            self._jobs.append(job)
            if self._worker is None:
                self._worker = threading.Thread(target=self._drain, name="ridethrough-checkpoint-writer")
                self._worker.start()

    def _drain(self) -> None:
        while True:
            with self._cond:
                if not self._jobs:
                    self._worker = None
                    return
                job = self._jobs.popleft()
            job()

    def _acquire(self, nbytes: int) -> torch.Tensor:
        with self._cond:
            while True:
                fits = [b for b in self._free if b.numel() >= nbytes]
                if fits:
                    best = min(fits, key=lambda b: b.numel())
                    self._free.remove(best)
                    self._lent += 1
                    return best
                if self._free or self._lent < self._max_buffers:
                    if self._free:  # too small for this state dict: replace it
                        self._free.pop(0)
                    self._lent += 1
                    break
                self._cond.wait()
        try:
            return _allocate(nbytes, self._pin)
        except BaseException:
            self._release(None)
            raise

    def _release(self, buf: torch.Tensor | None) -> None:
        with self._cond:
            self._lent -= 1
            if buf is not None:
                self._free.append(buf)
            self._cond.notify_all()


def _allocate(nbytes: int, pin: bool | None) -> torch.Tensor:
    import torch

    # Plain 4 KiB pages: on this kind of VM, MADV_HUGEPAGE made the first fault-in 3x slower
    # (synchronous compaction) and later copies no faster.
    pinned = pin if pin is not None else torch.cuda.is_available()
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)


def _stage(tensors: list[tuple[str, torch.Tensor]], offsets: list[int], buf: torch.Tensor) -> list[Blob]:
    import torch

    flat, blobs, gpus = buf.numpy(), [], set()
    for (key, t), at in zip(tensors, offsets, strict=True):
        n = t.numel() * t.element_size()
        staged = buf[at:at + n].view(t.dtype).view(t.shape)
        staged.copy_(t.detach(), non_blocking=t.is_cuda)
        if t.is_cuda:
            gpus.add(t.device)
        blobs.append((key, staged, flat[at:at + n]))
    for gpu in gpus:  # the caller may change its tensors once we return: the copies must have landed
        torch.cuda.synchronize(gpu)
    return blobs


_default_lock = threading.Lock()
_default: Checkpointer | None = None


def save_async(state_dict: object, path: str | os.PathLike[str], *,
               checkpointer: Checkpointer | None = None) -> SaveHandle:
    """Stage ``state_dict`` (the only blocking part) and write it to ``path`` in the background.

    The tensors may change as soon as this returns. Without ``checkpointer``, a process-wide one
    (made on first use) keeps its staging buffers between calls, which is what makes the copy fast;
    pass your own and `Checkpointer.close` it to give that memory back.
    """
    global _default
    if checkpointer is None:
        with _default_lock:
            _default = checkpointer = _default or Checkpointer()
    return checkpointer.save_async(state_dict, path)



def load(path: str | os.PathLike[str], *, map_location: str | torch.device = "cpu") -> Any:
    """Read a checkpoint, checking every checksum; `CheckpointCorrupt` names the file (and tensor) at fault."""
    import torch

    p = Path(path)
    with open(p, "rb") as f:
        tree, entries, _ = read_index(f, p)
        tensors = []
        for e in entries:
            raw = torch.empty(e.nbytes, dtype=torch.uint8)
            read_blob(f, p, e, raw.numpy().data)
            t = raw.view(e.dtype).view(e.shape)
            tensors.append(t if torch.device(map_location).type == "cpu" else t.to(map_location))
    return decode_tree(tree, tensors, str(p))


def verify(path: str | os.PathLike[str]) -> CheckpointInfo:
    """Check a checkpoint end to end without building tensors; `CheckpointCorrupt` if anything is off."""
    p = Path(path)
    with open(p, "rb") as f:
        tree, entries, dig = read_index(f, p)
        for e in entries:
            read_blob(f, p, e, None)
    decode_tree(tree, [None] * len(entries), str(p))  # only the tree's shape is checked
    return CheckpointInfo(p, len(entries), sum(e.nbytes for e in entries), dig)


def digest(path: str | os.PathLike[str]) -> str:
    """A name for the file's content that costs one small read: sha256 of its index and trailer.

    The index holds every blob's crc32, so a file whose blobs still pass `verify` and whose digest
    matches is the file that was written.
    """
    p = Path(path)
    with open(p, "rb") as f:
        return read_index(f, p)[2]

