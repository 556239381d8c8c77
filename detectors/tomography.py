"""Localisation by network tomography: the links that explain the probe paths that lose packets.

Every agent probes paths (its NIC → a peer's NIC) and reports, per path, probes sent and lost
by direction (``ridethrough.probe.*``). The metrics name the path's ends, not the links
between them, so the detector is given a `RouteMap`: for each direction of each probed path,
the routes its packets may take (ordered link names, ``h3-leaf1r0``, ``leaf1r0-spine1``). One
route is an exact path (walked in the fabric); several are ECMP members the map cannot tell
apart (`RouteMap.from_fabric`, the design: a cross-rack path may use any spine).

Each direction of each path in the window is an `Observation`: *bad* (loss at or above
``loss_bad_ratio``), *good* (loss at most ``loss_good_ratio``) or neither (too few probes,
loss in between). A path with no reply at all (suspended, or forward loss above
``down_ratio``) is one bad observation over both directions' routes: with no reply the prober
cannot tell which way its probes died. `localise` then runs a greedy set cover (see there).

Congestion is not breakage. Delay alone never makes a path bad here; and a lossy path whose
RTT sits well above its own baseline (a queue filling up and dropping: the signature of
congestion, `ridethrough.detectors.congestion`) is left out of the vote, neither bad nor good.
Only a path dying altogether (``down_ratio``) is bad whatever its delay.

Links the paths cannot tell apart (with two leaves per rail, every path over one leaf's spine
uplink crosses the other's) are told apart by the switches' port counters, as an operator
would: a failing optic shows as receive errors at the ports of its cable (`untie`). Without
such counters the finding names the first of the ``candidates`` (listed in the evidence),
confidence split between them.

Limits: a host whose agent dies looks like all of its links cut (AgentSilent says which it
is).
"""

from __future__ import annotations

import logging
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from ridethrough.detectors import sql
from ridethrough.detectors.contract import Detector, EntityType, Finding, FindingKind, Severity, Window
from ridethrough.detectors.fabric_map import Route, RouteFile, RouteMap, path_id
from ridethrough.detectors.tomography_ties import port_errors, untie

log = logging.getLogger(__name__)

EVIDENCE_MAX = 50
"""Most path ids listed in one finding's evidence (the counts are always complete)."""


@dataclass(frozen=True, slots=True)
class Observation:
    """One direction of one path over the window: the routes its packets may take, its verdict, its loss."""

    path: str
    routes: tuple[Route, ...]
    bad: bool
    loss: float = 0.0


@dataclass(frozen=True, slots=True)
class Blame:
    """A link `localise` chose, with the bad paths it explains and the good paths that cross it."""

    link: str
    explained: tuple[str, ...]
    contradicting: tuple[str, ...]
    votes: float
    """Explained bad paths, each weighted by the share of its routes that cross the link."""
    candidates: tuple[str, ...]
    """Every link the data cannot tell apart from ``link`` (itself included)."""
    confidence: float
    port_errors: Mapping[str, float] = field(default_factory=dict)
    """Per candidate, its ports' error increase, when those counters chose ``link`` among them (`untie`)."""


def _weights(obs: Observation) -> dict[str, float]:
    """Per link, the share of the observation's routes that cross it (1: certainly crossed)."""
    counts = Counter(link for route in obs.routes for link in set(route))
    return {link: n / len(obs.routes) for link, n in counts.items()}


def localise(observations: Iterable[Observation], *, min_paths: float = 2.0, min_share: float = 0.6) -> list[Blame]:
    """Greedy set cover: the fewest links that explain the bad observations.

    Repeatedly pick the link with the highest ``votes - against``: ``votes`` sums, over the bad
    observations not yet explained, the share of each one's routes that cross the link;
    ``against`` counts the good observations that certainly cross it (on every route: a good
    path that may have gone another way clears nothing). A link is eligible with ``votes >=
    min_paths`` (one stray bad path blames nothing) and ``votes / (votes + against) >=
    min_share`` (a link that many good paths cross is cleared). Its bad observations are then
    explained; stop when all are, or no link is eligible. Confidence is that share, divided
    among the links with the same score and the same explained paths (``candidates``).
    """
    obs = list(observations)
    bad = {o.path: _weights(o) for o in obs if o.bad and o.routes}
    crossers = good_crossers(obs)
    unexplained = set(bad)
    out: list[Blame] = []
    while unexplained and (blame := _pick({p: bad[p] for p in unexplained}, crossers, min_paths, min_share)):
        out.append(blame)
        unexplained -= set(blame.explained)
    return out


def good_crossers(observations: Iterable[Observation]) -> dict[str, list[str]]:
    """Per link, the good observations that certainly cross it (on every route they may take)."""
    crossers: dict[str, list[str]] = defaultdict(list)
    for o in observations:
        if not o.bad and o.routes:
            for link, w in _weights(o).items():
                if w == 1.0:
                    crossers[link].append(o.path)
    return crossers


def _pick(bad: Mapping[str, Mapping[str, float]], crossers: Mapping[str, list[str]], min_paths: float,
          min_share: float) -> Blame | None:
    """The best eligible link for the ``bad`` observations left (`localise`), or None."""
    scores: dict[str, tuple[float, float]] = {}
    explains: dict[str, tuple[str, ...]] = {}
    for link in sorted({link for weights in bad.values() for link in weights}):
        votes = sum(weights.get(link, 0.0) for weights in bad.values())
        against = len(crossers.get(link, ()))
        if votes >= min_paths and votes / (votes + against) >= min_share:
            scores[link] = (votes - against, votes)
            explains[link] = tuple(sorted(p for p, weights in bad.items() if link in weights))
    if not scores:
        return None
    best = max(scores, key=lambda link: scores[link])  # the first in name order among equals
    ties = tuple(link for link in scores if scores[link] == scores[best] and explains[link] == explains[best])
    votes = scores[best][1]
    contradicting = tuple(sorted(crossers.get(best, ())))
    share = votes / (votes + len(contradicting))
    return Blame(best, explains[best], contradicting, votes, ties, share / len(ties))


class Tomography:
    """Links that explain the lossy probe paths (see the module docstring).

    The defaults sit above healthy noise measured in the lab under heavy CPU load (probers and
    responders starved, not links): per direction over 60 s, p99 loss 3.4 %, at most 5.8 %, on
    a few scattered paths; a bad link takes down or makes lossy every path it carries (on a
    host link 12 or more directions, on a leaf-spine link half the cross-rack ones, each at
    weight 1/2 under the design map), so ``loss_bad_ratio`` 5 % and ``min_paths`` 4 leave the
    noise out and real faults in.

    A lossy direction is bad only when new losses showed in at least ``min_loss_rises``
    collections of the window (one burst, such as a peer that was not answering yet at start,
    is neither bad nor good), the last of them within ``recent_s`` of its newest point, and
    fewer probes through since then than its loss ratio makes likely (at 19 % loss, 22 probes in a
    row get through with probability ``healed_alpha``, 1 %): a link that came back up has stopped
    losing, whatever the window still holds. Nor is one whose every loss came by the end of its
    path's last suspension, probed since: that was an outage (reported as down while it lasted). A path whose
    last ``dead_s`` seconds, or newest collection, lost at least ``down_ratio`` of at least
    ``min_recent_probes`` probes is dead now, whatever its older history (a cut seconds ago is a link down, not a
    link losing a share of its packets). Paths to a node whose own prober has reported nothing
    for ``quiet_s`` while others did are left out altogether: a frozen host takes every path to
    it down, which is not a link's doing (AgentSilent reports it). So are paths to and from a node
    that came back within the window (its prober quiet for over ``quiet_s``, or first heard over
    ``quiet_s`` after the earliest one): the window still holds the losses of its absence.

    Queries: ``probe_loss`` (per path, probes sent and lost by direction, suspended) and
    ``probe_rtt_shift`` (per path, the p50 RTT of the last ``recent_s`` against the rest of
    the window: a queue when at least half the recent points exceed ``queue_factor`` times the
    baseline and ``queue_margin_s`` more). A direction needs ``min_probes`` probes to count.

    Ties (`untie`): `port_errors`, one query over the candidates' ports (`RouteMap.ports`), the
    increase of `PORT_ERROR_COUNTERS` per port; a link is chosen with ``tie_min_errors`` errors and
    the others at most ``tie_max_share`` of that. A failed read leaves the tie as it is.
    """

    name = "tomography"

    def __init__(self, *, routes: RouteMap | Callable[[], RouteMap], interval_s: float = 10.0,
                 window_s: float = 60.0, loss_bad_ratio: float = 0.05, loss_good_ratio: float = 0.002,
                 down_ratio: float = 0.9, min_probes: int = 20, min_paths: float = 4.0, min_share: float = 0.6,
                 recent_s: float = 20.0, queue_factor: float = 1.5, queue_margin_s: float = 50e-6,
                 min_loss_rises: int = 3, dead_s: float = 3.0, min_recent_probes: int = 3,
                 quiet_s: float = 10.0, tie_min_errors: float = 10.0, tie_max_share: float = 0.1,
                 healed_alpha: float = 0.01) -> None:
        if not 0 <= loss_good_ratio < loss_bad_ratio <= down_ratio <= 1:
            raise ValueError("tomography: expected 0 <= loss_good_ratio < loss_bad_ratio <= down_ratio <= 1")
        if tie_min_errors <= 0 or not 0 <= tie_max_share < 1:
            raise ValueError("tomography: expected tie_min_errors > 0 and 0 <= tie_max_share < 1")
        self._routes: Callable[[], RouteMap]
        if isinstance(routes, RouteMap):
            fixed = routes
            self._routes = lambda: fixed
        else:
            self._routes = routes
        self.interval_s = interval_s
        self.window_s = window_s
        self.loss_bad_ratio, self.loss_good_ratio, self.down_ratio = loss_bad_ratio, loss_good_ratio, down_ratio
        self.min_probes, self.min_paths, self.min_share = min_probes, min_paths, min_share
        self.recent_s, self.queue_factor, self.queue_margin_s = recent_s, queue_factor, queue_margin_s
        self.min_loss_rises, self.dead_s, self.min_recent_probes = min_loss_rises, dead_s, min_recent_probes
        self.quiet_s, self.healed_alpha = quiet_s, healed_alpha
        self.tie_min_errors, self.tie_max_share = tie_min_errors, tie_max_share

    def detect(self, window: Window) -> list[Finding]:
        """One finding per link the set cover chose."""
        routes = self._routes()
        queued = self._queued(window)
        observations: list[Observation] = []
        last_ns: dict[str, int] = {}
        loss_by_path = sql.probe_loss(window, recent_s=self.dead_s)
        # Nodes whose own prober reported within quiet_s of the freshest one (relative, so that a store
        # that lags behind every agent alike silences no one): a path to a node that went quiet dies with
        # the node, not with a link (AgentSilent tells that case), so it is no evidence about links.
        newest = max((int(st["last_ns"]) for st in loss_by_path.values()), default=0)
        alive = {key[0] for key, st in loss_by_path.items() if int(st["last_ns"]) >= newest - self.quiet_s * 1e9}
        alive -= self._returned(window)
        for key, stats in loss_by_path.items():
            if key[0] not in alive or key[2] not in alive:
                continue
            for o in self._observe(key, stats, routes, key in queued):
                observations.append(o)
                last_ns[o.path] = int(stats["last_ns"])
        loss = {o.path: o.loss for o in observations}
        blames = localise(observations, min_paths=self.min_paths, min_share=self.min_share)
        errors = port_errors(routes, {c for b in blames if len(b.candidates) > 1 for c in b.candidates}, window)
        if errors:
            crossers = good_crossers(observations)
            blames = [untie(b, errors, crossers, min_errors=self.tie_min_errors, max_share=self.tie_max_share)
                      for b in blames]
        return [self._finding(b, loss, last_ns, window) for b in blames]

    def _returned(self, window: Window) -> set[str]:
        """Nodes whose prober went quiet for over ``quiet_s`` within the window, or began reporting over ``quiet_s``
        after the earliest one did: a host back from a freeze (or a reboot). Its peers' probes to it were lost while
        it was away, and its paths stay suspended until retried: the window holds the host's absence, not a link's."""
        presence = sql.prober_presence(window)
        earliest = min((first for first, _ in presence.values()), default=0)
        quiet_ns = self.quiet_s * 1e9
        return {node for node, (first, gap) in presence.items() if first - earliest > quiet_ns or gap > quiet_ns}

    def _queued(self, window: Window) -> set[sql.PathKey]:
        rows = sql.gauge_shift(window, "ridethrough.probe.rtt", sql.PROBE_PATH,
                               split_ns=window.end_ns - round(self.recent_s * 1e9), factor=self.queue_factor,
                               margin=self.queue_margin_s, match={"probe.quantile": ["p50"]})
        return {(r["probe.src.node"], r["probe.src.nic"], r["probe.dst.node"], r["probe.dst.nic"]) for r in rows
                if r["base_n"] and r["recent_n"] and 2 * r["above"] >= r["recent_n"]}

    def _observe(self, key: sql.PathKey, stats: Mapping[str, float], routes: RouteMap,
                 queued: bool) -> list[Observation]:
        fwd, rev = path_id(*key, "forward"), path_id(*key, "reverse")
        sent, lost_fwd = stats["sent"], stats["lost_forward"]
        recent, lost_recent = stats.get("sent_recent", 0.0), stats.get("lost_forward_recent", 0.0)
        last, lost_last = stats.get("sent_last", 0.0), stats.get("lost_forward_last", 0.0)
        # dead over the last dead_s, or over the newest collection alone (collections come seconds apart
        # on a loaded host, and the first one after a cut already says it)
        dead_now = ((recent >= self.min_recent_probes and lost_recent >= self.down_ratio * recent)
                    or (last >= self.min_recent_probes and lost_last >= self.down_ratio * last))
        if stats["suspended"] or dead_now or (sent >= self.min_probes and lost_fwd >= self.down_ratio * sent):
            # No reply comes back, so the prober cannot tell which way its probes died: either route may hold the fault.
            either = routes.routes(fwd) + routes.routes(rev)
            return [Observation(path_id(*key, "both"), either, True, 1.0)] if either else []
        out: list[Observation] = []
        healed_before = int(stats["last_ns"]) - round(self.recent_s * 1e9)
        fwd_ratio = min(1.0, lost_fwd / sent) if sent else 0.0
        for pid, n, lost, way in ((fwd, sent, lost_fwd, "forward"), (rev, sent - lost_fwd, stats["lost_reverse"],
                                                                      "reverse")):
            # reverse loss is out of the probes that reached the peer: the others never had a way back
            if n < self.min_probes or not routes.routes(pid):
                continue
            ratio = min(1.0, lost / n)
            if way == "reverse" and ratio <= self.loss_good_ratio < fwd_ratio:
                # A reverse that lost nothing of what got through is no alibi when the forward lost: a link that
                # goes down for a while (a flap) loses probes both ways, but only probes sent while it was up
                # reach the peer to be answered, so the reverse looks clean. It crosses the forward's host
                # links too (links have no direction), and would clear the very link at fault.
                continue
            rises, last_loss_ns = stats.get(f"loss_rises_{way}", math.inf), stats.get(f"loss_last_ns_{way}", math.inf)
            if ratio >= self.loss_bad_ratio and (rises < self.min_loss_rises or last_loss_ns < healed_before
                                                 or self._stopped(stats, ratio, way)
                                                 or self._outage_over(stats, last_loss_ns)):
                continue  # one burst (a peer starting), or loss that stopped (a link back up): neither bad nor good
            if ratio >= self.loss_bad_ratio and not queued:
                out.append(Observation(pid, routes.routes(pid), True, ratio))
            elif ratio <= self.loss_good_ratio:
                out.append(Observation(pid, routes.routes(pid), False, ratio))
        return out

    def _outage_over(self, stats: Mapping[str, float], last_loss_ns: float) -> bool:
        """Whether every loss came by the end of the path's last suspension and it has been probed since: the
        losses were an outage (a cut, reported as down while it lasted), not a link that is losing a share now."""
        over = stats.get("suspended_last_ns", 0)
        return not stats["suspended"] and over > 0 and last_loss_ns <= over + self.dead_s * 1e9

    def _stopped(self, stats: Mapping[str, float], ratio: float, way: str) -> bool:
        """Whether so many probes got through since the direction's last loss that, were it still losing ``ratio``,
        some would have died (a geometric test at ``healed_alpha``): a link back up after a cut, whose losses the
        window still holds."""
        since = stats.get(f"sent_since_loss_{way}", 0.0)
        return since > 0 and (1.0 - ratio) ** since < self.healed_alpha

    def _finding(self, b: Blame, loss: Mapping[str, float], last_ns: Mapping[str, int], window: Window) -> Finding:
        losses = sorted(loss[p] for p in b.explained)
        median = losses[len(losses) // 2]
        # A cut is seen path by path (each prober learns it at its next collection): once a third of the
        # paths it explains are dead, the link is down, not losing a share of its packets.
        dead = sum(1 for p in b.explained if loss[p] >= self.down_ratio)
        down = median >= self.down_ratio or 3 * dead >= len(b.explained)
        others = [c for c in b.candidates if c != b.link]
        tie = (f"; its ports counted {b.port_errors[b.link]:g} error(s), {', '.join(others)} next to none"
               if b.port_errors else f"; the data cannot tell it from {', '.join(others)}")
        summary = (f"{b.link} {'down' if down else 'losing packets'}: explains {len(b.explained)} bad path(s) "
                   f"(median loss {median:.1%}); {len(b.contradicting)} good path(s) cross it"
                   + (tie if others else ""))
        return Finding(
            detector=self.name, kind=FindingKind.LINK_DOWN if down else FindingKind.LINK_DEGRADING,
            entity_type=EntityType.LINK, entity=b.link, severity=Severity.CRITICAL if down else Severity.WARNING,
            confidence=b.confidence, summary=summary, observed_at_ns=max(last_ns[p] for p in b.explained),
            cluster=window.cluster,
            evidence={"query": "probe_loss", "explained": len(b.explained), "contradicting": len(b.contradicting),
                      "votes": b.votes, "median_loss": median, "candidates": list(b.candidates),
                      "bad_paths": {p: loss[p] for p in b.explained[:EVIDENCE_MAX]},
                      "good_paths": list(b.contradicting[:EVIDENCE_MAX]),
                      **({"port_errors": dict(b.port_errors)} if b.port_errors else {})},
        )


def build(cfg: object) -> list[Detector]:
    """The tomography detector when ``cfg.fabric_map_file`` names a route map; none without one."""
    path: str = getattr(cfg, "fabric_map_file", "")
    if not path:
        log.info("tomography: no fabric_map_file configured; links are not localised from probe paths")
        return []
    return [Tomography(routes=RouteFile(path),
                       interval_s=getattr(cfg, "tomography_interval_s", 10.0),
                       window_s=getattr(cfg, "tomography_window_s", 60.0),
                       loss_bad_ratio=getattr(cfg, "tomography_loss_bad_ratio", 0.05),
                       loss_good_ratio=getattr(cfg, "tomography_loss_good_ratio", 0.002),
                       down_ratio=getattr(cfg, "tomography_down_ratio", 0.9),
                       min_probes=getattr(cfg, "tomography_min_probes", 20),
                       min_paths=getattr(cfg, "tomography_min_paths", 4.0),
                       min_share=getattr(cfg, "tomography_min_share", 0.6),
                       min_loss_rises=getattr(cfg, "tomography_min_loss_rises", 3),
                       dead_s=getattr(cfg, "tomography_dead_s", 3.0),
                       tie_min_errors=getattr(cfg, "tomography_tie_min_errors", 10.0),
                       tie_max_share=getattr(cfg, "tomography_tie_max_share", 0.1))]
