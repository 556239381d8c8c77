"""Which hosts must stop sending which traffic out of which NIC, so that no path crosses a bad link.

A host cannot pick the spine (the leaf hashes) but it picks the NIC for every destination. So
for a bad link ``L`` the fabric map (`ridethrough.detectors.fabric_map.RouteMap`) says, for
every probed direction ``src/nic->dst/nic:forward``, the routes its packets may take: if any of
them crosses ``L``, ``src`` must send to ``dst`` out of its other NICs. A spine link costs the
hosts on either side of it the whole rail between their racks (the leaf could hash any flow
onto the bad spine); a host link costs its host that NIC, and every other host that rail
towards it. Same-rack traffic on a spine link's rail is untouched.

The last-path rule: when some pair would be left without a NIC, nothing is planned at all, and
`plan_avoid` says which pair and why (a partial reroute would hide the problem it cannot fix).
`AddressFile` (the one part that reads a file) gives the hosts' stable addresses.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ridethrough.detectors.fabric_map import RouteMap, parse_path_id, path_id

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, order=True)
class HostChange:
    """On ``host`` (a host, or a leaf switch for a drain): send traffic for ``destination`` (a host's /32, or
    the prefix behind the leaf ``peer``) out of ``keep`` only, never out of ``avoid``."""

    host: str
    peer: str
    destination: str
    avoid: tuple[str, ...]
    keep: tuple[str, ...]

    def to_json(self) -> list[object]:
        """The change as a JSON list (`Plan.params` hold strings only)."""
        return [self.host, self.peer, self.destination, list(self.avoid), list(self.keep)]

    @classmethod
    def from_json(cls, doc: Sequence[object]) -> HostChange:
        """The change `to_json` wrote; ValueError if it is not one."""
        if len(doc) != 5 or not all(isinstance(x, str) for x in doc[:3]) or \
                not all(isinstance(x, list) and all(isinstance(n, str) for n in x) for x in doc[3:]):
            raise ValueError(f"not a host change: {doc!r}")
        host, peer, dest, avoid, keep = doc
        return cls(str(host), str(peer), str(dest), tuple(avoid), tuple(keep))  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class AvoidPlan:
    """The changes that take every path off ``link``, the path ids they remove, or why there is no plan."""

    link: str
    changes: tuple[HostChange, ...] = ()
    removed_paths: frozenset[str] = frozenset()
    """The routes (`RouteMap.route_ids`) the changes take out of use."""
    refusal: str = ""
    """Non-empty: no plan (the last-path rule, or nothing known about the link)."""


class AddressFile:
    """Each host's stable address, ``{node: "ip"}`` from a JSON file, re-read when it changes (the last good one
    kept)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._seen: tuple[int, dict[str, str]] = (-1, {})

    def __call__(self) -> dict[str, str]:
        try:
            mtime = Path(self.path).stat().st_mtime_ns
            if mtime != self._seen[0]:
                doc = json.loads(Path(self.path).read_text())
                if not isinstance(doc, dict) or not all(isinstance(v, str) for v in doc.values()):
                    raise ValueError('expected JSON {"node": "ip"}')
                self._seen = (mtime, dict(doc))
        except (OSError, ValueError) as exc:
            log.warning("reroute: stable addresses %s: %s", self.path, exc)
        return self._seen[1]


def encode_changes(changes: Sequence[HostChange]) -> str:
    """Changes as one JSON string, for `Plan.params`."""
    return json.dumps([c.to_json() for c in changes], separators=(",", ":"))


def decode_changes(text: str) -> tuple[HostChange, ...]:
    """Changes `encode_changes` wrote; ValueError if the text is not that."""
    doc = json.loads(text)
    if not isinstance(doc, list):
        raise ValueError("changes: expected a JSON list")
    return tuple(HostChange.from_json(c) for c in doc)


def by_host(changes: Sequence[HostChange]) -> dict[str, list[HostChange]]:
    """The changes grouped by the host that makes them, in their order."""
    out: dict[str, list[HostChange]] = {}
    for c in changes:
        out.setdefault(c.host, []).append(c)
    return out


def describe(changes: Sequence[HostChange]) -> tuple[str, ...]:
    """One plan step per host, sorted: ``on h0: route h2, h3 off nic1``."""
    return tuple(f"on {host}: route {', '.join(dict.fromkeys(c.peer for c in group))} off "
                 f"{', '.join(sorted({n for c in group for n in c.avoid}))}"
                 for host, group in sorted(by_host(changes).items()))


def plan_avoid(fmap: RouteMap, link: str, addresses: Mapping[str, str]) -> AvoidPlan:
    """The host route changes that keep every known path off ``link`` (see the module docstring).

    ``addresses``: each host's stable address (the /32 its peers route to it).
    """
    nics: dict[tuple[str, str], set[str]] = {}  # (src, dst) -> NICs src can send to dst from
    bad: dict[tuple[str, str], set[str]] = {}
    removed: set[str] = set()
    for pid in fmap.path_ids():
        src, nic, dst, dnic, direction = parse_path_id(pid)  # the map holds path ids only
        if direction != "forward":
            continue
        pair = (src, dst)
        nics.setdefault(pair, set()).add(nic)
        if any(link in route for route in fmap.routes(pid)):
            bad.setdefault(pair, set()).add(nic)
            # every route of the path and of the same packets seen from the other end's probe: a host that
            # moves a pair off a NIC loses all of that path's routes, not only those over the link
            for gone in (pid, path_id(dst, dnic, src, nic, "reverse")):
                removed.update(fmap.route_ids(gone))
    if not bad:
        return AvoidPlan(link, refusal=f"no known path crosses {link}: nothing to move")
    changes: list[HostChange] = []
    for (src, dst), avoid in sorted(bad.items()):
        keep = nics[(src, dst)] - avoid
        if not keep:
            return AvoidPlan(link, refusal=f"{src} reaches {dst} only over {link} (out of {', '.join(sorted(avoid))}):"
                                           " routing around it would remove the last path; nothing planned")
        if dst not in addresses:
            return AvoidPlan(link, refusal=f"the stable address of {dst} is unknown; cannot route {src}'s traffic "
                                           f"to it off {link}")
        changes.append(HostChange(src, dst, f"{addresses[dst]}/32", tuple(sorted(avoid)), tuple(sorted(keep))))
    return AvoidPlan(link, tuple(changes), frozenset(removed))
