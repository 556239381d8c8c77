"""The fabric map: which links each probed path may cross, and which link each NIC is cabled to.

The telemetry names ends (``h0/nic0``, a path ``h0/nic0->h5/nic0:forward``), the repair names
cables (``h0-leaf0r0``, ``leaf0r0-spine1``). The map joins them: tomography reads the routes,
the link detectors read the NICs. On a real fleet it comes from cabling records and LLDP, in the
lab from the topology (`RouteMap.from_fabric`); either way it is a JSON file::

    {"routes": {"h0/nic0->h5/nic0:forward": [["h0-leaf0r0", "leaf0r0-spine0", ...], ...]},
     "nics": {"h0/nic0": "h0-leaf0r0", "h0/mlx5_0": "h0-leaf0r0"}}

`RouteFile` re-reads it when it changes (routes move after a reroute).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)

Route = tuple[str, ...]
"""The links a packet crosses, in order."""
_PATH_ID = re.compile(r"(?P<src>[^/\s>]+)/(?P<nic>[^/\s>]+)->(?P<dst>[^/\s>]+)/(?P<dnic>[^/\s:]+):"
                      r"(?P<direction>forward|reverse)")


def path_id(src: str, src_nic: str, dst: str, dst_nic: str, direction: str) -> str:
    """``h0/nic0->h5/nic0:forward``: one direction of the path ``src``'s prober probes."""
    return f"{src}/{src_nic}->{dst}/{dst_nic}:{direction}"


def parse_path_id(path: str) -> tuple[str, str, str, str, str]:
    """``(src, src_nic, dst, dst_nic, direction)`` of a path id; ValueError if it is not one."""
    m = _PATH_ID.fullmatch(path)
    if m is None:
        raise ValueError(f"not a path id (SRC/NIC->DST/NIC:forward|reverse): {path!r}")
    return m["src"], m["nic"], m["dst"], m["dnic"], m["direction"]


def route_id(path: str, index: int) -> str:
    """The id of one of a path's routes: ``PATH#INDEX`` (its place in the map's list for the path)."""
    return f"{path}#{index}"


class _Named(Protocol):
    @property
    def name(self) -> str: ...


class _Spec(Protocol):
    @property
    def rails(self) -> int: ...


class _Cable(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def lower(self) -> str: ...
    @property
    def upper(self) -> str: ...
    def ifname(self, node: str) -> str: ...


class Fabric(Protocol):
    """What `RouteMap.from_fabric` needs of a fabric (`ridethrough.lab.topology.Topology` has it)."""

    @property
    def hosts(self) -> list[str]: ...
    @property
    def spec(self) -> _Spec: ...
    @property
    def links(self) -> Sequence[_Cable]: ...
    def nic_link(self, host: str, nic: str) -> _Named: ...
    def paths(self, src: str, dst: str) -> list[Route]: ...


_NIC = re.compile(r"[^/\s]+/[^/\s]+")


class RouteMap:
    """Path id (`path_id`) → the routes that direction's packets may take, and NIC → its link.

    JSON: ``{"routes": {id: [[link, ...]]}, "nics": {"h0/nic0": "h0-leaf0r0"}}`` (``nics`` optional).
    """

    def __init__(self, routes: Mapping[str, Sequence[Sequence[str]]], nics: Mapping[str, str] | None = None) -> None:
        self._nics: dict[str, str] = {}
        for nic, link in (nics or {}).items():
            if not isinstance(nic, str) or not _NIC.fullmatch(nic) or not isinstance(link, str) or not link:
                raise ValueError(f"route map: nic {nic!r}: expected HOST/NIC mapped to a link name")
            self._nics[nic] = link
        self._routes: dict[str, tuple[Route, ...]] = {}
        for pid, alternatives in routes.items():
            if not isinstance(pid, str) or not _PATH_ID.fullmatch(pid):
                raise ValueError(f"route map: path {pid!r}: expected SRC/NIC->DST/NIC:forward|reverse")
            if isinstance(alternatives, str) or not alternatives or not all(
                    not isinstance(r, str) and r and all(isinstance(x, str) and x for x in r) for r in alternatives):
                raise ValueError(f"route map: path {pid}: expected a non-empty list of routes (lists of link names)")
            self._routes[pid] = tuple(tuple(r) for r in alternatives)

    def routes(self, path: str) -> tuple[Route, ...]:
        """The routes of one path id; empty when the map does not know it."""
        return self._routes.get(path, ())

    def path_ids(self) -> list[str]:
        """Every path id the map knows, sorted."""
        return sorted(self._routes)

    def route_ids(self, path: str, *, crossing: str = "") -> list[str]:
        """One id per route of ``path`` (`route_id`), only those crossing the link ``crossing`` if given.

        The actuators' blast radius counts these: a host rerouting a pair loses every route of its
        path, a leaf draining one uplink only the routes over it.
        """
        return [route_id(path, i) for i, route in enumerate(self.routes(path)) if not crossing or crossing in route]

    def without(self, link: str) -> RouteMap:
        """The map once no route crosses ``link`` (a drained link): paths left with no route are dropped."""
        routes = {pid: [r for r in alternatives if link not in r] for pid, alternatives in self._routes.items()}
        return RouteMap({pid: r for pid, r in routes.items() if r}, self._nics)

    def link_of(self, nic: str) -> str | None:
        """The link a NIC (``h2/nic1``, ``h2/mlx5_1``) is cabled to; None when the map does not say."""
        return self._nics.get(nic)

    def __len__(self) -> int:
        return len(self._routes)

    @classmethod
    def parse(cls, data: object) -> RouteMap:
        """A map from its JSON form; ValueError naming what is wrong."""
        if (not isinstance(data, Mapping) or "routes" not in data or not set(data) <= {"routes", "nics"}
                or not isinstance(data["routes"], Mapping) or not isinstance(data.get("nics", {}), Mapping)):
            raise ValueError('route map: expected {"routes": {path id: [[link, ...], ...]}, "nics": {nic: link}}')
        return cls(data["routes"], data.get("nics"))

    @classmethod
    def load(cls, path: str | Path) -> RouteMap:
        """Read a JSON route map; ValueError naming the file."""
        try:
            return cls.parse(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as exc:
            raise ValueError(f"route map file {path}: {exc}") from None

    def to_json(self) -> dict[str, Any]:
        """The JSON form `parse` reads."""
        routes = {pid: [list(r) for r in alternatives] for pid, alternatives in sorted(self._routes.items())}
        out: dict[str, Any] = {"routes": routes}
        if self._nics:
            out["nics"] = dict(sorted(self._nics.items()))
        return out

    @classmethod
    def from_fabric(cls, fabric: Fabric, *, aliases: Callable[[int], Sequence[str]] = lambda r: ()) -> RouteMap:
        """The design's routes for every host pair and rail: NIC ``r`` probes its peer's NIC ``r``.

        A cross-rack path gets one route per spine (ECMP), since the design cannot say which.
        ``nic{r}`` of each host maps to its link, and so do the names ``aliases(r)`` gives (the
        RDMA device of the same port, e.g. ``mlx5_{r}``). So does every switch port, by its
        interface name on the switch (``leaf0r0/spine0`` and ``spine0/leaf0r0`` → ``leaf0r0-spine0``,
        ``leaf0r0/h0`` → ``h0-leaf0r0``): switches export their port counters as hosts do.
        """
        nics = [f"nic{r}" for r in range(fabric.spec.rails)]
        hosts = set(fabric.hosts)
        cabling = {f"{node}/{cable.ifname(node)}": cable.name
                   for cable in fabric.links for node in (cable.lower, cable.upper) if node not in hosts}
        cabling.update({f"{host}/{name}": fabric.nic_link(host, f"nic{r}").name
                        for host in fabric.hosts for r in range(fabric.spec.rails)
                        for name in (f"nic{r}", *aliases(r))})
        out: dict[str, list[Route]] = {}
        for src in fabric.hosts:
            for dst in (h for h in fabric.hosts if h != src):
                for nic in nics:
                    a, b = fabric.nic_link(src, nic).name, fabric.nic_link(dst, nic).name
                    there = [r for r in fabric.paths(src, dst) if r[0] == a and r[-1] == b]
                    back = [r for r in fabric.paths(dst, src) if r[0] == b and r[-1] == a]
                    out[path_id(src, nic, dst, nic, "forward")] = there
                    out[path_id(src, nic, dst, nic, "reverse")] = back
        return cls(out, cabling)

    def ports(self, link: str) -> list[str]:
        """Every port the map cables to ``link`` (``leaf0r0/spine0``, ``h0/nic0``...), sorted: `link_of` reversed."""
        return sorted(port for port, cabled in self._nics.items() if cabled == link)


class RouteFile:
    """A `RouteMap` from a JSON file, re-read when the file changes (routes move after a reroute).

    A bad file at start raises ValueError; a bad rewrite later is logged and the last good map kept.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._mtime = self._stat()
        self._map = RouteMap.load(self.path)

    def _stat(self) -> int:
        try:
            return self.path.stat().st_mtime_ns
        except OSError:
            return -1

    def __call__(self) -> RouteMap:
        """The current map."""
        mtime = self._stat()
        if mtime not in (-1, self._mtime):
            try:
                self._map, self._mtime = RouteMap.load(self.path), mtime
            except ValueError as exc:  # half-written or wrong: keep the map we have
                log.warning("fabric map: %s; keeping the last good map", exc)
        return self._map
