"""Headline benchmark: a gloo all-reduce job rides through a spine-link cut, thanks to the agents' reflex.

A lab (2 racks of one host, 2 rails, 2 spines) with its agents and server (its controller off: the
reflex needs nothing of it, and this machine's two cores are better spent on what is measured);
a PyTorch (CPU, gloo) all-reduce between h0 (rack 0) and h1 (rack 1), so every step crosses a
leaf, a spine and a leaf. The bench finds the spine link the job's traffic crosses (from byte
counters: see `spine_link`), then cuts it ``--cuts`` times (``ip link set down`` at the spine
end: the leaf keeps hashing the flow into the dead link, and no host sees a carrier change) and
brings it back each time, waiting for the reflex to return the traffic before the next cut. Per
cut: the longest stall of the collective loop (the longest time without a step completing, on
either rank, from the cut on) and the time from the cut to the override route on each host
(netlink route events, protocol 114). Then the same link is congested (tbf at 5 Mbit/s plus
10 Mbit/s of UDP across it) to show traffic leaving a link that is alive but bad.

Then the baseline, in the same lab and job: the agents are stopped (the reflex off) and the link
is cut once more; the job fails or stalls until gloo's timeout (30 s; 5 s with ``--quick``, which
is the job's timeout throughout). The agents' CPU is read from /proc before the job (the reflex
watching nobody) and during it, and the reflex thread's own (``rt-reflex``).

Targets (issue #7): zero job errors and a longest stall <= 300 ms, p99 over 20 cuts <= 500 ms,
with the reflex; without it the job fails. Bench labs return traffic after 1 s of health and
without flap damping, so cuts can follow each other; neither changes how fast traffic leaves.

Human-readable progress goes to stderr; the last line on stdout is one JSON object:
``{"bench": "reroute", "errors": …, "max_stall_ms": …, "p99_stall_ms": …, "baseline_failed": …}``.
Run: ``.venv/bin/python bench/reroute.py [--quick] [--cuts N]`` (root; ``--quick`` under 60 s on a quiet
machine).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

HOSTS = ("h0", "h1")
STORE_PORT = 29571
COMPUTE_MS = 0.0
"""Sleep per step besides the all-reduce (``--compute-ms``). None by default: on a busy machine a sleeping
process waits tens of ms for a CPU again, and the steps would measure the scheduler, not the fabric."""
MAX_STALL_TARGET_MS, P99_TARGET_MS = 300.0, 500.0


def worker(args: argparse.Namespace) -> int:
    """One rank (run inside a lab host): all-reduce until rank 0 sees the stop file; step end times as JSON."""
    import torch
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "stab")
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{STORE_PORT}", rank=args.rank,
                            world_size=2, timeout=timedelta(seconds=args.timeout_s))
    ends: list[int] = []
    error, wrong = None, 0
    try:
        while True:
            t = torch.full((args.elements + 1,), float(args.rank + 1))
            # rank 0's vote rides in the last element, so both ranks stop after the same step
            t[-1] = float(args.rank == 0 and os.path.exists(args.stop_file))
            dist.all_reduce(t)
            ends.append(time.time_ns())
            wrong += int(not torch.all(t[:-1] == 3.0).item())
            if t[-1] > 0:
                break
            if args.compute_ms:
                time.sleep(args.compute_ms / 1e3)
    except Exception as exc:  # the baseline's timeout or reset: the result, not a crash
        error = f"{type(exc).__name__}: {str(exc)[:300]}"
    print(json.dumps({"rank": args.rank, "ends": ends, "end_ns": time.time_ns(), "wrong": wrong, "error": error}),
          flush=True)
    os._exit(0)  # gloo's teardown can hang on a dead peer; the answer is printed


class RouteWatch:
    """Override routes (protocol 114) appearing and going on some hosts, from netlink route events."""

    def __init__(self, lab: Any, hosts: tuple[str, ...]) -> None:
        from ridethrough.lab.netns import ns_path, setns

        self.events: list[tuple[int, str, bool]] = []
        self._socks: dict[socket.socket, str] = {}
        for host in hosts:  # a socket lives in the namespace it was made in: make each one there
            home, fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY), os.open(ns_path(lab.topology.namespace(host)),
                                                                                 os.O_RDONLY)
            try:
                setns(fd)
                sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
                sock.bind((0, 0x40))  # RTMGRP_IPV4_ROUTE
                self._socks[sock] = host
            finally:
                setns(home)
                os.close(home)
                os.close(fd)
        self.overridden: dict[str, bool] = dict.fromkeys(hosts, False)

    def poll(self, timeout_s: float) -> None:
        """Read the events that came (waiting up to ``timeout_s`` for the first)."""
        import select
        import struct

        from pyroute2.netlink.rtnl.rtmsg import rtmsg

        ready, _, _ = select.select(list(self._socks), [], [], timeout_s)
        now = time.time_ns()
        for sock in ready:
            data, off = sock.recv(1 << 16), 0
            while off + 16 <= len(data):
                length, kind = struct.unpack_from("=IH", data, off)
                msg = rtmsg(data[off:off + length])
                msg.decode()
                if kind in (24, 25) and msg["proto"] == 114 and msg["dst_len"] == 32:  # RTM_NEW/DELROUTE
                    host = self._socks[sock]
                    self.overridden[host] = kind == 24
                    self.events.append((now, host, kind == 24))
                off += max(16, (length + 3) & ~3)

    def wait(self, want: bool, timeout_s: float) -> bool:
        """Wait until every host has (or has no) override; False at the deadline."""
        deadline = time.monotonic() + timeout_s
        while any(v != want for v in self.overridden.values()):
            if time.monotonic() >= deadline:
                return False
            self.poll(min(0.05, deadline - time.monotonic()))
        return True

    def first_after(self, t_ns: int) -> dict[str, float]:
        """Milliseconds from ``t_ns`` to each host's first override after it."""
        out: dict[str, float] = {}
        for at, host, new in self.events:
            if new and at >= t_ns and host not in out:
                out[host] = (at - t_ns) / 1e6
        return out

    def close(self) -> None:
        """Close the sockets."""
        for sock in self._socks:
            sock.close()


def log(msg: str) -> None:
    """Progress, to stderr."""
    print(f"[reroute {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def start_job(lab: Any, stop_file: Path, timeout_s: float, elements: int,
              compute_ms: float = COMPUTE_MS) -> list[subprocess.Popen[str]]:
    """Both ranks, rank 0 on h0 (which hosts gloo's store)."""
    master = lab.topology.stable_ip(HOSTS[0])
    return [lab.exec(host, [sys.executable, str(Path(__file__).resolve()), "--worker", "--rank", str(rank),
                            "--master", master, "--stop-file", str(stop_file), "--timeout-s", str(timeout_s),
                            "--elements", str(elements), "--compute-ms", str(compute_ms)], job=True,
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank, host in enumerate(HOSTS)]


def job_flow(lab: Any, procs: list[subprocess.Popen[str]], timeout_s: float = 180.0) -> tuple[int, int]:
    """(h0's port, h1's port) of the job's data connection, once it is up."""
    peer = lab.topology.stable_ip(HOSTS[1])
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise SystemExit(f"reroute: a rank exited ({p.returncode}): {(p.communicate()[1] or '')[-500:]}")
        for line in lab.run(HOSTS[0], ["cat", "/proc/net/tcp"]).stdout.splitlines()[1:]:
            f = line.split()
            (_, lp), (ra, rp) = (x.split(":") for x in f[1:3])
            remote = socket.inet_ntoa(bytes.fromhex(ra)[::-1])
            if f[3] == "01" and remote == peer and STORE_PORT not in (int(lp, 16), int(rp, 16)):
                return int(lp, 16), int(rp, 16)
        time.sleep(0.5)
    raise SystemExit("reroute: the job's connection never came up (see the lab's logs)")


def finish(procs: list[subprocess.Popen[str]], stop_file: Path, timeout_s: float) -> list[dict[str, Any]]:
    """Stop the job (rank 0 reads the stop file); each rank's result."""
    stop_file.touch()
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
        lines = stdout.strip().splitlines()
        out.append(json.loads(lines[-1]) if lines else {"ends": [], "wrong": 0, "error": f"no result: {stderr[-300:]}"})
    return out


def stall_ms(results: list[dict[str, Any]], t_ns: int, until_ns: int) -> float:
    """The longest time without a step completing, on either rank, that overlaps [``t_ns``, ``until_ns``].

    Gaps between consecutive completions, and the wait from the last one to the rank's end (a
    rank that stopped completing steps: the baseline's, at gloo's timeout).
    """
    worst = 0
    for r in results:
        seq = [*r["ends"], int(r["end_ns"])]
        for a, b in itertools.pairwise(seq):
            if a <= until_ns and b >= t_ns:
                worst = max(worst, b - a)
    return worst / 1e6


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)] if ordered else math.nan


def cpu_of(lab: Any, seconds: float) -> dict[str, float]:
    """Mean CPU % over ``seconds`` of the job hosts' agents, and of their reflex threads."""
    from _procs import proc_cpu_s, thread_cpu_s

    pids = [int(lab.state()["processes"][f"agent:{h}"]["pid"]) for h in HOSTS]
    before = [(proc_cpu_s(p), thread_cpu_s(p).get("rt-reflex", 0.0)) for p in pids]
    time.sleep(seconds)
    after = [(proc_cpu_s(p), thread_cpu_s(p).get("rt-reflex", 0.0)) for p in pids]
    n = len(pids) * seconds / 100
    return {"agent": round(sum(a[0] - b[0] for a, b in zip(after, before, strict=True)) / n, 2),
            "reflex": round(sum(a[1] - b[1] for a, b in zip(after, before, strict=True)) / n, 2)}


def open_lab(tag: str) -> Any:
    """A 2-host, 2-rack lab with agents and their reflex (the lab's processes inherit this environment)."""
    from ridethrough.lab.fabric import Lab
    from ridethrough.lab.supervisor import REFLEX_PEERS_FILE
    from ridethrough.lab.topology import TopologySpec

    os.environ["RIDETHROUGH_AGENT_REFLEX"] = "true"
    os.environ["RIDETHROUGH_AGENT_REFLEX_HOLDDOWN_S"] = os.environ["RIDETHROUGH_AGENT_REFLEX_HOLDDOWN_MAX_S"] = "1"
    os.environ["RIDETHROUGH_CONTROLLER_ENABLED"] = "false"
    lab = Lab.up(TopologySpec(hosts=2, racks=2, rails=2, spines=2, gpus=0), name=f"rr{tag}{os.getpid() % 100000}")
    stable = lab.dir / REFLEX_PEERS_FILE
    if not stable.exists():  # older supervisors do not write it yet
        stable.write_text(json.dumps({h: i["stable_ip"] for h, i in lab.state()["hosts"].items()}))
    return lab


def _tx_bytes(lab: Any, node: str) -> dict[str, int]:
    return {str(m.get("ifname")): int((m.get("stats64") or {}).get("tx_bytes", 0)) for m in lab.handle(node).links()}


def spine_link(lab: Any, procs: list[subprocess.Popen[str]], seconds: float = 1.0) -> tuple[str, str]:
    """(link, its spine end) that carries the job's h0→h1 traffic, from byte counters.

    Counters, not ``ip route get``: a lab TCP flow's spine is picked from the hash its socket
    stamped on the packet (veth keeps ``skb->hash`` across namespaces), not from its ports.
    """
    job_flow(lab, procs)
    topo, src = lab.topology, HOSTS[0]
    leaves = [topo.leaf(topo.rack_of(src), r) for r in range(topo.spec.rails)]
    before = {n: _tx_bytes(lab, n) for n in (src, *leaves)}
    time.sleep(seconds)
    after = {n: _tx_bytes(lab, n) for n in (src, *leaves)}
    sent = {nic: after[src][nic] - before[src].get(nic, 0) for nic in after[src] if nic.startswith("nic")}
    leaf = leaves[int(max(sent, key=sent.__getitem__)[3:])]
    up = {s: after[leaf][s] - before[leaf].get(s, 0) for s in topo.spines}
    spine = max(up, key=up.__getitem__)
    return f"{leaf}-{spine}", spine


def pin_flows(lab: Any) -> None:
    """Keep each TCP flow on its spine through retransmissions, as an IPv4 fabric's 5-tuple hash does.

    In the lab a leaf hashes a host's TCP packets by the hash the socket stamped on them (veth
    keeps it), and Linux re-draws that at every retransmission timeout (``net.core.txrehash``):
    the flow would hop spines by chance, a rescue real IPv4 switches do not give. Both runs pin it.
    """
    for host in HOSTS:
        done = lab.run(host, ["sysctl", "-qw", "net.core.txrehash=0"])
        if done.returncode != 0:
            raise SystemExit(f"reroute: cannot set net.core.txrehash in {host}: {done.stderr.strip()}")


def cut_cycles(lab: Any, watch: RouteWatch, link: str, spine: str, cuts: int, hold_s: float) -> list[dict[str, Any]]:
    """Cut the link at the spine ``cuts`` times, each time waiting for the overrides, then for their return."""
    out: list[dict[str, Any]] = []
    for i in range(cuts):
        t_cut = time.time_ns()
        lab.set_link(link, up=False, end=spine)
        moved = watch.wait(True, 3.0)
        time.sleep(hold_s)
        lab.set_link(link, up=True)
        back = watch.wait(False, 15.0)
        out.append({"t_ns": t_cut, "reroute_ms": watch.first_after(t_cut), "moved": moved, "back": back})
        seen = " ".join(f"{h}{'+' if new else '-'}@{(at - t_cut) / 1e6:.0f}" for at, h, new in watch.events
                        if at >= t_cut - 1_000_000_000)
        log(f"cut {i + 1}/{cuts}: override after {out[-1]['reroute_ms']} ms, returned: {back} (events, ms: {seen})")
        time.sleep(0.5)
    return out


def congest(lab: Any, watch: RouteWatch, link: str) -> dict[str, Any]:
    """A link that lives but is bad: tbf at 5 Mbit/s and 10 Mbit/s of UDP across it, leaf to spine."""
    from ridethrough.lab.control import Direction

    t_ns = time.time_ns()
    lab.degrade_link(link, rate_mbit=5.0, direction=Direction.FORWARD)
    load = lab.start_load(link, direction=Direction.FORWARD, rate_mbit=10.0)
    moved = watch.wait(True, 5.0)
    lab.stop_load(load)
    lab.restore_link(link)
    out = {"t_ns": t_ns, "moved": moved or bool(watch.first_after(t_ns)), "reroute_ms": watch.first_after(t_ns)}
    log(f"congested {link}: override after {out['reroute_ms']} ms")
    out["back"] = watch.wait(False, 15.0)
    return out


def baseline(lab: Any, procs: list[subprocess.Popen[str]], link: str, spine: str, timeout_s: float) -> int:
    """The reflex off (the agents stopped), the same cut: the job should fail at gloo's timeout. The cut's time."""
    from ridethrough.lab import procs as lab_procs

    agents = [lab_procs.ProcRef.from_json(ref) for key, ref in lab.state()["processes"].items()
              if key.startswith("agent:")]
    lab_procs.stop(agents, grace_s=2.0)
    for host in HOSTS:  # a stopped reflex leaves its overrides (by design): without ridethrough there are none
        ipr = lab.handle(host).ipr
        for route in ipr.get_routes(family=socket.AF_INET, table=254, proto=114):
            ipr.route("del", dst=f"{route.get_attr('RTA_DST')}/32", table=254, proto=114)
    t_ns = time.time_ns()
    lab.set_link(link, up=False, end=spine)
    log(f"baseline (agents stopped): cut {link} at {spine}; waiting up to {timeout_s + 10:.0f} s for the job")
    deadline = time.monotonic() + timeout_s + 10
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.2)
    return t_ns


def run(cuts: int, hold_s: float, timeout_s: float, elements: int, compute_ms: float, *, with_baseline: bool,
        keep: bool, control_s: float = 3.0) -> dict[str, Any]:
    """One lab, one job: ``cuts`` cuts and a congestion with the reflex on, then a cut with it off."""
    lab = open_lab("a")
    stop = lab.dir / "stop-job"
    watch: RouteWatch | None = None
    try:
        pin_flows(lab)
        watch, procs = RouteWatch(lab, HOSTS), start_job(lab, stop, timeout_s, elements, compute_ms)
        link, spine = spine_link(lab, procs)
        log(f"the job's h0→h1 traffic crosses {link}; cutting it at {spine}")
        control = [time.time_ns()]
        busy = cpu_of(lab, control_s)  # also the control: the job's longest stall with nothing cut
        control.append(time.time_ns())
        cycles = cut_cycles(lab, watch, link, spine, cuts, hold_s)
        degraded = congest(lab, watch, link)
        t_base = baseline(lab, procs, link, spine, timeout_s) if with_baseline else None
        results = finish(procs, stop, 30.0)
        return {"results": results, "cuts": cycles, "degraded": degraded, "t_base": t_base, "control": control,
                "cpu": busy}
    finally:
        stop.touch()
        if watch is not None:
            watch.close()
        lab.down(keep_dir=keep)
        if keep:
            log(f"kept {lab.dir} (agents' logs under logs/)")


def summary(r: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """The figures of a run; the headline four first."""
    results, t_base = r["results"], r["t_base"] or (1 << 63)
    # the stall a cut can cause: while either host's traffic may still go into the dead link
    stalls = [stall_ms(results, c["t_ns"], c["t_ns"] + round(1e6 * max(c["reroute_ms"].values(), default=3000)))
              for c in r["cuts"]]
    control = stall_ms(results, r["control"][0], r["control"][1])
    errors = sum(1 for x in results if x["error"] and x["end_ns"] < t_base) + sum(x["wrong"] for x in results)
    base_errors = [x["error"] for x in results if x["error"] and x["end_ns"] >= t_base]
    job_end = max(int(x["end_ns"]) for x in results)
    base_stall = stall_ms(results, t_base, job_end) if r["t_base"] else math.nan
    first = [min(c["reroute_ms"].values()) for c in r["cuts"] if c["reroute_ms"]]
    both = [max(c["reroute_ms"].values()) for c in r["cuts"] if len(c["reroute_ms"]) == len(HOSTS)]
    return {"bench": "reroute", "errors": errors, "max_stall_ms": round(max(stalls), 1),
            "p99_stall_ms": round(pct(stalls, 99), 1),
            "baseline_failed": (bool(base_errors) or base_stall >= 0.9 * timeout_s * 1e3) if r["t_base"] else None,
            "cuts": len(stalls), "rerouted": sum(c["moved"] for c in r["cuts"]),
            "returned": sum(c["back"] for c in r["cuts"]), "stalls_ms": [round(x, 1) for x in stalls],
            "control_stall_ms": round(control, 1),
            "median_stall_ms": round(pct(stalls, 50), 1),
            "first_override_ms_p50": round(pct(first, 50), 1) if first else None,
            "first_override_ms_max": round(max(first), 1) if first else None,
            "both_overrides_ms_max": round(max(both), 1) if both else None,
            "degraded_moved": r["degraded"]["moved"], "degraded_override_ms": r["degraded"]["reroute_ms"],
            "degraded_stall_ms": round(stall_ms(results, r["degraded"]["t_ns"], r["degraded"]["t_ns"] + round(
                1e6 * max(r["degraded"]["reroute_ms"].values(), default=5000))), 1),
            "baseline_stall_ms": round(base_stall, 1), "baseline_errors": [e[:120] for e in base_errors],
            "steps": [len(x["ends"]) for x in results], "cpu_pct": r["cpu"], "load_avg": os.getloadavg()[0]}


def main() -> int:
    """Run the lab and print the figures."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 cuts and a 5 s gloo timeout: under 60 s.")
    ap.add_argument("--cuts", type=int, default=0, help="Cuts with the reflex on (default 20, 2 with --quick).")
    ap.add_argument("--elements", type=int, default=1 << 14, help="float32 elements all-reduced per step.")
    ap.add_argument("--keep", action="store_true", help="Keep the lab's directory (its agents' logs).")
    ap.add_argument("--no-baseline", action="store_true", help="Skip the cut with the reflex off.")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--master", default="", help=argparse.SUPPRESS)
    ap.add_argument("--stop-file", default="", help=argparse.SUPPRESS)
    ap.add_argument("--timeout-s", type=float, default=30.0, help=argparse.SUPPRESS)
    ap.add_argument("--compute-ms", type=float, default=COMPUTE_MS, help="Sleep per step besides the all-reduce.")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    from ridethrough.lab.netns import unavailable_reason

    if (reason := unavailable_reason()) is not None:
        print(f"reroute: {reason}", file=sys.stderr)
        return 2
    cuts = args.cuts or (2 if args.quick else 20)
    timeout_s = 5.0 if args.quick else 30.0
    r = run(cuts, 0.3 if args.quick else 1.0, timeout_s, args.elements, args.compute_ms,
            with_baseline=not args.no_baseline, keep=args.keep, control_s=2.0 if args.quick else 3.0)
    out = summary(r, timeout_s)
    out["targets_met"] = (out["errors"] == 0 and out["max_stall_ms"] <= MAX_STALL_TARGET_MS
                          and out["p99_stall_ms"] <= P99_TARGET_MS and out["baseline_failed"] is not False)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
