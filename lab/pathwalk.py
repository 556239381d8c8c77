"""Which path the kernel really gives a flow: a hop-by-hop walk with ``ip route get``.

At the source host the walk asks for the output route of the flow (source and destination
stable addresses, protocol, ports: with ``fib_multipath_hash_policy=1`` the ports pick the
ECMP member); at each switch it asks for the *input* route as if the packet had arrived on
the interface it came in by (policy rules on ``iif`` apply, and the kernel builds a packet
with those ports to hash). A hop whose egress has no carrier, or a switch with no route,
breaks the walk there. This measures the kernel's routing; `Topology.paths` is the design.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

from pyroute2.netlink.exceptions import NetlinkError

from ridethrough.lab.topology import Path, Topology

RTN_LOCAL = 2
MAX_HOPS = 8


@dataclass(frozen=True, slots=True)
class Walk:
    """The links a flow crosses, in order; ``broken`` says where and why it stops short."""

    links: Path
    broken: str | None = None

    @property
    def ok(self) -> bool:
        """Whether the flow reaches its destination."""
        return self.broken is None


class Walker:
    """Walks flows through a running lab (anything with ``topology`` and ``handle(node)``)."""

    def __init__(self, lab: Any) -> None:
        self.lab = lab
        self.topo: Topology = lab.topology
        self._ifs: dict[str, dict[int, tuple[str, bool]]] = {}

    def refresh(self) -> None:
        """Forget cached interface states (after changing links)."""
        self._ifs.clear()

    def _interfaces(self, node: str) -> dict[int, tuple[str, bool]]:
        if node not in self._ifs:
            self._ifs[node] = {m["index"]: (str(m.get("ifname")), m.get("operstate") == "UP")
                               for m in self.lab.handle(node).links()}
        return self._ifs[node]

    def _index(self, node: str, ifname: str) -> int:
        return next(i for i, (name, _) in self._interfaces(node).items() if name == ifname)

    def walk(self, src: str, dst: str, *, sport: int, dport: int, proto: int = socket.IPPROTO_UDP) -> Walk:
        """The path of one flow from ``src``'s stable address to ``dst``'s."""
        src_ip, dst_ip = self.topo.stable_ip(src), self.topo.stable_ip(dst)
        node, iif = src, None
        links: list[str] = []
        for _ in range(MAX_HOPS):
            kw: dict[str, Any] = {"src": src_ip, "sport": sport, "dport": dport, "ip_proto": proto}
            if iif is not None:
                kw["iif"] = iif
            try:
                route = self.lab.handle(node).route_get(dst_ip, **kw)
            except NetlinkError as exc:
                return Walk(tuple(links), f"no route at {node}: {exc}")
            if route["type"] == RTN_LOCAL:
                return Walk(tuple(links), None if node == dst else f"delivered to {node}, not {dst}")
            ifname, oper_up = self._interfaces(node)[route.get_attr("RTA_OIF")]
            link = self.topo.link_at(node, ifname)
            if link is None:
                return Walk(tuple(links), f"{node} routes out of {ifname}, not a fabric link")
            links.append(link.name)
            if not oper_up:
                return Walk(tuple(links), f"{link.name} is down at {node}")
            node = link.peer(node)
            iif = self._index(node, link.ifname(node))
        return Walk(tuple(links), f"more than {MAX_HOPS} hops (a loop?)")
