"""What each node's namespace holds: sysctls, addresses, routes and policy rules (pure).

* Hosts reach every other host's stable address by ECMP over their NICs (one nexthop per
  rail), with the stable address as the preferred source; a host does not forward.
* A leaf routes its own rack's hosts by /32 to the host's NIC on its rail, and everything
  else (other racks' stable addresses, its rail's NIC block) by ECMP over the spines.
* A spine keeps the rail: a policy rule per leaf-facing interface sends what arrives from a
  leaf of rail ``r`` to table ``100 + r``, where each rack's stable /24 goes to that rack's
  leaf of the same rail. NIC blocks are rail-specific already and live in the main table.

Cross-rack host pairs thus have rails x spines paths, and same-rack pairs have rails.
`fib_multipath_hash_policy=1` hashes on L4 ports so flows spread, and every node gets its own
``fib_multipath_hash_seed`` (Linux >= 6.11): with one seed everywhere a flow hashes alike at each
hop (ECMP polarisation) and a leaf would always pick the spine with its own rail's index, so
only ``rails`` of the ``rails x spines`` paths would carry traffic. Routing is static (no
routing protocol): a link whose far end goes down keeps its routes (packets sent into it
are lost); an end that is itself set down drops its own routes through it, as the kernel does.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from ridethrough.lab.topology import STABLE_NET, Kind, Topology, rail_net

MAIN_TABLE = 254
HASH_SEED = "net/ipv4/fib_multipath_hash_seed"
OPTIONAL_SYSCTLS = frozenset({HASH_SEED})
"""Sysctls older kernels lack; writing them is skipped there."""
RAIL_TABLE_BASE = 100
RULE_PRIORITY_BASE = 1000

COMMON_SYSCTLS: dict[str, str] = {
    "net/ipv4/fib_multipath_hash_policy": "1",
    # Paths are asymmetric by design (each direction hashes on its own): no reverse-path filter.
    "net/ipv4/conf/all/rp_filter": "0",
    "net/ipv4/conf/default/rp_filter": "0",
    # Static routing: a peer losing carrier does not move traffic; only the actuators reroute.
    "net/ipv4/conf/all/ignore_routes_with_linkdown": "0",
    # Answer and announce ARP from the interface's own address (hosts have several).
    "net/ipv4/conf/all/arp_announce": "2",
    "net/ipv4/conf/default/arp_announce": "2",
    # IPv6 would chatter (DAD, router solicitations) on every link and blur the counters.
    "net/ipv6/conf/all/disable_ipv6": "1",
    "net/ipv6/conf/default/disable_ipv6": "1",
}


@dataclass(frozen=True, slots=True)
class Addr:
    """An address on an interface."""

    ifname: str
    address: str
    prefixlen: int


@dataclass(frozen=True, slots=True)
class Route:
    """A route; several nexthops make it ECMP. A nexthop is (gateway, interface)."""

    dst: str
    nexthops: tuple[tuple[str, str], ...]
    table: int = MAIN_TABLE
    prefsrc: str | None = None

    def via(self, ifname: str) -> bool:
        """Whether a nexthop leaves through ``ifname``."""
        return any(dev == ifname for _, dev in self.nexthops)


@dataclass(frozen=True, slots=True)
class Rule:
    """A policy rule: packets arriving on ``iifname`` look up ``table``."""

    iifname: str
    table: int
    priority: int


@dataclass(slots=True)
class NodePlan:
    """Everything one node's namespace is configured with."""

    node: str
    kind: Kind
    sysctls: dict[str, str] = field(default_factory=dict)
    addresses: list[Addr] = field(default_factory=list)
    routes: list[Route] = field(default_factory=list)
    rules: list[Rule] = field(default_factory=list)


def plan(topo: Topology, node: str) -> NodePlan:
    """The plan of one node."""
    kind = topo.kind(node)
    out = NodePlan(node, kind, dict(COMMON_SYSCTLS))
    out.sysctls["net/ipv4/ip_forward"] = "0" if kind is Kind.HOST else "1"
    out.sysctls[HASH_SEED] = str(hash_seed(node))
    for link in topo.node_links(node):
        lower = link.lower == node
        out.addresses.append(Addr(link.ifname(node), link.lower_ip if lower else link.upper_ip, 31))
    {Kind.HOST: _host, Kind.LEAF: _leaf, Kind.SPINE: _spine}[kind](topo, node, out)
    return out


def hash_seed(node: str) -> int:
    """A node's multipath hash seed: fixed per node name, so a flow takes the same path in every lab."""
    return int.from_bytes(hashlib.sha256(node.encode()).digest()[:4], "big") | 1


def _host(topo: Topology, host: str, out: NodePlan) -> None:
    stable = topo.stable_ip(host)
    out.addresses.append(Addr("stab", stable, 32))
    out.addresses.append(Addr("mgmt", topo.mgmt_ip(host), topo.mgmt.prefixlen))
    nics = [topo.nic_link(host, f"nic{r}") for r in range(topo.spec.rails)]
    out.routes.append(Route(str(STABLE_NET), tuple((n.upper_ip, n.lower_if) for n in nics), prefsrc=stable))
    for r, n in enumerate(nics):
        out.routes.append(Route(str(rail_net(r)), ((n.upper_ip, n.lower_if),), prefsrc=n.lower_ip))


def _leaf(topo: Topology, leaf: str, out: NodePlan) -> None:
    rack, rail = topo.leaf_position(leaf)
    for host in topo.rack_hosts(rack):
        link = topo.link(f"{host}-{leaf}")
        out.routes.append(Route(f"{topo.stable_ip(host)}/32", ((link.lower_ip, link.upper_if),)))
    ups = tuple((topo.link(f"{leaf}-{s}").upper_ip, s) for s in topo.spines)
    out.routes.append(Route(str(STABLE_NET), ups))
    out.routes.append(Route(str(rail_net(rail)), ups))


def _spine(topo: Topology, spine: str, out: NodePlan) -> None:
    for li, leaf in enumerate(topo.leaves):
        rack, rail = topo.leaf_position(leaf)
        link = topo.link(f"{leaf}-{spine}")
        table = RAIL_TABLE_BASE + rail
        out.rules.append(Rule(link.upper_if, table, RULE_PRIORITY_BASE + li))
        out.routes.append(Route(f"10.200.{rack}.0/24", ((link.lower_ip, link.upper_if),), table=table))
        out.routes.append(Route(f"10.{64 + rail}.{rack}.0/24", ((link.lower_ip, link.upper_if),)))
