"""The audit's traffic endpoint: one process per (node, address), sending paced UDP flows and receiving its peers'.

Run where the traffic must start and end (inside a lab namespace, or on a host)::

    python -m ridethrough.audit_load --bind 10.64.0.1 --port 29000 --duration-s 2 --mtu 1500 \\
        --flows '[{"id": 3, "dst": "10.64.0.0", "dport": 29000, "sport": 29103, "rate_mbit": 80, "size": 1200}]'

It binds a receiving socket on ``--bind:--port`` and one socket per flow on ``--bind:sport``,
prints ``{"ready": true}``, and waits for a line ``go`` on stdin: the driver starts every
endpoint of a round, waits until all are ready, then releases them together, so no flow
starts before its receiver listens. Then, per flow:

1. MTU: up to `MTU_TRIES` datagrams of exactly ``--mtu`` bytes (IP and UDP headers included),
   don't-fragment set; the receiving endpoint answers each with a small ack. ``refused`` says
   this end's own interface would not send it (its MTU is smaller: EMSGSIZE).
2. Load: datagrams of ``size`` bytes at ``rate_mbit`` for ``--duration-s``; each carries its
   flow id, sequence number and send time, so the receiver counts what arrived and the
   one-way delay (send and receive clocks must agree: true inside one machine's namespaces).

It keeps receiving for ``--grace-s`` and until its sockets are drained, then prints one JSON
line: per flow id, what it sent (``sent``, ``errors``, ``mtu``) and what it received from
others' flows (``recv``), and ``drops``: what its own network namespace dropped while it ran,
``rcvbuf`` (a full socket buffer), ``rx`` and ``tx`` (its interfaces' drop counters: on a veth, a
peer's backlog the CPU did not drain). An end host the CPU leaves waiting loses those; that is
not the link's loss, and the driver takes them out (a shaper's drops are the qdisc's, not the
interface's, and stay the link's). Only the standard library is imported: it starts fast.
"""

from __future__ import annotations

import argparse
import errno
import json
import select
import socket
import struct
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

HEADER = struct.Struct("!4sHBxIQ")
"""magic, flow id, kind, pad, sequence number, send time (ns since the epoch)."""
MAGIC = b"RTAU"
DATA, PROBE, ACK = 0, 1, 2
IP_UDP_HEADERS = 28
IP_MTU_DISCOVER = 10
IP_PMTUDISC_DO = 2
IP_PMTUDISC_DONT = 0
MTU_TRIES = 3
MTU_WAIT_S = 0.25
OWD_SAMPLES_MAX = 20_000
RCVBUF_BYTES = 8 << 20
SO_RCVBUFFORCE = 33


@dataclass(slots=True)
class Flow:
    """One flow this endpoint sends: to ``dst:dport`` from its own ``sport``."""

    id: int
    dst: str
    dport: int
    sport: int
    rate_mbit: float
    size: int = 1200
    sock: socket.socket | None = None
    planned: int = 0
    """Datagrams due so far at the flow's pace (sent or refused)."""
    sent: int = 0
    errors: int = 0
    acks: int = 0
    refused: bool = False


@dataclass(slots=True)
class Received:
    """What arrived of one flow (from another endpoint)."""

    packets: int = 0
    bytes: int = 0
    owd_ns: list[int] = field(default_factory=list)


def _udp(bind: str, port: int, *, df: bool) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:  # a deep buffer: a receiver that the scheduler leaves waiting must not drop (that is not the link's loss)
        sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, RCVBUF_BYTES)
    except OSError:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF_BYTES)
    sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO if df else IP_PMTUDISC_DONT)
    sock.bind((bind, port))
    return sock


class Endpoint:
    """The sockets and counters of one endpoint (see the module docstring)."""

    def __init__(self, bind: str, port: int, flows: Sequence[Flow]) -> None:
        self.listen = _udp(bind, port, df=False)
        self.flows = {f.id: f for f in flows}
        for f in flows:
            f.sock = _udp(bind, f.sport, df=True)
        self.received: dict[int, Received] = {}
        self.stop = threading.Event()
        self._lock = threading.Lock()

    def receive(self) -> None:
        """Count data, answer probes, note acks; until `stop` is set and the sockets are drained."""
        socks = [self.listen, *(f.sock for f in self.flows.values() if f.sock is not None)]
        while True:
            ready = select.select(socks, [], [], 0.05)[0]
            if not ready and self.stop.is_set():
                return  # a receiver the scheduler held back still reads all that queued: that is not loss
            for sock in ready:
                try:
                    data, addr = sock.recvfrom(65536)
                except OSError:
                    continue
                self._handle(sock, data, addr, time.time_ns())

    def _handle(self, sock: socket.socket, data: bytes, addr: Any, now_ns: int) -> None:
        if len(data) < HEADER.size:
            return
        magic, flow_id, kind, seq, sent_ns = HEADER.unpack_from(data)
        if magic != MAGIC:
            return
        if kind == PROBE:
            sock.sendto(HEADER.pack(MAGIC, flow_id, ACK, seq, sent_ns), addr)
        elif kind == ACK and flow_id in self.flows:
            self.flows[flow_id].acks += 1
        elif kind == DATA:
            with self._lock:
                got = self.received.setdefault(flow_id, Received())
                got.packets += 1
                got.bytes += len(data)
                if len(got.owd_ns) < OWD_SAMPLES_MAX:
                    got.owd_ns.append(now_ns - sent_ns)

    def probe_mtu(self, mtu: int) -> None:
        """Don't-fragment datagrams of exactly ``mtu`` bytes on the wire to each flow's peer."""
        payload = max(mtu - IP_UDP_HEADERS, HEADER.size)
        for _ in range(MTU_TRIES):
            pending = [f for f in self.flows.values() if not f.acks and not f.refused]
            if not pending:
                return
            for f in pending:
                assert f.sock is not None
                packet = HEADER.pack(MAGIC, f.id, PROBE, 0, time.time_ns()).ljust(payload, b"p")
                try:
                    f.sock.sendto(packet, (f.dst, f.dport))
                except OSError as exc:
                    f.refused = exc.errno == errno.EMSGSIZE  # our own interface's MTU is smaller
            time.sleep(MTU_WAIT_S)

    def blast(self, duration_s: float) -> None:
        """Send every flow's datagrams at its pace for ``duration_s``."""
        start = time.monotonic()
        flows = [f for f in self.flows.values() if f.sock is not None and f.rate_mbit > 0]
        intervals = {f.id: f.size * 8 / (f.rate_mbit * 1e6) for f in flows}
        while (now := time.monotonic()) - start < duration_s:
            if not flows:  # a receiving-only endpoint listens for the whole load
                time.sleep(min(0.05, start + duration_s - now))
                continue
            f = min(flows, key=lambda x: x.planned * intervals[x.id])
            due = start + f.planned * intervals[f.id]
            if due > now:
                time.sleep(min(due - now, 0.005))
                continue
            packet = HEADER.pack(MAGIC, f.id, DATA, f.planned, time.time_ns()).ljust(f.size, b"\0")
            assert f.sock is not None
            try:
                f.sock.sendto(packet, (f.dst, f.dport))
                f.sent += 1
            except OSError:  # a full queue or a refused size: counted, and the pace is kept
                f.errors += 1
            f.planned += 1

    def report(self, drops: dict[str, int] | None = None) -> dict[str, Any]:
        """The one JSON-able result of this endpoint (``drops``: what its own namespace dropped)."""
        with self._lock:
            recv = {str(k): {"packets": r.packets, "bytes": r.bytes, "owd_ns": _quantiles(r.owd_ns)}
                    for k, r in self.received.items()}
        sent = {str(f.id): {"sent": f.sent, "errors": f.errors, "size": f.size,
                            "mtu": {"ok": f.acks > 0, "refused": f.refused}} for f in self.flows.values()}
        return {"sent": sent, "recv": recv, "drops": drops or {}}


def _quantiles(values: list[int]) -> list[int]:
    """[p50, p99, max] of ``values`` ([] when empty)."""
    if not values:
        return []
    s = sorted(values)
    return [s[len(s) // 2], s[min(len(s) - 1, (len(s) * 99) // 100)], s[-1]]


def run(bind: str, port: int, flows: Sequence[Flow], *, duration_s: float, mtu: int, grace_s: float,
        wait_go: bool = True) -> dict[str, Any]:
    """Bind, say ready, wait for ``go``, probe the MTU, load, drain; the endpoint's report."""
    ep = Endpoint(bind, port, flows)
    print(json.dumps({"ready": True}), flush=True)
    if wait_go and sys.stdin.readline().strip() != "go":
        return {"error": "no go from the driver"}
    before = host_drops()
    rx = threading.Thread(target=ep.receive, daemon=True)
    rx.start()
    if mtu:
        ep.probe_mtu(mtu)
    ep.blast(duration_s)
    time.sleep(grace_s)
    ep.stop.set()
    rx.join(10.0)
    after = host_drops()
    return ep.report({k: max(0, after[k] - before[k]) for k in after})


def host_drops() -> dict[str, int]:
    """What this network namespace has dropped so far: ``rcvbuf`` (UDP), ``rx`` and ``tx`` (all interfaces)."""
    rx, tx = interface_drops()
    return {"rcvbuf": udp_rcvbuf_errors(), "rx": rx, "tx": tx}


def interface_drops(path: str = "/proc/net/dev") -> tuple[int, int]:
    """Receive and transmit drops summed over this network namespace's interfaces.

    ``/proc/net/dev`` (per namespace) holds two header lines, then one line per interface::

        Inter-|   Receive                                                |  Transmit
         face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls ...
          nic0: 1200000    1000    0    3    0     0          0         0  2400000    2000    0   17    0     0 ...
    """
    rx = tx = 0
    try:
        with open(path) as f:
            for line in f:
                name, sep, rest = line.partition(":")
                fields = rest.split()
                if sep and "|" not in name and len(fields) >= 12:
                    rx, tx = rx + int(fields[3]), tx + int(fields[11])
    except (OSError, ValueError):
        return 0, 0  # nothing to read: those drops are then counted as the link's loss
    return rx, tx


def udp_rcvbuf_errors(path: str = "/proc/net/snmp") -> int:
    """UDP datagrams this network namespace dropped for a full socket buffer (``Udp: RcvbufErrors``).

    ``/proc/net/snmp`` holds a header line and a value line per protocol::

        Udp: InDatagrams NoPorts InErrors OutDatagrams RcvbufErrors SndbufErrors InCsumErrors IgnoredMulti MemErrors
        Udp: 1021 3 0 1040 0 0 0 0 0
    """
    try:
        with open(path) as f:
            rows = [line.split() for line in f if line.startswith("Udp:")]
        return int(dict(zip(rows[0][1:], rows[1][1:], strict=True))["RcvbufErrors"])
    except (OSError, IndexError, KeyError, ValueError):
        return 0  # no counter to read: drops by this end are then counted as the link's loss


def parse_flows(text: str) -> list[Flow]:
    """Flows from their JSON list; ValueError saying what is wrong."""
    try:
        raw = json.loads(text)
        flows = [Flow(int(f["id"]), str(f["dst"]), int(f["dport"]), int(f["sport"]), float(f["rate_mbit"]),
                      int(f.get("size", 1200))) for f in raw]
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"--flows: expected a JSON list of {{id, dst, dport, sport, rate_mbit, size}}: {exc}") from exc
    if any(f.size < HEADER.size for f in flows):
        raise ValueError(f"--flows: size must be at least {HEADER.size} bytes")
    return flows


def main(argv: Sequence[str] | None = None) -> int:
    """Command line (see the module docstring)."""
    p = argparse.ArgumentParser(prog="ridethrough.audit_load")
    p.add_argument("--bind", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--flows", default="[]")
    p.add_argument("--duration-s", type=float, default=2.0)
    p.add_argument("--mtu", type=int, default=0, help="Probe this MTU first (0: no probe).")
    p.add_argument("--grace-s", type=float, default=0.5)
    a = p.parse_args(argv)
    try:
        out = run(a.bind, a.port, parse_flows(a.flows), duration_s=a.duration_s, mtu=a.mtu, grace_s=a.grace_s)
    except (OSError, ValueError) as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return 1
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
