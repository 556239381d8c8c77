"""Congested paths named by the link whose queue explains them (used by `congestion`).

A queue sits on one egress, and every path through it queues: the same set cover as the
tomography's (`tomography.localise`) over the fabric map's routes finds the fewest links that
explain the congested directions, with the directions that stayed flat clearing the links they
certainly cross. Where the paths cannot tell two links apart (two leaves per rail), the one whose
ports counted transmit wait (``ridethrough.ib.port.xmit_wait``, a congested egress's counter) is
named (`tomography_ties.untie`). Directions too few for the cover go to the one link on their routes
whose ports counted transmit wait, if there is exactly one. Each such link becomes one ``congestion``
finding on the link, listing the paths it explains; a congested path no link explains stays a
finding of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from ridethrough.detectors.contract import EntityType, Finding, Window
from ridethrough.detectors.fabric_map import RouteMap
from ridethrough.detectors.tomography import Blame, Observation, good_crossers, localise
from ridethrough.detectors.tomography_ties import port_counts, untie

XMIT_WAIT = "ridethrough.ib.port.xmit_wait"
EVIDENCE_MAX = 50


@dataclasses.dataclass(frozen=True, slots=True)
class LinkCover:
    """How congested paths are folded into links: the set cover's and the tie-break's thresholds."""

    min_paths: float = 2.0
    """Congested directions (weighted by the share of their routes over the link) a link must explain."""
    min_share: float = 0.6
    tie_min_wait: float = 10.0
    """Transmit wait one tied link's ports must count to be named alone (the others at most ``tie_max_share``)."""
    tie_max_share: float = 0.1


def to_links(found: Sequence[Finding], flat: Sequence[str], routes: RouteMap, window: Window,
             cover: LinkCover | None = None) -> list[Finding]:
    """``found`` (path findings, each with its direction's path id in ``evidence["path"]``) folded into link
    findings where a link explains them; ``flat``: path ids of directions with enough data and no queue."""
    cover = cover or LinkCover()
    by_path = {str(f.evidence["path"]): f for f in found if routes.routes(str(f.evidence.get("path", "")))}
    observations = [Observation(pid, routes.routes(pid), True, float(f.evidence["excess_s"]))
                    for pid, f in by_path.items()]
    observations += [Observation(pid, routes.routes(pid), False, 0.0) for pid in flat if routes.routes(pid)]
    blames = localise(observations, min_paths=cover.min_paths, min_share=cover.min_share)
    tied = {c for b in blames if len(b.candidates) > 1 for c in b.candidates}
    if tied:
        waits = port_counts(routes, tied, window, metric=XMIT_WAIT)
        crossers = good_crossers(observations)
        blames = [untie(b, waits, crossers, min_errors=cover.tie_min_wait, max_share=cover.tie_max_share)
                  for b in blames]
    explained = {p for b in blames for p in b.explained}
    blames += _by_port_wait([p for p in by_path if p not in explained], routes, window, cover)
    explained = {p for b in blames for p in b.explained}
    out = [_link_finding(b, by_path, window) for b in blames]
    return out + [f for f in found if str(f.evidence.get("path", "")) not in explained]


def _by_port_wait(paths: Sequence[str], routes: RouteMap, window: Window, cover: LinkCover) -> list[Blame]:
    """Congested directions too few for the set cover, each given to the one link on its routes whose ports
    counted transmit wait (at least ``tie_min_wait``): the queue the probes crossed, seen at its port."""
    if not paths:
        return []
    links = {pid: {link for route in routes.routes(pid) for link in route} for pid in paths}
    waits = port_counts(routes, set().union(*links.values()), window, metric=XMIT_WAIT)
    by_link: dict[str, list[str]] = {}
    for pid in paths:
        waiting = [link for link in links[pid] if waits.get(link, 0.0) >= cover.tie_min_wait]
        if len(waiting) == 1:  # two waiting links on its routes: the probes cannot say which queue they met
            by_link.setdefault(waiting[0], []).append(pid)
    return [Blame(link, tuple(sorted(pids)), (), float(len(pids)), (link,), 1.0, {link: waits[link]})
            for link, pids in sorted(by_link.items())]


def _link_finding(b: Blame, by_path: Mapping[str, Finding], window: Window) -> Finding:
    paths = [by_path[p] for p in b.explained]
    worst = max(paths, key=lambda f: float(f.evidence["excess_s"]))
    others = [c for c in b.candidates if c != b.link]
    waited = f"; its ports waited {b.port_errors[b.link]:g} times to send" if b.port_errors else ""
    tie = (f"{waited}, {', '.join(others)} next to none" if waited and others
           else waited or (f"; the paths cannot tell it from {', '.join(others)}" if others else ""))
    return Finding(
        detector=worst.detector, kind=worst.kind, entity_type=EntityType.LINK, entity=b.link,
        severity=worst.severity, confidence=b.confidence,
        summary=f"{b.link} queueing: {len(paths)} path direction(s) through it queue (one-way delay up to "
                f"+{float(worst.evidence['excess_s']) * 1e6:.0f} µs), their reverse flat, no loss{tie}",
        observed_at_ns=max(f.observed_at_ns for f in paths), cluster=window.cluster,
        evidence={"query": "probe_owd_shift", "explained": len(paths), "contradicting": len(b.contradicting),
                  "candidates": list(b.candidates), "paths": [f.entity for f in paths[:EVIDENCE_MAX]],
                  "excess_s": {f.entity: f.evidence["excess_s"] for f in paths[:EVIDENCE_MAX]},
                  **({"port_xmit_wait": dict(b.port_errors)} if b.port_errors else {})},
    )
