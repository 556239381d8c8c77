"""Versioned weights from a trainer to N replicas (inference or rollout workers), swapped in whole.

    pub = WeightPublisher(host="0.0.0.0")                   # trainer
    v = pub.publish(model.state_dict())                     # copies, returns at once
    pub.wait_delivered(v, count=4, timeout_s=30)

    sub = WeightSubscriber(("trainer-host", port), name="replica-3")   # each replica
    version, state = sub.current()          # once per request: one consistent pair, never half a model

Transport: TCP with a small framed protocol. One code path serves replicas on the trainer's host
(loopback moves GB/s, so shared memory would save little) and on other hosts or lab namespaces;
a replica that restarts or loses the link reconnects and is sent the newest version. Frames::

    header (24 bytes) = b"RTWP", protocol u8 (1), kind u8, 0 u16, meta_len u32, payload_len u64, meta_crc32 u32
    meta = JSON; payload = raw bytes

Kinds: HELLO (replica -> trainer: name, version it has), WEIGHTS (trainer -> replica: version and
per tensor key, dtype, shape, offset, size, crc32; payload = the tensors' bytes), ACK (replica ->
trainer: the version now in use). Every length is bounded before anything is allocated, the meta
and every tensor are checksummed, and a frame that fails a check is refused with `BadFrame`, the
connection dropped, and the replica keeps serving the version it had. Frames are checksummed, not
authenticated: bind the publisher to the job's own network.

A replica builds each version in fresh memory and swaps one reference under a lock, so a request
that took ``current()`` keeps a whole model even while the next version lands. A slow replica
gets the newest version when it is ready for one (intermediate versions are skipped).
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import struct
import threading
import zlib
from collections.abc import Mapping
from enum import IntEnum
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple

from ridethrough.checkpoint_format import BlobEntry, CheckpointCorrupt, aligned, dtype_name

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

MAGIC = b"RTWP"
PROTOCOL = 1
_HEADER = struct.Struct("<4sBBHIQI")
_MAX_RETRY_S = 10.0
MAX_META_BYTES = 16 << 20  # ~100k tensors' entries; anything larger is not a frame of ours


class Kind(IntEnum):
    """What a frame carries."""

    HELLO = 1
    WEIGHTS = 2
    ACK = 3


class BadFrame(ValueError):
    """A frame that fails a check: wrong magic or protocol, a length over its bound, a checksum, bad meta."""


class WeightVersion(NamedTuple):
    """One published version: its number and a read-only mapping of tensor name to tensor."""

    version: int
    state: Mapping[str, torch.Tensor]


# ---- frames ----

def send_frame(sock: socket.socket, kind: Kind, meta: Mapping[str, Any], payload: memoryview | None = None) -> None:
    """Write one frame (header, meta JSON, payload)."""
    body = json.dumps(meta, separators=(",", ":")).encode()
    size = 0 if payload is None else payload.nbytes
    sock.sendall(_HEADER.pack(MAGIC, PROTOCOL, kind, 0, len(body), size, zlib.crc32(body)) + body)
    if payload is not None and size:
        sock.sendall(payload)


def read_head(sock: socket.socket, *, max_payload: int) -> tuple[Kind, dict[str, Any], int]:
    """Read a frame's header and meta (not its payload): kind, meta, payload length. `BadFrame` if wrong."""
    magic, proto, kind, _, meta_len, payload_len, crc = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if magic != MAGIC:
        raise BadFrame(f"bad magic {magic!r}: not a ridethrough weight frame (is something else on this port?)")
    if proto != PROTOCOL or kind not in Kind.__members__.values():
        raise BadFrame(f"protocol {proto} kind {kind}: this side speaks protocol {PROTOCOL}, kinds {list(Kind)}")
    if meta_len > MAX_META_BYTES or payload_len > max_payload:
        raise BadFrame(f"frame of {meta_len} meta and {payload_len} payload bytes is over the limits "
                       f"({MAX_META_BYTES} and {max_payload})")
    body = _recv_exact(sock, meta_len)
    if zlib.crc32(body) != crc:
        raise BadFrame("frame meta fails its checksum")
    try:
        meta = json.loads(body)
    except ValueError as exc:
        raise BadFrame(f"frame meta is not JSON: {exc}") from exc
    if not isinstance(meta, dict):
        raise BadFrame(f"frame meta is {type(meta).__name__}, not an object")
    return Kind(kind), meta, payload_len


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"peer closed the connection mid-frame ({got} of {len(view)} bytes)" if got
                                  else "peer closed the connection")
        got += n


def _version(meta: Mapping[str, Any]) -> int:
    v = meta.get("version")
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise BadFrame(f"frame version {v!r} is not a non-negative integer")
    return v


# ---- trainer side ----

class _Staged:
    """One version's tensors in one buffer; the meta (with crc32s) is made once, by the first sender."""

    def __init__(self, version: int, state: Mapping[str, torch.Tensor]) -> None:
        import torch

        self.version = version
        self._entries: list[dict[str, Any]] = []
        at = 0
        for key, t in state.items():
            self._entries.append({"key": key, "dtype": dtype_name(t.dtype), "shape": list(t.shape),
                                  "offset": at, "nbytes": t.numel() * t.element_size()})
            at = aligned(at + t.numel() * t.element_size())  # a tensor view needs its dtype's alignment
        self.buf = torch.empty(at, dtype=torch.uint8)
        for e, t in zip(self._entries, state.values(), strict=True):
            self.buf[e["offset"]:e["offset"] + e["nbytes"]].view(t.dtype).view(t.shape).copy_(t.detach())
        self.payload = self.buf.numpy().data
        self._lock = threading.Lock()
        self._meta: dict[str, Any] | None = None

    def meta(self) -> dict[str, Any]:
        with self._lock:
            if self._meta is None:
                for e in self._entries:
                    e["crc32"] = zlib.crc32(self.payload[e["offset"]:e["offset"] + e["nbytes"]])
                self._meta = {"version": self.version, "tensors": self._entries}
            return self._meta


class WeightPublisher:
    """Serves versioned weights to every subscriber that connects to ``address``.

    ``publish`` copies the tensors (the trainer may change them as soon as it returns); one thread
    per subscriber sends it the newest version and waits for its ACK (up to ``ack_timeout_s``).
    """

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, ack_timeout_s: float = 120.0) -> None:
        self._server = socket.create_server((host, port))
        self.address: tuple[str, int] = self._server.getsockname()[:2]
        self._ack_timeout_s = ack_timeout_s
        self._cond = threading.Condition()
        self._latest: _Staged | None = None
        self._acked: dict[socket.socket, tuple[str, int]] = {}  # by connection: names need not be unique
        self._conns: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._publishing = threading.Lock()  # one publish at a time: versions are checked, then taken
        self.last_error: str | None = None
        self._accepting = threading.Thread(target=self._accept, name="ridethrough-publish-accept", daemon=True)
        self._accepting.start()

    def publish(self, state: Mapping[str, torch.Tensor], *, version: int | None = None) -> int:
        """Make ``state`` the newest version (``version``, or the last one + 1; it must grow); its number.

        Subscribers only take a version newer than theirs: a trainer that restarts should go on from
        its old numbers (e.g. publish with ``version=step``).
        """
        with self._publishing:
            last = self._latest.version if self._latest else 0
            version = last + 1 if version is None else version
            if version <= last:
                raise ValueError(f"version {version} is not newer than the published {last}: versions only grow")
            staged = _Staged(version, state)
            with self._cond:
                self._latest = staged
                self._cond.notify_all()
            return version

    def acked(self) -> dict[str, int]:
        """The version each connected subscriber (by name) last confirmed it has swapped in."""
        with self._cond:
            return dict(self._acked.values())

    def wait_delivered(self, version: int, *, count: int, timeout_s: float) -> bool:
        """True once ``count`` subscribers use ``version`` or newer; False at the deadline."""
        with self._cond:
            return self._cond.wait_for(lambda: sum(v >= version for _, v in self._acked.values()) >= count,
                                       timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop serving; subscribers see their connection close and keep their version.

        Returns once every connection is closed (or ``timeout_s`` passed), so the port is free again.
        """
        with self._cond:
            self._closed = True
            conns = list(self._conns)
            self._cond.notify_all()
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the accept thread
        self._server.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for thread in [self._accepting, *self._threads]:
            thread.join(timeout_s)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            thread = threading.Thread(target=self._serve, args=(conn,), name="ridethrough-publish-peer", daemon=True)
            with self._cond:
                if self._closed:
                    conn.close()
                    return
                self._threads = [t for t in self._threads if t.is_alive()] + [thread]
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        name = "?"
        with self._cond:
            self._conns.add(conn)
        try:
            conn.settimeout(self._ack_timeout_s)
            kind, meta, _ = read_head(conn, max_payload=0)
            if kind != Kind.HELLO or not isinstance(meta.get("name"), str):
                raise BadFrame(f"expected HELLO with a name, got {kind.name} {str(meta)[:80]}")
            name, sent = meta["name"], _version(meta)
            with self._cond:  # listed from the start with the version it already has (a reconnect may be current)
                self._acked[conn] = (name, sent)
                self._cond.notify_all()
            while (staged := self._next(sent)) is not None:
                send_frame(conn, Kind.WEIGHTS, staged.meta(), staged.payload)
                kind, meta, _ = read_head(conn, max_payload=0)
                if kind != Kind.ACK or _version(meta) != staged.version:
                    raise BadFrame(f"expected ACK of version {staged.version}, got {kind.name} {str(meta)[:80]}")
                sent = staged.version
                with self._cond:
                    self._acked[conn] = (name, sent)
                    self._cond.notify_all()
        except (OSError, BadFrame) as exc:
            if not self._closed:
                self.last_error = f"subscriber {name}: {exc}"
                log.warning("dropping weight subscriber %s: %s", name, exc)
        finally:
            with self._cond:
                self._conns.discard(conn)
                self._acked.pop(conn, None)
                self._cond.notify_all()
            conn.close()

    def _next(self, sent: int) -> _Staged | None:
        with self._cond:
            self._cond.wait_for(lambda: self._closed or (self._latest is not None and self._latest.version > sent))
            return None if self._closed else self._latest


# ---- replica side ----

class WeightSubscriber:
    """Keeps the newest weights a `WeightPublisher` at ``address`` sends; reconnects when the link drops.

    ``max_bytes`` bounds a version's size (a frame claiming more is refused before any allocation).
    Errors are recorded (`last_error`, `errors`) and logged, never raised into the replica's loop.
    """

    def __init__(self, address: tuple[str, int], *, name: str, max_bytes: int = 64 << 30,
                 connect_timeout_s: float = 10.0, retry_s: float = 0.5) -> None:
        self.address, self.name, self.max_bytes = address, name, max_bytes
        self._connect_timeout_s, self._retry_s = connect_timeout_s, retry_s
        self._cond = threading.Condition()
        self._current: WeightVersion | None = None
        self._stop = threading.Event()
        self._conn: socket.socket | None = None
        self.last_error: str | None = None
        self.errors = 0
        self._thread = threading.Thread(target=self._run, name=f"ridethrough-subscribe-{name}", daemon=True)
        self._thread.start()

    def current(self) -> WeightVersion | None:
        """The version in use and its tensors, one consistent pair (None before the first arrives)."""
        with self._cond:
            return self._current

    def wait_for(self, version: int, *, timeout_s: float) -> WeightVersion:
        """The current version once it is ``version`` or newer; TimeoutError at the deadline."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._current is not None and self._current.version >= version,
                                       timeout_s):
                raise TimeoutError(f"{self.name}: no version >= {version} within {timeout_s} s "
                                   f"(last error: {self.last_error})")
            assert self._current is not None
            return self._current

    def close(self) -> None:
        """Stop receiving; `current` keeps the last version."""
        self._stop.set()
        conn = self._conn
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._thread.join(10)

    def _run(self) -> None:
        pause_s = self._retry_s
        while not self._stop.is_set():
            try:
                with socket.create_connection(self.address, timeout=self._connect_timeout_s) as conn:
                    self._conn, pause_s = conn, self._retry_s
                    conn.settimeout(None)  # versions may be hours apart; close() shuts the socket down
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    have = self.current()
                    send_frame(conn, Kind.HELLO, {"name": self.name, "version": have.version if have else 0})
                    while not self._stop.is_set():
                        self._receive(conn)
            except (OSError, BadFrame) as exc:
                if not self._stop.is_set():
                    self._record(exc, loud=pause_s == self._retry_s)
            finally:
                self._conn = None
            self._stop.wait(pause_s)
            pause_s = min(pause_s * 2, _MAX_RETRY_S)  # a publisher that is away is not asked 2x a second

    def _receive(self, conn: socket.socket) -> None:
        import torch

        kind, meta, payload_len = read_head(conn, max_payload=self.max_bytes)
        version = _version(meta)
        have = self.current()
        if kind != Kind.WEIGHTS or (have is not None and version <= have.version):
            raise BadFrame(f"expected WEIGHTS newer than version {have.version if have else 0}, "
                           f"got {kind.name} of version {version}")
        raw = meta.get("tensors")
        if not isinstance(raw, list):
            raise BadFrame(f"WEIGHTS of version {version} has no tensor list")
        try:
            entries = [BlobEntry.parse(e, where=f"version {version}", lo=0, hi=payload_len) for e in raw]
        except CheckpointCorrupt as exc:
            raise BadFrame(str(exc)) from exc
        if len({e.key for e in entries}) != len(entries):
            raise BadFrame(f"WEIGHTS of version {version} names a tensor twice")
        end = aligned(max((e.offset + e.nbytes for e in entries), default=0))
        if payload_len > end:  # checked before allocating: a frame may not claim memory its tensors do not use
            raise BadFrame(f"WEIGHTS of version {version}: {payload_len} payload bytes for tensors ending at {end}")
        buf = torch.empty(payload_len, dtype=torch.uint8)  # fresh memory: readers of the old version keep it
        view = buf.numpy().data
        _recv_into(conn, view)
        state = {}
        for e in entries:
            crc = zlib.crc32(view[e.offset:e.offset + e.nbytes])
            if crc != e.crc32:
                raise BadFrame(f"version {version}: tensor {e.key} fails its checksum "
                               f"(crc32 {crc:#010x}, expected {e.crc32:#010x})")
            state[e.key] = buf[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape)
        with self._cond:  # the swap: one reference, so current() never sees half of a version
            self._current = WeightVersion(version, MappingProxyType(state))
        send_frame(conn, Kind.ACK, {"version": version})
        with self._cond:  # wake waiters after the ACK: one that closes at once must not cut it off
            self._cond.notify_all()

    def _record(self, exc: Exception, *, loud: bool) -> None:
        self.errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        log.log(logging.WARNING if loud else logging.DEBUG, "weight subscriber %s: %s (keeping version %s, "
                "reconnecting)", self.name, exc, self._current.version if self._current else None)
