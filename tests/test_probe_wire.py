"""The probe packet: round trips, strict decoding (only WireError, whatever the bytes), field caps."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ridethrough.collector.probe_sample import TimestampKind
from ridethrough.collector.probe_wire import (
    MAGIC,
    NIC_MAX_BYTES,
    NODE_MAX_BYTES,
    PACKET_BYTES,
    T1_OFFSET,
    T3_OFFSET,
    VERSION,
    DropReason,
    Endpoint,
    Probe,
    Reply,
    WireError,
    decode,
    encode,
    patch_time,
    reply_bytes,
    reply_to,
)

T0 = 1_764_480_000_000_000_000
A, B = Endpoint("h0", "nic0"), Endpoint("gpu-node-017.rack3.example.com", "mlx5_0")
PROBE = Probe(seq=2**63 + 5, pair_id=77, pair_index=1, cookie=2**64 - 1, t1_ns=T0, tx_kind=TimestampKind.KERNEL,
              src=A, dst=B)
REPLY = reply_to(PROBE, t2_ns=T0 + 5_000, t3_ns=T0 + 9_000, rx_kind=TimestampKind.KERNEL,
                 tx_kind=TimestampKind.USER, rx_count=12, epoch=0xDEADBEEF)

kinds = st.sampled_from(list(TimestampKind))
names = st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=NIC_MAX_BYTES)
endpoints = st.builds(Endpoint, names, names)
times = st.integers(1, 2**62 - 1)


def test_packets_are_small_and_all_one_size() -> None:
    assert PACKET_BYTES == 192
    assert len(encode(PROBE)) == len(encode(REPLY)) == PACKET_BYTES


def test_probe_and_reply_round_trip() -> None:
    assert decode(encode(PROBE)) == PROBE
    assert decode(encode(REPLY)) == REPLY
    assert (REPLY.src, REPLY.dst, REPLY.seq, REPLY.cookie, REPLY.t1_ns) == (A, B, PROBE.seq, PROBE.cookie, T0)


@given(seq=st.integers(0, 2**64 - 1), pair=st.integers(0, 2**64 - 1), index=st.sampled_from([0, 1]),
       cookie=st.integers(0, 2**64 - 1), t1=times, kind=kinds, src=endpoints, dst=endpoints)
def test_any_valid_probe_round_trips(seq: int, pair: int, index: int, cookie: int, t1: int, kind: TimestampKind,
                                     src: Endpoint, dst: Endpoint) -> None:
    probe = Probe(seq, pair, index, cookie, t1, kind, src, dst)
    assert decode(encode(probe)) == probe


@given(t2=times, turnaround=st.integers(0, 10**9), rx=kinds, tx=kinds, count=st.integers(0, 2**32 - 1),
       epoch=st.integers(0, 2**32 - 1))
def test_any_valid_reply_round_trips(t2: int, turnaround: int, rx: TimestampKind, tx: TimestampKind, count: int,
                                     epoch: int) -> None:
    t3 = min(t2 + turnaround, 2**62 - 1)
    reply = reply_to(PROBE, t2_ns=t2, t3_ns=t3, rx_kind=rx, tx_kind=tx, rx_count=count, epoch=epoch)
    assert decode(encode(reply)) == reply


def test_reply_bytes_is_the_encoded_reply() -> None:
    packet = reply_bytes(encode(PROBE), t2_ns=T0 + 5_000, rx_kind=TimestampKind.KERNEL, rx_count=12, epoch=0xDEADBEEF)
    patch_time(packet, T3_OFFSET, T0 + 9_000)
    assert bytes(packet) == encode(REPLY)
    assert decode(bytes(packet)) == REPLY


def test_send_times_can_be_written_at_the_last_moment() -> None:
    packet = bytearray(encode(PROBE))
    patch_time(packet, T1_OFFSET, T0 + 42)
    decoded = decode(bytes(packet))
    assert isinstance(decoded, Probe) and decoded.t1_ns == T0 + 42


@settings(max_examples=500)
@given(st.binary(max_size=400))
def test_arbitrary_bytes_raise_only_wire_error(data: bytes) -> None:
    try:
        decode(data)
    except WireError as exc:
        assert isinstance(exc.reason, DropReason)


@settings(max_examples=1000)
@given(st.binary(min_size=PACKET_BYTES - 8, max_size=PACKET_BYTES - 8), st.sampled_from([1, 2, 3, 0]))
def test_arbitrary_bodies_behind_a_valid_header_raise_only_wire_error(body: bytes, kind: int) -> None:
    """Get past the magic and version, so that the field and name checks see arbitrary input."""
    data = MAGIC + bytes([VERSION, kind]) + body[:4] + body[4:]
    try:
        packet = decode(data)
    except WireError:
        return
    assert encode(packet) == data  # whatever is accepted is canonical: it re-encodes to the same bytes


@settings(max_examples=1000)
@given(st.integers(0, PACKET_BYTES - 1), st.integers(0, 255), st.sampled_from([PROBE, REPLY]))
def test_one_corrupted_byte_is_rejected_or_still_canonical(at: int, value: int, packet: Probe | Reply) -> None:
    data = bytearray(encode(packet))
    data[at] = value
    try:
        decoded = decode(bytes(data))
    except WireError:
        return
    assert encode(decoded) == bytes(data)


@pytest.mark.parametrize(("mutate", "reason"), [
    (lambda b: b[:-1], DropReason.LENGTH),
    (lambda b: b + b"\0", DropReason.LENGTH),
    (lambda b: b"XX" + b[2:], DropReason.MAGIC),
    (lambda b: b[:2] + b"\x02" + b[3:], DropReason.VERSION),
    (lambda b: b[:3] + b"\x07" + b[4:], DropReason.TYPE),
    (lambda b: b[:4] + b"\x01" + b[5:], DropReason.FIELD),  # reserved flags
    (lambda b: b[:5] + b"\x02" + b[6:], DropReason.FIELD),  # pair index 2
    (lambda b: b[:6] + b"\x09" + b[7:], DropReason.FIELD),  # unknown timestamp kind
    (lambda b: b[:64] + b"\0" * 48 + b[112:], DropReason.NAME),  # empty node
    (lambda b: b[:64] + b"h 1".ljust(48, b"\0") + b[112:], DropReason.NAME),  # a space
    (lambda b: b[:64] + b"h\x001".ljust(48, b"\0") + b[112:], DropReason.NAME),  # an embedded NUL
    (lambda b: b[:176] + "é".encode().ljust(16, b"\0"), DropReason.NAME),
])
def test_each_check_names_its_reason(mutate: object, reason: DropReason) -> None:
    with pytest.raises(WireError) as err:
        decode(mutate(encode(PROBE)))  # type: ignore[operator]
    assert err.value.reason is reason


def _with_times(packet: bytes, t1: int, t2: int, t3: int) -> bytes:
    return packet[:32] + struct.pack("!qqq", t1, t2, t3) + packet[56:]


def test_times_must_fit_the_type() -> None:
    probe, reply = encode(PROBE), encode(REPLY)
    for bad in (_with_times(probe, 0, 0, 0), _with_times(probe, -5, 0, 0), _with_times(probe, T0, T0, 0),
                _with_times(reply, T0, T0 + 9, T0 + 5), _with_times(reply, T0, 0, T0), _with_times(reply, 0, T0, T0),
                _with_times(reply, T0, T0, 2**62), probe[:56] + b"\0\0\0\1" + probe[60:]):
        with pytest.raises(WireError) as err:
            decode(bad)
        assert err.value.reason is DropReason.FIELD


def test_names_are_capped_and_printable() -> None:
    Endpoint("n" * NODE_MAX_BYTES, "e" * NIC_MAX_BYTES)
    for node, nic in (("n" * (NODE_MAX_BYTES + 1), "nic0"), ("h0", "e" * (NIC_MAX_BYTES + 1)), ("", "nic0"),
                      ("h 0", "nic0"), ("h0", "nïc0"), ("h0\n", "nic0")):
        with pytest.raises(ValueError, match="printable ASCII"):
            Endpoint(node, nic)


def test_fields_out_of_range_do_not_encode() -> None:
    for bad in (Probe(-1, 0, 0, 0, T0, TimestampKind.USER, A, B), Probe(0, 2**64, 0, 0, T0, TimestampKind.USER, A, B),
                Probe(0, 0, 2, 0, T0, TimestampKind.USER, A, B)):
        with pytest.raises(ValueError):
            encode(bad)
