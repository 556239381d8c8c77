"""The leaf switches a drain can steer: what lives behind each leaf, and which port each uplink is.

A leaf picks the spine for every packet it sends up (ECMP over its uplinks), so it can keep a
bad leaf-spine link out of every route by routing the prefixes behind the *other* leaves away
from one uplink port. To plan that the controller needs, per leaf, the prefixes it serves (on a
real fabric, what it announces in BGP: its rack's addresses) and the interface name of each of
its uplinks (from LLDP or the cabling records); in the lab `ridethrough.lab.supervisor` writes it
from the topology. JSON::

    {"leaf0r0": {"prefixes": ["10.200.0.0/24", "10.64.0.0/24"],
                 "ports": {"leaf0r0-spine0": "spine0", "leaf0r0-spine1": "spine1"}}}

`SwitchFile` re-reads the file when it changes and keeps the last good map when a rewrite is bad.
"""

from __future__ import annotations

import ipaddress
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ridethrough.actuators.commands import check_dev

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Leaf:
    """One leaf: the prefixes behind it, and its uplinks (link name → interface name on the leaf)."""

    prefixes: tuple[str, ...]
    ports: Mapping[str, str]


class SwitchMap:
    """Leaf name → `Leaf` (see the module docstring); `parse` checks every field."""

    def __init__(self, leaves: Mapping[str, Leaf]) -> None:
        self.leaves = dict(leaves)
        self._by_link = {link: name for name, leaf in self.leaves.items() for link in leaf.ports}

    def leaf_of(self, link: str) -> str | None:
        """The leaf one of whose uplinks ``link`` is (None: not a leaf uplink the map knows)."""
        return self._by_link.get(link)

    def end_leaf(self, link: str) -> str | None:
        """The leaf at one end of ``link`` (a host link ``h0-leaf0r0`` or an uplink), if the map knows one."""
        if link in self._by_link:
            return self._by_link[link]
        return next((end for end in link.split("-") if end in self.leaves), None)

    @classmethod
    def parse(cls, data: object) -> SwitchMap:
        """A map from its JSON form; ValueError naming the leaf and field that are wrong."""
        if not isinstance(data, Mapping):
            raise ValueError('switch map: expected {"LEAF": {"prefixes": [CIDR, ...], "ports": {LINK: IFNAME}}}')
        leaves: dict[str, Leaf] = {}
        for name, doc in data.items():
            if not isinstance(name, str) or not name or not isinstance(doc, Mapping) or \
                    set(doc) != {"prefixes", "ports"}:
                raise ValueError(f"switch map: leaf {name!r}: expected exactly the keys prefixes and ports")
            prefixes, ports = doc["prefixes"], doc["ports"]
            if not isinstance(prefixes, list) or not prefixes or not all(isinstance(p, str) for p in prefixes):
                raise ValueError(f"switch map: leaf {name}: prefixes must be a non-empty list of CIDR prefixes")
            for p in prefixes:
                try:
                    ipaddress.ip_network(p, strict=True)
                except ValueError as exc:
                    raise ValueError(f"switch map: leaf {name}: prefix {p!r}: {exc}") from None
            if not isinstance(ports, Mapping) or not ports or not all(
                    isinstance(k, str) and k and isinstance(v, str) for k, v in ports.items()):
                raise ValueError(f"switch map: leaf {name}: ports must map each uplink's link name to an interface")
            for link, ifname in ports.items():
                try:
                    check_dev(ifname)
                except ValueError as exc:
                    raise ValueError(f"switch map: leaf {name}: port of {link}: {exc}") from None
            leaves[name] = Leaf(tuple(prefixes), dict(ports))
        return cls(leaves)

    @classmethod
    def load(cls, path: str | Path) -> SwitchMap:
        """Read a JSON switch map; ValueError naming the file."""
        try:
            return cls.parse(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as exc:
            raise ValueError(f"switch map file {path}: {exc}") from None


class SwitchFile:
    """A `SwitchMap` from a JSON file, re-read when it changes; None until a good one was read."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._seen: tuple[int, SwitchMap | None] = (-1, None)

    def __call__(self) -> SwitchMap | None:
        """The current map (the last good one if the file went bad; None if there never was one)."""
        try:
            mtime = self.path.stat().st_mtime_ns
            if mtime != self._seen[0]:
                self._seen = (mtime, SwitchMap.load(self.path))
        except (OSError, ValueError) as exc:
            log.warning("reroute: %s; %s", exc, "keeping the last good switch map" if self._seen[1] else
                        "no switch drains until it is readable")
        return self._seen[1]
