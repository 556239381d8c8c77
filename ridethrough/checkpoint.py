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

import hashlib
import io
import json
import math
import os
import secrets
import struct
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch

MAGIC = b"RTCKPT01"
END_MAGIC = b"RTCKEND1"
_PREAMBLE = MAGIC + bytes(56)
_TRAILER = struct.Struct("<QQI4x8s")
ALIGN = 64
_CHUNK = 32 << 20  # write/crc granularity: large enough for full-speed I/O, small enough to throttle smoothly
_MAX_INDEX = 256 << 20


class CheckpointCorrupt(ValueError):
    """A checkpoint failed a check (trailer, index checksum, a blob's crc32); the message names the file."""


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """What `verify` found: a sound file with ``tensors`` blobs of ``data_bytes``; ``digest`` names its content."""

    path: Path
    tensors: int
    data_bytes: int
    digest: str


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of `ALIGN` (64): where the next blob may start."""
    return -(-n // ALIGN) * ALIGN


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``: how files and frames name a dtype."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: object, where: str) -> torch.dtype:
    """The dtype a file or frame names; `CheckpointCorrupt` (prefixed ``where``) for anything else."""
    import torch

    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise CheckpointCorrupt(f"{where}: unknown dtype {name!r}")
    return dtype


def byte_view(t: torch.Tensor) -> np.ndarray:
    """The bytes of a CPU tensor as a flat uint8 array (a contiguous copy only if it is not already)."""
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


# ---- the tree: nested containers with tensors as leaves, stored as tagged JSON ----

def _encode(obj: object, where: str, tensors: list[tuple[str, torch.Tensor]]) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        if type(obj) not in (torch.Tensor, torch.nn.Parameter) or obj.layout != torch.strided or obj.is_quantized:
            raise TypeError(f"cannot checkpoint {type(obj).__name__} ({obj.layout}) at {where or '<root>'}: "
                            "only plain dense tensors (use torch.distributed.checkpoint for DTensor)")
        tensors.append((where or "<root>", obj))
        return {"$tensor": len(tensors) - 1}
    if obj is None or isinstance(obj, bool | int | float | str):  # json keeps NaN and inf as NaN/Infinity
        return obj
    if isinstance(obj, list | tuple):
        items = [_encode(v, f"{where}[{i}]", tensors) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else {"$tuple": items}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in obj):
            return {k: _encode(v, f"{where}.{k}" if where else k, tensors) for k, v in obj.items()}
        return {"$dict": [[_encode(k, f"{where}<key>", tensors), _encode(v, f"{where}[{k!r}]", tensors)]
                          for k, v in obj.items()]}
    raise TypeError(f"cannot checkpoint {type(obj).__name__} at {where or '<root>'}: supported are tensors, dicts, "
                    "lists, tuples, str, int, float, bool and None")


def _decode(node: Any, tensors: list[Any], where: str) -> Any:
    if isinstance(node, list):
        return [_decode(v, tensors, where) for v in node]
    if not isinstance(node, dict):
        return node
    if len(node) != 1 or not next(iter(node)).startswith("$"):
        return {k: _decode(v, tensors, where) for k, v in node.items()}
    (tag, value), = node.items()
    try:
        if tag == "$tensor" and isinstance(value, int) and 0 <= value < len(tensors):
            return tensors[value]
        if tag == "$tuple" and isinstance(value, list):
            return tuple(_decode(v, tensors, where) for v in value)
        if tag == "$dict" and isinstance(value, list):
            return {_decode(k, tensors, where): _decode(v, tensors, where) for k, v in value}
    except (TypeError, ValueError) as exc:  # an unhashable key, a pair that is not one
        raise CheckpointCorrupt(f"{where}: bad tree node {str(node)[:80]} ({exc})") from exc
    raise CheckpointCorrupt(f"{where}: bad tree node {str(node)[:80]}")


# ---- writing ----

def fsync_dir(path: Path) -> None:
    """fsync a directory, so that a rename or a new file in it survives a power cut."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


Blob = tuple[str, "torch.Tensor", "np.ndarray"]
"""(key path, a tensor with the blob's dtype and shape, its bytes as a flat uint8 array)."""


def _write_file(path: Path, tree: Any, blobs: list[Blob],
                io_bytes_per_s: float | None) -> str:
    """Write the file through a temp name, fsync, rename, fsync the directory; the digest of what was written."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    entries: list[dict[str, Any]] = []
    started, written = time.monotonic(), 0
    try:
        with open(tmp, "wb") as f:
            f.write(_PREAMBLE)
            for key, t, data in blobs:
                offset, crc = f.tell(), 0
                view = data.data
                for at in range(0, len(view), _CHUNK):
                    chunk = view[at:at + _CHUNK]
                    crc = zlib.crc32(chunk, crc)
                    f.write(chunk)
                    written += len(chunk)
                    if io_bytes_per_s:  # cap the background writer so it leaves the job's own I/O alone
                        time.sleep(max(0.0, written / io_bytes_per_s - (time.monotonic() - started)))
                f.write(bytes(aligned(f.tell()) - f.tell()))
                entries.append({"key": key, "dtype": dtype_name(t.dtype), "shape": list(t.shape), "offset": offset,
                                "nbytes": len(view), "crc32": crc})
            index = json.dumps({"format": 1, "tree": tree, "tensors": entries}, separators=(",", ":")).encode()
            trailer = _TRAILER.pack(f.tell(), len(index), zlib.crc32(index), END_MAGIC)
            f.write(index + trailer)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return _digest(index, trailer)


def _digest(index: bytes, trailer: bytes) -> str:
    return "sha256:" + hashlib.sha256(index + trailer).hexdigest()


def save(state_dict: object, path: str | os.PathLike[str]) -> None:
    """Write ``state_dict`` to ``path`` now (same format and atomic replace as `save_async`)."""
    tensors: list[tuple[str, torch.Tensor]] = []
    tree = _encode(state_dict, "", tensors)
    blobs = [(key, t, byte_view(t.detach().cpu())) for key, t in tensors]
    _write_file(_checked_path(path), tree, blobs, None)


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
        tree = _encode(state_dict, "", tensors)
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
            digest = _write_file(handle.path, tree, blobs, self._io_bytes_per_s)
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


# ---- reading ----

@dataclass(frozen=True, slots=True)
class BlobEntry:
    """One tensor's place in a file or frame: ``key``, dtype, shape, byte ``offset``, ``nbytes``, ``crc32``."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    crc32: int

    @classmethod
    def parse(cls, raw: object, *, where: str, lo: int, hi: int) -> BlobEntry:
        """Check an index entry that must lie within bytes [lo, hi); `CheckpointCorrupt` naming ``where``."""
        if not isinstance(raw, dict) or not isinstance(raw.get("key"), str):
            raise CheckpointCorrupt(f"{where}: bad tensor entry {str(raw)[:80]}")
        where = f"{where}: tensor {raw['key']}"
        dtype = parse_dtype(raw.get("dtype"), where)
        shape, offset, nbytes, crc = raw.get("shape"), raw.get("offset"), raw.get("nbytes"), raw.get("crc32")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
                and isinstance(offset, int) and isinstance(nbytes, int) and isinstance(crc, int)):
            raise CheckpointCorrupt(f"{where}: bad shape/offset/nbytes/crc32 in {str(raw)[:120]}")
        if (nbytes != math.prod(shape) * dtype.itemsize or not lo <= offset <= offset + nbytes <= hi
                or offset % dtype.itemsize):
            raise CheckpointCorrupt(f"{where}: {nbytes} bytes at {offset} do not fit shape {shape} "
                                    f"{dtype_name(dtype)} within bytes [{lo}, {hi}), aligned to its element size")
        return cls(raw["key"], dtype, tuple(shape), offset, nbytes, crc)

    def check(self, got: int, where: str) -> None:
        """Raise `CheckpointCorrupt` unless ``got`` (the crc32 of this blob's bytes as read) is the one expected."""
        if got != self.crc32:
            raise CheckpointCorrupt(f"{where}: tensor {self.key} fails its checksum "
                                    f"(crc32 {got:#010x}, expected {self.crc32:#010x})")


def _read_index(f: io.BufferedReader, path: Path) -> tuple[Any, list[BlobEntry], str]:
    size = os.fstat(f.fileno()).st_size
    if size < len(_PREAMBLE) + _TRAILER.size or f.read(len(MAGIC)) != MAGIC:
        raise CheckpointCorrupt(f"{path}: not a ridethrough checkpoint (bad magic or {size} bytes only)")
    f.seek(size - _TRAILER.size)
    trailer = f.read(_TRAILER.size)
    at, n, crc, end = _TRAILER.unpack(trailer)
    if end != END_MAGIC:
        raise CheckpointCorrupt(f"{path}: no trailer: the file was cut short or damaged")
    if at < len(_PREAMBLE) or n > _MAX_INDEX or at + n + _TRAILER.size != size:
        raise CheckpointCorrupt(f"{path}: trailer points outside the file ({n} bytes at {at} of {size})")
    f.seek(at)
    index = f.read(n)
    if zlib.crc32(index) != crc:
        raise CheckpointCorrupt(f"{path}: index fails its checksum")
    try:
        doc = json.loads(index)
    except ValueError as exc:
        raise CheckpointCorrupt(f"{path}: index is not JSON ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("format") != 1 or not isinstance(doc.get("tensors"), list):
        raise CheckpointCorrupt(f"{path}: unknown index format {str(doc)[:80]}")
    entries = [BlobEntry.parse(e, where=str(path), lo=len(_PREAMBLE), hi=at) for e in doc["tensors"]]
    return doc.get("tree"), entries, _digest(index, trailer)


def _read_blob(f: io.BufferedReader, path: Path, e: BlobEntry, into: memoryview | None) -> None:
    """Read one blob into ``into`` (or through a small scratch buffer) and check its crc32."""
    f.seek(e.offset)
    scratch = memoryview(bytearray(0 if into is not None else min(e.nbytes, _CHUNK)))
    crc = 0
    for at in range(0, e.nbytes, _CHUNK):
        chunk = into[at:at + _CHUNK] if into is not None else scratch[:min(_CHUNK, e.nbytes - at)]
        if f.readinto(chunk) != len(chunk):
            raise CheckpointCorrupt(f"{path}: tensor {e.key} is cut short")
        crc = zlib.crc32(chunk, crc)
    e.check(crc, str(path))


def load(path: str | os.PathLike[str], *, map_location: str | torch.device = "cpu") -> Any:
    """Read a checkpoint, checking every checksum; `CheckpointCorrupt` names the file (and tensor) at fault."""
    import torch

    p = Path(path)
    with open(p, "rb") as f:
        tree, entries, _ = _read_index(f, p)
        tensors = []
        for e in entries:
            raw = torch.empty(e.nbytes, dtype=torch.uint8)
            _read_blob(f, p, e, raw.numpy().data)
            t = raw.view(e.dtype).view(e.shape)
            tensors.append(t if torch.device(map_location).type == "cpu" else t.to(map_location))
    return _decode(tree, tensors, str(p))


def verify(path: str | os.PathLike[str]) -> CheckpointInfo:
    """Check a checkpoint end to end without building tensors; `CheckpointCorrupt` if anything is off."""
    p = Path(path)
    with open(p, "rb") as f:
        tree, entries, dig = _read_index(f, p)
        for e in entries:
            _read_blob(f, p, e, None)
    _decode(tree, [None] * len(entries), str(p))  # only the tree's shape is checked
    return CheckpointInfo(p, len(entries), sum(e.nbytes for e in entries), dig)


def digest(path: str | os.PathLike[str]) -> str:
    """A name for the file's content that costs one small read: sha256 of its index and trailer.

    The index holds every blob's crc32, so a file whose blobs still pass `verify` and whose digest
    matches is the file that was written.
    """
    p = Path(path)
    with open(p, "rb") as f:
        return _read_index(f, p)[2]
