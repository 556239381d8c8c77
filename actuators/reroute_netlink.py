"""The control plane's routes on the agent's host: a `RouteOps` over netlink (pyroute2).

The controller's ``route.set`` writes a route for one destination (a peer's stable address, a
/32) and ``route.restore`` takes it away again. Those routes are marked with protocol
`RTPROT_RIDETHROUGH_CENTRAL` (115, unassigned in ``rtnetlink.h``) and this class reads, replaces
and deletes only routes with that mark: the host's own routes and the reflex's overrides
(protocol 114, `ridethrough.actuators.routes`) are never touched. The controller installs its
routes at a metric above 0, so a reflex override of the same /32 (metric 0) wins while it is
there, and the reflex takes the controller's route as its base (see `routes.HostRoutes`).

Every change is one ``RTM_NEWROUTE`` with ``NLM_F_REPLACE``: a packet sees the old route or the
new one, never none. IPv4 only, like the reflex. The netlink socket opens on first use, so an
agent without ``CAP_NET_ADMIN`` still starts (a route command then fails with the reason).
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

from pyroute2.netlink.exceptions import NetlinkError

from ridethrough.actuators.commands import Route
from ridethrough.actuators.routes import MAIN_TABLE, RTPROT_RIDETHROUGH, RTPROT_RIDETHROUGH_CENTRAL, NetlinkSocket

__all__ = ["RTPROT_RIDETHROUGH_CENTRAL", "NetlinkRouteOps"]
_ESRCH = 3
_UNICAST = 1
_OURS = (RTPROT_RIDETHROUGH, RTPROT_RIDETHROUGH_CENTRAL)


_LOOPBACK = ipaddress.IPv4Network("127.0.0.0/8")


def _network(destination: str) -> ipaddress.IPv4Network:
    net = ipaddress.ip_network("0.0.0.0/0" if destination == "default" else destination, strict=True)
    if not isinstance(net, ipaddress.IPv4Network):
        raise ValueError(f"{destination}: only IPv4 routes are handled")
    return net


class NetlinkRouteOps(NetlinkSocket):
    """`RouteOps` for the routes the control plane owns in this network namespace (see the module docstring)."""

    def _names(self) -> dict[int, str]:
        return self._link_names()

    def _routes(self, table: int, **match: Any) -> list[Any]:
        return list(self._nl().get_routes(family=socket.AF_INET, table=table, **match))

    def _ours(self, net: ipaddress.IPv4Network, table: int) -> list[Any]:
        dst = str(net.network_address)
        return [m for m in self._routes(table, proto=RTPROT_RIDETHROUGH_CENTRAL)
                if m["dst_len"] == net.prefixlen and (m.get_attr("RTA_DST") or "0.0.0.0") == dst]

    def get(self, destination: str, *, table: int) -> Route | None:
        """Our route for exactly ``destination`` in ``table`` (None: we have none there)."""
        net = _network(destination)
        with self._lock:
            ours = self._ours(net, table)
            if not ours:
                return None
            msg = min(ours, key=lambda m: int(m.get_attr("RTA_PRIORITY") or 0))
            hops = _hops(msg, self._names())
        if not hops:
            return None
        (dev, via), more = hops[0], hops[1:]
        return Route(destination, dev, via, table, int(msg.get_attr("RTA_PRIORITY") or 0), tuple(more))

    def replace(self, route: Route) -> None:
        """Install ``route`` (atomically replacing ours at its metric; ours at other metrics go after)."""
        net = _network(route.destination)
        if net.subnet_of(_LOOPBACK):  # a route for it would send this host's own traffic off the host
            raise ValueError(f"{route.destination}: loopback addresses never leave the host; not routed")
        with self._lock:
            index = {name: i for i, name in self._names().items()}
            hops = [(route.dev, route.via), *route.more]
            missing = [dev for dev, _ in hops if dev not in index]
            if missing:
                raise ValueError(f"route {route.destination}: no interface {missing} on this host")
            kw: dict[str, Any] = {"dst": str(net), "table": route.table, "proto": RTPROT_RIDETHROUGH_CENTRAL,
                                  "priority": route.metric}
            out = [{"oif": index[dev], **({"gateway": via} if via else {})} for dev, via in hops]
            if len(out) == 1:
                kw.update(out[0])
            else:
                kw["multipath"] = out
            self._nl().route("replace", **kw)
            for old in self._ours(net, route.table):  # one route of ours per destination
                if int(old.get_attr("RTA_PRIORITY") or 0) != route.metric:
                    self._delete(net, route.table, int(old.get_attr("RTA_PRIORITY") or 0))

    def delete(self, destination: str, *, table: int) -> None:
        """Delete our routes for ``destination`` (none there is fine: the covering route carries on)."""
        net = _network(destination)
        with self._lock:
            for old in self._ours(net, table):
                self._delete(net, table, int(old.get_attr("RTA_PRIORITY") or 0))

    def _delete(self, net: ipaddress.IPv4Network, table: int, metric: int) -> None:
        try:
            self._nl().route("del", dst=str(net), table=table, proto=RTPROT_RIDETHROUGH_CENTRAL, priority=metric)
        except NetlinkError as exc:
            if exc.code != _ESRCH:  # ESRCH: gone already, which is what we wanted
                raise

    def lookup(self, destination: str, *, own: bool) -> tuple[tuple[str, str], ...]:
        """The nexthops of the main-table route that carries ``destination``'s first address now.

        Longest prefix first, then the lowest metric, every ECMP nexthop (not the one a flow hashes
        to). ``own``: whoever wrote the route (what the kernel uses); else leaving out ridethrough's
        (the reflex's and ours): the host's route beneath.
        """
        want = _network(destination).network_address
        with self._lock:
            best: tuple[int, int, Any] | None = None
            for msg in self._routes(MAIN_TABLE):
                if msg["type"] != _UNICAST or (not own and msg["proto"] in _OURS):
                    continue
                net = ipaddress.IPv4Network(f"{msg.get_attr('RTA_DST') or '0.0.0.0'}/{msg['dst_len']}")
                rank = (net.prefixlen, -int(msg.get_attr("RTA_PRIORITY") or 0))
                if want in net and (best is None or rank > best[:2]):
                    best = (*rank, msg)
            return () if best is None else tuple(_hops(best[2], self._names()))


def _hops(msg: Any, names: dict[int, str]) -> list[tuple[str, str]]:
    """A route message's nexthops as (interface, gateway or '')."""
    multipath = msg.get_attr("RTA_MULTIPATH")
    if multipath:
        return [(names.get(int(nh["oif"]), f"if{nh['oif']}"), str(dict(nh.get("attrs", [])).get("RTA_GATEWAY") or ""))
                for nh in multipath]
    oif = msg.get_attr("RTA_OIF")
    return [] if oif is None else [(names.get(int(oif), f"if{oif}"), str(msg.get_attr("RTA_GATEWAY") or ""))]
