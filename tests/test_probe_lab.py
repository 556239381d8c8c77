"""Probes across the namespace lab: every path over both NICs, host clocks, a congested direction.

Each host runs `ridethrough.collector.probe_cli` (a responder and a prober) on its own lab
clock; the test knows the clocks (the lab's scripts), so it can correct every sample to true
one-way delays and check that every timestamp went through the host clock.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ridethrough.collector.clock import read_spec
from ridethrough.collector.probe_sample import ProbeSample, TimestampKind
from ridethrough.collector.probe_stats import Correction, one_way_delays
from ridethrough.lab import netns
from ridethrough.lab.control import Direction
from ridethrough.lab.fabric import Lab
from ridethrough.lab.topology import TopologySpec
from tests.conftest import wait_for

REASON = netns.unavailable_reason()
pytestmark = [pytest.mark.integration, pytest.mark.skipif(REASON is not None, reason=REASON or "")]
SPEC = TopologySpec(hosts=4, racks=2, rails=2, spines=1, gpus=0)
PORT = 7447
PROBE = [sys.executable, "-m", "ridethrough.collector.probe_cli"]


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with Lab.up(SPEC, name=f"tprb{os.getpid() % 100000}", agents=False) as running:
        yield running


@pytest.fixture(scope="module")
def peers(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Path:
    topo = lab.topology
    table = {h: {f"nic{r}": f"{topo.nic_ip(h, r)}:{PORT}" for r in range(SPEC.rails)} for h in topo.hosts}
    path = tmp_path_factory.mktemp("probe") / "peers.json"
    path.write_text(json.dumps(table))
    return path


def corrections(lab: Lab) -> dict[str, Correction]:
    """Each host's clock offset from true time now, with its drift: what a perfect clock sync would say."""
    now, out = time.time_ns(), {}
    for h in lab.topology.hosts:
        spec = read_spec(lab.host_dir(h) / "clock.json")
        out[h] = Correction(spec.local(now) - now, spec.drift_ppm, spec.local(now))
    return out


def ready(proc: subprocess.Popen[str], out: Path) -> bool:
    """The probe tool said it is ready (or it died)."""
    return proc.poll() is not None or "ready" in out.read_text()


@contextlib.contextmanager
def probing(lab: Lab, peers: Path, duration_s: float) -> Iterator[dict[str, Any]]:
    """Every host probes every other for ``duration_s``; yields {host: [samples], "summary": {host: ...}}.

    Output goes to files, not pipes: a pipe nobody reads while probing would fill and stall the prober.
    """
    outs = {h: peers.parent / f"{h}-{time.monotonic_ns()}.out" for h in lab.topology.hosts}
    # a 5 s timeout: on a busy 2-core machine a responder can be starved for seconds (CI lost one probe
    # of 114 at 2 s), and its late answer is not a lost probe (the kernel's stamps still give the true delays)
    procs = {h: lab.exec(h, [*PROBE, "--node", h, "--peers", str(peers), "--duration-s", str(duration_s),
                             "--clock-script", str(lab.host_dir(h) / "clock.json"), "--interval-s", "0.05",
                             "--timeout-s", "5.0", "--samples", "--wait-go"],
                         stdin=subprocess.PIPE, stdout=outs[h].open("w"), stderr=subprocess.PIPE, text=True)
             for h in lab.topology.hosts}
    result: dict[str, Any] = {"summary": {}}
    try:
        for h, p in procs.items():
            wait_for(functools.partial(ready, p, outs[h]), timeout_s=30, what=f"{h} ready")
            assert p.poll() is None, f"{h}: {p.stderr.read() if p.stderr else ''}"
        for p in procs.values():
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        yield result
        for h, p in procs.items():
            _, err = p.communicate(timeout=duration_s + 30)
            assert p.returncode == 0, err
            lines = [json.loads(x) for x in outs[h].read_text().splitlines()]
            result[h] = [ProbeSample(**{**x["sample"], "rx_kind": TimestampKind(x["sample"]["rx_kind"]),
                                        "tx_kind": TimestampKind(x["sample"]["tx_kind"])})
                         for x in lines if "sample" in x]
            result["summary"][h] = lines[-1]["summary"]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def test_every_path_over_both_nics_is_probed_without_loss_on_host_clocks(lab: Lab, peers: Path) -> None:
    hosts = lab.topology.hosts
    with probing(lab, peers, 3.0) as run:
        pass
    corr = corrections(lab)
    for h in hosts:
        summary = run["summary"][h]
        assert len(summary["paths"]) == (len(hosts) - 1) * SPEC.rails, h
        for p in summary["paths"]:
            # the prober settles before it stops: every probe it sent was answered (none lost, none in flight)
            assert p["sent"] >= 40 and p["lost"] == 0 and p["sent"] == p["received"], f"{h}: {p}"
        assert not summary["dropped"]["prober"] and not summary["dropped"]["responder"], summary["dropped"]
        seen = {s.path for s in run[h]}
        assert seen == {(h, f"nic{r}", o, f"nic{r}") for o in hosts if o != h for r in range(SPEC.rails)}
        assert all(s.rx_kind is TimestampKind.KERNEL for s in run[h]), h
        # the responder's send stamp is taken in user space: a responder starved between taking it and
        # sending adds its wait to that probe's RTT, so single probes can take up to the timeout; most don't
        rtts = [s.rtt_ns for s in run[h]]
        assert all(0 < r < 5_000_000_000 for r in rtts) and statistics.median(rtts) < 2_000_000, (h, sorted(rtts)[-5:])
        # The lab's clocks are up to 10 ms apart: only stamps all taken on their host's clock correct to
        # small positive delays. (A single one can be late: t3 is read in user space, and 2 CPUs run it all.)
        delays = [d for s in run[h] for d in one_way_delays(s, corr) or ()]
        assert min(delays) > -50_000 and statistics.median(delays) < 500_000, (h, min(delays), max(delays))


def test_a_congested_direction_shows_in_that_directions_delay(lab: Lab, peers: Path) -> None:
    """Rail 0 from rack 0 to rack 1 queues at leaf0r0's port to the spine; nothing else does.

    (The prober's send stamp is the driver's, taken after the host's own qdisc: a queue in the
    sending host is not the fabric's, so a tbf at a host's end would not show; one in a switch does.)
    """
    link = "leaf0r0-spine0"
    lab.degrade_link(link, rate_mbit=2.0, burst_kbit=16.0, latency_ms=20.0, direction=Direction.FORWARD)
    lab.start_load(link, direction=Direction.FORWARD, rate_mbit=4.0)
    try:
        time.sleep(1.0)  # the load starts and fills the queue
        with probing(lab, peers, 3.0) as run:
            pass
    finally:
        lab.restore_link(link)
    corr = corrections(lab)

    def median_owd(src: str, nic: str, dst: str, direction: int) -> float:
        delays = [one_way_delays(s, corr) for s in run[src] if s.src_nic == nic and s.dst_node == dst]
        return statistics.median(d[direction] for d in delays if d is not None)

    forward, reverse, queued, clear = 0, 1, 5_000_000, 1_000_000
    for src in ("h0", "h1"):
        for dst in ("h2", "h3"):
            assert median_owd(src, "nic0", dst, forward) > queued, (src, dst)  # rack 0 → rack 1 on rail 0
            assert median_owd(src, "nic0", dst, reverse) < clear, (src, dst)  # the way back does not queue
            assert median_owd(src, "nic1", dst, forward) < clear, (src, dst)  # nor does the other rail
            assert median_owd(dst, "nic0", src, reverse) > queued, (dst, src)  # seen from the far end
            assert median_owd(dst, "nic0", src, forward) < clear, (dst, src)
    assert median_owd("h0", "nic0", "h1", forward) < clear  # inside the rack: no spine, no queue
