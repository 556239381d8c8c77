"""The raw rtnetlink interface dump: what the kernel says is decoded, what it must not say fails clearly."""

from __future__ import annotations

import socket
import struct

import pytest

from ridethrough.lab import rtnl_links
from ridethrough.lab.control import LabError
from ridethrough.lab.rtnl_links import NLMSG_DONE, NLMSG_ERROR, RTM_NEWLINK, dump, open_in


def attr(kind: int, value: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(value), kind) + value
    return raw + b"\0" * (-len(raw) % 4)


def message(kind: int, body: bytes, seq: int = 1) -> bytes:
    return struct.pack("=IHHII", 16 + len(body), kind, 2, seq, 0) + body


def link(name: str, *, mtu: int = 1500, oper: int = 6, rx_dropped: int = 0) -> bytes:
    stats = struct.pack("=8Q", 1, 2, 3, 4, 0, 0, rx_dropped, 0) + b"\0" * 64
    body = struct.pack("=BxHiII", 0, 1, 7, 0, 0) + attr(3, name.encode() + b"\0") + attr(4, struct.pack("=I", mtu))
    return message(RTM_NEWLINK, body + attr(16, bytes([oper])) + attr(23, stats))


class Answers:
    """A socket that answers every request with the next of ``chunks``."""

    def __init__(self, *chunks: bytes) -> None:
        self.chunks = list(chunks)
        self.sent: list[bytes] = []

    def send(self, data: bytes) -> int:
        self.sent.append(data)
        return len(data)

    def recv(self, n: int) -> bytes:
        if not self.chunks:
            raise TimeoutError("timed out")
        return self.chunks.pop(0)


def test_a_dump_decodes_each_interface_and_ends_at_done() -> None:
    sock = Answers(link("spine0", mtu=1400, rx_dropped=5) + link("h0", oper=2), message(NLMSG_DONE, b"\0" * 4))
    got = dump(sock)  # type: ignore[arg-type]
    assert [(m["ifname"], m["mtu"], m["operstate"], m["stats64"]["rx_dropped"]) for m in got] == [
        ("spine0", 1400, "UP", 5), ("h0", 1500, "DOWN", 0)]
    length, kind, flags, seq, _ = struct.unpack_from("=IHHII", sock.sent[0])
    assert (length, kind, flags & 0x300, seq) == (32, 18, 0x300, 1)


def test_answers_to_another_request_are_skipped() -> None:
    sock = Answers(message(NLMSG_DONE, b"", seq=9) + link("spine1") + message(NLMSG_DONE, b""))
    assert [m["ifname"] for m in dump(sock)] == ["spine1"]  # type: ignore[arg-type]


@pytest.mark.parametrize(("answer", "why"), [
    (message(NLMSG_ERROR, struct.pack("=i", -1)), "refused: Operation not permitted"),
    (struct.pack("=IHHII", 4000, RTM_NEWLINK, 2, 1, 0), "a message of 4000 bytes"),
    (struct.pack("=IHHII", 8, RTM_NEWLINK, 2, 1, 0), "a message of 8 bytes"),
    (message(RTM_NEWLINK, b"\0" * 6), "truncated"),
    (struct.pack("=IHHII", 16, NLMSG_ERROR, 2, 1, 0), "malformed"),
])
def test_a_malformed_or_refused_answer_is_a_clear_error(answer: bytes, why: str) -> None:
    with pytest.raises(LabError, match=why):
        dump(Answers(answer))  # type: ignore[arg-type]


def test_a_silent_kernel_times_out_as_a_lab_error_and_a_missing_namespace_cannot_be_entered() -> None:
    with pytest.raises(LabError, match="timed out"):
        dump(Answers(link("x")))  # type: ignore[arg-type]
    with pytest.raises(LabError, match="no-such-namespace"):
        open_in("/var/run/netns/no-such-namespace")


def test_a_socket_opened_here_lists_this_namespaces_loopback() -> None:
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, rtnl_links.NETLINK_ROUTE) as sock:
        sock.settimeout(5)
        assert "lo" in {m.get("ifname") for m in dump(sock)}
