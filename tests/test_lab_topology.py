"""The lab's topology, naming, addressing, routing plan and state file, without touching the machine."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterator
from pathlib import Path as FsPath

import pytest

from ridethrough.lab import faults, procs
from ridethrough.lab.build import default_clocks
from ridethrough.lab.control import LabError
from ridethrough.lab.routing import MAIN_TABLE, NodePlan, hash_seed, plan
from ridethrough.lab.state import StateFile, list_labs
from ridethrough.lab.topology import (
    IFNAMSIZ,
    STABLE_NET,
    Kind,
    Path,
    Topology,
    TopologySpec,
    check_lab_name,
    lab_prefix,
)

SIZES = [TopologySpec(), TopologySpec(hosts=4, racks=1, rails=2, spines=2),
         TopologySpec(hosts=16, racks=4, rails=4, spines=4), TopologySpec(hosts=2, racks=2, rails=1, spines=1),
         TopologySpec(hosts=12, racks=3, rails=2, spines=3)]


def test_default_sizes_and_names() -> None:
    topo = Topology(TopologySpec(), name="demo")
    assert topo.hosts == [f"h{i}" for i in range(8)]
    assert topo.leaves == ["leaf0r0", "leaf0r1", "leaf1r0", "leaf1r1"]
    assert topo.spines == ["spine0", "spine1"]
    assert len(topo.links) == 8 * 2 + 4 * 2
    assert topo.link("h3-leaf0r1").lower_if == "nic1" and topo.link("h3-leaf0r1").upper_if == "h3"
    assert topo.link("leaf1r0-spine1").lower_if == "spine1" and topo.link("leaf1r0-spine1").upper_if == "leaf1r0"
    assert [topo.rack_of(h) for h in topo.hosts] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert topo.nic_link("h5", "nic1").name == "h5-leaf1r1"
    assert topo.namespace("spine0") == "rt-demo-spine0"


@pytest.mark.parametrize("spec", SIZES, ids=str)
def test_names_agree_with_the_fault_catalogue(spec: TopologySpec) -> None:
    topo = Topology(spec, name="t")
    names = faults.names(spec.hosts, spec.racks, spec.rails, spec.spines, spec.gpus or 1)
    assert [link.name for link in topo.links] == list(names.links)
    assert topo.hosts == list(names.hosts) and topo.leaves == list(names.leaves)
    for host in topo.hosts:
        for r in range(spec.rails):
            assert topo.nic_link(host, f"nic{r}").name == names.nic_link(host, f"nic{r}")


@pytest.mark.parametrize("spec", SIZES, ids=str)
def test_addresses_are_unique_and_each_link_is_one_subnet(spec: TopologySpec) -> None:
    topo = Topology(spec, name="t", mgmt_subnet="198.18.7.0/24")
    ends = [ip for link in topo.links for ip in (link.lower_ip, link.upper_ip)]
    stable = [topo.stable_ip(h) for h in topo.hosts]
    mgmt = [topo.mgmt_ip(h) for h in topo.hosts] + [topo.server_ip]
    assert len(set(ends + stable + mgmt)) == len(ends) + len(stable) + len(mgmt)
    for link in topo.links:
        net = ipaddress.IPv4Network(f"{link.lower_ip}/31", strict=False)
        assert ipaddress.IPv4Address(link.upper_ip) in net
    assert all(ipaddress.IPv4Address(ip) in STABLE_NET for ip in stable)
    assert all(ipaddress.IPv4Address(ip) in topo.mgmt for ip in mgmt)


def test_interface_names_fit_even_for_the_largest_lab() -> None:
    for spec in [*SIZES, TopologySpec(hosts=240, racks=2, rails=64, spines=127),
                 TopologySpec(hosts=128, racks=128, rails=2, spines=2)]:
        topo = Topology(spec, name="a-rather-long-lab-name")
        too_long = [n for n in topo.interface_names() if len(n) > IFNAMSIZ]
        assert not too_long, too_long
        assert all(n.startswith(topo.prefix) for n in topo.root_interfaces())


def test_prefix_is_stable_short_and_per_name() -> None:
    assert lab_prefix("demo") == lab_prefix("demo")
    assert len(lab_prefix("demo")) == 5 and lab_prefix("demo").startswith("r")
    assert len({lab_prefix(f"lab{i}") for i in range(200)}) == 200
    for bad in ("", "UPPER", "-x", "a" * 25, "sp ace", "a/b"):
        with pytest.raises(ValueError):
            check_lab_name(bad)


def test_spec_rejects_sizes_that_do_not_make_a_lab() -> None:
    for kw in ({"hosts": 7, "racks": 2}, {"spines": 0}, {"rails": 0}, {"hosts": 300, "racks": 3}, {"gpus": -1}):
        with pytest.raises(ValueError):
            TopologySpec(**kw)  # type: ignore[arg-type]


def _check_path(topo: Topology, src: str, dst: str, path: Path) -> None:
    node = src
    for name in path:
        link = topo.link(name)
        assert node in (link.lower, link.upper), (path, node)
        node = link.peer(node)
    assert node == dst


@pytest.mark.parametrize("spec", SIZES, ids=str)
def test_path_enumeration(spec: TopologySpec) -> None:
    topo = Topology(spec, name="t")
    for a in topo.hosts:
        for b in topo.hosts:
            if a == b:
                continue
            paths = topo.paths(a, b)
            same_rack = topo.rack_of(a) == topo.rack_of(b)
            assert len(paths) == len(set(paths)) == (spec.rails if same_rack else spec.rails * spec.spines)
            for p in paths:
                _check_path(topo, a, b, p)


# -- the routing plan, walked in pure Python: every ECMP choice, longest-prefix match -------------------


def _lookup(p: NodePlan, dst: str, iif: str | None) -> list[tuple[str, str]] | None:
    """Nexthops for ``dst`` arriving on ``iif``: policy rules first, then main; None if local."""
    if any(a.address == dst for a in p.addresses):
        return None
    tables = [r.table for r in sorted(p.rules, key=lambda r: r.priority) if r.iifname == iif] + [MAIN_TABLE]
    addr = ipaddress.IPv4Address(dst)
    for table in tables:
        best = None
        candidates = [(ipaddress.IPv4Network(r.dst), list(r.nexthops)) for r in p.routes if r.table == table]
        candidates += [(ipaddress.IPv4Network(f"{a.address}/{a.prefixlen}", strict=False), [("", a.ifname)])
                       for a in p.addresses if table == MAIN_TABLE and a.prefixlen < 32]
        for net, hops in candidates:
            if addr in net and (best is None or net.prefixlen > best[0].prefixlen):
                best = (net, hops)
        if best is not None:
            return best[1]
    raise AssertionError(f"{p.node}: no route to {dst} (iif {iif})")


def _all_paths(topo: Topology, plans: dict[str, NodePlan], src: str, dst: str) -> Iterator[Path]:
    target = topo.stable_ip(dst)

    def step(node: str, iif: str | None, sofar: tuple[str, ...]) -> Iterator[Path]:
        hops = _lookup(plans[node], target, iif)
        if hops is None:
            assert node == dst
            yield sofar
            return
        for gw, dev in hops:
            link = topo.link_at(node, dev)
            assert link is not None
            peer = link.peer(node)
            assert gw in ("", link.lower_ip if peer == link.lower else link.upper_ip), (node, gw, dev)
            yield from step(peer, link.ifname(peer), (*sofar, link.name))
    yield from step(src, None, ())


@pytest.mark.parametrize("spec", SIZES, ids=str)
def test_routing_plan_gives_exactly_the_designed_paths(spec: TopologySpec) -> None:
    topo = Topology(spec, name="t")
    plans = {node: plan(topo, node) for node in topo.nodes}
    for a in topo.hosts:
        for b in topo.hosts:
            if a != b:
                assert sorted(_all_paths(topo, plans, a, b)) == sorted(topo.paths(a, b)), (a, b)


def test_plan_details() -> None:
    topo = Topology(TopologySpec(), name="t")
    host, leaf, spine = plan(topo, "h0"), plan(topo, "leaf0r1"), plan(topo, "spine1")
    assert host.kind is Kind.HOST and host.sysctls["net/ipv4/ip_forward"] == "0"
    assert leaf.sysctls["net/ipv4/ip_forward"] == spine.sysctls["net/ipv4/ip_forward"] == "1"
    ecmp = next(r for r in host.routes if r.dst == str(STABLE_NET))
    assert ecmp.prefsrc == topo.stable_ip("h0") and {dev for _, dev in ecmp.nexthops} == {"nic0", "nic1"}
    assert [(r.iifname, r.table) for r in spine.rules] == [("leaf0r0", 100), ("leaf0r1", 101), ("leaf1r0", 100),
                                                            ("leaf1r1", 101)]
    seeds = {hash_seed(n) for n in topo.nodes}
    assert len(seeds) == len(topo.nodes) and 0 not in seeds


def test_default_clocks_follow_the_name_and_stay_in_range() -> None:
    a, b = default_clocks("one", ["h0", "h1"]), default_clocks("two", ["h0", "h1"])
    assert a == default_clocks("one", ["h0", "h1"]) and a != b
    assert all(abs(off) <= 10_000_000 and abs(drift) <= 100 for off, drift in (*a.values(), *b.values()))


def test_state_file_lifecycle(tmp_path: FsPath) -> None:
    root = tmp_path
    sf = StateFile(root, "x")
    sf.create({"name": "x", "mode": "netns", "dir": str(root / "x")})
    with pytest.raises(LabError, match="already exists"):
        sf.create({"name": "x"})
    sf.append("namespaces", "a", "b")
    sf.set_in("status", "fabric", "ready")
    assert sf.update(lambda st: st["namespaces"]) == ["a", "b"]
    assert sf.read()["status"] == {"fabric": "ready"} and list_labs(root) == ["x"]
    sf.remove()
    assert list_labs(root) == []
    with pytest.raises(LabError, match="no lab"):
        sf.read()


def test_process_identity_survives_only_while_the_process_does() -> None:
    me = procs.ref(os.getpid())
    assert me is not None and procs.alive(me)
    assert not procs.alive(procs.ProcRef(me.pid, me.start + 1))  # same pid, another start: a stranger
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    assert procs.ref(pid) is None


def test_without_namespaces_the_lab_says_so_in_one_line_and_offers_loopback(
        monkeypatch: pytest.MonkeyPatch, tmp_path: FsPath) -> None:
    from typer.testing import CliRunner

    from ridethrough.lab import netns
    from ridethrough.lab.cli import lab_app
    from ridethrough.lab.fabric import Lab

    monkeypatch.setattr(netns, "unavailable_reason", lambda: "network namespaces need root (this process is not root)")
    with pytest.raises(LabError, match="--loopback") as info:
        Lab.up(name="never", state_root=tmp_path)
    assert "\n" not in str(info.value)
    result = CliRunner().invoke(lab_app, ["up", "--name", "never", "--state-root", str(tmp_path)])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "--loopback" in result.output
    assert list(tmp_path.iterdir()) == []


def test_names_follow_the_documented_convention() -> None:
    """lab/control.py's naming, spelled out: hosts h<i>, leaves leaf<rack>r<rail>, links lower tier first."""
    names = faults.names(4, 2, 2, 1, 1)
    assert list(names.hosts) == ["h0", "h1", "h2", "h3"]
    assert list(names.leaves) == ["leaf0r0", "leaf0r1", "leaf1r0", "leaf1r1"]
    assert list(names.spines) == ["spine0"]
    assert {"h0-leaf0r0", "h3-leaf1r1", "leaf1r0-spine0"} <= set(names.links)
    assert len(names.links) == 4 * 2 + 4 * 1
    assert names.nic_link("h3", "nic1") == "h3-leaf1r1"
    assert names.nic_link("h0", "nic0") == "h0-leaf0r0"
