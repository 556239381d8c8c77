"""The checkpoint file format: the tagged-JSON tree, writing a file atomically, and reading it back checked.

See `ridethrough.checkpoint` for the layout; this module is shared with weight publishing
(`ridethrough.actuators.publish`), whose frames carry the same index entries.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import secrets
import struct
import time
import zlib
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

def encode_tree(obj: object, where: str, tensors: list[tuple[str, torch.Tensor]]) -> Any:
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
        items = [encode_tree(v, f"{where}[{i}]", tensors) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else {"$tuple": items}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in obj):
            return {k: encode_tree(v, f"{where}.{k}" if where else k, tensors) for k, v in obj.items()}
        return {"$dict": [[encode_tree(k, f"{where}<key>", tensors), encode_tree(v, f"{where}[{k!r}]", tensors)]
                          for k, v in obj.items()]}
    raise TypeError(f"cannot checkpoint {type(obj).__name__} at {where or '<root>'}: supported are tensors, dicts, "
                    "lists, tuples, str, int, float, bool and None")


def decode_tree(node: Any, tensors: list[Any], where: str) -> Any:
    if isinstance(node, list):
        return [decode_tree(v, tensors, where) for v in node]
    if not isinstance(node, dict):
        return node
    if len(node) != 1 or not next(iter(node)).startswith("$"):
        return {k: decode_tree(v, tensors, where) for k, v in node.items()}
    (tag, value), = node.items()
    try:
        if tag == "$tensor" and isinstance(value, int) and 0 <= value < len(tensors):
            return tensors[value]
        if tag == "$tuple" and isinstance(value, list):
            return tuple(decode_tree(v, tensors, where) for v in value)
        if tag == "$dict" and isinstance(value, list):
            return {decode_tree(k, tensors, where): decode_tree(v, tensors, where) for k, v in value}
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


def write_file(path: Path, tree: Any, blobs: list[Blob],
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
    return content_digest(index, trailer)


def content_digest(index: bytes, trailer: bytes) -> str:
    return "sha256:" + hashlib.sha256(index + trailer).hexdigest()


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


def read_index(f: io.BufferedReader, path: Path) -> tuple[Any, list[BlobEntry], str]:
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
    return doc.get("tree"), entries, content_digest(index, trailer)


def read_blob(f: io.BufferedReader, path: Path, e: BlobEntry, into: memoryview | None) -> None:
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

