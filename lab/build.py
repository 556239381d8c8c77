"""Bringing a namespace lab up: allocate, record, build the fabric, lay out hosts, start the supervisor.

Everything is recorded in the state file *before* it is made, so a crash at any point
leaves a record `ridethrough.lab.teardown` can undo.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ridethrough.collector.clock import MAX_DRIFT_PPM, MAX_OFFSET_NS, ClockScript
from ridethrough.lab import cgroups, netns
from ridethrough.lab.control import LabError
from ridethrough.lab.fake_gpu import create_fake_gpus
from ridethrough.lab.fake_ib import create_tree
from ridethrough.lab.netns import Handles
from ridethrough.lab.procs import ref
from ridethrough.lab.routing import plan
from ridethrough.lab.state import State, StateFile, list_labs, root_lock
from ridethrough.lab.topology import MGMT_NET, Kind, Topology, TopologySpec

OTLP_PORT = 4317
STORE_HTTP_PORT = 8123
CLOCK_PORT = 8190
"""The clock service's corrections endpoint on the management address (agents poll it)."""
ClockSpecs = Mapping[str, tuple[int, float]]


def _seed(*parts: str) -> int:
    return int.from_bytes(hashlib.sha256("/".join(parts).encode()).digest()[:4], "big")


def default_clocks(name: str, hosts: list[str]) -> dict[str, tuple[int, float]]:
    """Each host's clock (offset ns, drift ppm), chosen from the lab's name: the same name, the same clocks."""
    out = {}
    for host in hosts:
        rng = random.Random(_seed(name, host, "clock"))
        out[host] = (rng.randint(-MAX_OFFSET_NS, MAX_OFFSET_NS), round(rng.uniform(-MAX_DRIFT_PPM, MAX_DRIFT_PPM), 3))
    return out


def _root_addresses() -> set[ipaddress.IPv4Network]:
    h = netns.NsHandle(None)
    try:
        return {ipaddress.IPv4Network(f"{a.get('address')}/{a['prefixlen']}", strict=False)
                for a in h.ipr.get_addr(family=2)}
    finally:
        h.close()


def _root_ifnames() -> list[str]:
    h = netns.NsHandle(None)
    try:
        return [str(m.get("ifname")) for m in h.links()]
    finally:
        h.close()


def other_labs(root: Path, name: str) -> list[State]:
    """The states of every other lab under ``root`` (unreadable ones skipped)."""
    out = []
    for other in list_labs(root):
        if other != name:
            try:
                out.append(json.loads((root / f"{other}.json").read_text()))
            except (OSError, ValueError):
                continue
    return out


def allocate(sf: StateFile, spec: TopologySpec, *, name: str, agents: bool,
             clocks: ClockSpecs | None) -> tuple[Topology, State]:
    """Pick a management /24 no one uses, check the prefix is free, and write the first state."""
    with root_lock(sf.root):
        if sf.exists():
            raise LabError(f"lab {name!r} already exists (state {sf.path}); take it down first: "
                           f"ridethrough lab down {name}")
        others = other_labs(sf.root, name)
        probe = Topology(spec, name=name)
        clash = [o["name"] for o in others if o.get("prefix") == probe.prefix]
        leftovers = [i for i in _root_ifnames() if i.startswith(probe.prefix)]
        if clash or leftovers:
            raise LabError(f"lab {name!r}: its interface prefix {probe.prefix} is in use by "
                           f"{', '.join(clash + leftovers)}; pick another name (or take the other lab down)")
        used = {o.get("mgmt_subnet") for o in others}
        in_use = _root_addresses()
        subnets = list(MGMT_NET.subnets(new_prefix=24))
        start = _seed(name, "mgmt") % len(subnets)
        for i in range(len(subnets)):
            net = subnets[(start + i) % len(subnets)]
            if str(net) not in used and not any(net.overlaps(a) for a in in_use):
                break
        else:
            raise LabError("no free management /24 left in 198.18.0.0/15")
        topo = Topology(spec, name=name, mgmt_subnet=str(net))
        state = initial_state(topo, sf, agents=agents, clocks=clocks or default_clocks(name, topo.hosts))
        sf.create(state)
    return topo, state


def initial_state(topo: Topology, sf: StateFile, *, agents: bool, clocks: ClockSpecs) -> State:
    """What the lab is, before anything is made."""
    cg = cgroups.available()
    hosts: dict[str, Any] = {}
    for host in topo.hosts:
        hosts[host] = {
            "index": topo.host_index(host), "rack": topo.rack_of(host), "ns": topo.namespace(host),
            "stable_ip": topo.stable_ip(host), "mgmt_ip": topo.mgmt_ip(host), "dir": str(sf.dir / "hosts" / host),
            "nics": {f"nic{r}": {"ip": topo.nic_ip(host, r), "link": topo.nic_link(host, f"nic{r}").name}
                     for r in range(topo.spec.rails)},
            "clock": {"offset_ns": clocks[host][0], "drift_ppm": clocks[host][1]},
            "cgroup": str(cgroups.host_dir(topo.name, host)) if cg else None,
            "jobs_cgroup": str(cgroups.host_dir(topo.name, host, jobs=True)) if cg else None,
        }
    s = topo.spec
    return {
        "name": topo.name, "mode": "netns", "prefix": topo.prefix, "dir": str(sf.dir), "agents": agents,
        "spec": {"hosts": s.hosts, "racks": s.racks, "rails": s.rails, "spines": s.spines, "gpus": s.gpus},
        "mgmt_subnet": str(topo.mgmt), "server_ip": topo.server_ip, "otlp_port": OTLP_PORT,
        "store_http_port": STORE_HTTP_PORT, "clock_port": CLOCK_PORT, "created_unix_ns": time.time_ns(),
        "hosts": hosts,
        "cgroup": str(cgroups.lab_dir(topo.name)) if cg else None,
        "namespaces": [], "root_links": [], "cgroups": [], "processes": {}, "status": {"fabric": "building"},
    }


def make_cgroups(sf: StateFile, state: State) -> None:
    """The lab's cgroup tree (recorded first)."""
    if state.get("cgroup") is None:
        return
    sf.append("cgroups", state["cgroup"])
    for info in state["hosts"].values():
        cgroups.make(Path(info["jobs_cgroup"]))
        cgroups.set_shares(Path(info["jobs_cgroup"]), cgroups.JOB_SHARES)
    server = cgroups.server_dir(Path(state["cgroup"]))
    cgroups.make(server)
    cgroups.set_shares(server, cgroups.SERVER_SHARES)


def make_bridge(topo: Topology, sf: StateFile) -> None:
    """The management bridge in the root namespace, with the server's address."""
    sf.append("root_links", topo.bridge, *(topo.mgmt_root_if(h) for h in topo.hosts))
    root = netns.NsHandle(None)
    try:
        root.ipr.link("add", ifname=topo.bridge, kind="bridge")
        idx = root.index(topo.bridge)
        root.ipr.addr("add", index=idx, address=topo.server_ip, prefixlen=topo.mgmt.prefixlen)
        root.set_up(topo.bridge)
    finally:
        root.close()


def spawn_supervisor(sf: StateFile, state: State) -> subprocess.Popen[bytes]:
    """Start ``python -m ridethrough.lab.supervisor STATE`` detached, in the lab's cgroup."""
    logs = Path(state["dir"]) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    cg = state.get("cgroup")
    with open(logs / "supervisor.log", "ab") as log:
        proc = netns.popen(None, [sys.executable, "-m", "ridethrough.lab.supervisor", str(sf.path)],
                           cgroup=None if cg is None else Path(cg), start_new_session=True,
                           stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    rec = ref(proc.pid)
    if rec is not None:
        sf.set_in("processes", "supervisor", rec.to_json())
    return proc


def build_fabric(topo: Topology, sf: StateFile, handles: Handles) -> int:
    """Namespaces, sysctls, veths, addresses, rules and routes; returns the number of veth pairs."""
    names = {node: topo.namespace(node) for node in topo.nodes}
    sf.append("namespaces", *names.values())
    for ns in names.values():
        netns.create(ns)
    plans = {node: plan(topo, node) for node in topo.nodes}
    netns.set_sysctls({names[n]: p.sysctls for n, p in plans.items()})
    fds = {node: os.open(netns.ns_path(ns), os.O_RDONLY) for node, ns in names.items()}
    root_fd = os.open("/proc/self/ns/net", os.O_RDONLY)
    root = handles(None)
    pairs = 0
    try:
        bridge = root.index(topo.bridge)
        for host in topo.hosts:
            h = handles(names[host])
            h.add_veth("stab", "stabp", None)
            h.add_veth("mgmt", topo.mgmt_root_if(host), root_fd)
            root.ipr.link("set", index=root.index(topo.mgmt_root_if(host)), master=bridge, state="up")
            pairs += 2
        for link in topo.links:
            handles(names[link.lower]).add_veth(link.lower_if, link.upper_if, fds[link.upper])
            pairs += 1
        for node, p in plans.items():
            ifs = [link.ifname(node) for link in topo.node_links(node)]
            if topo.kind(node) is Kind.HOST:
                ifs += ["stab", "stabp", "mgmt"]
            handles(names[node]).apply(p, interfaces=ifs)
    finally:
        for fd in (*fds.values(), root_fd):
            os.close(fd)
    return pairs


def make_host_dirs(topo: Topology, state: State) -> None:
    """Each host's fake sysfs tree, fake GPUs, NIC fault script and clock."""
    for host, info in state["hosts"].items():
        d = Path(info["dir"])
        (d / "sysfs").mkdir(parents=True, exist_ok=True)
        create_tree(d / "sysfs", topo.spec.rails)
        create_fake_gpus(d / "gpus.json", topo.spec.gpus, host=host, seed=_seed(topo.name, host, "gpu"))
        (d / "nic_faults.json").write_text('{"ramps": []}\n')
        ClockScript(d / "clock.json").set(info["clock"]["offset_ns"], info["clock"]["drift_ppm"])
