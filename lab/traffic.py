"""Small traffic tools that run inside lab namespaces: a paced UDP blaster, sinks, echo, probes.

Every tool is bounded in time; each prints one JSON line when it ends. Run as
``python -m ridethrough.lab.traffic TOOL ...`` (the lab starts them in a namespace)::

    blast     --dst IP --port P --rate-mbit R --duration-s D [--bind IP] [--sport S] [--size B] [--count N]
    sink      --bind IP --port P --duration-s D                 UDP, counts what arrives
    echo      --bind IP --port P --duration-s D                 UDP and TCP echo on one port
    probe     --bind IP --flows SPORT:DST:DPORT,... [--size B] [--df] [--tcp]   echo round trips
    tcp-send  --dst IP --port P --duration-s D [--bind IP]     prints throughput
    tcp-sink  --bind IP --port P --duration-s D
"""

from __future__ import annotations

import argparse
import json
import select
import socket
import sys
import threading
import time
from collections.abc import Sequence

IP_MTU_DISCOVER = 10
IP_PMTUDISC_DO = 2


def blast(dst: str, port: int, *, rate_mbit: float, duration_s: float, bind: str = "", sport: int = 0,
          size: int = 1200, count: int = 0) -> dict[str, float]:
    """Send UDP datagrams of ``size`` bytes at ``rate_mbit`` for ``duration_s`` (or ``count`` of them)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    if bind or sport:
        sock.bind((bind, sport))
    payload = b"\0" * size
    interval_s = size * 8 / (rate_mbit * 1e6)
    start = time.monotonic()
    sent = errors = 0
    while (now := time.monotonic()) - start < duration_s and not (count and sent >= count):
        due = start + sent * interval_s
        if due > now:
            time.sleep(min(due - now, 0.01))
            continue
        try:
            sock.sendto(payload, (dst, port))
            sent += 1
        except OSError:  # a full queue or a link that is down: keep the pace
            errors += 1
            sent += 1
    return {"sent": sent, "errors": errors, "seconds": time.monotonic() - start}


def sink(bind: str, port: int, *, duration_s: float) -> dict[str, float]:
    """Receive UDP on ``bind:port`` for ``duration_s``; count packets and bytes."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((bind, port))
    deadline = time.monotonic() + duration_s
    packets = nbytes = 0
    while (left := deadline - time.monotonic()) > 0:
        if select.select([sock], [], [], min(left, 0.5))[0]:
            nbytes += len(sock.recv(65536))
            packets += 1
    return {"packets": packets, "bytes": nbytes}


def _tcp_echo(conn: socket.socket) -> None:
    with conn:
        while data := conn.recv(65536):
            conn.sendall(data)


def echo(bind: str, port: int, *, duration_s: float) -> dict[str, float]:
    """Echo UDP datagrams and TCP streams on one port until ``duration_s`` passes."""
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind((bind, port))
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind((bind, port))
    tcp.listen(64)
    print(json.dumps({"ready": True}), flush=True)
    deadline = time.monotonic() + duration_s
    served = 0
    while (left := deadline - time.monotonic()) > 0:
        for s in select.select([udp, tcp], [], [], min(left, 0.5))[0]:
            if s is udp:
                data, addr = udp.recvfrom(65536)
                udp.sendto(data, addr)
            else:
                conn, _ = tcp.accept()
                threading.Thread(target=_tcp_echo, args=(conn,), daemon=True).start()
            served += 1
    return {"served": served}


def _tcp_round_trip(bind: str, sport: int, dst: str, dport: int, *, size: int, timeout_s: float) -> bool:
    conn = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the same source port again, past TIME_WAIT
    conn.settimeout(timeout_s)
    try:
        with conn:
            conn.bind((bind, sport))
            conn.connect((dst, dport))
            conn.sendall(b"p" * size)
            got = b""
            while len(got) < size:
                chunk = conn.recv(65536)
                if not chunk:
                    return False
                got += chunk
            return True
    except OSError:
        return False


def probe(bind: str, flows: Sequence[tuple[int, str, int]], *, size: int = 64, df: bool = False,
          timeout_s: float = 1.0, tries: int = 3, tcp: bool = False) -> dict[str, list[bool]]:
    """One echo round trip per flow (source port, destination, destination port): did it come back?"""
    results: list[bool] = []
    for sport, dst, dport in flows:
        if tcp:
            results.append(_tcp_round_trip(bind, sport, dst, dport, size=size, timeout_s=timeout_s))
            continue
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if df:
            sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
        sock.bind((bind, sport))
        sock.settimeout(timeout_s / tries)
        ok = False
        for _ in range(tries):
            try:
                sock.sendto(b"p" * size, (dst, dport))
                ok = len(sock.recv(65536)) == size
            except OSError:
                ok = False
            if ok:
                break
        sock.close()
        results.append(ok)
    return {"ok": results}


def tcp_send(dst: str, port: int, *, duration_s: float, bind: str = "") -> dict[str, float]:
    """Send as fast as TCP allows for ``duration_s``; report the goodput."""
    sock = socket.create_connection((dst, port), timeout=5, source_address=(bind, 0) if bind else None)
    chunk = b"\0" * 65536
    start = time.monotonic()
    sent = 0
    while time.monotonic() - start < duration_s:
        sent += sock.send(chunk)
    elapsed = time.monotonic() - start
    sock.close()
    return {"bytes": sent, "seconds": elapsed, "mbit_per_s": sent * 8 / elapsed / 1e6}


def tcp_sink(bind: str, port: int, *, duration_s: float) -> dict[str, float]:
    """Accept TCP connections on ``bind:port`` and discard what arrives, for ``duration_s``."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((bind, port))
    srv.listen(8)
    print(json.dumps({"ready": True}), flush=True)
    deadline = time.monotonic() + duration_s
    conns: list[socket.socket] = []
    received = 0
    while (left := deadline - time.monotonic()) > 0:
        for s in select.select([srv, *conns], [], [], min(left, 0.5))[0]:
            if s is srv:
                conns.append(srv.accept()[0])
                continue
            data = s.recv(1 << 20)
            received += len(data)
            if not data:
                conns.remove(s)
                s.close()
    return {"bytes": received}


def _flows(text: str) -> list[tuple[int, str, int]]:
    out = []
    for item in text.split(","):
        sport, dst, dport = item.split(":")
        out.append((int(sport), dst, int(dport)))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: one tool per run, one JSON line of results."""
    p = argparse.ArgumentParser(prog="ridethrough.lab.traffic")
    p.add_argument("tool", choices=("blast", "sink", "echo", "probe", "tcp-send", "tcp-sink"))
    p.add_argument("--dst", default="")
    p.add_argument("--bind", default="")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--rate-mbit", type=float, default=100.0)
    p.add_argument("--duration-s", type=float, default=10.0)
    p.add_argument("--size", type=int, default=0)
    p.add_argument("--flows", default="")
    p.add_argument("--df", action="store_true")
    p.add_argument("--tcp", action="store_true")
    p.add_argument("--sport", type=int, default=0)
    p.add_argument("--count", type=int, default=0)
    a = p.parse_args(argv)
    if a.tool == "blast":
        out: dict[str, object] = dict(blast(a.dst, a.port, rate_mbit=a.rate_mbit, duration_s=a.duration_s,
                                            bind=a.bind, sport=a.sport, size=a.size or 1200, count=a.count))
    elif a.tool == "sink":
        out = dict(sink(a.bind, a.port, duration_s=a.duration_s))
    elif a.tool == "echo":
        out = dict(echo(a.bind, a.port, duration_s=a.duration_s))
    elif a.tool == "probe":
        out = dict(probe(a.bind, _flows(a.flows), size=a.size or 64, df=a.df, tcp=a.tcp))
    elif a.tool == "tcp-send":
        out = dict(tcp_send(a.dst, a.port, duration_s=a.duration_s, bind=a.bind))
    else:
        out = dict(tcp_sink(a.bind, a.port, duration_s=a.duration_s))
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
