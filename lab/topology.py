"""The shape of a lab: hosts, racks, rails, leaves, spines, links, names, addresses and paths.

Pure code: nothing here touches the machine. The default is rail-optimised: 8 hosts in 2
racks with 2 NICs (rails) each; one leaf per rack and rail; every leaf cabled to every one
of 2 spines. NIC ``r`` of every host in rack ``k`` goes to leaf ``(k, r)``.

Names follow `ridethrough.lab.control`: hosts ``h{i}``, leaves ``leaf{k}r{r}``, spines
``spine{s}``, links ``{lower}-{upper}`` (``h3-leaf1r0``, ``leaf1r0-spine1``). Inside a node's
namespace the interface of a link is named after the neighbour (``h3`` on a leaf,
``spine1`` on a leaf, ``leaf1r0`` on a spine), except on hosts, where NIC ``r`` is ``nic{r}``.

Addresses (inside the lab's namespaces only; rack-aligned so switches aggregate per rack):

* host stable address (jobs bind to it): ``10.200.{rack}.{j+1}/32``, ``j`` = index in rack;
* host link (host, rail r): the /31 ``10.{64+r}.{rack}.{2j}``; leaf end even, host end odd;
* leaf-spine link (leaf L, spine s): the /31 ``10.128.{L}.{2s}``; spine end even, leaf end odd;
* management: one /24 per lab from 198.18.0.0/15 (benchmarking range), server on ``.1``,
  host ``h{i}`` on ``.{10+i}``.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import re
from dataclasses import dataclass
from enum import Enum
from functools import cached_property

STABLE_NET = ipaddress.IPv4Network("10.200.0.0/16")
LEAF_SPINE_NET = ipaddress.IPv4Network("10.128.0.0/16")
MGMT_NET = ipaddress.IPv4Network("198.18.0.0/15")
MGMT_FIRST_HOST = 10
IFNAMSIZ = 15
"""Longest Linux interface name."""
MAX_HOSTS = 240
_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,23}")


def rail_net(rail: int) -> ipaddress.IPv4Network:
    """The block holding every host-link /31 of one rail."""
    return ipaddress.IPv4Network(f"10.{64 + rail}.0.0/16")


def check_lab_name(name: str) -> str:
    """A lab name: lower-case letters, digits and dashes, at most 24 characters."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"lab name {name!r}: use 1-24 lower-case letters, digits or dashes, starting with "
                         "a letter or digit")
    return name


def lab_prefix(name: str) -> str:
    """The 5-character prefix of everything a lab creates in the root namespace (``r`` + hash)."""
    digest = base64.b32encode(hashlib.sha256(check_lab_name(name).encode()).digest()).decode().lower()
    return "r" + digest[:4]


class Kind(Enum):
    """What a node is."""

    HOST = "host"
    LEAF = "leaf"
    SPINE = "spine"


@dataclass(frozen=True, slots=True)
class TopologySpec:
    """The sizes of a lab; ``gpus`` is fake GPUs per host."""

    hosts: int = 8
    racks: int = 2
    rails: int = 2
    spines: int = 2
    gpus: int = 8

    def __post_init__(self) -> None:
        if min(self.hosts, self.racks, self.rails, self.spines) < 1 or self.gpus < 0:
            raise ValueError("hosts, racks, rails and spines must be at least 1 (gpus at least 0)")
        if self.hosts % self.racks:
            raise ValueError(f"{self.hosts} hosts do not split evenly into {self.racks} racks")
        if self.hosts > MAX_HOSTS or self.hosts // self.racks > 127:
            raise ValueError(f"at most {MAX_HOSTS} hosts and 127 per rack")
        if self.racks * self.rails > 256 or self.rails > 64 or self.spines > 127:
            raise ValueError("at most 64 rails, 127 spines and 256 leaves (racks x rails)")


@dataclass(frozen=True, slots=True)
class Link:
    """A cable (a veth pair): ``lower`` is the host or the leaf, ``upper`` the leaf or the spine."""

    lower: str
    upper: str
    lower_if: str
    upper_if: str
    lower_ip: str
    upper_ip: str
    rail: int

    @property
    def name(self) -> str:
        """``{lower}-{upper}``, as `ridethrough.lab.control` names links."""
        return f"{self.lower}-{self.upper}"

    def ifname(self, node: str) -> str:
        """This link's interface in ``node``'s namespace."""
        if node == self.lower:
            return self.lower_if
        if node == self.upper:
            return self.upper_if
        raise ValueError(f"{node} is not an end of {self.name}")

    def peer(self, node: str) -> str:
        """The other end."""
        return self.upper if node == self.lower else self.lower


Path = tuple[str, ...]
"""A path between two hosts: the names of the links it crosses, in order."""


class Topology:
    """Every node, link, interface, address and path of a lab with a given spec and name."""

    def __init__(self, spec: TopologySpec, *, name: str = "lab", mgmt_subnet: str = "198.18.0.0/24") -> None:
        self.spec = spec
        self.name = check_lab_name(name)
        self.prefix = lab_prefix(name)
        self.mgmt = ipaddress.IPv4Network(mgmt_subnet)
        self.per_rack = spec.hosts // spec.racks

    # -- nodes -----------------------------------------------------------------------------

    @cached_property
    def hosts(self) -> list[str]:
        """``h0`` … ``h{N-1}``."""
        return [f"h{i}" for i in range(self.spec.hosts)]

    @cached_property
    def leaves(self) -> list[str]:
        """``leaf{rack}r{rail}``, rack-major."""
        return [self.leaf(k, r) for k in range(self.spec.racks) for r in range(self.spec.rails)]

    @cached_property
    def spines(self) -> list[str]:
        """``spine0`` … ."""
        return [f"spine{s}" for s in range(self.spec.spines)]

    @property
    def nodes(self) -> list[str]:
        """Hosts, leaves, spines."""
        return [*self.hosts, *self.leaves, *self.spines]

    @staticmethod
    def leaf(rack: int, rail: int) -> str:
        """The leaf of one rack and rail."""
        return f"leaf{rack}r{rail}"

    def kind(self, node: str) -> Kind:
        """Host, leaf or spine; ValueError for a name the lab does not have."""
        if node in self._host_index:
            return Kind.HOST
        if node in self._leaf_index:
            return Kind.LEAF
        if node in self.spines:
            return Kind.SPINE
        raise ValueError(f"no node {node!r} in lab {self.name}")

    @cached_property
    def _host_index(self) -> dict[str, int]:
        return {h: i for i, h in enumerate(self.hosts)}

    @cached_property
    def _leaf_index(self) -> dict[str, int]:
        return {leaf: i for i, leaf in enumerate(self.leaves)}

    def host_index(self, host: str) -> int:
        """``h3`` → 3."""
        try:
            return self._host_index[host]
        except KeyError:
            raise ValueError(f"no host {host!r} in lab {self.name} (hosts are h0..h{self.spec.hosts - 1})") from None

    def rack_of(self, host: str) -> int:
        """The rack a host sits in."""
        return self.host_index(host) // self.per_rack

    def rack_hosts(self, rack: int) -> list[str]:
        """The hosts of one rack."""
        return self.hosts[rack * self.per_rack:(rack + 1) * self.per_rack]

    def leaf_position(self, leaf: str) -> tuple[int, int]:
        """(rack, rail) of a leaf."""
        i = self._leaf_index[leaf]
        return divmod(i, self.spec.rails)

    # -- links -----------------------------------------------------------------------------

    @cached_property
    def links(self) -> list[Link]:
        """Host links (host-major, rail-minor), then leaf-spine links (leaf-major)."""
        out: list[Link] = []
        for host in self.hosts:
            k, j = divmod(self.host_index(host), self.per_rack)
            for r in range(self.spec.rails):
                base = f"10.{64 + r}.{k}"
                out.append(Link(host, self.leaf(k, r), f"nic{r}", host, f"{base}.{2 * j + 1}", f"{base}.{2 * j}", r))
        for li, leaf in enumerate(self.leaves):
            _, r = self.leaf_position(leaf)
            for s, spine in enumerate(self.spines):
                base = f"10.128.{li}"
                out.append(Link(leaf, spine, spine, leaf, f"{base}.{2 * s + 1}", f"{base}.{2 * s}", r))
        return out

    @cached_property
    def _links_by_name(self) -> dict[str, Link]:
        return {link.name: link for link in self.links}

    @cached_property
    def _links_by_if(self) -> dict[tuple[str, str], Link]:
        out: dict[tuple[str, str], Link] = {}
        for link in self.links:
            out[(link.lower, link.lower_if)] = link
            out[(link.upper, link.upper_if)] = link
        return out

    def link(self, name: str) -> Link:
        """A link by name; ValueError naming the lab's links if there is none."""
        try:
            return self._links_by_name[name]
        except KeyError:
            raise ValueError(f"no link {name!r} in lab {self.name} (links look like h0-leaf0r0, "
                             "leaf0r0-spine0)") from None

    def link_at(self, node: str, ifname: str) -> Link | None:
        """The link whose interface ``ifname`` sits in ``node`` (None: not a fabric interface)."""
        return self._links_by_if.get((node, ifname))

    def node_links(self, node: str) -> list[Link]:
        """The links with an end in ``node``."""
        return [link for link in self.links if node in (link.lower, link.upper)]

    def nic_link(self, host: str, nic: str) -> Link:
        """The link a host's NIC ``nic{r}`` is cabled to."""
        if not nic.startswith("nic") or not nic[3:].isdigit() or int(nic[3:]) >= self.spec.rails:
            raise ValueError(f"no NIC {nic!r} (NICs are nic0..nic{self.spec.rails - 1})")
        return self.link(f"{host}-{self.leaf(self.rack_of(host), int(nic[3:]))}")

    # -- addresses and names ---------------------------------------------------------------

    def stable_ip(self, host: str) -> str:
        """The address jobs on ``host`` bind to; it never goes down with a NIC."""
        k, j = divmod(self.host_index(host), self.per_rack)
        return f"10.200.{k}.{j + 1}"

    def nic_ip(self, host: str, rail: int) -> str:
        """The address of one NIC of a host."""
        return self.link(f"{host}-{self.leaf(self.rack_of(host), rail)}").lower_ip

    @property
    def server_ip(self) -> str:
        """The management address of the lab's server (in the root namespace)."""
        return str(self.mgmt.network_address + 1)

    def mgmt_ip(self, host: str) -> str:
        """A host's management address (its agent reaches the server from it)."""
        return str(self.mgmt.network_address + MGMT_FIRST_HOST + self.host_index(host))

    def namespace(self, node: str) -> str:
        """The network namespace of a node: ``rt-{lab}-{node}``."""
        return f"rt-{self.name}-{node}"

    @property
    def bridge(self) -> str:
        """The management bridge in the root namespace."""
        return f"{self.prefix}br"

    def mgmt_root_if(self, host: str) -> str:
        """The root-namespace end of a host's management veth."""
        return f"{self.prefix}m{self.host_index(host)}"

    def root_interfaces(self) -> list[str]:
        """Every interface name the lab puts in the root namespace."""
        return [self.bridge, *(self.mgmt_root_if(h) for h in self.hosts)]

    def interface_names(self) -> list[str]:
        """Every interface name the lab creates anywhere (for the length check)."""
        names = {link.lower_if for link in self.links} | {link.upper_if for link in self.links}
        return sorted(names | {"stab", "stabp", "mgmt", *self.root_interfaces()})

    # -- paths -----------------------------------------------------------------------------

    def paths(self, src: str, dst: str) -> list[Path]:
        """Every path the routing can pick from ``src``'s stable address to ``dst``'s.

        One per rail inside a rack (through that rail's leaf), one per (rail, spine) across
        racks: spines keep the rail.
        """
        ka, kb = self.rack_of(src), self.rack_of(dst)
        if src == dst:
            return [()]
        out: list[Path] = []
        for r in range(self.spec.rails):
            la, lb = self.leaf(ka, r), self.leaf(kb, r)
            if ka == kb:
                out.append((f"{src}-{la}", f"{dst}-{la}"))
                continue
            for spine in self.spines:
                out.append((f"{src}-{la}", f"{la}-{spine}", f"{lb}-{spine}", f"{dst}-{lb}"))
        return out
