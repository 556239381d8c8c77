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

   * still get through: at least ``min_probes`` probes settled (answered or lost) *since the
     apply* (from ``settle_s`` after it: probes sent before it over the old route are still being
     declared lost), their loss not significantly above ``max_loss_ratio`` (a one-sided binomial
     test at ``loss_alpha``: one probe of 17 lost is noise on a busy host, 12 of 24 is not), and
     neither prober reporting the path
     suspended (it stops probing a path that loses ten in a row, and retries it slowly). Counters
     are read as increases between points newer than the apply instant, so nothing sent before
     the change counts;
   * not cross the bad link: the fabric map's routes for those probe paths (path ids as the
     tomography reads them, ``h0/nic0->h2/nic0:forward``) avoid it. Probes follow the NIC, not
     the /32 the plan rewrote, so this is the path the moved traffic shares with them.

The route's devices name the rails: the probe source must know a NIC by the same name (``probe_bind``
or the peer table), as the plan already assumes. A pair without enough fresh probes is waited
for, polling until shortly before the deadline; then the verify fails naming it ("no probe data
since the apply"), and the runner rolls back. Loss above the threshold, a suspended path and a
path over the link fail at once: waiting would not change them.
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
SUSPENDED = "ridethrough.probe.path.suspended"
_COUNTERS = ((SENT, sql.PROBE_PATH), (RECEIVED, sql.PROBE_PATH), (LOST, (*sql.PROBE_PATH, "probe.direction")))
_ON = {"1", "true", "yes", "on"}
_OFF = {"0", "false", "no", "off"}


@dataclass(frozen=True, slots=True)
class ProbeVerifyConfig:
    """How the probes judge a reroute (see the module docstring)."""

    enabled: bool = True
    """Off: the route readback alone decides (as without a store)."""
    max_loss_ratio: float = 0.05
    """Loss a rail the pair now uses may have, of the probes settled since the apply (judged by `loss_alpha`)."""
    loss_alpha: float = 0.01
    """A rail fails when its loss would be this unlikely were its true loss ``max_loss_ratio``: a healthy rail
    under a loaded prober loses a probe now and then, and a handful of probes cannot tell 6 % from 3 %."""
    min_probes: int = 4
    """Settled probes since the apply a rail needs before it is judged (two collections of a healthy prober)."""
    poll_s: float = 1.0
    """Between reads of the store while evidence is missing."""
    margin_s: float = 1.0
    """The verify answers this long before its deadline (the runner would otherwise call it timed out)."""
    settle_s: float = 2.0
    """Probes counted only from this long after the apply: a probe sent just before it over the old route is
    declared lost up to the prober's timeout (1 s) later, and would be blamed on the new one."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_loss_ratio < 1.0:
            raise ValueError(f"reroute probe verify: max_loss_ratio {self.max_loss_ratio} must be in [0, 1)")
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
        else:
            self.lost += increase
        self.saw(pid)

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
               deadline: Deadline) -> Result:
        """Poll the store until every pair is confirmed, one fails for good, or the deadline (less the margin)."""
        started, verdict, error = time.monotonic(), Verdict(), ""
        while True:
            try:
                verdict, error = self.judge(link=link, pairs=pairs, routes=routes, since_ns=since_ns,
                                            cluster=cluster), ""
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
            return Result.failure(f"probes: cannot read the store: {error}", **timing)
        problems = (*verdict.failed, *verdict.waiting)
        if problems:
            return Result.failure(f"probes: {len(problems)} of {_rails(pairs)} pair rails not confirmed: "
                                  f"{'; '.join(problems[:5])}{' ...' if len(problems) > 5 else ''}", **timing)
        return Result.success(f"probes since the apply confirm all {len(pairs)} pairs: {verdict.settled} probes "
                              f"settled over the rails they use, {verdict.lost} lost, none of those rails crosses "
                              f"{link}", **timing)

    def judge(self, *, link: str, pairs: Sequence[PairRails], routes: RouteMap, since_ns: int,
              cluster: str) -> Verdict:
        """One read: each pair rail confirmed, failed or still waiting for probes."""
        evidence = self._evidence(pairs, since_ns, cluster)
        failed: list[str] = []
        waiting: list[str] = []
        settled = lost = 0
        for p in pairs:
            for nic in p.nics:
                ev = evidence.get((p.host, p.peer, nic), _Evidence())
                where = f"{p.host} -> {p.peer} over {nic}"
                crossing = [pid for pid in ev.paths if _crosses(routes, pid, link)]
                unknown = [pid for pid in ev.paths if not routes.routes(pid)]
                done = ev.received + ev.lost
                if crossing:
                    failed.append(f"{where}: its probes cross {link} ({', '.join(crossing[:2])})")
                elif unknown:
                    failed.append(f"{where}: the fabric map has no route for {', '.join(unknown[:2])}; cannot tell "
                                  f"whether it crosses {link}")
                elif ev.suspended:
                    failed.append(f"{where}: its probes go unanswered (the prober suspended the path since the "
                                  "apply)")
                elif done >= self.config.min_probes and too_lossy(ev.lost, done, self.config.max_loss_ratio,
                                                                  self.config.loss_alpha):
                    failed.append(f"{where}: {ev.lost / done:.0%} of {done:.0f} probes lost since the apply")
                elif done < self.config.min_probes:
                    waiting.append(f"{where}: {_missing(ev, self.config.min_probes)}")
                settled, lost = settled + int(done), lost + int(ev.lost)
        return Verdict(tuple(failed), tuple(waiting), settled, lost)

    def _evidence(self, pairs: Sequence[PairRails], since_ns: int,
                  cluster: str) -> dict[tuple[str, str, str], _Evidence]:
        """(host, peer, host's NIC) → the probes over that rail since ``since_ns``, both hosts' probers'."""
        nodes = sorted({p.host for p in pairs} | {p.peer for p in pairs})
        window = Window(start_ns=since_ns, end_ns=self._clock() + _FUTURE_NS, query=self._query, cluster=cluster)
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
    if ev.sent and not ev.received + ev.lost:
        return f"{ev.sent:.0f} probes sent since the apply, none answered or lost yet"
    return f"only {ev.received + ev.lost:.0f} probes settled since the apply (needs {need})"


def _rails(pairs: Sequence[PairRails]) -> int:
    return sum(len(p.nics) for p in pairs)
