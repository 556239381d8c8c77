"""Probe overhead: the CPU and bandwidth one agent's prober and responder cost at the default rates.

One agent-like process (`ridethrough.collector.probe_cli`, node ``a``) probes 10 peers over
2 NICs (20 paths) at the default interval and answers the 10 peers, which each probe it over
both NICs (so it answers 20 paths too, as in a cluster where everyone probes 10 others).
The peers run in this process; everything is on loopback addresses (127.0.1.x for nic0,
127.0.2.x for nic1). The figures are the agent process's CPU time while probing over wall
time (in % of one core), and its probe traffic per NIC on the wire (payload plus UDP, IPv4
and Ethernet framing with preamble and inter-frame gap) as a fraction of a 100 Gbit/s and a
10 Gbit/s link. Targets: <= 2 % of a core, <= 0.1 % of a link.

Run: ``.venv/bin/python bench/probe_overhead.py [--quick] [--interval-s S]``; the last line
on stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ridethrough.collector.probe_responder import Responder
from ridethrough.collector.prober import Prober, ProberSettings

PEERS = 10
NICS = ("nic0", "nic1")
WIRE_OVERHEAD_BYTES = 8 + 20 + 14 + 4 + 8 + 12
"""UDP, IPv4, Ethernet header, FCS, preamble, inter-frame gap."""
LINKS_BPS = {"100g": 100e9, "10g": 10e9}


def free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def addr(nic: int, host: int) -> str:
    return f"127.0.{nic + 1}.{host + 1}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="15 s instead of 60 s")
    parser.add_argument("--interval-s", type=float, default=ProberSettings().interval_s)
    args = parser.parse_args()
    duration_s = 15.0 if args.quick else 60.0
    port = free_port(addr(0, 0))
    nodes = ["a", *(f"p{i}" for i in range(PEERS))]
    table = {n: {nic: f"{addr(r, h)}:{port}" for r, nic in enumerate(NICS)} for h, n in enumerate(nodes)}
    peers_file = Path(tempfile.mkdtemp(prefix="probe-bench-")) / "peers.json"
    peers_file.write_text(json.dumps(table))
    parsed = {n: {nic: (a.split(":")[0], port) for nic, a in nics.items()} for n, nics in table.items()}
    helpers = []
    for n in nodes[1:]:
        r = Responder(node=n, listen=parsed[n], known_nodes=parsed.keys)
        p = Prober(node=n, local={nic: a for nic, (a, _) in parsed[n].items()}, peers=parsed, on_sample=lambda s: None,
                   settings=ProberSettings(k=0, pinned=("a",), interval_s=args.interval_s))
        r.start()
        helpers.append((r, p))
    agent = subprocess.Popen(
        [sys.executable, "-m", "ridethrough.collector.probe_cli", "--node", "a", "--peers", str(peers_file),
         "--duration-s", str(duration_s), "--interval-s", str(args.interval_s), "--wait-go"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert agent.stdin is not None and agent.stdout is not None
    try:
        print("agent ready:", agent.stdout.readline().strip())
        for _, p in helpers:
            p.start()
        agent.stdin.write("go\n")
        agent.stdin.flush()
        started = time.monotonic()
        summary = json.loads(agent.stdout.read().strip().splitlines()[-1])["summary"]
        print(f"ran {time.monotonic() - started:.1f} s")
    finally:
        agent.kill()
        agent.wait()
        for r, p in helpers:
            p.stop(timeout_s=2.0)
            r.stop(timeout_s=2.0)
    cpu_pct = 100.0 * summary["cpu_s"] / summary["wall_s"]
    per_nic_bps = 8 * (summary["payload_bytes_out"] + summary["packets_out"] * WIRE_OVERHEAD_BYTES) \
        / summary["wall_s"] / len(NICS)
    fractions = {name: per_nic_bps / bps for name, bps in LINKS_BPS.items()}
    lost = sum(p["lost"] for p in summary["paths"])
    print(f"user {summary['user_s']:.2f} s, system {summary['system_s']:.2f} s")
    print(f"paths {len(summary['paths'])}, packets out {summary['packets_out']} in {summary['packets_in']}, "
          f"lost {lost}, dropped {summary['dropped']}")
    print(f"cpu {cpu_pct:.2f} % of a core; {per_nic_bps / 1e3:.1f} kbit/s per NIC = "
          f"{fractions['100g']:.2e} of 100 Gbit/s, {fractions['10g']:.2e} of 10 Gbit/s")
    print(json.dumps({"bench": "probe_overhead", "cpu_core_pct": round(cpu_pct, 3),
                      "bandwidth_fraction": fractions["10g"], "bandwidth_fraction_100g": fractions["100g"],
                      "per_nic_kbit_s": round(per_nic_bps / 1e3, 2), "paths": len(summary["paths"]),
                      "interval_s": args.interval_s, "lost": lost, "seconds": round(summary["wall_s"], 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
