"""Telling apart links the probe paths cannot: by the counters at their ports (used by `tomography` and
`congestion`).

With two leaves per rail every path over one leaf's spine uplink crosses the other's, so the set
cover ties them. An operator looks at the switches' port counters: a failing optic shows as
receive errors at the ports of its own cable (`port_errors`), a congested egress as transmit wait
at its port (`port_counts` of ``ridethrough.ib.port.xmit_wait``). Those are read for the tied links
(one query, summed in the store), and `untie` names the one link that counted when the others
counted next to none.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from ridethrough.detectors import sql
from ridethrough.detectors.contract import Window
from ridethrough.detectors.fabric_map import RouteMap

if TYPE_CHECKING:
    from ridethrough.detectors.tomography import Blame

log = logging.getLogger("ridethrough.detectors.tomography")
PORT_ERROR_COUNTERS = ("port_rcv_errors", "symbol_error")
"""``ridethrough.ib.port.errors`` counters that say a cable corrupts what it carries (read at either end)."""


def untie(blame: Blame, errors: Mapping[str, float], crossers: Mapping[str, Sequence[str]], *,
          min_errors: float = 10.0, max_share: float = 0.1) -> Blame:
    """``blame`` named by the one candidate whose ports counted errors; ``blame`` itself otherwise.

    ``errors`` holds, per link, the increase of its ports' error counters over the window. A
    candidate is chosen when it counted at least ``min_errors`` and every other at most
    ``max_share`` of that (errors on both, or on none, leave the tie as it is). The candidates
    explain the same paths with the same score, so the chosen one keeps the votes; its own good
    ``crossers`` contradict it, and its confidence is no longer split.
    """
    if len(blame.candidates) < 2:
        return blame
    counts = {c: errors.get(c, 0.0) for c in blame.candidates}
    leader = max(blame.candidates, key=lambda c: counts[c])
    top = counts[leader]
    if top < min_errors or any(counts[c] > max_share * top for c in blame.candidates if c != leader):
        return blame
    contradicting = tuple(sorted(crossers.get(leader, ())))
    return dataclasses.replace(blame, link=leader, contradicting=contradicting, port_errors=counts,
                               confidence=blame.votes / (blame.votes + len(contradicting)))


def port_errors(routes: RouteMap, links: Iterable[str], window: Window) -> dict[str, float]:
    """Per link, the error increase its ports counted in the window; empty when no link has a port
    in the map, or the store failed."""
    return port_counts(routes, links, window, metric="ridethrough.ib.port.errors", counters=PORT_ERROR_COUNTERS)


def port_counts(routes: RouteMap, links: Iterable[str], window: Window, *, metric: str,
                counters: Sequence[str] = ()) -> dict[str, float]:
    """Per link, the increase of ``metric`` at its ports in the window (only the ``ib.counter`` values in
    ``counters``, if given), summed in the store; empty when no link has a port in the map, or the store failed."""
    port_link = {port: link for link in links for port in routes.ports(link)}
    if not port_link:
        return {}
    match = {"ib.device": sorted({port.partition("/")[2] for port in port_link})}
    attrs: tuple[str, ...] = ("ib.device", "ib.port")
    if counters:
        match["ib.counter"] = list(counters)
        attrs += ("ib.counter",)
    try:
        rows = sql.counter_series(window, metric, attrs, match=match)
    except Exception:  # the counters only break ties: a failed read must not lose the finding
        log.warning("reading %s at the tied links' ports failed; ties stay as they are", metric, exc_info=True)
        return {}
    out: dict[str, float] = defaultdict(float)
    for row in rows:  # one row per port and counter, summed in the store; other nodes' ports of that name drop
        link = port_link.get(f"{row['node']}/{row['ib.device']}")
        if link is not None:
            out[link] += float(row["increase"])
    return out

