"""A durable on-disk spool of batches the store could not take yet.

A batch is the raw OTLP requests it was built from plus its insert deduplication token,
so a replay rebuilds the same rows and ClickHouse drops any part that had landed.
Each batch is one file, written to a temporary name, fsynced, renamed and the folder
fsynced: a file is either whole or absent, even if the process is killed mid-write.
A file that fails its checksum is moved to ``quarantine/`` and counted, never deleted.

File layout (little-endian)::

    b"RTSPOOL1" | u32 header length | header JSON {"token", "created_ns"}
    then per request: u8 signal | u32 length | bytes
    then u32 CRC-32 of everything before it
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ridethrough.exporters.signals import Signal

log = logging.getLogger(__name__)

_MAGIC = b"RTSPOOL1"
_SUFFIX = ".spool"


class SpoolFull(Exception):
    """Writing the batch would take the spool over its byte limit."""


class SpoolCorrupt(Exception):
    """A spool file is unreadable; it has been quarantined."""


@dataclass(frozen=True, slots=True)
class SpooledBatch:
    """A batch read back from the spool."""

    path: Path
    token: str
    created_ns: int
    requests: tuple[tuple[Signal, bytes], ...]


def encode(token: str, requests: list[tuple[Signal, bytes]], *, created_ns: int) -> bytes:
    """The bytes of one spool file."""
    header = json.dumps({"token": token, "created_ns": created_ns}).encode()
    parts = [_MAGIC, struct.pack("<I", len(header)), header]
    for signal, raw in requests:
        parts += [struct.pack("<BI", signal.code, len(raw)), raw]
    body = b"".join(parts)
    return body + struct.pack("<I", zlib.crc32(body))


def decode(data: bytes) -> tuple[str, int, tuple[tuple[Signal, bytes], ...]]:
    """(token, created_ns, requests) from a spool file's bytes; ValueError if damaged."""
    if len(data) < len(_MAGIC) + 8 or not data.startswith(_MAGIC):
        raise ValueError("not a spool file (bad magic or too short)")
    body, (crc,) = data[:-4], struct.unpack("<I", data[-4:])
    if zlib.crc32(body) != crc:
        raise ValueError("checksum mismatch")
    pos = len(_MAGIC)
    (hlen,) = struct.unpack_from("<I", body, pos)
    header = json.loads(body[pos + 4: pos + 4 + hlen])
    pos += 4 + hlen
    requests: list[tuple[Signal, bytes]] = []
    while pos < len(body):
        code, length = struct.unpack_from("<BI", body, pos)
        pos += 5
        requests.append((Signal.from_code(code), body[pos: pos + length]))
        pos += length
    return str(header["token"]), int(header["created_ns"]), tuple(requests)


class Spool:
    """The spool folder: write, list, read, remove and quarantine batches."""

    def __init__(self, directory: str | os.PathLike[str], *, max_bytes: int) -> None:
        self.dir = Path(directory)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "quarantine").mkdir(exist_ok=True)
        self._sweep_temporaries()
        self._bytes = sum(p.stat().st_size for p in self.pending())

    def _sweep_temporaries(self) -> None:
        # A temporary file is a write that never completed: its batch was never acknowledged.
        for tmp in self.dir.glob(".tmp-*"):
            tmp.unlink(missing_ok=True)

    @property
    def bytes_used(self) -> int:
        """Bytes in pending spool files."""
        return self._bytes

    def write(self, token: str, requests: list[tuple[Signal, bytes]]) -> Path:
        """Durably write one batch; returns its path. `SpoolFull` if over the limit."""
        created_ns = time.time_ns()
        data = encode(token, requests, created_ns=created_ns)
        with self._lock:
            if self._bytes + len(data) > self.max_bytes:
                raise SpoolFull(f"spool {self.dir} holds {self._bytes} bytes, limit {self.max_bytes}")
            self._bytes += len(data)
        final = self.dir / f"{created_ns:020d}-{token}{_SUFFIX}"
        try:
            _write_durably(self.dir, final, data)
        except BaseException:
            with self._lock:
                self._bytes -= len(data)
            raise
        return final

    def pending(self) -> list[Path]:
        """Spool files, oldest first."""
        # A ".tmp-" file is a write in progress (or one that died): never a batch to replay.
        return sorted(p for p in self.dir.glob(f"*{_SUFFIX}") if not p.name.startswith(".tmp-"))

    def load(self, path: Path) -> SpooledBatch:
        """Read one batch; a damaged file is quarantined and `SpoolCorrupt` raised."""
        try:
            token, created_ns, requests = decode(path.read_bytes())
        except (ValueError, KeyError, struct.error) as exc:
            self.quarantine(path, str(exc))
            raise SpoolCorrupt(f"{path.name}: {exc}") from exc
        return SpooledBatch(path, token, created_ns, requests)

    def remove(self, path: Path) -> None:
        """Forget a batch that is now in the store."""
        self._forget(path, lambda: path.unlink(missing_ok=True))

    def quarantine(self, path: Path, reason: str) -> None:
        """Move a batch aside, with the reason beside it, for a human to look at."""
        target = self.dir / "quarantine" / path.name
        log.error("spool: quarantining %s: %s", path.name, reason)
        self._forget(path, lambda: os.replace(path, target))
        try:
            (self.dir / "quarantine" / (path.name + ".reason")).write_text(reason + "\n")
        except OSError as exc:  # a full disk must not stop replay: the batch is aside, the log has the reason
            log.error("spool: could not write the reason beside %s: %s", path.name, exc)

    def _forget(self, path: Path, action: Callable[[], object]) -> None:
        size = path.stat().st_size if path.exists() else 0
        action()
        _fsync_dir(self.dir)
        with self._lock:
            self._bytes = max(0, self._bytes - size)


def _write_durably(directory: Path, final: Path, data: bytes) -> None:
    tmp = directory / f".tmp-{final.name}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a disk that filled up mid-write keeps no half batch
        raise
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
