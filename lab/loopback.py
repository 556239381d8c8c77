"""The degraded mode: a lab without network namespaces (no root, or a kernel that refuses them).

Hosts are processes on loopback: each host gets an address ``127.A.B.{10+i}`` for its jobs and one
per NIC (after the hosts' addresses), its own directory (fake IB tree, fake GPUs, NIC fault script, clock) and, unless
``agents=False``, a real ``ridethrough agent``; one server listens on ``127.A.B.1``. What can
be emulated is (GPU faults, clock steps, NIC error-counter ramps, freeze and thaw of the
host's recorded processes, and straggle where cgroups are writable); link faults (packet
loss too), MTU changes, loads and a ramp's eventual link down are refused with a one-line `LabError`.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ridethrough.lab import build, cgroups
from ridethrough.lab.control import LabError
from ridethrough.lab.hostops import LabBase
from ridethrough.lab.state import State, StateFile, default_state_root, read_running, root_lock
from ridethrough.lab.topology import Topology, TopologySpec, check_lab_name


def _loopback_net(name: str, taken: set[str]) -> str:
    """A 127.A.B.0/24 no other loopback lab under this root uses."""
    start = int.from_bytes(hashlib.sha256(f"{name}/loopback".encode()).digest()[:2], "big")
    for i in range(200 * 256):
        n = (start + i) % (200 * 256)
        net = f"127.{20 + n // 256}.{n % 256}"
        if net not in taken:
            return net
    raise LabError("no free 127.x.y.0/24 left for a loopback lab")


def loopback_state(topo: Topology, sf: StateFile, *, net: str, agents: bool,
                   clocks: Mapping[str, tuple[int, float]]) -> State:
    """What a loopback lab is, before anything is made."""
    cg = cgroups.available()
    hosts: dict[str, Any] = {}
    rails = topo.spec.rails
    # each NIC its own address, as on a real host (its prober binds one socket per NIC address)
    nic_base = 10 + len(topo.hosts)
    if nic_base + len(topo.hosts) * rails > 254:
        raise LabError(f"a loopback lab has room for {244 // (1 + rails)} hosts with {rails} rails in one /24, "
                       f"not {len(topo.hosts)}")
    for host in topo.hosts:
        i = topo.host_index(host)
        addr = f"{net}.{10 + i}"
        hosts[host] = {
            "index": i, "rack": topo.rack_of(host), "ns": None, "stable_ip": addr, "mgmt_ip": addr,
            "dir": str(sf.dir / "hosts" / host),
            "nics": {f"nic{r}": {"ip": f"{net}.{nic_base + i * rails + r}", "link": topo.nic_link(host, f"nic{r}").name}
                     for r in range(rails)},
            "clock": {"offset_ns": clocks[host][0], "drift_ppm": clocks[host][1]},
            "cgroup": str(cgroups.host_dir(topo.name, host)) if cg else None,
            "jobs_cgroup": str(cgroups.host_dir(topo.name, host, jobs=True)) if cg else None,
        }
    s = topo.spec
    return {
        "name": topo.name, "mode": "loopback", "prefix": topo.prefix, "dir": str(sf.dir), "agents": agents,
        "spec": {"hosts": s.hosts, "racks": s.racks, "rails": s.rails, "spines": s.spines, "gpus": s.gpus},
        "loopback_net": net, "server_ip": f"{net}.1", "otlp_port": build.OTLP_PORT,
        "store_http_port": build.STORE_HTTP_PORT, "clock_port": build.CLOCK_PORT,
        "created_unix_ns": time.time_ns(), "hosts": hosts,
        "cgroup": str(cgroups.lab_dir(topo.name)) if cg else None,
        "namespaces": [], "root_links": [], "cgroups": [], "processes": {}, "status": {"fabric": "building"},
    }


class LoopbackLab(LabBase):
    """A lab of processes on loopback (see the module docstring)."""

    @classmethod
    def up(cls, spec: TopologySpec | None = None, *, name: str = "lab", agents: bool = True,
           state_root: Path | None = None, clocks: Mapping[str, tuple[int, float]] | None = None,
           cleanup_at_exit: bool = True, timeout_s: float = 60.0) -> LoopbackLab:
        """Lay out the hosts, start the supervisor (server, agents, counters); return when ready."""
        started = time.monotonic()
        sf = StateFile(state_root or default_state_root(os.environ), check_lab_name(name))
        topo = Topology(spec or TopologySpec(), name=name)
        with root_lock(sf.root):
            taken = set()
            for other in build.other_labs(sf.root, name):
                taken.add(str(other.get("loopback_net", "")))
            state = loopback_state(topo, sf, net=_loopback_net(name, taken), agents=agents,
                                   clocks=clocks or build.default_clocks(name, topo.hosts))
            sf.create(state)
        lab = cls(sf, state)
        try:
            build.make_cgroups(sf, state)
            build.make_host_dirs(topo, state)
            lab._supervisor = build.spawn_supervisor(sf, state)
            sf.set_in("status", "fabric", "ready")
            lab._wait_ready(timeout_s)
        except BaseException:
            lab._down_at_exit()
            raise
        if cleanup_at_exit:
            lab._cleanup_at_exit()
        lab.up_s = time.monotonic() - started
        return lab

    @classmethod
    def attach(cls, name: str, *, state_root: Path | None = None) -> LoopbackLab:
        """A handle on a running loopback lab."""
        return cls(*read_running(name, state_root=state_root, mode="loopback"))

    def _check_can_cut(self, link: str) -> None:
        raise self._no_fabric(f"taking {link} down after a ramp")

    def __repr__(self) -> str:
        return f"LoopbackLab({self.name!r}, dir={self.dir})"
