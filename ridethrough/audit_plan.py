"""The audit's load schedule: every link in turn (in rounds), then paths together, within a time budget.

* **Link rounds.** Each link is loaded on its own, both ways at once, from one end to the
  other. Links that share no node run in the same round (a node runs one endpoint per
  round), at most ``parallel`` per round; the busiest nodes are placed first, so the number
  of rounds stays near the largest node degree (a greedy edge colouring).
* **Path round.** Host-to-host flows, all at once, chosen so that together they cross every
  link they can (a greedy set cover over the routes the driver reports for each source port:
  ECMP picks by port, so the port pins the path).
* **Budget.** A round costs ``load_s`` plus a fixed overhead; with the phases' fixed costs,
  `fit` shortens the load (down to ``min_load_s``) and then drops whole rounds until the
  estimate fits. What is dropped is listed with the reason, never silently skipped.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

ROUND_OVERHEAD_S = 2.5
"""Starting the endpoints, the MTU probes, draining and collecting: per round, on a busy 2-core machine."""
AFTER_LOAD_S = 12.0
"""What the phases after the load need: error counters reaching the store, GPU checks, localisation."""
PathRoute = Callable[[str, str, int], tuple[str, ...] | None]
"""(source host, destination host, source port) → the links that flow crosses (None: no route)."""


@dataclass(frozen=True, slots=True)
class LinkEnds:
    """A link and its two end nodes."""

    name: str
    lower: str
    upper: str


@dataclass(frozen=True, slots=True)
class PathFlow:
    """A pinned host-to-host flow of the path round."""

    src: str
    dst: str
    sport: int
    links: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Schedule:
    """What the load phase will run, and what it leaves out."""

    rounds: tuple[tuple[LinkEnds, ...], ...]
    paths: tuple[PathFlow, ...]
    load_s: float
    estimated_s: float
    dropped: dict[str, str] = field(default_factory=dict)
    """Link (or ``paths``) → why it will not be loaded."""

    def covered(self) -> set[str]:
        """Every link some round or path loads."""
        return {lk.name for rnd in self.rounds for lk in rnd} | {x for p in self.paths for x in p.links}


def link_rounds(links: Sequence[LinkEnds], *, parallel: int) -> list[list[LinkEnds]]:
    """Rounds of node-disjoint links, at most ``parallel`` each; every link in exactly one round."""
    if parallel < 1:
        raise ValueError(f"parallel must be at least 1, got {parallel}")
    left = sorted(links, key=lambda lk: lk.name)
    rounds: list[list[LinkEnds]] = []
    while left:
        # the nodes with the most links still to load go first: they bound the number of rounds
        degree = Counter(n for lk in left for n in (lk.lower, lk.upper))
        left.sort(key=lambda lk: (-max(degree[lk.lower], degree[lk.upper]), -min(degree[lk.lower],
                                                                                  degree[lk.upper]), lk.name))
        busy: set[str] = set()
        rnd: list[LinkEnds] = []
        for lk in left:
            if len(rnd) < parallel and lk.lower not in busy and lk.upper not in busy:
                rnd.append(lk)
                busy |= {lk.lower, lk.upper}
        rounds.append(rnd)
        left = [lk for lk in left if lk not in rnd]
    return rounds


def path_cover(hosts: Sequence[str], links: Sequence[str], route: PathRoute, *, per_host: int = 2,
               tries: int = 64, first_port: int = 30100) -> tuple[list[PathFlow], set[str]]:
    """Flows that together cross as many of ``links`` as the routes allow; and the links none crosses.

    Each host sends at most ``per_host`` flows, first to the host half the list away (another
    rack, in the lab's numbering), then to the others; ``tries`` source ports per pair.
    """
    want = set(links)
    flows: list[PathFlow] = []
    sent: Counter[str] = Counter()
    n = len(hosts)
    for shift in [n // 2, *(s for s in range(1, n) if s != n // 2)] if n > 1 else []:
        for i, src in enumerate(hosts):
            dst = hosts[(i + shift) % n]
            for sport in range(first_port, first_port + tries):
                if not want or sent[src] >= per_host:
                    break
                links_crossed = route(src, dst, sport)
                if links_crossed and want & set(links_crossed):
                    flows.append(PathFlow(src, dst, sport, links_crossed))
                    sent[src] += 1
                    want -= set(links_crossed)
        if not want:
            break
    return flows, want


def fit(rounds: Sequence[Sequence[LinkEnds]], paths: Sequence[PathFlow], *, budget_s: float, load_s: float,
        min_load_s: float = 1.0) -> Schedule:
    """The rounds and paths that fit ``budget_s`` (what is left when the load starts): shorter loads first, then
    no path round, then fewer link rounds (the last ones first)."""
    def cost(n_rounds: int, with_paths: bool, seconds: float) -> float:
        return AFTER_LOAD_S + (n_rounds + int(with_paths)) * (seconds + ROUND_OVERHEAD_S)

    keep, with_paths, seconds = len(rounds), bool(paths), load_s
    if cost(keep, with_paths, seconds) > budget_s:
        spare = budget_s - AFTER_LOAD_S - (keep + int(with_paths)) * ROUND_OVERHEAD_S
        seconds = max(min_load_s, min(load_s, spare / max(1, keep + int(with_paths))))
    if cost(keep, with_paths, seconds) > budget_s and with_paths:
        with_paths = False
    while keep and cost(keep, with_paths, seconds) > budget_s:
        keep -= 1
    dropped = {lk.name: f"the {budget_s:g} s budget left no time for its round"
               for rnd in rounds[keep:] for lk in rnd}
    if paths and not with_paths:
        dropped["paths"] = f"the {budget_s:g} s budget left no time for the path round"
    return Schedule(tuple(tuple(r) for r in rounds[:keep]), tuple(paths) if with_paths else (), seconds,
                    cost(keep, with_paths, seconds), dropped)
