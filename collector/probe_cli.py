"""Run a responder and a prober for a while and print what they saw, as JSON lines (the lab's probe tool).

    python -m ridethrough.collector.probe_cli --node h0 --peers peers.json --duration-s 5 [--samples]
        [--clock-script clock.json] [--interval-s 0.5] [--pair-gap-us 20] [--k 10] [--wait-go]

Prints ``{"ready": {...addresses}}`` once the responder answers; with ``--wait-go`` it then waits
for a line on stdin before probing (so that a test can start every host's responder first).
With ``--samples`` each `ProbeSample` is a line ``{"sample": {...}}``. Last comes
``{"summary": {...}}``: per-path counters, drops, answered probes, packets and bytes sent and
received, and the CPU seconds the process spent while probing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from ridethrough.collector.clock import ScriptedClock
from ridethrough.collector.probe_paths import load_peers
from ridethrough.collector.probe_responder import Responder
from ridethrough.collector.probe_sample import ProbeSample
from ridethrough.collector.probe_stats import SampleAggregator
from ridethrough.collector.probe_wire import PACKET_BYTES
from ridethrough.collector.prober import Prober, ProberSettings
from ridethrough.collector.sources.probe import DEFAULT_PURE_TOLERANCE_NS
from ridethrough.collector.timestamps import HostTime

_print_lock = threading.Lock()


def _line(obj: dict[str, Any]) -> None:
    with _print_lock:
        sys.stdout.write(json.dumps(obj, separators=(",", ":")) + "\n")
        sys.stdout.flush()


def sample_json(s: ProbeSample) -> dict[str, Any]:
    """A sample as plain JSON values."""
    out = dataclasses.asdict(s)
    out["rx_kind"], out["tx_kind"] = s.rx_kind.value, s.tx_kind.value
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(prog="ridethrough.collector.probe_cli", description=__doc__.split("\n")[0])
    p.add_argument("--node", required=True)
    p.add_argument("--peers", required=True, help="peer table JSON: {node: {nic: address}}")
    p.add_argument("--port", type=int, default=7447)
    p.add_argument("--duration-s", type=float, required=True)
    p.add_argument("--clock-script", default="")
    p.add_argument("--interval-s", type=float, default=0.5)
    p.add_argument("--pair-gap-us", type=float, default=20.0)
    p.add_argument("--timeout-s", type=float, default=1.0)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--pinned", default="", help="comma-separated peers always probed")
    p.add_argument("--samples", action="store_true")
    p.add_argument("--wait-go", action="store_true")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run until ``--duration-s`` has passed after the start of probing."""
    args = parse_args(argv)
    peers = load_peers(args.peers, default_port=args.port)
    own = peers.get(args.node)
    if not own:
        print(f"node {args.node!r} is not in {args.peers}", file=sys.stderr)
        return 2
    host_time = HostTime(ScriptedClock(args.clock_script)) if args.clock_script else HostTime()
    responder = Responder(node=args.node, listen=own, host_time=host_time, known_nodes=peers.keys)
    settings = ProberSettings(k=args.k, interval_s=args.interval_s, pair_gap_ns=round(args.pair_gap_us * 1000),
                              timeout_s=args.timeout_s, pinned=tuple(filter(None, args.pinned.split(","))))
    aggregator = SampleAggregator(pure_tolerance_ns=DEFAULT_PURE_TOLERANCE_NS)  # what an agent does with each

    def on_sample(s: ProbeSample) -> None:
        aggregator.add(s)
        if args.samples:
            _line({"sample": sample_json(s)})

    prober = Prober(node=args.node, local={nic: addr for nic, (addr, _) in own.items()}, peers=peers,
                    on_sample=on_sample, settings=settings, host_time=host_time)
    responder.start()
    try:
        _line({"ready": {nic: list(a) for nic, a in responder.addresses.items()}})
        if args.wait_go:
            sys.stdin.readline()
        t0, wall0 = os.times(), time.monotonic()
        prober.start()
        while (left := args.duration_s - (time.monotonic() - wall0)) > 0:
            time.sleep(min(left, 1.0))
            aggregator.take()  # as the agent's collection would, each second
        t1, wall_s = os.times(), time.monotonic() - wall0
        user_s, system_s = t1.user - t0.user, t1.system - t0.system
        prober.settle(args.timeout_s + 1.0)  # so that each path's sent = received + lost
        prober.stop(timeout_s=2.0)
        time.sleep(args.timeout_s)  # let peers' last probes be answered before the responder goes
    finally:
        responder.stop(timeout_s=2.0)
    _line({"summary": summary(prober, responder, user_s=user_s, system_s=system_s, wall_s=wall_s)})
    return 0


def summary(prober: Prober, responder: Responder, *, user_s: float, system_s: float, wall_s: float) -> dict[str, Any]:
    """What a run did, for tests and the overhead bench."""
    statuses = prober.paths()
    paths = [{"src_nic": p.path.local.nic, "dst_node": p.path.peer.node, "dst_nic": p.path.peer.nic,
              "sent": p.sent, "received": p.received, "lost": p.lost, "lost_forward": p.lost_forward,
              "lost_reverse": p.lost_reverse, "suspended": p.suspended} for p in statuses]
    answered = sum(responder.answered().values())
    sent, received = sum(p.sent for p in statuses), sum(p.received for p in statuses)
    return {"paths": paths, "answered": answered, "cpu_s": user_s + system_s, "user_s": user_s,
            "system_s": system_s, "wall_s": wall_s,
            "dropped": {"prober": {str(r): n for r, n in prober.dropped().items() if n},
                        "responder": {str(r): n for r, n in responder.dropped().items() if n}},
            "packets_out": sent + answered, "packets_in": received + answered,
            "payload_bytes_out": (sent + answered) * PACKET_BYTES}

if __name__ == "__main__":
    sys.exit(main())
