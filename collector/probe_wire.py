"""The probe packet: one fixed-size binary layout for probes and replies, and its strict checks.

Probes and replies are the same size (`PACKET_BYTES`), so a responder never sends more than
it receives: it cannot be used to amplify a flood. All integers are network byte order::

    offset size field
         0    2 magic "RT"
         2    1 version (1)
         3    1 type: 1 probe, 2 reply
         4    1 flags (reserved, 0)
         5    1 pair_index: 0 or 1 within a coded pair
         6    1 tx_kind: how the sender's send time (t1 in a probe, t3 in a reply) was taken
         7    1 rx_kind: how t2 was taken (reply only; 0 in a probe)
         8    8 seq: the prober's sequence number (unique per prober NIC)
        16    8 pair_id
        24    8 cookie: random per probe, echoed in the reply (an off-path spoofer cannot guess it)
        32    8 t1_ns: prober send time, prober clock (echoed in the reply)
        40    8 t2_ns: responder receive time, responder clock (reply only)
        48    8 t3_ns: responder send time, responder clock (reply only)
        56    4 rx_count: probes the responder has received on this path (reply only; splits loss
                  into forward and reverse)
        60    4 epoch: random per responder start; a new epoch resets rx_count (reply only)
        64   48 prober node id, ASCII, NUL-padded
       112   16 prober NIC name, ASCII, NUL-padded
       128   48 responder node id (in a probe: whom the prober means to reach)
       176   16 responder NIC name
       192      end

Decoding is strict: exact length, magic, version, type, zero flags, known kinds, names of
printable ASCII with only NUL padding after them, and timestamps consistent with the type.
Anything else raises `WireError` with a `DropReason`; `decode` raises nothing else.
"""

from __future__ import annotations

import enum
import functools
import re
import struct
from dataclasses import dataclass

from ridethrough.collector.probe_sample import TimestampKind

MAGIC = b"RT"
VERSION = 1
NODE_MAX_BYTES = 48
"""Longest node id a probe can carry (ASCII)."""
NIC_MAX_BYTES = 16
"""Longest NIC name a probe can carry (Linux interface names are at most 15)."""
_LAYOUT = struct.Struct(f"!2sBBBBBBQQQqqqII{NODE_MAX_BYTES}s{NIC_MAX_BYTES}s{NODE_MAX_BYTES}s{NIC_MAX_BYTES}s")
PACKET_BYTES = _LAYOUT.size
"""Size of every probe and reply payload (192)."""
T1_OFFSET = 32
T3_OFFSET = 48
"""Where t1 and t3 sit, so a sender can write its send time into an encoded packet at the last moment."""
_TIME = struct.Struct("!q")
MAX_NS = (1 << 62) - 1
"""Largest timestamp accepted (year 2116): far enough, and leaves headroom for differences."""
_NAME = re.compile(rb"[\x21-\x7e]+")  # printable ASCII without spaces: names become metric attributes

KIND_CODES: dict[TimestampKind, int] = {TimestampKind.HARDWARE: 1, TimestampKind.KERNEL: 2, TimestampKind.USER: 3}
"""A timestamp kind's byte on the wire (0: no timestamp)."""
_KINDS = {code: kind for kind, code in KIND_CODES.items()}


class PacketType(enum.IntEnum):
    """What a packet is."""

    PROBE = 1
    REPLY = 2


class DropReason(enum.StrEnum):
    """Why a probe packet was dropped: the ``reason`` attribute of ``ridethrough.probe.dropped``.

    The first six come from `decode`; the rest from the responder's and prober's checks.
    """

    LENGTH = "length"
    MAGIC = "magic"
    VERSION = "version"
    TYPE = "type"
    FIELD = "field"
    NAME = "name"
    UNEXPECTED_TYPE = "unexpected_type"
    """A reply at a responder or a probe at a prober."""
    UNKNOWN_NODE = "unknown_node"
    WRONG_DESTINATION = "wrong_destination"
    """A probe naming another node or NIC than the one it reached."""
    REPLAYED = "replayed"
    FUTURE = "future"
    """A timestamp further ahead of the receiver's clock than the allowed skew."""
    PAST = "past"
    """A timestamp further behind than the allowed skew (an old packet replayed)."""
    RATE_LIMITED = "rate_limited"
    UNKNOWN_SEQ = "unknown_seq"
    LATE = "late"
    """A reply that came after its probe had been counted lost."""
    BAD_COOKIE = "bad_cookie"
    WRONG_PEER = "wrong_peer"
    """A reply from another address or identity than the probe went to."""
    INCONSISTENT = "inconsistent"
    """A reply whose times cannot be one exchange (negative RTT, a turnaround beyond the timeout)."""
    SEND_ERROR = "send_error"
    SOCKET_OVERFLOW = "socket_overflow"
    """Dropped by the kernel before the thread read it: the socket's receive buffer was full (a stalled thread)."""
    INTERNAL = "internal"


class WireError(ValueError):
    """A packet that does not decode; ``reason`` says which check failed."""

    def __init__(self, reason: DropReason, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One end of a probe path: a node and one of its NICs."""

    node: str
    nic: str

    def __post_init__(self) -> None:
        check_name(self.node, NODE_MAX_BYTES, "node id")
        check_name(self.nic, NIC_MAX_BYTES, "NIC name")

    def __str__(self) -> str:
        return f"{self.node}/{self.nic}"


def check_name(name: str, max_bytes: int, what: str) -> str:
    """``name`` if it can go on the wire; ValueError saying why not (for config checks)."""
    raw = name.encode("utf-8", "replace")
    if not name.isascii() or not _NAME.fullmatch(raw) or len(raw) > max_bytes:
        raise ValueError(f"{what} {name!r} must be 1-{max_bytes} printable ASCII characters without spaces")
    return name


@dataclass(frozen=True, slots=True)
class Probe:
    """A probe from ``src`` (the prober) to ``dst``; ``t1_ns`` on the prober's clock."""

    seq: int
    pair_id: int
    pair_index: int
    cookie: int
    t1_ns: int
    tx_kind: TimestampKind
    src: Endpoint
    dst: Endpoint


@dataclass(frozen=True, slots=True)
class Reply:
    """A reply: the probe's fields echoed, plus the responder's times and counters."""

    seq: int
    pair_id: int
    pair_index: int
    cookie: int
    t1_ns: int
    t2_ns: int
    t3_ns: int
    rx_kind: TimestampKind
    """How t2 was taken."""
    tx_kind: TimestampKind
    """How t3 was taken."""
    rx_count: int
    epoch: int
    src: Endpoint
    """The prober (as the probe named it)."""
    dst: Endpoint
    """The responder."""


Packet = Probe | Reply


def reply_to(probe: Probe, *, t2_ns: int, t3_ns: int, rx_kind: TimestampKind, tx_kind: TimestampKind,
             rx_count: int, epoch: int) -> Reply:
    """The reply to ``probe`` (the responder is the probe's ``dst``)."""
    return Reply(probe.seq, probe.pair_id, probe.pair_index, probe.cookie, probe.t1_ns, t2_ns, t3_ns,
                 rx_kind, tx_kind, rx_count, epoch, probe.src, probe.dst)


def encode(packet: Packet) -> bytes:
    """The packet's bytes; ValueError for a field out of range."""
    if isinstance(packet, Probe):
        fields = (PacketType.PROBE, 0, packet.t1_ns, 0, 0, KIND_CODES[packet.tx_kind], 0, 0, 0)
    else:
        fields = (PacketType.REPLY, 0, packet.t1_ns, packet.t2_ns, packet.t3_ns, KIND_CODES[packet.tx_kind],
                  KIND_CODES[packet.rx_kind], packet.rx_count, packet.epoch)
    kind, flags, t1, t2, t3, tx, rx, count, epoch = fields
    if packet.pair_index not in (0, 1):
        raise ValueError(f"pair_index must be 0 or 1, got {packet.pair_index}")
    try:
        return _LAYOUT.pack(MAGIC, VERSION, kind, flags, packet.pair_index, tx, rx, packet.seq, packet.pair_id,
                            packet.cookie, t1, t2, t3, count, epoch, packet.src.node.encode(),
                            packet.src.nic.encode(), packet.dst.node.encode(), packet.dst.nic.encode())
    except struct.error as exc:
        raise ValueError(f"cannot encode {packet}: {exc}") from None


_REPLY_KINDS = struct.Struct("!BB")  # tx_kind and rx_kind (offset 6); the type byte is at 3
_REPLY_TAIL = struct.Struct("!qqII")  # t2, t3, rx_count, epoch (offset 40)


def reply_bytes(probe_packet: bytes, *, t2_ns: int, rx_kind: TimestampKind, rx_count: int, epoch: int) -> bytearray:
    """The reply to an encoded probe that `decode` accepted, built from its bytes (t3 = t2 until patched).

    Same as ``encode(reply_to(decode(probe_packet), ...))`` with a user-space t3, at a fraction of the cost:
    a reply echoes every field of its probe, and the probe already names the responder.
    """
    out = bytearray(probe_packet)
    out[3] = PacketType.REPLY
    _REPLY_KINDS.pack_into(out, 6, KIND_CODES[TimestampKind.USER], KIND_CODES[rx_kind])
    _REPLY_TAIL.pack_into(out, 40, t2_ns, t2_ns, rx_count, epoch)
    return out


def patch_time(packet: bytearray, offset: int, ns: int) -> None:
    """Write a send time (`T1_OFFSET` or `T3_OFFSET`) into an encoded packet."""
    _TIME.pack_into(packet, offset, ns)


def decode(data: bytes) -> Packet:
    """Parse and check one packet; `WireError` (and nothing else) if it is not a valid one."""
    if len(data) != PACKET_BYTES:
        raise WireError(DropReason.LENGTH, f"{len(data)} bytes, expected {PACKET_BYTES}")
    (magic, version, kind, flags, pair_index, tx, rx, seq, pair_id, cookie, t1, t2, t3, count, epoch,
     src_node, src_nic, dst_node, dst_nic) = _LAYOUT.unpack(data)
    if magic != MAGIC:
        raise WireError(DropReason.MAGIC, f"magic {magic!r}")
    if version != VERSION:
        raise WireError(DropReason.VERSION, f"version {version}, this end speaks {VERSION}")
    if kind not in (PacketType.PROBE, PacketType.REPLY):
        raise WireError(DropReason.TYPE, f"type {kind}")
    if flags or pair_index not in (0, 1) or tx not in _KINDS:
        raise WireError(DropReason.FIELD, f"flags {flags}, pair_index {pair_index}, tx_kind {tx}")
    src, dst = _endpoint(src_node, src_nic), _endpoint(dst_node, dst_nic)
    if kind == PacketType.PROBE:
        if rx or t2 or t3 or count or epoch or not 0 < t1 <= MAX_NS:
            raise WireError(DropReason.FIELD, "a probe carries t1 only")
        return Probe(seq, pair_id, pair_index, cookie, t1, _KINDS[tx], src, dst)
    if rx not in _KINDS or not (0 < t1 <= MAX_NS and 0 < t2 <= t3 <= MAX_NS):
        raise WireError(DropReason.FIELD, f"reply with rx_kind {rx}, t1 {t1}, t2 {t2}, t3 {t3}")
    return Reply(seq, pair_id, pair_index, cookie, t1, t2, t3, _KINDS[rx], _KINDS[tx], count, epoch, src, dst)


@functools.lru_cache(maxsize=4096)  # a cluster has few endpoints; checking each name every packet is most of decode
def _endpoint(node: bytes, nic: bytes) -> Endpoint:
    return Endpoint(_name(node), _name(nic))


def _name(field: bytes) -> str:
    name = field.rstrip(b"\0")
    if not _NAME.fullmatch(name):
        raise WireError(DropReason.NAME, f"name field {field!r}")
    return name.decode("ascii")
