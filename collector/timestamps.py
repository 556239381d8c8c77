"""Kernel timestamps on a UDP probe socket: receive times from cmsgs, send times from the error queue.

Python's `socket` module has neither ``SO_TIMESTAMPING`` nor its flags, so they are defined
here for Linux (asm-generic values: x86-64, arm64, riscv; not parisc, sparc or alpha).

A `ProbeSocket` asks for, best first:

* ``SO_TIMESTAMPING`` with software receive and transmit stamps (``SOF_TIMESTAMPING_RX_SOFTWARE |
  TX_SOFTWARE | SOFTWARE``), each send keyed by ``OPT_ID`` and reported without the packet
  (``OPT_TSONLY``); with ``want_hardware``, raw hardware stamps too, which appear only where
  the NIC stamps and someone (ptp4l, hwstamp_ctl) has enabled it on the device;
* else ``SO_TIMESTAMPNS``: kernel receive stamps, user-space send times;
* else user-space times for both.

The kernel's software send stamp is taken in the driver's transmit routine, after the host's
own qdisc: a queue in the sending host (a tbf on its NIC, a busy NIC ring) is not in it, as it
would not be in a NIC's hardware stamp; the user-space fallback is taken before and includes it.

Kernel and hardware stamps are true ``CLOCK_REALTIME`` (hardware assumes phc2sys keeps the
NIC clock on it); the user-space fallback reads `time.time_ns` too. Callers map every stamp
onto the host's clock with `HostTime.to_local` (the lab bends each host's clock by a script).
"""

from __future__ import annotations

import contextlib
import errno
import socket
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ridethrough.collector.clock import Clock, ScriptedClock
from ridethrough.collector.probe_sample import TimestampKind
from ridethrough.collector.probe_wire import PACKET_BYTES

SO_TIMESTAMPNS = 35
SO_TIMESTAMPING = 37
SO_TIMESTAMPNS_NEW = 64
SO_TIMESTAMPING_NEW = 65
SCM_TIMESTAMPNS = SO_TIMESTAMPNS
SCM_TIMESTAMPING = SO_TIMESTAMPING

SOF_TIMESTAMPING_TX_HARDWARE = 1 << 0
SOF_TIMESTAMPING_TX_SOFTWARE = 1 << 1
SOF_TIMESTAMPING_RX_HARDWARE = 1 << 2
SOF_TIMESTAMPING_RX_SOFTWARE = 1 << 3
SOF_TIMESTAMPING_SOFTWARE = 1 << 4
SOF_TIMESTAMPING_RAW_HARDWARE = 1 << 6
SOF_TIMESTAMPING_OPT_ID = 1 << 7
SOF_TIMESTAMPING_OPT_TSONLY = 1 << 11
SOF_TIMESTAMPING_OPT_TX_SWHW = 1 << 14

SOFTWARE_FLAGS = SOF_TIMESTAMPING_RX_SOFTWARE | SOF_TIMESTAMPING_SOFTWARE
TX_FLAGS = SOF_TIMESTAMPING_TX_SOFTWARE | SOF_TIMESTAMPING_OPT_ID | SOF_TIMESTAMPING_OPT_TSONLY
HARDWARE_FLAGS = (SOF_TIMESTAMPING_RX_HARDWARE | SOF_TIMESTAMPING_TX_HARDWARE | SOF_TIMESTAMPING_RAW_HARDWARE
                  | SOF_TIMESTAMPING_OPT_TX_SWHW)

IP_RECVERR = 11
IPV6_RECVERR = 25
SO_EE_ORIGIN_TIMESTAMPING = 4
SO_RCVBUFFORCE = 33
SO_RXQ_OVFL = 40
"""Asks for a cmsg with the socket's count of datagrams dropped for want of buffer space (Linux)."""
RCVBUF_BYTES = 4 << 20
"""Receive buffer asked for: a thread starved for seconds finds its datagrams queued, not dropped (at 1-2 KiB of
kernel memory a datagram, a few thousand fit)."""
_U32 = struct.Struct("=I")
SCM_TSTAMP_SND = 0
_EXTENDED_ERR = struct.Struct("=IBBBBII")  # struct sock_extended_err, before the offender address
_TIMESPEC3 = struct.Struct("=6q")  # struct scm_timestamping (64-bit time_t): software, legacy, raw hardware
_TIMESPEC = struct.Struct("=2q")
_ANCILLARY_BYTES = 256
_SANE_NS = 1 << 62


@dataclass(frozen=True, slots=True)
class Received:
    """One datagram and when it arrived (true time)."""

    payload: bytes
    addr: tuple[str, int]
    rx_true_ns: int
    kind: TimestampKind
    read_ns: int = 0
    """When the thread read it (wall clock, ns): against ``rx_true_ns``, how long it waited in the socket."""


@dataclass(frozen=True, slots=True)
class TxStamp:
    """When the kernel (or NIC) sent the datagram with OPT_ID ``key`` (true time)."""

    key: int
    true_ns: int
    kind: TimestampKind


class HostTime:
    """The host's clock, and the map from true (kernel) time onto it.

    For the system clock the map is the identity; for the lab's `ScriptedClock` it is the
    script itself; any other clock (a test's) is taken to be true time plus its current offset.
    """

    def __init__(self, clock: Clock = time.time_ns) -> None:
        self.clock = clock
        if clock is time.time_ns:
            self._map: Callable[[int], int] = _identity
        elif isinstance(clock, ScriptedClock):
            scripted = clock
            self._map = lambda true_ns: scripted.spec().local(true_ns)
        else:
            self._map = lambda true_ns: true_ns + (clock() - time.time_ns())

    def to_local(self, true_ns: int) -> int:
        """What the host clock read at true time ``true_ns``."""
        return self._map(true_ns)

    def now(self) -> int:
        """The host clock now, read through the same map as kernel stamps."""
        return self._map(time.time_ns())


def _identity(true_ns: int) -> int:
    return true_ns


class ProbeSocket:
    """A non-blocking UDP socket that reports when each datagram arrived and left."""

    def __init__(self, sock: socket.socket, *, rx_kind: TimestampKind, tx_timestamps: bool, flags: int) -> None:
        self.sock = sock
        self.rx_kind = rx_kind
        """The best receive stamp this socket gives (a hardware stamp is reported when present)."""
        self.tx_timestamps = tx_timestamps
        """Whether sends are stamped into the error queue (the driver may still not deliver them)."""
        self._flags = flags
        self._next_key = 0
        self.overflowed = 0
        """Datagrams the kernel dropped so far because this socket's buffer was full (``SO_RXQ_OVFL``; 0 where
        the kernel does not say)."""

    @property
    def address(self) -> tuple[str, int]:
        """The bound (address, port)."""
        host, port = self.sock.getsockname()[:2]
        return str(host), int(port)

    def fileno(self) -> int:
        """The socket's file descriptor (for poll)."""
        return self.sock.fileno()

    def send(self, payload: bytes, addr: tuple[str, int]) -> tuple[int, int]:
        """Send one datagram; (its OPT_ID key or -1, true time just before the send).

        OSError propagates; after one the key counter is re-synchronised with the kernel's.
        """
        before_ns = time.time_ns()
        try:
            self.sock.sendto(payload, addr)
        except OSError:
            self._resync_keys()
            raise
        if not self.tx_timestamps:
            return -1, before_ns
        key, self._next_key = self._next_key, self._next_key + 1
        return key, before_ns

    def recv(self) -> Received | None:
        """The next datagram, or None if none is waiting."""
        try:
            data, ancillary, _, addr = self.sock.recvmsg(PACKET_BYTES + 1, _ANCILLARY_BYTES)
        except (BlockingIOError, InterruptedError):
            return None
        read_ns = time.time_ns()
        stamp = parse_rx_cmsgs(ancillary)
        if stamp is None:
            stamp = read_ns, TimestampKind.USER
        dropped = parse_overflow(ancillary)
        if dropped is not None:
            self.overflowed = dropped
        return Received(data, (str(addr[0]), int(addr[1])), *stamp, read_ns=read_ns)

    def tx_stamps(self) -> list[TxStamp]:
        """Every send stamp waiting in the error queue."""
        out: list[TxStamp] = []
        while True:
            try:
                _, ancillary, _, _ = self.sock.recvmsg(PACKET_BYTES, _ANCILLARY_BYTES, socket.MSG_ERRQUEUE)
            except (BlockingIOError, InterruptedError):
                return out
            except OSError as exc:  # an ICMP error surfacing through the queue: not ours to handle
                if exc.errno not in (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH):
                    raise
                continue
            stamp = parse_errqueue(ancillary)
            if stamp is not None:
                out.append(stamp)

    def close(self) -> None:
        """Close the socket."""
        self.sock.close()

    def _resync_keys(self) -> None:
        """After a failed send the kernel may or may not have used a key: restart both counters at 0."""
        if not self.tx_timestamps:
            return
        self.tx_stamps()  # drop stamps under old keys first
        self.sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPING, self._flags & ~SOF_TIMESTAMPING_OPT_ID)
        self.sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPING, self._flags)  # setting OPT_ID zeroes the key
        self._next_key = 0


def open_probe_socket(bind_addr: str, port: int, *, want_tx_timestamps: bool = True, want_hardware: bool = False,
                      device: str = "") -> ProbeSocket:
    """A `ProbeSocket` bound to ``bind_addr:port`` (port 0 for any), with the best stamps on offer.

    ``device`` also binds it to an interface (``SO_BINDTODEVICE``) so that routing cannot
    send its datagrams out of another NIC. OSError if it cannot be bound.
    """
    family = socket.AF_INET6 if ":" in bind_addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        if device:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, device.encode())
        sock.bind((bind_addr, port))
        sock.setblocking(False)
        _buffer_and_overflow(sock)
        return _with_timestamps(sock, want_tx_timestamps, want_hardware)
    except BaseException:
        sock.close()
        raise


def _buffer_and_overflow(sock: socket.socket) -> None:
    """A receive buffer of `RCVBUF_BYTES` (forced past ``rmem_max`` where allowed) and drop counts in cmsgs."""
    for option in (SO_RCVBUFFORCE, socket.SO_RCVBUF):  # FORCE needs CAP_NET_ADMIN; RCVBUF is capped at rmem_max
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, RCVBUF_BYTES)
            break
        except OSError:
            continue
    with contextlib.suppress(OSError):  # without it the drops go uncounted, and nothing else changes
        sock.setsockopt(socket.SOL_SOCKET, SO_RXQ_OVFL, 1)


def _with_timestamps(sock: socket.socket, want_tx: bool, want_hardware: bool) -> ProbeSocket:
    flags = SOFTWARE_FLAGS | (TX_FLAGS if want_tx else 0) | (HARDWARE_FLAGS if want_hardware else 0)
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPING, flags)
        return ProbeSocket(sock, rx_kind=TimestampKind.KERNEL, tx_timestamps=want_tx, flags=flags)
    except OSError:
        pass  # an old or unusual kernel: try the simpler option
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        return ProbeSocket(sock, rx_kind=TimestampKind.KERNEL, tx_timestamps=False, flags=0)
    except OSError:
        return ProbeSocket(sock, rx_kind=TimestampKind.USER, tx_timestamps=False, flags=0)


# A receive cmsg as recvmsg returned it on x86-64 loopback (level SOL_SOCKET=1, type SCM_TIMESTAMPING=37,
# three timespecs: software, legacy (zero), raw hardware (zero without a stamping NIC)):
#   [(1, 37, b'\x1e\x1a\rk\x00\x00\x00\x00\x0e\xa7w\x02\x00\x00\x00\x00' + b'\x00' * 32)]
# and with SO_TIMESTAMPNS (type SCM_TIMESTAMPNS=35, one timespec):
#   [(1, 35, b'\x1e\x1a\rk\x00\x00\x00\x00-\x05x\x02\x00\x00\x00\x00')]
def parse_rx_cmsgs(ancillary: Iterable[tuple[int, int, bytes]]) -> tuple[int, TimestampKind] | None:
    """(true ns, kind) of the best receive stamp among the cmsgs, or None if there is none."""
    for level, kind, data in ancillary:
        if level != socket.SOL_SOCKET:
            continue
        if kind in (SCM_TIMESTAMPING, SO_TIMESTAMPING_NEW) and len(data) >= _TIMESPEC3.size:
            return _best_of(_TIMESPEC3.unpack_from(data))
        if kind in (SCM_TIMESTAMPNS, SO_TIMESTAMPNS_NEW) and len(data) >= _TIMESPEC.size:
            ns = _ns(*_TIMESPEC.unpack_from(data))
            if ns:
                return ns, TimestampKind.KERNEL
    return None


# A send stamp from the error queue with OPT_TSONLY (no payload), captured the same way: the stamp, then
# (SOL_IP=0, IP_RECVERR=11, sock_extended_err{ee_errno=ENOMSG (42), ee_origin=4 (timestamping),
# ee_info=SCM_TSTAMP_SND (0), ee_data=OPT_ID key (0)} + a zeroed sockaddr_in):
#   [(1, 37, b'\x1e\x1a\rk\x00\x00\x00\x00\xa4\x9ew\x02\x00\x00\x00\x00' + b'\x00' * 32),
#    (0, 11, b'*\x00\x00\x00\x04' + b'\x00' * 27)]
# The drop count cmsg on the same socket (level SOL_SOCKET=1, type SO_RXQ_OVFL=40, a native-endian u32):
#   [(1, 40, b'\x03\x00\x00\x00')]
def parse_overflow(ancillary: Iterable[tuple[int, int, bytes]]) -> int | None:
    """The socket's cumulative count of datagrams dropped for want of buffer, if a cmsg carries it."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_RXQ_OVFL and len(data) >= _U32.size:
            return int(_U32.unpack_from(data)[0])
    return None


def parse_errqueue(ancillary: Iterable[tuple[int, int, bytes]]) -> TxStamp | None:
    """The send stamp in one error-queue message, or None if it holds none (or another event)."""
    stamp: tuple[int, TimestampKind] | None = None
    key: int | None = None
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind in (SCM_TIMESTAMPING, SO_TIMESTAMPING_NEW) \
                and len(data) >= _TIMESPEC3.size:
            stamp = _best_of(_TIMESPEC3.unpack_from(data))
        elif (level, kind) in ((socket.IPPROTO_IP, IP_RECVERR), (socket.IPPROTO_IPV6, IPV6_RECVERR)) \
                and len(data) >= _EXTENDED_ERR.size:
            ee_errno, origin, _, _, _, info, ee_data = _EXTENDED_ERR.unpack_from(data)
            if ee_errno == errno.ENOMSG and origin == SO_EE_ORIGIN_TIMESTAMPING and info == SCM_TSTAMP_SND:
                key = ee_data
    if stamp is None or key is None:
        return None
    return TxStamp(key, *stamp)


def _best_of(fields: tuple[int, ...]) -> tuple[int, TimestampKind] | None:
    hardware, software = _ns(fields[4], fields[5]), _ns(fields[0], fields[1])
    if hardware:
        return hardware, TimestampKind.HARDWARE
    if software:
        return software, TimestampKind.KERNEL
    return None


def _ns(sec: int, nsec: int) -> int:
    """A timespec in ns; 0 for an empty or absurd one."""
    ns = sec * 1_000_000_000 + nsec
    return ns if 0 < ns < _SANE_NS and 0 <= nsec < 1_000_000_000 else 0
