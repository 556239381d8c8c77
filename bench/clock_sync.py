"""Clock-sync accuracy in the lab: our estimator against NTP's, on the same probes, against truth.

Hosts get known offsets (up to ±10 ms) and drifts (up to ±100 ppm) from the lab. Every host runs
the real responder and prober (``ridethrough.collector.probe_cli``) with its scripted clock, under
three conditions: idle; symmetric load (a ``tbf``-capped link congested both ways); asymmetric
load (the same link capped and congested in one direction only, so queues build one way). For
each condition, the pairwise estimates (ours: coded pairs + max-margin separator, one per pair
and 2 s window; NTP: RFC 5905 minimum-delay filter over the last 8 exchanges, after every
exchange) are compared with the truth the lab holds, each at its own time; ours are also
corrected on the probe graph to per-host offsets against a reference host (``host_*``). One-way
delays corrected with those offsets are compared with the delays implied by the true clocks.

    python bench/clock_sync.py [--quick]

The last stdout line is JSON: {"bench": "clock_sync", "idle_p50_us", "asym_p99_us",
"ntp_asym_p99_us", "asym_ratio", ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ridethrough.collector.clock import ClockSpec, read_spec
from ridethrough.collector.clock_graph import PairEdge, solve
from ridethrough.collector.huygens import HuygensConfig, estimate_windows
from ridethrough.collector.ntp import ntp_offset
from ridethrough.collector.probe_sample import ProbeSample, TimestampKind
from ridethrough.lab.control import Direction
from ridethrough.lab.fabric import Lab
from ridethrough.lab.topology import TopologySpec

WINDOW_NS = 2_000_000_000
CONGESTED = "h0-leaf0r0"
"""The link the load conditions congest: every probe h0 sends on rail 0 crosses it."""
REFERENCE = "h1"


def _sample(d: dict[str, Any]) -> ProbeSample:
    d = dict(d)
    d["rx_kind"], d["tx_kind"] = TimestampKind(d["rx_kind"]), TimestampKind(d["tx_kind"])
    return ProbeSample(**d)


def run_probes(lab: Lab, *, duration_s: float, interval_s: float, work: Path) -> list[ProbeSample]:
    """Every host probes every other for ``duration_s``; all their samples."""
    topo = lab.topology
    peers = {h: {f"nic{r}": topo.nic_ip(h, r) for r in range(topo.spec.rails)} for h in topo.hosts}
    peers_file = work / "peers.json"
    peers_file.write_text(json.dumps(peers))
    hosts = lab.state()["hosts"]
    procs = []
    for h in topo.hosts:
        argv = [sys.executable, "-m", "ridethrough.collector.probe_cli", "--node", h, "--peers", str(peers_file),
                "--duration-s", str(duration_s), "--interval-s", str(interval_s), "--k", str(len(topo.hosts)),
                "--clock-script", str(Path(hosts[h]["dir"]) / "clock.json"), "--samples", "--wait-go"]
        procs.append(lab.exec(h, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
    for p in procs:  # every responder answers before anyone probes
        assert p.stdout is not None
        line = p.stdout.readline()
        if '"ready"' not in line:
            raise RuntimeError(f"a prober did not start: {line!r}")
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    samples: list[ProbeSample] = []
    for p in procs:
        out, _ = p.communicate(timeout=duration_s + 60)
        samples += [_sample(json.loads(line)["sample"]) for line in out.splitlines() if line.startswith('{"sample"')]
    return samples


def _true_ns(spec: ClockSpec, local_ns: int) -> int:
    t = local_ns
    for _ in range(3):  # local(t) is within 10 ms and 100 ppm of t: two steps converge
        t = local_ns - (spec.local(t) - t)
    return t


def _true_offset(specs: dict[str, ClockSpec], node: str, true_ns: int) -> float:
    """clock_node - clock_reference at true time ``true_ns``."""
    return float(specs[node].local(true_ns) - specs[REFERENCE].local(true_ns))


def _by_pair(samples: Sequence[ProbeSample]) -> dict[tuple[str, str], list[ProbeSample]]:
    pairs: dict[tuple[str, str], list[ProbeSample]] = defaultdict(list)
    for s in sorted(samples, key=lambda s: s.t1_ns):
        pairs[(s.src_node, s.dst_node)].append(s)
    return pairs


def _window(t_ns: int, origin: int) -> int:
    return (t_ns - origin) // WINDOW_NS


def ours_edges(pairs: dict[tuple[str, str], list[ProbeSample]], origin: int) -> dict[int, list[PairEdge]]:
    """Our pairwise estimates per window, carried to the window's middle."""
    cfg = HuygensConfig(window_ns=WINDOW_NS)
    edges: dict[int, list[PairEdge]] = defaultdict(list)
    for pair_samples in pairs.values():
        for est in estimate_windows(pair_samples, config=cfg, origin_ns=origin):
            w = _window(est.window_start_ns, origin)
            mid = origin + w * WINDOW_NS + WINDOW_NS // 2
            edges[w].append(PairEdge.from_estimate(est, at_ns=mid))
    return edges


def _pair_truth(specs: dict[str, ClockSpec], a: str, b: str, a_clock_ns: int) -> float:
    """clock_b - clock_a at the true instant when A's clock read ``a_clock_ns``."""
    t = _true_ns(specs[a], a_clock_ns)
    return float(specs[b].local(t) - specs[a].local(t))


def pair_errors_ours(pairs: dict[tuple[str, str], list[ProbeSample]], specs: dict[str, ClockSpec],
                     origin: int) -> list[float]:
    """|our pairwise offset - truth| for every window estimate, at its own reference time, in ns."""
    cfg = HuygensConfig(window_ns=WINDOW_NS)
    return [abs(est.offset_ns - _pair_truth(specs, a, b, est.reference_ns))
            for (a, b), ps in pairs.items() for est in estimate_windows(ps, config=cfg, origin_ns=origin)]


def pair_errors_ntp(pairs: dict[tuple[str, str], list[ProbeSample]], specs: dict[str, ClockSpec]) -> list[float]:
    """|NTP's pairwise offset - truth| after every exchange, at that exchange's time, in ns."""
    return [abs(offset - _pair_truth(specs, a, b, t_ns))
            for (a, b), ps in pairs.items() for t_ns, offset in ntp_offset(ps)]


def node_errors(edges: dict[int, list[PairEdge]], specs: dict[str, ClockSpec], origin: int) -> list[float]:
    """|estimated - true| per host (reference excluded) and complete window, in ns."""
    errors: list[float] = []
    windows = sorted(edges)[1:-1]  # the first and last windows are partial
    for w in windows:
        sol = solve(edges[w], reference=REFERENCE)
        mid_true = _true_ns(specs[REFERENCE], origin + w * WINDOW_NS + WINDOW_NS // 2)
        errors += [abs(clock.offset_ns - _true_offset(specs, n, mid_true))
                   for n, clock in sol.nodes.items() if n != REFERENCE]
    return errors


def owd_errors(samples: Sequence[ProbeSample], edges: dict[int, list[PairEdge]], specs: dict[str, ClockSpec],
               origin: int) -> list[float]:
    """|corrected forward one-way delay - true one-way delay| for every sample, in ns."""
    solutions = {w: solve(e, reference=REFERENCE).nodes for w, e in edges.items()}
    out: list[float] = []
    for s in samples:
        w = _window(s.t1_ns, origin)
        nodes = solutions.get(w, {})
        if any(n not in nodes and n != REFERENCE for n in (s.src_node, s.dst_node)):
            continue
        since_mid = s.t1_ns - (origin + w * WINDOW_NS + WINDOW_NS // 2)
        theta = _node_offset(nodes, s.dst_node, since_mid) - _node_offset(nodes, s.src_node, since_mid)
        est = s.t2_ns - s.t1_ns - theta
        true = _true_ns(specs[s.dst_node], s.t2_ns) - _true_ns(specs[s.src_node], s.t1_ns)
        out.append(abs(est - true))
    return out


def _node_offset(nodes: dict[str, Any], node: str, since_mid_ns: int) -> float:
    """The node's offset from the reference, carried along its drift from the window's middle."""
    if node == REFERENCE:
        return 0.0
    return float(nodes[node].offset_ns + nodes[node].drift_ppm * 1e-6 * since_mid_ns)


def _pct(values: Sequence[float], q: float) -> float:
    return round(float(np.percentile(values, q)) / 1000.0, 2) if values else float("nan")


def evaluate(samples: Sequence[ProbeSample], specs: dict[str, ClockSpec]) -> dict[str, float]:
    """Figures for one condition, in µs: pairwise for both estimators, per host (graph) for ours."""
    origin = min(s.t1_ns for s in samples)
    pairs = _by_pair(samples)
    ours, ntp = pair_errors_ours(pairs, specs, origin), pair_errors_ntp(pairs, specs)
    edges = ours_edges(pairs, origin)
    hosts = node_errors(edges, specs, origin)
    owd = owd_errors(samples, edges, specs, origin)
    return {"p50_us": _pct(ours, 50), "p99_us": _pct(ours, 99), "ntp_p50_us": _pct(ntp, 50),
            "ntp_p99_us": _pct(ntp, 99), "host_p50_us": _pct(hosts, 50), "host_p99_us": _pct(hosts, 99),
            "owd_err_p50_us": _pct(owd, 50), "owd_err_p99_us": _pct(owd, 99), "samples": len(samples),
            "pair_estimates": len(ours), "ntp_estimates": len(ntp)}


def load(lab: Lab, condition: str) -> list[str]:
    """Apply a condition's congestion; returns the load handles to stop."""
    if condition == "idle":
        return []
    both = condition == "sym"
    lab.degrade_link(CONGESTED, rate_mbit=20, burst_kbit=64, latency_ms=50,
                     direction=Direction.BOTH if both else Direction.FORWARD)
    directions = [Direction.FORWARD, Direction.REVERSE] if both else [Direction.FORWARD]
    return [lab.start_load(CONGESTED, direction=d, rate_mbit=40) for d in directions]


def main(argv: list[str] | None = None) -> int:
    """Bring a lab up, run the three conditions, print the figures."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="Shorter conditions: under a minute in all.")
    ap.add_argument("--duration-s", type=float, default=None, help="Seconds per condition.")
    ap.add_argument("--interval-s", type=float, default=0.2, help="Seconds between coded pairs on a path.")
    args = ap.parse_args(argv)
    duration = args.duration_s or (9.0 if args.quick else 24.0)
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="rt-clock-") as tmp, \
            Lab.up(TopologySpec(), name=f"clk{os.getpid() % 10000}", agents=False) as lab:
        specs = {h: read_spec(Path(i["dir"]) / "clock.json") for h, i in lab.state()["hosts"].items()}
        for condition in ("idle", "sym", "asym"):
            handles = load(lab, condition)
            try:
                started = time.monotonic()
                samples = run_probes(lab, duration_s=duration, interval_s=args.interval_s, work=Path(tmp))
            finally:
                for h in handles:
                    lab.stop_load(h)
                if condition != "idle":
                    lab.restore_link(CONGESTED)
            results[condition] = evaluate(samples, specs)
            print(f"{condition}: {results[condition]} ({time.monotonic() - started:.0f} s)", file=sys.stderr)
    asym = results["asym"]
    summary = {
        "bench": "clock_sync", "idle_p50_us": results["idle"]["p50_us"], "idle_p99_us": results["idle"]["p99_us"],
        "sym_p99_us": results["sym"]["p99_us"], "asym_p50_us": asym["p50_us"], "asym_p99_us": asym["p99_us"],
        "ntp_idle_p50_us": results["idle"]["ntp_p50_us"], "ntp_sym_p99_us": results["sym"]["ntp_p99_us"],
        "ntp_asym_p99_us": asym["ntp_p99_us"], "host_asym_p99_us": asym["host_p99_us"],
        "host_idle_p50_us": results["idle"]["host_p50_us"],
        "asym_ratio": round(asym["ntp_p99_us"] / asym["p99_us"], 2) if asym["p99_us"] else None,
        "owd_err_p50_us": {c: r["owd_err_p50_us"] for c, r in results.items()},
        "owd_err_p99_us": {c: r["owd_err_p99_us"] for c, r in results.items()},
        "conditions": results, "duration_s_per_condition": duration, "interval_s": args.interval_s,
        "hosts": 8, "reference": REFERENCE, "congested_link": CONGESTED, "quick": args.quick,
    }
    summary["targets"] = {"asym_ratio_at_least_5": bool(summary["asym_ratio"] and summary["asym_ratio"] >= 5),
                          "idle_p50_under_20us": bool(summary["idle_p50_us"] < 20)}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
