"""The namespace lab on the real kernel: paths, faults, side-by-side labs, cleanup; and the loopback mode.

Needs root and network namespaces (skipped with the reason otherwise). One default lab (8 hosts,
no agents) serves most tests; tests that change it put it back.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from ridethrough.lab import cgroups, netns, procs
from ridethrough.lab.control import Direction, GpuFault, LabError
from ridethrough.lab.fabric import Lab
from ridethrough.lab.loopback import LoopbackLab
from ridethrough.lab.pathwalk import Walker
from ridethrough.lab.topology import Topology, TopologySpec
from tests.conftest import wait_for

REASON = netns.unavailable_reason()
needs_netns = pytest.mark.skipif(REASON is not None, reason=REASON or "")
pytestmark = pytest.mark.integration
TOOL = [sys.executable, "-m", "ridethrough.lab.traffic"]
SLEEPER = [sys.executable, "-c", "import time\nwhile True: time.sleep(0.05)"]
SMALL = TopologySpec(hosts=2, racks=1, rails=1, spines=1, gpus=2)


def _name(tag: str) -> str:
    return f"t{tag}{os.getpid() % 100000}"


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with Lab.up(TopologySpec(), name=_name("fab"), agents=False) as running:
        yield running


def tool(lab: Lab, node: str, *args: str, timeout_s: float = 60.0) -> dict[str, object]:
    """Run a traffic tool in a node; its JSON result."""
    done = lab.run(node, [*TOOL, *args], timeout_s=timeout_s)
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@contextlib.contextmanager
def servers(lab: Lab, kind: str, where: list[tuple[str, str]], port: int) -> Iterator[None]:
    """``echo`` or ``tcp-sink`` servers on (node, address) pairs, ready when entered."""
    started = [lab.exec(node, [*TOOL, kind, "--bind", ip, "--port", str(port), "--duration-s", "120"],
                        stdout=subprocess.PIPE, text=True) for node, ip in where]
    try:
        for p in started:
            assert p.stdout is not None and "ready" in p.stdout.readline(), "a server did not start"
        yield
    finally:
        for p in started:
            p.kill()
            p.wait()


def probe(lab: Lab, node: str, bind: str, flows: list[tuple[int, str, int]], *extra: str) -> list[bool]:
    """Echo round trips from ``bind`` for (source port, destination, destination port) flows."""
    spec = ",".join(f"{s}:{d}:{p}" for s, d, p in flows)
    ok = tool(lab, node, "probe", "--bind", bind, "--flows", spec, *extra)["ok"]
    assert isinstance(ok, list)
    return [bool(x) for x in ok]


# -- the fabric ------------------------------------------------------------------------------------------


@needs_netns
def test_every_host_reaches_every_other_over_udp_and_tcp(lab: Lab) -> None:
    topo, port = lab.topology, 7000
    with servers(lab, "echo", [(h, topo.stable_ip(h)) for h in topo.hosts], port):
        runs = {}
        for h in topo.hosts:
            flows = ",".join(f"{21000 + i}:{topo.stable_ip(o)}:{port}" for i, o in enumerate(topo.hosts) if o != h)
            for extra in ([], ["--tcp"]):
                runs[(h, bool(extra))] = lab.exec(h, [*TOOL, "probe", "--bind", topo.stable_ip(h), "--flows", flows,
                                                      *extra], stdout=subprocess.PIPE, text=True)
        for key, p in runs.items():
            out, _ = p.communicate(timeout=60)
            assert json.loads(out)["ok"] == [True] * (len(topo.hosts) - 1), key


@needs_netns
def test_kernel_paths_are_exactly_the_topology_paths(lab: Lab) -> None:
    """Walk flows hop by hop (route get with L4 ports at each node) until every designed path shows up."""
    topo, walker, rng = lab.topology, Walker(lab), random.Random(7)
    for a in topo.hosts:
        for b in topo.hosts:
            if a == b:
                continue
            expected, seen, flows = set(topo.paths(a, b)), set(), 0
            while flows < 16 or (seen != expected and flows < 300):
                w = walker.walk(a, b, sport=rng.randint(1024, 65535), dport=rng.randint(1024, 65535),
                                proto=rng.choice((6, 17)))
                assert w.ok and w.links in expected, (a, b, w)
                seen.add(w.links)
                flows += 1
            assert seen == expected, (a, b)
            same_rack = topo.rack_of(a) == topo.rack_of(b)
            assert len(seen) == (topo.spec.rails if same_rack else topo.spec.rails * topo.spec.spines)


def _tx(lab: Lab, node: str, ifname: str) -> int:
    return int(next(m for m in lab.handle(node).links() if m.get("ifname") == ifname).get("stats64")["tx_packets"])


def _hops(topo: Topology, src: str, path: tuple[str, ...]) -> list[tuple[str, str]]:
    """(node, egress interface) of each link of a path, walking from ``src``."""
    out, node = [], src
    for name in path:
        link = topo.link(name)
        out.append((node, link.ifname(node)))
        node = link.peer(node)
    return out


@needs_netns
def test_real_packets_take_the_walked_path(lab: Lab) -> None:
    """For each path from h0 to h5, a flow the walk puts on it sends 300 packets: they cross those links only."""
    topo, walker, sent = lab.topology, Walker(lab), 300
    dst = topo.stable_ip("h5")
    for path in topo.paths("h0", "h5"):
        sport = next(s for s in range(30000, 31000) if walker.walk("h0", "h5", sport=s, dport=9999).links == path)
        others = {hop for p in topo.paths("h0", "h5") if p != path for hop in _hops(topo, "h0", p)}
        mine = set(_hops(topo, "h0", path))
        before = {hop: _tx(lab, *hop) for hop in mine | others}
        tool(lab, "h0", "blast", "--dst", dst, "--port", "9999", "--bind", topo.stable_ip("h0"), "--sport", str(sport),
             "--count", str(sent), "--rate-mbit", "50", "--size", "200", "--duration-s", "10")
        delta = {hop: _tx(lab, *hop) - before[hop] for hop in before}
        assert all(delta[hop] >= sent for hop in mine), (path, delta)
        assert all(delta[hop] < sent // 10 for hop in others - mine), (path, delta)


@needs_netns
def test_cutting_a_spine_link_breaks_exactly_the_routes_across_it(lab: Lab) -> None:
    topo, walker, rng, cut = lab.topology, Walker(lab), random.Random(11), "leaf0r0-spine0"
    flows = [(a, b, rng.randint(1024, 65535), rng.randint(1024, 65535))
             for a in topo.hosts for b in topo.hosts if topo.rack_of(a) != topo.rack_of(b) for _ in range(8)]
    before = {f: walker.walk(f[0], f[1], sport=f[2], dport=f[3]) for f in flows}
    crossing = {f for f, w in before.items() if cut in w.links}
    assert 0 < len(crossing) < len(flows)
    # real traffic: UDP echo h0 <-> h4; a round trip works iff neither direction crosses the cut
    h0, h4, port = topo.stable_ip("h0"), topo.stable_ip("h4"), 7300
    def crosses(sport: int) -> bool:
        return any(cut in w.links for w in (walker.walk("h0", "h4", sport=sport, dport=port),
                                             walker.walk("h4", "h0", sport=port, dport=sport)))
    cut_ports = [s for s in range(32000, 32200) if crosses(s)][:4]
    ok_ports = [s for s in range(32000, 32200) if not crosses(s)][:4]
    lab.set_link(cut, up=False, end="spine0")
    try:
        walker.refresh()
        for f in flows:
            after = walker.walk(f[0], f[1], sport=f[2], dport=f[3])
            if f in crossing:
                assert not after.ok and before[f].links[:len(after.links)] == after.links, (f, after)
            else:
                assert after == before[f], (f, after)
        with servers(lab, "echo", [("h4", h4)], port):
            got = probe(lab, "h0", h0, [(s, h4, port) for s in cut_ports + ok_ports])
        assert got == [False] * len(cut_ports) + [True] * len(ok_ports)
    finally:
        lab.set_link(cut, up=True, end="spine0")
    walker.refresh()
    assert all(walker.walk(f[0], f[1], sport=f[2], dport=f[3]) == before[f] for f in flows)


def _rx_bytes(lab: Lab, node: str, ifname: str) -> int:
    return int(next(m for m in lab.handle(node).links() if m.get("ifname") == ifname).get("stats64")["rx_bytes"])


@needs_netns
def test_degrade_caps_throughput_on_the_link(lab: Lab) -> None:
    """TCP for 1.5 s across h2-leaf0r0, measured by what the leaf's end receives, before and under tbf."""
    link = lab.topology.link("h2-leaf0r0")

    def mbit_per_s() -> float:
        before, t0 = _rx_bytes(lab, "leaf0r0", "h2"), time.monotonic()
        tool(lab, "h2", "tcp-send", "--dst", link.upper_ip, "--port", "7200", "--bind", link.lower_ip,
             "--duration-s", "1.5")
        return (_rx_bytes(lab, "leaf0r0", "h2") - before) * 8 / (time.monotonic() - t0) / 1e6

    with servers(lab, "tcp-sink", [("leaf0r0", link.upper_ip)], 7200):
        free = mbit_per_s()
        lab.degrade_link(link.name, rate_mbit=20, burst_kbit=32, latency_ms=20, direction=Direction.FORWARD)
        try:
            assert "tbf" in [q.get_attr("TCA_KIND") for q in lab.handle("h2").qdiscs()]
            capped = mbit_per_s()
        finally:
            lab.restore_link(link.name)
    assert "tbf" not in [q.get_attr("TCA_KIND") for q in lab.handle("h2").qdiscs()]  # restored for real
    assert free > 100, free
    assert 8 < capped < 22, capped


@needs_netns
def test_mtu_mismatch_fails_large_packets_on_that_link_only(lab: Lab) -> None:
    bad, good = lab.topology.link("h1-leaf0r1"), lab.topology.link("h1-leaf0r0")
    port = 7400

    def works(link_name: str, size: int) -> bool:
        link = lab.topology.link(link_name)
        return probe(lab, "h1", link.lower_ip, [(23000, link.upper_ip, port)], "--size", str(size), "--df")[0]

    with servers(lab, "echo", [("leaf0r1", bad.upper_ip), ("leaf0r0", good.upper_ip)], port):
        assert works(bad.name, 1400)
        lab.set_mtu(bad.name, end="leaf0r1", mtu=1000)
        try:
            assert not works(bad.name, 1400)
            assert works(bad.name, 200)
            assert works(good.name, 1400)
        finally:
            lab.restore_link(bad.name)
        assert works(bad.name, 1400)


@needs_netns
def test_freeze_stops_and_thaw_resumes_a_host(lab: Lab, tmp_path: Path) -> None:
    ticks = tmp_path / "ticks"
    writer = lab.exec("h3", [sys.executable, "-c",
                             f"import time\nwhile True:\n  open({str(ticks)!r}, 'a').write('.')\n  time.sleep(0.02)"])
    try:
        wait_for(lambda: ticks.exists() and ticks.stat().st_size > 3, what="writer running")
        lab.freeze_host("h3")
        wait_for(lambda: procs.state(writer.pid) == "T", what="stopped")
        size = ticks.stat().st_size
        time.sleep(0.3)
        assert ticks.stat().st_size == size
        lab.thaw_host("h3")
        wait_for(lambda: ticks.stat().st_size > size, what="resumed")
    finally:
        writer.kill()
        writer.wait()


@needs_netns
def test_straggle_caps_the_cpu_of_job_processes(lab: Lab) -> None:
    if not cgroups.available():
        pytest.skip("no writable cgroup v1 cpu controller")
    burner = lab.exec("h7", [sys.executable, "-c", "while True: pass"], job=True)
    jobs = cgroups.host_dir(lab.name, "h7", jobs=True)

    def cpu_over(seconds: float) -> float:
        start = procs.cpu_time_s(burner.pid)
        time.sleep(seconds)
        return (procs.cpu_time_s(burner.pid) - start) / seconds

    try:
        free = cpu_over(0.6)
        lab.straggle("h7", cpu_fraction=0.05)
        throttled = cgroups.throttled(jobs)
        capped = cpu_over(1.0)
        # The cap holds whatever else runs: at most 5 % of a CPU (plus a period's slack). On a machine
        # so busy that the burner got under 10 % anyway, the cap may have had nothing to throttle.
        assert capped < 0.1, (capped, free)
        assert cgroups.throttled(jobs) > throttled or free < 0.1, (capped, free)
        lab.unstraggle("h7")
        assert (jobs / "cpu.cfs_quota_us").read_text().strip() == "-1"
    finally:
        burner.kill()
        burner.wait()


@needs_netns
def test_counters_follow_traffic_and_a_nic_ramp_ends_in_link_down(lab: Lab) -> None:
    port_dir = lab.host_dir("h6") / "sysfs" / "class" / "infiniband" / "mlx5_1" / "ports" / "1"
    link = lab.topology.nic_link("h6", "nic1")

    def counter(name: str) -> int:
        return int((port_dir / "counters" / name).read_text())

    xmit = counter("port_xmit_data")
    tool(lab, "h6", "blast", "--dst", link.upper_ip, "--port", "9", "--bind", link.lower_ip, "--count", "200",
         "--size", "1000", "--rate-mbit", "50", "--duration-s", "10")
    wait_for(lambda: (counter("port_xmit_data") - xmit) * 4 >= 200 * 1000, what="xmit counter follows the veth")
    lab.nic_error_ramp("h6", "nic1", counter="symbol_error", rate_per_s=500, link_down_after_s=0.6)
    try:
        wait_for(lambda: counter("symbol_error") > 100, what="symbol errors climb")
        wait_for(lambda: (port_dir / "state").read_text().startswith("1:"), what="the ramp takes the link down")
        assert not next(m for m in lab.handle("h6").links() if m.get("ifname") == "nic1")["flags"] & 1
    finally:
        lab.clear_nic("h6", "nic1")
        lab.set_link(link.name, up=True, end="h6")
    wait_for(lambda: (port_dir / "state").read_text().startswith("4:"), what="the link back up")
    assert Walker(lab).walk("h6", "h7", sport=1, dport=1).ok


@needs_netns
def test_bad_targets_are_refused_in_one_line(lab: Lab) -> None:
    for call in (lambda: lab.set_link("h0-leaf9r9", up=False), lambda: lab.set_mtu("h0-leaf0r0", end="h1", mtu=900),
                 lambda: lab.freeze_host("h99"), lambda: lab.stop_load("load:999"),
                 lambda: lab.degrade_link("h0-leaf0r0", rate_mbit=0)):
        with pytest.raises(LabError) as info:
            call()
        assert "\n" not in str(info.value)


# -- several labs, and what they leave behind ------------------------------------------------------------


def snapshot() -> dict[str, set[str]]:
    """Namespaces, root interfaces and qdiscs, lab cgroups and processes on this machine now."""
    root = netns.NsHandle(None)
    try:
        names = {m["index"]: str(m.get("ifname")) for m in root.links()}
        qdiscs = {f"{names.get(q['index'], q['index'])}:{q.get_attr('TCA_KIND')}" for q in root.qdiscs()}
    finally:
        root.close()
    cg = cgroups.CPU_ROOT / cgroups.PARENT
    groups = {str(Path(d).relative_to(cg)) for d, _, _ in os.walk(cg)} if cg.exists() else set()
    processes = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            processes.add(f"{pid} {cmd}")
    return {"netns": set(netns.list_names()), "interfaces": set(names.values()), "qdiscs": qdiscs,
            "cgroups": groups, "processes": processes}


def left_behind(before: dict[str, set[str]], after: dict[str, set[str]], name: str, prefix: str) -> dict[str, set[str]]:
    """What appeared since ``before`` and belongs to the lab (other labs may come and go meanwhile)."""
    return {k: {x for x in after[k] - before[k] if name in x or prefix in x} for k in after
            if any(name in x or prefix in x for x in after[k] - before[k])}


def _store_rows(store_http: str, table: str = "otel_metrics_sum", where: str = "1") -> dict[str, int]:
    sql = (f"SELECT ResourceAttributes['ridethrough.node.id'] AS n, count() FROM {table} WHERE {where} GROUP BY n "
           "FORMAT JSONCompact")
    # reads take turns with the gateway's writes on one store handle: on a busy machine one may wait a
    # while, and a read that timed out is polled again (the caller's wait_for holds the deadline)
    try:
        with urllib.request.urlopen(f"{store_http}/?query={urllib.parse.quote(sql)}", timeout=20) as r:
            return {str(n): int(c) for n, c in json.loads(r.read())["data"]}
    except TimeoutError:
        return {}


@needs_netns
@pytest.mark.slow
def test_agents_report_and_nothing_is_left_after_a_killed_supervisor_and_lab_down() -> None:
    before = snapshot()
    name = _name("crash")
    lab = Lab.up(SMALL, name=name, agents=True, cleanup_at_exit=False)
    job = None
    try:
        store = lab.server["store_http"]
        wait_for(lambda: set(_store_rows(store)) >= {"h0", "h1"}, timeout_s=60, what="both agents' rows")
        gpu_rows = wait_for(lambda: _store_rows(store, "otel_metrics_gauge", "MetricName = 'hw.gpu.utilization'"),
                            timeout_s=30, what="fake GPU rows")
        assert set(gpu_rows) == {"h0", "h1"}, "each host's agent reads its own fake GPUs"
        if cgroups.available():  # the server weighs as much as four hosts when the CPUs are contended
            server = cgroups.server_dir(cgroups.lab_dir(name))
            pid = procs.ProcRef.from_json(lab.state()["processes"]["server"]).pid
            assert pid in cgroups.procs(server)
            assert (server / "cpu.shares").read_text().strip() == str(cgroups.SERVER_SHARES)
        job = lab.exec("h1", SLEEPER, job=True)
        sup = procs.ProcRef.from_json(lab.state()["processes"]["supervisor"])
        os.kill(sup.pid, signal.SIGKILL)
        wait_for(lambda: not procs.alive(sup), what="supervisor dead")
        done = subprocess.run([sys.executable, "-m", "ridethrough.lab.cli", "down", name,
                               "--state-root", str(lab.sf.root)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert "down in" in done.stdout
    finally:
        if lab.sf.exists():
            lab.down()
        if job is not None:
            job.wait(10)
        if lab._supervisor is not None:
            lab._supervisor.wait(10)
    assert left_behind(before, snapshot(), name, lab.topology.prefix) == {}
    assert not lab.sf.exists() and not lab.dir.exists()


@needs_netns
def test_two_labs_run_side_by_side(lab: Lab) -> None:
    before = snapshot()
    with Lab.up(SMALL, name=_name("two"), agents=False) as other:
        assert other.topology.prefix != lab.topology.prefix
        assert other.info["mgmt_subnet"] != lab.info["mgmt_subnet"]
        assert not set(other.state()["namespaces"]) & set(lab.state()["namespaces"])
        for each in (lab, other):  # the same addresses in both, each in its own namespaces
            t = each.topology
            with servers(each, "echo", [("h1", t.stable_ip("h1"))], 7500):
                assert probe(each, "h0", t.stable_ip("h0"), [(24000, t.stable_ip("h1"), 7500)]) == [True]
        name, prefix = other.name, other.topology.prefix
    assert left_behind(before, snapshot(), name, prefix) == {}
    assert Walker(lab).walk("h0", "h5", sport=5, dport=5).ok


# -- the degraded mode -----------------------------------------------------------------------------------


def test_loopback_mode_emulates_what_it_can_and_refuses_the_rest(tmp_path: Path) -> None:
    from ridethrough.collector.clock import ClockScript
    from ridethrough.lab.fake_gpu import GpuScript

    spec = TopologySpec(hosts=2, racks=1, rails=2, spines=1, gpus=2)
    with LoopbackLab.up(spec, name=_name("loop"), agents=False, state_root=tmp_path) as lab:
        assert lab.mode == "loopback" and lab.hosts() == ["h0", "h1"] and lab.links() == []
        addresses = [nic["ip"] for h in lab.hosts() for nic in lab.host_info(h)["nics"].values()]
        stable = [lab.host_info(h)["stable_ip"] for h in lab.hosts()]
        assert len(set(addresses + stable)) == 6, "every NIC has its own address (a prober binds each)"
        lab.gpu_fault("h0", 1, GpuFault.XID, {"code": 79})
        assert [f.fault for f in GpuScript(lab.host_dir("h0") / "gpus.json").faults()] == [GpuFault.XID]
        lab.step_clock("h1", step_ns=5_000_000)
        assert [s for _, s in ClockScript(lab.host_dir("h1") / "clock.json").read().steps] == [5_000_000]
        lab.nic_error_ramp("h0", "nic1", counter="symbol_error", rate_per_s=500)
        errors = lab.host_dir("h0") / "sysfs/class/infiniband/mlx5_1/ports/1/counters/symbol_error"
        wait_for(lambda: int(errors.read_text()) > 50, what="the pump writes the ramp")
        for refused in (lambda: lab.set_link("h0-leaf0r0", up=False),
                        lambda: lab.set_mtu("h0-leaf0r0", end="h0", mtu=9),
                        lambda: lab.nic_error_ramp("h0", "nic0", counter="symbol_error", rate_per_s=1,
                                                   link_down_after_s=1.0)):
            with pytest.raises(LabError, match="loopback mode"):
                refused()
        sleeper = lab.exec("h1", SLEEPER)
        lab.freeze_host("h1")
        wait_for(lambda: procs.state(sleeper.pid) == "T", what="frozen")
        lab.thaw_host("h1")
        wait_for(lambda: procs.state(sleeper.pid) in ("S", "R"), what="thawed")
    sleeper.wait(10)
    assert not lab.sf.exists() and not lab.dir.exists()


@needs_netns
def test_flap_is_run_by_the_supervisor(lab: Lab) -> None:
    link = "leaf1r1-spine1"
    log = lab.dir / "logs" / "supervisor.log"

    def ran() -> list[str]:
        return [line for line in log.read_text().splitlines() if "ran scheduled set_link" in line and link in line]

    earlier = len(ran())
    lab.flap_link(link, period_s=0.3, count=2)
    assert len(lab.state()["schedule"]) == 4
    wait_for(lambda: len(ran()) >= earlier + 4, timeout_s=10, what="the flap's four steps")
    assert [("'up': True" in line) for line in ran()[earlier:]] == [False, True, False, True]
    wait_for(lambda: all(m.get("operstate") == "UP" for m in lab.handle("spine1").links()
                         if m.get("ifname") == "leaf1r1"), what="the link up after the flap")
