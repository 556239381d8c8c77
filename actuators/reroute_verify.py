"""Verifying a central reroute: the routes read back, then the agents' probes since the apply (pure but for the store).

After ``apply`` the ``reroute`` plugin checks each changed (host, peer) pair twice:

1. **Routes** (`route_problems`, fast): the agent's ``route.get`` shows our route and the NICs the
   kernel now sends the peer's traffic out of (``lookup``); none may be one the plan avoids.
2. **Probes** (`ProbeVerifier`, from the store): the agents' prober sends coded pairs from each
   NIC's own address to the peer's NIC on the same rail (``ridethrough.probe.*``, attributes
   ``probe.src.node``/``.nic`` → ``probe.dst.node``/``.nic``), so a probe path *is* the rail a
   flow leaving that NIC takes. For every NIC the pair's traffic now leaves by, the probes over
   that rail between the two hosts (the host's own, and the peer's towards that NIC, whose
   reverse direction is the same packets) must:

   * still get through: at least ``min_probes`` probes judged (answered, late or lost; a probe the
     prober could not judge, its peer silent on every rail, is lost unless either host says its
     probe threads stalled, ``ridethrough.probe.stalled``, and then counts neither way) *since the
     apply*, from ``settle_s`` after it: a probe sent before it over the old route is declared
     lost a timeout later, and its direction settled up to two probe intervals after that, so its
     loss reaches the store seconds after the change. Their loss must not be significantly above
     the same rail's loss *before the fault* (the ``baseline_s`` before the plan's ``baseline_until_ns``,
     where the rail's prober ran as it runs now: a loaded host's noise included) plus
     ``loss_margin``: a one-sided binomial test at ``loss_alpha`` of the loss since the apply
     against that rate. A rail with too few probes in its baseline is held to ``max_loss_ratio``
     instead. Neither prober may report the path suspended (it stops probing a path that loses
     ten in a row, and retries it slowly). Counters are read as increases between points newer
     than the apply instant, so nothing sent before the change counts;
   * not cross the bad link: the fabric map's routes for those probe paths (path ids as the
     tomography reads them, ``h0/nic0->h2/nic0:forward``) avoid it. Probes follow the NIC, not
     the /32 the plan rewrote, so this is the path the moved traffic shares with them.

The route's devices name the rails: the probe source must know a NIC by the same name (``probe_bind``
or the peer table), as the plan already assumes. A pair without enough judged probes is waited
for, polling until shortly before the deadline: no decision is taken on a handful of probes.
Then, with no rail failed, the verify is *undecided*: the routes read back right and no probe
showed them wrong, so the action stays in place as ``unverified`` (as it does when the store
cannot be read), rather than being rolled back on no evidence. Loss significantly above the
baseline, a suspended path and a path over the link fail at once: waiting would not change them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ridethrough.actuators.commands import parse_hops
from ridethrough.actuators.contract import Deadline, Result
from ridethrough.actuators.reroute_plan import HostChange
from ridethrough.detectors import sql
from ridethrough.detectors.contract import Query, Window
from ridethrough.detectors.fabric_map import RouteMap, path_id
from ridethrough.exporters.store import StoreError, StoreUnavailable

_FUTURE_NS = 5_000_000_000
"""Rows stamped up to this far past the controller's clock still count (an agent's clock runs a little ahead)."""
SENT, RECEIVED, LOST = "ridethrough.probe.sent", "ridethrough.probe.received", "ridethrough.probe.lost"
UNKNOWN = "ridethrough.probe.unknown"
SUSPENDED = "ridethrough.probe.path.suspended"
_COUNTERS = ((SENT, sql.PROBE_PATH), (RECEIVED, sql.PROBE_PATH), (UNKNOWN, sql.PROBE_PATH),
             (LOST, (*sql.PROBE_PATH, "probe.direction")))
_ON = {"1", "true", "yes", "on"}
_OFF = {"0", "false", "no", "off"}


@dataclass(frozen=True, slots=True)
class ProbeVerifyConfig:
    """How the probes judge a reroute (see the module docstring)."""

    enabled: bool = True
    """Off: the route readback alone decides (as without a store)."""
    max_loss_ratio: float = 0.05
    """The loss a rail is held to when its own baseline has fewer than ``min_probes`` probes."""
    loss_margin: float = 0.02
    """How far above its baseline loss a rail's loss since the apply may be before the test can fail it."""
    loss_alpha: float = 0.01
    """A rail fails when its loss since the apply would be this unlikely were its true loss its baseline plus
    ``loss_margin``: a handful of probes cannot tell 6 % from 3 %."""
    min_probes: int = 20
    """Judged probes since the apply a rail needs before it is judged either way."""
    baseline_s: float = 120.0
    """How much of the rail's history before the fault its baseline loss is read from."""
    fault_lead_s: float = 60.0
    """How long before its incident opened a fault may have begun (the detectors' longest window): the baseline
    ends that long before the incident."""
    poll_s: float = 1.0
    """Between reads of the store while evidence is missing."""
    margin_s: float = 1.0
    """The verify answers this long before its deadline (the runner would otherwise call it timed out)."""
    settle_s: float = 5.0
    """Probes counted only from this long after the apply: a probe sent just before it over the old route reaches
    the store as lost up to the agents' probe timeout plus two probe intervals plus a collection later (3 s at
    their defaults), and would be blamed on the new one."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_loss_ratio < 1.0 or not 0.0 <= self.loss_margin < 1.0:
            raise ValueError(f"reroute probe verify: max_loss_ratio {self.max_loss_ratio} and loss_margin "
                             f"{self.loss_margin} must be in [0, 1)")
        if self.baseline_s <= 0:
            raise ValueError("reroute probe verify: baseline_s must be positive")
        if not 0.0 < self.loss_alpha < 0.5:
            raise ValueError(f"reroute probe verify: loss_alpha {self.loss_alpha} must be in (0, 0.5)")
        if self.min_probes < 1 or self.poll_s <= 0 or self.margin_s < 0 or self.settle_s < 0:
            raise ValueError("reroute probe verify: min_probes must be >= 1, poll_s > 0, margin_s and settle_s >= 0")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> ProbeVerifyConfig:
        """``RIDETHROUGH_REROUTE_PROBE_VERIFY`` (true/false), ``..._PROBE_MAX_LOSS_RATIO``, ``..._PROBE_MIN_PROBES``;
        a bad value is a ValueError naming the variable."""
        out: dict[str, Any] = {}
        raw = environ.get("RIDETHROUGH_REROUTE_PROBE_VERIFY", "").strip().lower()
        if raw:
            if raw not in _ON | _OFF:
                raise ValueError(f"RIDETHROUGH_REROUTE_PROBE_VERIFY={raw!r}: expected true or false")
            out["enabled"] = raw in _ON
        for var, name, kind in (("RIDETHROUGH_REROUTE_PROBE_MAX_LOSS_RATIO", "max_loss_ratio", float),
                                ("RIDETHROUGH_REROUTE_PROBE_MIN_PROBES", "min_probes", int)):
            if environ.get(var, "").strip():
                try:
                    out[name] = kind(environ[var])
                except ValueError:
                    raise ValueError(f"{var}={environ[var]!r}: expected a{'n integer' if kind is int else ' number'}"
                                     ) from None
        return cls(**out)


def route_problems(c: HostChange, data: Mapping[str, Any]) -> list[str]:
    """What is wrong with one route as ``route.get`` read it back (empty: right)."""
    ours = [str(data.get("dev", "")), *(d for d, _ in parse_hops(str(data.get("more", ""))))]
    used, where = used_nics(data), f"{c.host} -> {c.peer}"
    if not data.get("present"):
        return [f"{where}: the route is gone"]
    if set(ours) & set(c.avoid):
        return [f"{where}: the route leaves through {', '.join(sorted(set(ours) & set(c.avoid)))}"]
    if not used:
        return [f"{where}: no path left"]
    if set(used) & set(c.avoid):
        return [f"{where}: traffic still leaves through {', '.join(sorted(set(used) & set(c.avoid)))}"]
    return []


def used_nics(data: Mapping[str, Any]) -> tuple[str, ...]:
    """The NICs the kernel sends the destination's traffic out of now, from a ``route.get`` reply."""
    return tuple(sorted({d for d in str(data.get("lookup", "")).split(",") if d}))


@dataclass(frozen=True, slots=True)
class PairRails:
    """One changed pair: ``host`` now sends ``peer``'s traffic out of ``nics``."""

    host: str
    peer: str
    nics: tuple[str, ...]


@dataclass(slots=True)
class _Evidence:
    """The probes over one rail of one pair since the apply."""

    sent: float = 0.0
    received: float = 0.0
    lost: float = 0.0
    unknown: float = 0.0
    suspended: bool = False
    """A prober's latest word since the apply: it gave up on the path (its probes go unanswered)."""
    paths: list[str] = field(default_factory=list)
    """The probe paths seen, as path ids in the pair's direction (host → peer)."""

    def add(self, metric: str, increase: float, pid: str) -> None:
        """Fold in one counter series' increase (a lost series per direction: both are round-trip losses)."""
        if metric == SENT:
            self.sent += increase
        elif metric == RECEIVED:
            self.received += increase
        elif metric == UNKNOWN:
            self.unknown += increase
        else:
            self.lost += increase
        self.saw(pid)

    @property
    def judged(self) -> float:
        """Probes answered (in time or late) or lost."""
        return self.received + self.lost

    def saw(self, pid: str) -> None:
        """Note a probe path that speaks for this rail."""
        if pid not in self.paths:
            self.paths.append(pid)


@dataclass(frozen=True, slots=True)
class Verdict:
    """One read of the store: what failed for good, what still waits for probes, and the totals."""

    failed: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    settled: int = 0
    lost: int = 0
    unknown: int = 0


class ProbeVerifier:
    """Judges a reroute from the probe metrics in the store (see the module docstring)."""

    def __init__(self, query: Query, *, config: ProbeVerifyConfig | None = None,
                 clock: Callable[[], int] = time.time_ns, sleep: Callable[[float], None] = time.sleep) -> None:
        """``query``: a read-only `Window.query` over the store the gateway writes; ``clock``: wall-clock ns, the
        time base of the rows' ``TimeUnix``."""
        self.config = config or ProbeVerifyConfig()
        self._query = query
        self._clock = clock
        self._sleep = sleep

    def verify(self, *, link: str, pairs: Sequence[PairRails], routes: RouteMap, since_ns: int, cluster: str,
               deadline: Deadline, baseline_until_ns: int = 0) -> Result:
        """Poll the store until every pair is confirmed, one fails for good, or the deadline (less the margin).

        ``baseline_until_ns``: the end of the rails' history before the fault (0: none; ``max_loss_ratio`` then).
        """
        started, verdict, error = time.monotonic(), Verdict(), ""
        baseline: dict[tuple[str, str, str], _Evidence] | None = None
        while True:
            try:
                if baseline is None:
                    baseline = self.baseline(pairs, baseline_until_ns, cluster)
                verdict, error = self.judge(link=link, pairs=pairs, routes=routes, since_ns=since_ns,
                                            cluster=cluster, baseline=baseline), ""
            except (StoreUnavailable, StoreError) as exc:  # the store may come back before the deadline
                error = str(exc)
            if not error and (verdict.failed or not verdict.waiting):
                break
            left = deadline.remaining_s() - self.config.margin_s
            if left <= 0:
                break
            self._sleep(min(self.config.poll_s, left))
        timing = {"probes_s": time.monotonic() - started}
        if error:
            return Result.undecided(f"probes: cannot read the store: {error}", **timing)
        if verdict.failed:
            problems = (*verdict.failed, *verdict.waiting)
            return Result.failure(f"probes: {len(problems)} of {_rails(pairs)} pair rails not confirmed: "
                                  f"{_listed(problems)}", **timing)
        if verdict.waiting:
            return Result.undecided(f"probes: {len(verdict.waiting)} of {_rails(pairs)} pair rails had too few "
                                    f"judged probes by the deadline, none showed loss: {_listed(verdict.waiting)}",
                                    **timing)
        return Result.success(f"probes since the apply confirm all {len(pairs)} pairs: {verdict.settled} probes "
                              f"judged over the rails they use, {verdict.lost} lost ({verdict.unknown} not judged: "
                              f"a peer stalled), none of those rails crosses {link}", **timing)

    def baseline(self, pairs: Sequence[PairRails], until_ns: int,
                 cluster: str) -> dict[tuple[str, str, str], _Evidence]:
        """Each pair rail's probes over the ``baseline_s`` before ``until_ns`` (none when ``until_ns`` is 0)."""
        if not until_ns:
            return {}
        return self._evidence(pairs, until_ns - round(self.config.baseline_s * 1e9), cluster, end_ns=until_ns)

    def judge(self, *, link: str, pairs: Sequence[PairRails], routes: RouteMap, since_ns: int,
              cluster: str, baseline: Mapping[tuple[str, str, str], _Evidence] | None = None) -> Verdict:
        """One read: each pair rail confirmed, failed or still waiting for probes."""
        evidence = self._evidence(pairs, since_ns, cluster)
        cfg = self.config
        failed: list[str] = []
        waiting: list[str] = []
        settled = lost = unknown = 0
        for p in pairs:
            for nic in p.nics:
                ev = evidence.get((p.host, p.peer, nic), _Evidence())
                allowed, against = self._allowed((baseline or {}).get((p.host, p.peer, nic)))
                where = f"{p.host} -> {p.peer} over {nic}"
                crossing = [pid for pid in ev.paths if _crosses(routes, pid, link)]
                unmapped = [pid for pid in ev.paths if not routes.routes(pid)]
                done = ev.judged
                if crossing:
                    failed.append(f"{where}: its probes cross {link} ({', '.join(crossing[:2])})")
                elif unmapped:
                    failed.append(f"{where}: the fabric map has no route for {', '.join(unmapped[:2])}; cannot tell "
                                  f"whether it crosses {link}")
                elif ev.suspended:
                    failed.append(f"{where}: its probes go unanswered (the prober suspended the path since the "
                                  "apply)")
                elif done >= cfg.min_probes and too_lossy(ev.lost, done, allowed, cfg.loss_alpha):
                    failed.append(f"{where}: {ev.lost / done:.0%} of {done:.0f} probes lost since the apply, "
                                  f"against {against}")
                elif done < cfg.min_probes:
                    waiting.append(f"{where}: {_missing(ev, cfg.min_probes)}")
                settled, lost, unknown = settled + int(done), lost + int(ev.lost), unknown + int(ev.unknown)
        return Verdict(tuple(failed), tuple(waiting), settled, lost, unknown)

    def _allowed(self, base: _Evidence | None) -> tuple[float, str]:
        """The loss a rail is tested against (its baseline plus the margin) and how a human reads it."""
        cfg = self.config
        if base is None or base.judged < cfg.min_probes:
            return cfg.max_loss_ratio, f"{cfg.max_loss_ratio:.0%} (too few probes before the fault to go by)"
        rate = (base.lost + 0.5) / (base.judged + 1.0)  # a baseline of none lost is not a promise of none
        return (min(0.99, rate + cfg.loss_margin),
                f"{base.lost:.0f} of {base.judged:.0f} lost before the fault, +{cfg.loss_margin:.0%}")

    def _evidence(self, pairs: Sequence[PairRails], since_ns: int, cluster: str,
                  end_ns: int = 0) -> dict[tuple[str, str, str], _Evidence]:
        """(host, peer, host's NIC) → the probes over that rail from ``since_ns`` (to ``end_ns``, or now), both
        hosts' probers'."""
        nodes = sorted({p.host for p in pairs} | {p.peer for p in pairs})
        window = Window(start_ns=since_ns, end_ns=end_ns or self._clock() + _FUTURE_NS, query=self._query,
                        cluster=cluster)
        match = {"probe.src.node": nodes, "probe.dst.node": nodes}
        wanted = {(p.host, p.peer, nic) for p in pairs for nic in p.nics}
        out: dict[tuple[str, str, str], _Evidence] = {}
        for metric, attrs in _COUNTERS:
            for row in sql.counter_series(window, metric, attrs, match=match):
                for key, pid in _rails_of(row):
                    if key in wanted:
                        out.setdefault(key, _Evidence()).add(metric, float(row["increase"]), pid)
        for row in sql.gauge_series(window, SUSPENDED, sql.PROBE_PATH, match=match):
            for key, pid in _rails_of(row):
                if key in wanted:
                    ev = out.setdefault(key, _Evidence())
                    ev.suspended |= row["latest"] == 1.0
                    ev.saw(pid)
        stalled = sql.stalled_nodes(window)
        for (host, peer, _), ev in out.items():
            if not {host, peer} & stalled:  # silence on every rail while neither end was held off: the paths'
                ev.lost, ev.unknown = ev.lost + ev.unknown, 0.0
        return out


def _rails_of(row: Mapping[str, Any]) -> Iterable[tuple[tuple[str, str, str], str]]:
    """The pair rails a probe series speaks for, each with the path id of the pair's direction: the prober's own
    (its forward direction) and the peer's towards the prober's NIC (the reverse direction of the peer's path)."""
    src, nic, dst, dnic = (str(row[a]) for a in sql.PROBE_PATH)
    yield (src, dst, nic), path_id(src, nic, dst, dnic, "forward")
    yield (dst, src, dnic), path_id(src, nic, dst, dnic, "reverse")


def too_lossy(lost: float, settled: float, ratio: float, alpha: float) -> bool:
    """Whether ``lost`` of ``settled`` probes is significantly more than ``ratio`` would lose: the chance of
    losing that many or more, were each lost with probability ``ratio``, is below ``alpha`` (binomial tail)."""
    n, k = round(settled), round(lost)
    if k <= ratio * n:
        return False
    if ratio == 0.0:
        return k > 0
    # P(X >= k) for X ~ Binomial(n, ratio), summed in log space (n may be thousands of probes)
    log_p, log_q, log_n = math.log(ratio), math.log1p(-ratio), math.lgamma(n + 1)
    tail = sum(math.exp(log_n - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q)
               for i in range(k, n + 1))
    return tail < alpha


def _crosses(routes: RouteMap, pid: str, link: str) -> bool:
    return any(link in route for route in routes.routes(pid))


def _missing(ev: _Evidence, need: int) -> str:
    if not ev.paths:
        return "no probe data since the apply"
    stalled = f" ({ev.unknown:.0f} unanswered while a host's probe threads stalled)" if ev.unknown else ""
    if ev.sent and not ev.judged:
        return f"{ev.sent:.0f} probes sent since the apply, none judged yet{stalled}"
    return f"only {ev.judged:.0f} probes judged since the apply (needs {need}){stalled}"


def _listed(problems: Sequence[str]) -> str:
    return f"{'; '.join(problems[:5])}{' ...' if len(problems) > 5 else ''}"


def _rails(pairs: Sequence[PairRails]) -> int:
    return sum(len(p.nics) for p in pairs)
