"""The reflex's netlink edge: per-destination route overrides, and the peers this host talks to.

An *override* is a /32 route in the main table for one peer's stable address, marked with
protocol `RTPROT_RIDETHROUGH` (114, unassigned in ``rtnetlink.h``; name it for ``ip route`` with
``echo "114 ridethrough" > /etc/iproute2/rt_protos.d/ridethrough.conf``). It copies the route
that covers the address (the *base*: on a multi-rail host, the stable prefix by ECMP over one
nexthop per NIC, e.g. ``10.200.0.0/16 src 10.200.0.1 nexthop via 10.64.0.0 dev nic0 nexthop
via 10.65.0.0 dev nic1``) with some NICs' nexthops left out, and locks ``rto_min`` so that TCP
on the rerouted path retransmits sooner than the kernel's 200 ms floor.

Every change is one ``RTM_NEWROUTE`` with ``NLM_F_REPLACE`` (atomic: a packet sees the old
route or the new one, never none), and taking an override away is one delete of our /32
(matched on protocol, so a /32 someone else wrote is never touched): the base already covers
the address, so there is no instant without a route either. Only IPv4 main-table routes with
explicit nexthops are handled (nexthop objects, ``nhid``, are not copied).

`tcp_peers` lists the remote addresses of established TCP connections (``sock_diag``), so the
reflex watches the peers this host's jobs actually talk to.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pyroute2 import DiagSocket, IPRoute
from pyroute2.netlink.exceptions import NetlinkError

RTPROT_RIDETHROUGH = 114
"""The routing protocol number that marks the reflex's routes."""
RTPROT_RIDETHROUGH_CENTRAL = 115
"""The routing protocol number of the routes the controller sets through the control plane
(`ridethrough.actuators.reroute_netlink`): a base the reflex may override, never foreign to it."""
MAIN_TABLE = 254
RTAX_RTO_MIN = 13
_TCP_ESTABLISHED = 1
_ESRCH = 3


class RouteError(RuntimeError):
    """A route could not be read or written; the message names the address and the kernel's reason."""


@dataclass(frozen=True, slots=True)
class Nexthop:
    """One nexthop: a gateway (None: on-link) out of an interface, with its ECMP weight."""

    gateway: str | None
    ifname: str
    weight: int = 1


@dataclass(frozen=True, slots=True)
class BaseRoute:
    """The route that covers a destination when no override is there."""

    prefix: str
    nexthops: tuple[Nexthop, ...]
    prefsrc: str | None = None

    def without(self, ifnames: Iterable[str]) -> tuple[Nexthop, ...]:
        """The nexthops that do not leave through ``ifnames``."""
        drop = set(ifnames)
        return tuple(nh for nh in self.nexthops if nh.ifname not in drop)


@dataclass(frozen=True, slots=True)
class Override:
    """One of our /32 routes as the kernel holds it."""

    address: str
    nexthops: tuple[Nexthop, ...]
    rto_min_ms: int = 0


class RouteTable(Protocol):
    """What the reflex needs of a host's routing (`HostRoutes` is the kernel's; tests may keep one in memory)."""

    def interface_of(self, address: str) -> str | None:
        """The interface holding a local address."""
        ...

    def base_route(self, address: str) -> BaseRoute | None:
        """The route covering ``address`` when there is no override."""
        ...

    def overrides(self) -> dict[str, Override]:
        """Our overrides, by address."""
        ...

    def foreign(self, address: str) -> bool:
        """Whether someone else's /32 for ``address`` is there."""
        ...

    def tcp_peers(self) -> set[str]:
        """Remote addresses of established TCP connections."""
        ...

    def replace(self, address: str, base: BaseRoute, nexthops: Sequence[Nexthop], *, rto_min_ms: int) -> None:
        """Install or atomically replace the override of ``address``; `RouteError` if it cannot."""
        ...

    def remove(self, address: str) -> None:
        """Delete the override of ``address``; `RouteError` if it cannot."""
        ...

    def close(self) -> None:
        """Release what it holds."""
        ...


class NetlinkSocket:
    """One rtnetlink socket, opened on first use, and a lock for its users.

    The socket is in the network namespace this process runs in, or, with ``netns``, in that named
    namespace (``ip netns`` name; it must exist: none is created): a process in the root namespace
    then reads and writes, say, a lab switch's routes.
    """

    def __init__(self, netns: str | None = None) -> None:
        self.netns = netns
        self._ipr: Any = None
        self._lock = threading.Lock()

    def _nl(self) -> Any:
        if self._ipr is None:
            # flags=0: never create the namespace (pyroute2 would, by default, and leave it behind)
            self._ipr = IPRoute() if self.netns is None else IPRoute(netns=self.netns, flags=0)
            # pyroute2 0.9.7's sync IPRoute never sets this key, which its own nlm_request reads.
            self._ipr.asyncore.status.setdefault("nlm_generator", False)
        return self._ipr

    def open(self) -> None:
        """Open the socket now rather than on first use (a namespace that is not there fails here, with OSError)."""
        with self._lock:
            self._nl()

    def _link_names(self) -> dict[int, str]:
        return {int(m["index"]): str(m.get_attr("IFLA_IFNAME")) for m in self._nl().get_links()}

    def close(self) -> None:
        """Close the netlink socket (it reopens on use)."""
        with self._lock:
            if self._ipr is not None:
                self._ipr.close()
                self._ipr = None


class HostRoutes(NetlinkSocket):
    """The routes and TCP connections of the network namespace this process runs in.

    Opens its netlink sockets on first use; one thread at a time (the reflex's).
    """

    def __init__(self) -> None:
        super().__init__()
        self._names: dict[int, str] = {}

    # -- reading ---------------------------------------------------------------------------

    def interfaces(self) -> dict[int, str]:
        """Interface names by index (re-read every call: interfaces come and go)."""
        self._names = self._link_names()
        return dict(self._names)

    def interface_of(self, address: str) -> str | None:
        """The interface holding a local address (None: no interface has it)."""
        for msg in self._nl().get_addr(family=socket.AF_INET):
            if msg.get_attr("IFA_ADDRESS") == address or msg.get_attr("IFA_LOCAL") == address:
                return self._name(int(msg["index"]))
        return None

    def base_route(self, address: str) -> BaseRoute | None:
        """The longest-prefix main-table route covering ``address``, not counting our overrides."""
        want = ipaddress.IPv4Address(address)
        best: tuple[int, Any] | None = None
        for msg in self._routes():
            if msg["proto"] == RTPROT_RIDETHROUGH or msg["type"] != 1:  # ours, or not a unicast route
                continue
            net = ipaddress.IPv4Network(f"{msg.get_attr('RTA_DST') or '0.0.0.0'}/{msg['dst_len']}")
            if want in net and (best is None or net.prefixlen > best[0]):
                best = (net.prefixlen, msg)
        if best is None:
            return None
        msg = best[1]
        prefix = f"{msg.get_attr('RTA_DST') or '0.0.0.0'}/{msg['dst_len']}"
        return BaseRoute(prefix, self._nexthops(msg), msg.get_attr("RTA_PREFSRC"))

    def overrides(self) -> dict[str, Override]:
        """Our /32 routes, by address (left by an earlier run too)."""
        out: dict[str, Override] = {}
        for msg in self._routes(proto=RTPROT_RIDETHROUGH):
            if msg["dst_len"] == 32:
                metrics = dict((msg.get_attr("RTA_METRICS") or {}).get("attrs", []))
                address = str(msg.get_attr("RTA_DST"))
                out[address] = Override(address, self._nexthops(msg), int(metrics.get("RTAX_RTO_MIN", 0)))
        return out

    def foreign(self, address: str) -> bool:
        """Whether a /32 for ``address`` that is not ours is in the main table (then we leave it be).

        The controller's (protocol `RTPROT_RIDETHROUGH_CENTRAL`) is not foreign: it is the base an
        override copies (`base_route` finds it), so the reflex still acts on top of a central reroute.
        """
        mine = (RTPROT_RIDETHROUGH, RTPROT_RIDETHROUGH_CENTRAL)
        return any(m["dst_len"] == 32 and m.get_attr("RTA_DST") == address and m["proto"] not in mine
                   for m in self._routes())

    def tcp_peers(self) -> set[str]:
        """Remote IPv4 addresses of this namespace's established TCP connections (IPv4-mapped IPv6 ones too)."""
        out: set[str] = set()
        with DiagSocket() as diag:
            diag.bind()
            for family in (socket.AF_INET, socket.AF_INET6):
                for s in diag.get_sock_stats(family=family, states=1 << _TCP_ESTABLISHED):
                    address = ipaddress.ip_address(str(s["idiag_dst"]))
                    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
                        address = address.ipv4_mapped
                    if isinstance(address, ipaddress.IPv4Address):
                        out.add(str(address))
        return out

    def _routes(self, **match: Any) -> list[Any]:
        try:
            return list(self._nl().get_routes(family=socket.AF_INET, table=MAIN_TABLE, **match))
        except (NetlinkError, OSError) as exc:
            raise RouteError(f"cannot read the main routing table: {exc}") from exc

    def _name(self, index: int) -> str:
        if index not in self._names:
            self.interfaces()
        return self._names.get(index, f"if{index}")

    def _nexthops(self, msg: Any) -> tuple[Nexthop, ...]:
        multipath = msg.get_attr("RTA_MULTIPATH")
        if multipath:
            return tuple(Nexthop(dict(nh.get("attrs", [])).get("RTA_GATEWAY"), self._name(int(nh["oif"])),
                                 int(nh.get("hops", 0)) + 1) for nh in multipath)
        oif = msg.get_attr("RTA_OIF")
        return () if oif is None else (Nexthop(msg.get_attr("RTA_GATEWAY"), self._name(int(oif))),)

    # -- writing ---------------------------------------------------------------------------

    def replace(self, address: str, base: BaseRoute, nexthops: Sequence[Nexthop], *, rto_min_ms: int) -> None:
        """Install (or replace, atomically) the override of ``address`` through ``nexthops``.

        ``rto_min_ms`` > 0 locks TCP's minimum retransmission timeout on it (0: the kernel's).
        """
        if not nexthops:
            raise RouteError(f"override of {address}: no nexthop left (the reflex never removes the last path)")
        kw: dict[str, Any] = {"dst": f"{address}/32", "table": MAIN_TABLE, "proto": RTPROT_RIDETHROUGH}
        if base.prefsrc:
            kw["prefsrc"] = base.prefsrc
        if rto_min_ms > 0:
            kw["metrics"] = {"rto_min": rto_min_ms, "lock": 1 << RTAX_RTO_MIN}
        indexes = {name: index for index, name in self.interfaces().items()}
        try:
            hops = [self._hop(nh, indexes) for nh in nexthops]
            if len(hops) == 1:
                kw.update(hops[0])
            else:
                kw["multipath"] = [{**hop, "hops": nh.weight - 1} for hop, nh in zip(hops, nexthops, strict=True)]
            self._nl().route("replace", **kw)
        except (NetlinkError, OSError, KeyError) as exc:
            raise RouteError(f"override of {address} via {[nh.ifname for nh in nexthops]}: {exc}") from exc

    @staticmethod
    def _hop(nh: Nexthop, indexes: dict[str, int]) -> dict[str, Any]:
        hop: dict[str, Any] = {"oif": indexes[nh.ifname]}
        if nh.gateway:
            hop["gateway"] = nh.gateway
        return hop

    def remove(self, address: str) -> None:
        """Delete our override of ``address`` (the base route takes over at once; none there is fine)."""
        try:
            self._nl().route("del", dst=f"{address}/32", table=MAIN_TABLE, proto=RTPROT_RIDETHROUGH)
        except NetlinkError as exc:
            if exc.code != _ESRCH:  # ESRCH: no such route, which is what we wanted
                raise RouteError(f"removing the override of {address}: {exc}") from exc
        except OSError as exc:
            raise RouteError(f"removing the override of {address}: {exc}") from exc
