"""Drain a bad leaf-spine link at the leaves: which leaf routes which prefixes off which uplink (pure).

Hosts cannot pick the spine, but the leaf a packet enters the fabric through (its *ingress* leaf)
does: it hashes every packet bound for another rack over its uplinks. So for a bad link between
leaf ``L`` and spine ``S``, every route of the fabric map that crosses it is one of:

* up through it: the route enters the fabric at ``L`` and leaves ``L`` towards ``S``;
* down through it: it enters at another leaf ``I``, goes up to ``S`` and comes down to ``L``.

Either way the ingress leaf ``I`` (the leaf of the route's first link) took the uplink of the
route's second link, and routing the prefixes behind the route's egress leaf (that of its last
link) away from that uplink at ``I`` takes the route off the link. The pair keeps its rail and
the other spines: a drain costs one uplink of one rail between two racks where a host reroute
costs the whole rail. Same-rack traffic never crosses a spine link and is untouched.

The last-path rule holds here too: if ``I`` has no other uplink, nothing is planned and the
refusal says which leaf and why; the caller may then fall back to rerouting at the hosts.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from ridethrough.actuators.reroute_plan import HostChange
from ridethrough.actuators.reroute_verify import PairRails
from ridethrough.actuators.switch_map import SwitchMap
from ridethrough.detectors.fabric_map import RouteMap, parse_path_id


@dataclass(frozen=True, slots=True, order=True)
class Flow:
    """``host`` sends to ``peer`` out of ``nic``: one direction of a probe path, as the probe verify reads it."""

    host: str
    peer: str
    nic: str


@dataclass(frozen=True, slots=True)
class DrainPlan:
    """The leaf changes that take every route off ``link``, what they remove, the flows to check, or why not."""

    link: str
    changes: tuple[HostChange, ...] = ()
    removed_paths: frozenset[str] = frozenset()
    """The routes (`RouteMap.route_ids`) that stop being used: only those over the link."""
    flows: tuple[Flow, ...] = ()
    """Each probed direction whose routes crossed the link: after the drain its probes must get through."""
    refusal: str = ""


def plan_drain(fmap: RouteMap, link: str, switches: SwitchMap) -> DrainPlan:
    """The leaf route changes that keep every known route off the leaf-spine ``link`` (see the module docstring)."""
    if switches.leaf_of(link) is None:
        return DrainPlan(link, refusal=f"{link} is not a leaf uplink the switch map knows: no leaf can drain it")
    avoid: dict[tuple[str, str], set[str]] = {}  # (ingress leaf, egress leaf) -> uplinks to stop using
    removed: set[str] = set()
    flows: set[Flow] = set()
    for pid in fmap.path_ids():
        for rid, route in zip(fmap.route_ids(pid), fmap.routes(pid), strict=True):
            if link not in route:
                continue
            ingress, egress = switches.end_leaf(route[0]), switches.end_leaf(route[-1])
            if ingress is None or egress is None or len(route) < 3 or \
                    route[1] not in switches.leaves[ingress].ports:
                return DrainPlan(link, refusal=f"route {' > '.join(route)} of {pid} does not go up through an uplink "
                                               "of a leaf the switch map knows; cannot drain at the leaves")
            avoid.setdefault((ingress, egress), set()).add(route[1])
            removed.add(rid)
            flows.add(_flow(pid))
    if not avoid:
        return DrainPlan(link, refusal=f"no known path crosses {link}: nothing to move")
    changes: list[HostChange] = []
    for (ingress, egress), uplinks in sorted(avoid.items()):
        ports = switches.leaves[ingress].ports
        off = tuple(sorted(ports[u] for u in uplinks))
        keep = tuple(sorted(set(ports.values()) - set(off)))
        if not keep:
            return DrainPlan(link, refusal=f"{ingress} reaches {egress} only over {', '.join(sorted(uplinks))}: "
                                           "draining it would remove the last path; nothing planned")
        changes += [HostChange(ingress, egress, prefix, off, keep) for prefix in switches.leaves[egress].prefixes]
    return DrainPlan(link, tuple(changes), frozenset(removed), tuple(sorted(flows)))


def _flow(pid: str) -> Flow:
    """The direction a path id's routes carry: forward is src → dst out of src's NIC, reverse dst → src."""
    src, nic, dst, dnic, direction = parse_path_id(pid)
    return Flow(src, dst, nic) if direction == "forward" else Flow(dst, src, dnic)


def encode_flows(flows: Sequence[Flow]) -> str:
    """Flows as one JSON string, for `Plan.params`."""
    return json.dumps([[f.host, f.peer, f.nic] for f in flows], separators=(",", ":"))


def decode_flows(text: str) -> tuple[Flow, ...]:
    """Flows `encode_flows` wrote; ValueError if the text is not that."""
    doc = json.loads(text)
    if not isinstance(doc, list) or not all(isinstance(f, list) and len(f) == 3 and all(isinstance(x, str) for x in f)
                                            for f in doc):
        raise ValueError("flows: expected a JSON list of [host, peer, nic]")
    return tuple(Flow(*f) for f in doc)


def flow_rails(flows: Sequence[Flow]) -> list[PairRails]:
    """Flows as the probe verify reads them: per (host, peer), the NICs it sends out of."""
    nics: dict[tuple[str, str], set[str]] = {}
    for f in flows:
        nics.setdefault((f.host, f.peer), set()).add(f.nic)
    return [PairRails(host, peer, tuple(sorted(n))) for (host, peer), n in sorted(nics.items())]
