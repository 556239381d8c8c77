"""Interface dumps over a raw rtnetlink socket opened inside a namespace: name, MTU, operstate, receive drops.

pyroute2 reaches another namespace through a forked helper that relays every request (some 3 ms of
CPU a dump); a watcher that looks at six switches five times a second cannot afford that. A netlink
socket belongs to the namespace it was created in, whoever uses it later, so `open_in` creates one
from a short-lived thread that enters the namespace (threads switch namespaces alone), and `dump`
asks it for every interface (``RTM_GETLINK`` with ``NLM_F_DUMP``): a tenth of a millisecond.

`dump` answers in the shape pyroute2's messages have as dicts (``ifname``, ``mtu``, ``operstate``,
``stats64`` with ``rx_dropped``), so callers read either the same way.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
from typing import Any

from ridethrough.lab.control import LabError

NETLINK_ROUTE = 0
RTM_NEWLINK, RTM_GETLINK = 16, 18
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
IFLA_MTU, IFLA_IFNAME, IFLA_OPERSTATE, IFLA_STATS64 = 4, 3, 16, 23
OPERSTATES = ("UNKNOWN", "NOTPRESENT", "DOWN", "LOWERLAYERDOWN", "TESTING", "DORMANT", "UP")
"""RFC 2863 operational states in the kernel's ``IF_OPER_*`` order (as ``ip link`` names them)."""
STATS64_FIELDS = ("rx_packets", "tx_packets", "rx_bytes", "tx_bytes", "rx_errors", "tx_errors", "rx_dropped",
                  "tx_dropped")
"""The leading ``__u64`` fields of ``struct rtnl_link_stats64``."""
_HDR = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, seq, pid
_IFINFO = struct.Struct("=BxHiII")  # ifinfomsg: family, type, index, flags, change
_ATTR = struct.Struct("=HH")  # rtattr: length, type
RECV_BYTES = 65536
TIMEOUT_S = 5.0


def open_in(ns_path: str) -> socket.socket:
    """A rtnetlink socket in the namespace bound at ``ns_path``; LabError if it cannot be entered."""
    from ridethrough.lab.netns import setns

    made: list[socket.socket] = []
    failed: list[BaseException] = []

    def enter_and_open() -> None:
        try:
            fd = os.open(ns_path, os.O_RDONLY)
            try:
                setns(fd)  # this thread only, and it ends here: no one else runs in that namespace
            finally:
                os.close(fd)
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE)
            sock.settimeout(TIMEOUT_S)
            made.append(sock)
        except OSError as exc:
            failed.append(exc)

    worker = threading.Thread(target=enter_and_open, name="rtnl-open")
    worker.start()
    worker.join()
    if failed or not made:
        raise LabError(f"a netlink socket in {ns_path}: {failed[0] if failed else 'not made'}")
    return made[0]


def dump(sock: socket.socket, seq: int = 1) -> list[dict[str, Any]]:
    """Every interface of the socket's namespace; LabError if the kernel refuses or the answer is malformed."""
    request = _HDR.pack(_HDR.size + _IFINFO.size, RTM_GETLINK, NLM_F_REQUEST | NLM_F_DUMP, seq, 0)
    try:
        sock.send(request + _IFINFO.pack(socket.AF_UNSPEC, 0, 0, 0, 0))
        out: list[dict[str, Any]] = []
        while True:
            data = sock.recv(RECV_BYTES)
            offset = 0
            while offset + _HDR.size <= len(data):
                length, kind, _, got_seq, _ = _HDR.unpack_from(data, offset)
                if length < _HDR.size or offset + length > len(data):
                    raise LabError(f"netlink: a message of {length} bytes in a {len(data)}-byte answer")
                if got_seq == seq:
                    if kind == NLMSG_DONE:
                        return out
                    if kind == NLMSG_ERROR:
                        (code,) = struct.unpack_from("=i", data, offset + _HDR.size)
                        raise LabError(f"netlink: RTM_GETLINK refused: {os.strerror(-code)}")
                    if kind == RTM_NEWLINK:
                        out.append(_link(data[offset + _HDR.size:offset + length]))
                offset += (length + 3) & ~3
    except struct.error as exc:  # a message shorter than its header says
        raise LabError(f"netlink: a malformed answer: {exc}") from exc
    except OSError as exc:
        raise LabError(f"netlink: {exc}") from exc


def _link(body: bytes) -> dict[str, Any]:
    """One RTM_NEWLINK body: its interface message, then attributes."""
    if len(body) < _IFINFO.size:
        raise LabError("netlink: a truncated RTM_NEWLINK")
    link: dict[str, Any] = {"index": _IFINFO.unpack_from(body)[2]}
    offset = _IFINFO.size
    while offset + _ATTR.size <= len(body):
        length, kind = _ATTR.unpack_from(body, offset)
        if length < _ATTR.size:
            break
        value = body[offset + _ATTR.size:offset + length]
        if kind == IFLA_IFNAME:
            link["ifname"] = value.split(b"\0", 1)[0].decode(errors="replace")
        elif kind == IFLA_MTU and len(value) >= 4:
            link["mtu"] = struct.unpack_from("=I", value)[0]
        elif kind == IFLA_OPERSTATE and value:
            link["operstate"] = OPERSTATES[value[0]] if value[0] < len(OPERSTATES) else "UNKNOWN"
        elif kind == IFLA_STATS64 and len(value) >= 8 * len(STATS64_FIELDS):
            link["stats64"] = dict(zip(STATS64_FIELDS, struct.unpack_from(f"={len(STATS64_FIELDS)}Q", value),
                                       strict=True))
        offset += (length + 3) & ~3
    return link
