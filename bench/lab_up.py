"""Lab bring-up benchmark: the default lab (8 hosts, 2 racks, 2 rails, 2 spines) with agents, up and down.

Each round brings a fresh lab up with `Lab.up` (namespaces, veths, routes, host trees, the
supervisor, the server and 8 agents; it returns once the processes run and the server's
ready file exists), waits (outside both clocks) until every agent's first rows are in the
store, so the lab is taken down in its steady state, and takes it down with `Lab.down`.
``up_s`` and ``down_s`` are medians over the rounds (targets: under 10 s and under 5 s on a
2-core machine); ``first_rows_s`` is how long after ``up`` returned every agent had
exported. Needs root and network namespaces.

Human-readable progress goes to stderr; the last line on stdout is one JSON object.
Run: ``.venv/bin/python bench/lab_up.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import urllib.parse
import urllib.request

from ridethrough.lab import procs
from ridethrough.lab.fabric import Lab
from ridethrough.lab.netns import unavailable_reason
from ridethrough.lab.topology import Topology, TopologySpec

UP_TARGET_S = 10.0
DOWN_TARGET_S = 5.0


def _agents_with_rows(store_http: str) -> int:
    sql = "SELECT uniqExact(ResourceAttributes['ridethrough.node.id']) FROM otel_metrics_sum FORMAT JSONCompact"
    try:
        with urllib.request.urlopen(f"{store_http}/?query={urllib.parse.quote(sql)}", timeout=5) as r:
            return int(json.loads(r.read())["data"][0][0])
    except (OSError, ValueError, KeyError, IndexError):
        return 0


def _first_rows_s(lab: Lab, hosts: int, timeout_s: float = 60.0) -> float | None:
    started = time.monotonic()
    store = lab.server["store_http"]
    while time.monotonic() - started < timeout_s:
        if _agents_with_rows(store) >= hosts:
            return round(time.monotonic() - started, 2)
        time.sleep(0.2)
    return None


def one_round(i: int, spec: TopologySpec) -> dict[str, float | int | None]:
    """Bring a lab up and down once; its figures."""
    name = f"bench{os.getpid() % 100000}x{i}"
    t0 = time.monotonic()
    lab = Lab.up(spec, name=name, agents=True)
    up_s = time.monotonic() - t0
    state = lab.state()
    agents = sum(procs.alive(procs.ProcRef.from_json(v)) for k, v in state["processes"].items()
                 if k.startswith("agent:"))
    rows = _first_rows_s(lab, spec.hosts)
    t1 = time.monotonic()
    report = lab.down()
    down_s = time.monotonic() - t1
    if report.problems:
        raise SystemExit(f"lab {name} left things behind: {report.problems}")
    print(f"round {i}: up {up_s:.2f} s, down {down_s:.2f} s, {agents} agents running"
          + (f", every agent's rows in the store {rows} s after up" if rows is not None else ""), file=sys.stderr)
    return {"up_s": up_s, "down_s": down_s, "agents": agents, "namespaces": len(state["namespaces"]),
            "veth_pairs": lab.veth_pairs, "first_rows_s": rows}


def main() -> int:
    """Run the rounds; print one JSON line last."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="One round (well under a minute).")
    ap.add_argument("--rounds", type=int, help="Rounds (default 3; --quick: 1).")
    args = ap.parse_args()
    reason = unavailable_reason()
    if reason:
        print(f"lab_up: {reason}", file=sys.stderr)
        return 2
    rounds = args.rounds or (1 if args.quick else 3)
    spec = TopologySpec()
    results = [one_round(i, spec) for i in range(rounds)]
    rows = [float(r["first_rows_s"]) for r in results if r["first_rows_s"] is not None]
    up = [float(r["up_s"] or 0) for r in results]
    down = [float(r["down_s"] or 0) for r in results]
    print(json.dumps({
        "bench": "lab_up", "up_s": round(statistics.median(up), 3), "down_s": round(statistics.median(down), 3),
        "up_s_max": round(max(up), 3), "down_s_max": round(max(down), 3), "rounds": rounds,
        "up_target_s": UP_TARGET_S, "down_target_s": DOWN_TARGET_S,
        "within_targets": max(up) < UP_TARGET_S and max(down) < DOWN_TARGET_S,
        "hosts": spec.hosts, "namespaces": results[0]["namespaces"], "veth_pairs": results[0]["veth_pairs"],
        "links": len(Topology(spec).links),
        "agents": results[0]["agents"], "first_rows_s": round(statistics.median(rows), 2) if rows else None,
        "cpu_count": os.cpu_count(),
        "quick": args.quick,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
