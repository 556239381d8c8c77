"""The agent's reflex: move a peer's traffic off a rail that stopped working, within ~100 ms, alone.

A host cannot see a spine link (no carrier changes on its NICs) and cannot pick the spine (the
leaf hashes), but it picks the rail for every destination. So the reflex watches each rail to
each peer it talks to (`ridethrough.actuators.liveness`: echoes every 10 ms from 16 source
ports, so every spine behind the rail is exercised) and, when one goes down, writes a /32 route
for that peer's stable address through the remaining rails (`ridethrough.actuators.routes`:
one atomic replace, ``rto_min`` locked low). The peer's own reflex fixes the other direction.
When the rail has been healthy for the hold-down, the /32 goes and the base ECMP route carries
the traffic again. What it did is reported afterwards: an event (an OTel log record) and a
span, start at the first failed probe, end when the route was written. The rules are `decide`'s.

Which peers: with ``watch="active"`` those this host has established TCP connections to (their
stable address, from ``sock_diag``) or still holds an override for, plus a minute's linger;
with ``"all"`` every peer in the table. Peers and their NICs come from the probe peer table,
their stable addresses from the reflex peers file, JSON ``{node: "stable address"}``; both are
re-read when they change. Overrides left by an earlier run are adopted, not thrown away.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ridethrough.actuators.liveness import HealthSettings, Liveness, Outcome, PathHealth, Target
from ridethrough.actuators.routes import BaseRoute, HostRoutes, RouteError, RouteTable
from ridethrough.collector.probe_paths import PeerTable, load_peers, plan_paths
from ridethrough.collector.probe_wire import NODE_MAX_BYTES, check_name
from ridethrough.collector.sample import Event, EventSink, Sample
from ridethrough.collector.timestamps import HostTime

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from ridethrough.settings import AgentConfig

_log = logging.getLogger(__name__)
SCOPE = "ridethrough.reflex"
_CHECK_S = 0.05  # hold-down expiry and held decisions are looked at this often
_NICE = -10
Rails = frozenset[str]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReflexSettings:
    """How the reflex probes and acts (defaults: see `ridethrough.settings.AgentConfig`)."""

    interval_s: float = 0.01
    timeout_s: float = 0.03
    max_rate: float = 500.0
    flows: int = 16
    health: HealthSettings = field(default_factory=HealthSettings)
    rto_min_ms: int = 50
    watch: str = "active"
    linger_s: float = 60.0
    refresh_s: float = 1.0

    def __post_init__(self) -> None:
        if self.watch not in ("active", "all"):
            raise ValueError(f"watch must be 'active' or 'all', got {self.watch!r}")


def decide(current: Rails, paths: Mapping[str, PathHealth]) -> Rails | None:
    """The rails (local NICs) one peer's traffic should avoid now, or None to leave things as they are.

    ``current`` is what it avoids now; ``paths`` the verdict on each probed rail to the peer.

    * A rail stays avoided until it is up again (its hold-down passed); then it is given back.
    * A rail is newly avoided only while it is failing (a port's run of bad probes unbroken) and
      another rail is proven: clean (no port in a bad run) since before the failing rail's latest
      bad probe was sent, and answered a probe sent after it. That is, the two were probed at
      the same time and only one failed: a stall of this host or of the peer's agent silences
      every rail at once, so it moves nothing, and its blip is over (the run broken) after.
    * The proven rail is preferably one in use; if the only one is still in its hold-down, it is
      given back early: an emergency is no time to wait. Every rail is never avoided at once.
    """
    stay = frozenset(n for n in current if n in paths and not paths[n].up)
    new = frozenset(n for n, h in paths.items() if h.failing) - current
    want = stay
    if new:
        last_bad = min(paths[n].failing_last_s for n in new)
        proven = {n for n, h in paths.items()
                  if n not in new and h.clean and h.clean_since_s <= last_bad <= h.last_good_s}
        if proven - stay:
            want = stay | new
        elif proven:
            want = (stay - proven) | new
    return None if want == current else want


def load_stable(path: str | Path) -> dict[str, str]:
    """Read the reflex peers file, ``{node: "stable IPv4 address"}``; ValueError naming the file and entry."""
    try:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError('expected {node: "stable address"}')
        out: dict[str, str] = {}
        for node, addr in data.items():
            check_name(str(node), NODE_MAX_BYTES, "node id")
            out[str(node)] = str(ipaddress.IPv4Address(str(addr)))
        return out
    except (OSError, ValueError) as exc:
        raise ValueError(f"reflex peers file {path}: {exc}") from None


class _File:
    """A file re-read when its mtime changes; keeps the last good contents when a read fails."""

    def __init__(self, path: str, load: Callable[[str], Any], empty: Any) -> None:
        self.path, self._load, self.value, self._mtime = path, load, empty, -1

    def refresh(self) -> bool:
        """True if the contents changed (never, without a path)."""
        if not self.path:
            return False
        try:
            mtime = Path(self.path).stat().st_mtime_ns
        except OSError:
            return False
        if mtime == self._mtime:
            return False
        try:
            self.value, self._mtime = self._load(self.path), mtime
        except ValueError as exc:  # half-written or wrong: keep what we have, say so once per change
            self._mtime = mtime
            _log.warning("reflex: %s", exc)
            return False
        return True


class Reflex:
    """Source ``reflex``: the reflex as a background part of the agent (see the module docstring)."""

    def __init__(self, *, node: str, settings: ReflexSettings, peers_file: str, stable_file: str, port: int,
                 host_time: HostTime | None = None, clock: Callable[[], int] = time.time_ns,
                 routes: RouteTable | None = None, tracer_provider: TracerProvider | None = None,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.node, self.settings = node, settings
        self._peers = _File(peers_file, lambda p: load_peers(p, default_port=port), {})
        self._stable = _File(stable_file, load_stable, {})
        self._time, self._clock, self._mono = host_time or HostTime(), clock, monotonic
        self.routes: RouteTable = routes or HostRoutes()
        self._provider = tracer_provider
        self._tracer = tracer_provider.get_tracer(SCOPE) if tracer_provider is not None else None
        self._emit: EventSink = lambda _: None
        self._live: Liveness | None = None
        self._health: dict[Target, PathHealth] = {}
        self.avoided: dict[str, Rails] = {}
        """Rails each peer's traffic avoids now (peers with an override)."""
        self._held: dict[str, Rails] = {}
        self._seen: dict[str, float] = {}
        self._ifname: dict[str, str] = {}
        self._adopted = False
        self._unsettled = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def name(self) -> str:
        """``reflex``."""
        return "reflex"

    @property
    def interval_s(self) -> float:
        """How often the agent calls `collect`."""
        return 1.0

    def collect(self, now_ns: int) -> list[Sample]:
        """Nothing yet: the reflex reports through events and spans."""
        return []

    def verdicts(self) -> dict[str, dict[str, bool]]:
        """Whether each watched rail (local NIC) to each peer is up now."""
        out: dict[str, dict[str, bool]] = {}
        for target, health in list(self._health.items()):
            out.setdefault(target.peer, {})[target.nic] = health.up
        return out

    def start(self, *, emit: EventSink) -> None:
        """Start probing and acting in a thread of its own."""
        if not (self._peers.path and self._stable.path):
            _log.warning("reflex: idle until probe_peers_file and reflex_peers_file are given")
        self._emit = emit
        self._thread = threading.Thread(target=self._run, name="rt-reflex", daemon=True)
        self._thread.start()

    def stop(self, *, timeout_s: float) -> None:
        """Stop the thread; overrides stay (a path that was bad is not trusted because the agent stopped)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._live is not None:
            self._live.close()
        self.routes.close()
        if self._provider is not None:
            self._provider.shutdown()

    # -- the loop --------------------------------------------------------------------------

    def _run(self) -> None:
        _name_thread(b"rt-reflex")
        try:  # it sleeps between probes, so a higher priority costs nothing but shortens its wake-ups
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _NICE)
        except OSError as exc:  # no CAP_SYS_NICE: run at the agent's priority
            _log.info("reflex: cannot raise the thread's priority (%s)", exc)
        next_refresh = next_check = 0.0
        while not self._stop.is_set():
            try:
                now = self._mono()
                if now >= next_refresh:
                    self._refresh(now)
                    next_refresh = now + self.settings.refresh_s
                if self._live is None:
                    self._stop.wait(self.settings.refresh_s)
                    continue
                changed = self._take(self._live.tick(now), now)
                if now >= next_check:  # hold-downs ending, and a look at everything now and then
                    for health in self._health.values():
                        health.tick(now)
                    changed, next_check = True, now + _CHECK_S
                if changed or self._unsettled:
                    self._act()
                wait = min(self._live.next_due_s(), next_check, next_refresh) - self._mono()
                if self._take(self._live.wait(max(0.0, min(wait, 0.1))), self._mono()) or self._unsettled:
                    self._act()
            except Exception:  # one bad turn must not end the reflex; pace the retries
                _log.exception("reflex: loop failed")
                self._stop.wait(0.5)

    def _take(self, outcomes: list[Outcome], now_s: float) -> bool:
        """Feed outcomes to the verdicts; re-probe a port that just failed; True if a path became failing."""
        changed = False
        for o in outcomes:
            health = self._health.get(o.target)
            if health is None:
                continue
            if health.observe(o):
                changed = True
                _log.info("reflex: %s to %s failing: port %d, %d bad in a row (%s)", o.target.nic, o.target.peer,
                          o.flow, health.settings.losses, "lost" if o.rtt_ns is None else f"{o.rtt_ns / 1e6:.1f} ms")
            bad = o.rtt_ns is None or o.rtt_ns > health.settings.delay_s * 1e9
            if bad and health.suspect(o.flow) and self._live is not None:
                self._live.probe(o.target, o.flow, now_s)  # same port, same spine: confirm it now
        return changed

    # -- deciding and acting ---------------------------------------------------------------

    def _act(self) -> None:
        """Bring every peer's route in line with its verdicts (what `decide` allows now)."""
        by_peer: dict[str, dict[str, PathHealth]] = {}
        for target, health in self._health.items():
            by_peer.setdefault(target.peer, {})[target.nic] = health
        unsettled = False
        for peer, paths in by_peer.items():
            current = self.avoided.get(peer, frozenset())
            want = decide(current, paths)
            if want is not None and self._held.get(peer) != want:
                self._apply(peer, want, paths)
            # a rail is failing but its peer's traffic still uses it: look again at the next outcome,
            # which may be the alternative's first answer since the failure began
            unsettled = unsettled or (want is None and any(h.failing and n not in current for n, h in paths.items()))
        self._unsettled = unsettled

    def _apply(self, peer: str, want: Rails, paths: Mapping[str, PathHealth]) -> None:
        address = self._stable.value.get(peer)
        if address is None:
            return
        started = self._mono()
        base = self.routes.base_route(address)
        if base is None or self.routes.foreign(address):
            self._hold(peer, want, "no base route covers it" if base is None else "a /32 that is not ours is there")
            return
        # Only traffic that leaves by the rails it probes is the reflex's to steer: a route by any other
        # interface (a management port, the default route of a host whose rails share an address) is not.
        off_rail = sorted({nh.ifname for nh in base.nexthops} - set(self._ifname.values()))
        if off_rail:
            self._hold(peer, want, f"its route leaves by {', '.join(off_rail)}, not by a probed rail")
            return
        hops = base.without(self._ifname.get(nic, nic) for nic in want)
        if not hops:
            self._hold(peer, want, "that would remove the last path")
            return
        error = None
        try:
            if want:
                self.routes.replace(address, base, hops, rto_min_ms=self.settings.rto_min_ms)
            else:
                self.routes.remove(address)
            self.avoided[peer] = want
            if not want:
                del self.avoided[peer]
            self._held.pop(peer, None)
        except RouteError as exc:
            error = str(exc)
        self._report(peer, address, want, paths, base, started, error)

    def _hold(self, peer: str, down: Rails, why: str) -> None:
        self._held[peer] = down  # not tried again until the wanted rails change
        body = f"{self.node}: traffic to {peer} stays where it is although {', '.join(sorted(down))} failed: {why}"
        _log.warning("%s", body)
        self._event("reflex.held", body, "WARN", {"reflex.peer": peer, "reflex.rails.avoided": ",".join(sorted(down))})

    def _report(self, peer: str, address: str, want: Rails, paths: Mapping[str, PathHealth], base: BaseRoute,
                started_s: float, error: str | None) -> None:
        """An event and a span for one route change: from the evidence's start to the route written."""
        now_ns, now_s = self._clock(), self._mono()
        if want:  # since the first failed probe of the run that took the rail down
            since = min((paths[n].failing_since_s for n in want if n in paths and paths[n].failing),
                        default=min((paths[n].down_since_s for n in want if n in paths), default=started_s))
            reason = ",".join(sorted({paths[n].reason for n in want if n in paths}))
        else:  # since the last failed probe: healthy from then on
            since = max((h.last_bad_seen_s for h in paths.values()), default=started_s)
            reason = "healthy"
        since = since if math.isfinite(since) else started_s
        used = sorted(nh.ifname for nh in base.without(self._ifname.get(n, n) for n in want))
        attrs: dict[str, str | float] = {
            "reflex.peer": peer, "reflex.peer.address": address, "reflex.rails.avoided": ",".join(sorted(want)),
            "reflex.rails.used": ",".join(used), "reflex.reason": reason,
            "reflex.evidence_ms": round((started_s - since) * 1e3, 1),
            "reflex.apply_ms": round((now_s - started_s) * 1e3, 2)}
        if error is not None:
            name, severity, body = "reflex.failed", "ERROR", f"{self.node}: could not reroute {peer}: {error}"
        elif want:
            name, severity = "reflex.reroute", "WARN"
            body = (f"{self.node}: traffic to {peer} ({address}) moved off {', '.join(sorted(want))} ({reason}, "
                    f"{attrs['reflex.evidence_ms']} ms after the first failed probe) onto {', '.join(used)}")
        else:
            name, severity = "reflex.return", "INFO"
            body = f"{self.node}: traffic to {peer} ({address}) back on {', '.join(used)}"
        _log.warning("%s", body)
        self._event(name, body, severity, {k: str(v) for k, v in attrs.items()})
        if self._tracer is not None:
            from opentelemetry.trace import Status, StatusCode

            span = self._tracer.start_span(name, start_time=now_ns - round((now_s - since) * 1e9), attributes=attrs)
            span.set_status(Status(StatusCode.ERROR, error) if error else Status(StatusCode.OK))
            span.end(end_time=now_ns)

    def _event(self, name: str, body: str, severity: str, attrs: dict[str, str]) -> None:
        try:
            self._emit(Event(name, body, self._clock(), severity, attrs))
        except Exception:  # the sink's failure must not undo or repeat the route change
            _log.exception("reflex: cannot report %s", name)

    # -- peers, targets, files -------------------------------------------------------------

    def _refresh(self, now_s: float) -> None:
        self._stable.refresh()
        if self._peers.refresh() or self._live is None:
            self._restart_liveness()
        if self._live is None:
            return
        if not self._adopted:
            self._adopt()
        stable = self._stable.value
        if self.settings.watch == "active":
            by_address = {addr: peer for peer, addr in stable.items()}
            for address in self.routes.tcp_peers():
                if address in by_address:
                    self._seen[by_address[address]] = now_s
        linger = self.settings.linger_s
        watched = {p for p in stable if p != self.node and (self.settings.watch == "all" or p in self.avoided
                                                              or now_s - self._seen.get(p, -math.inf) <= linger)}
        peers: PeerTable = self._peers.value
        targets = [Target(path.peer.node, path.local.nic, path.peer.nic, path.peer_addr)
                   for path in plan_paths(self.node, list(self._live.local), peers, sorted(watched & peers.keys()))]
        self._live.set_targets(targets)
        self._health = {t: self._health.get(t) or self._new_health(t, now_s) for t in targets}

    def _new_health(self, target: Target, now_s: float) -> PathHealth:
        health = PathHealth(self.settings.health)
        if target.nic in self.avoided.get(target.peer, ()):  # adopted: it earns its way back like any other
            health.hold(now_s, "adopted")
        return health

    def _restart_liveness(self) -> None:
        own = self._peers.value.get(self.node, {})
        local = {nic: addr for nic, (addr, _) in own.items()}
        if self._live is not None and self._live.local == local:
            return
        if self._live is not None:
            self._live.close()
            self._live = None
        if not local:
            return
        s = self.settings
        live = Liveness(node=self.node, local=local, flows=s.flows, interval_s=s.interval_s, timeout_s=s.timeout_s,
                        max_rate=s.max_rate, host_time=self._time, monotonic=self._mono)
        try:
            live.open()
        except OSError as exc:
            _log.warning("reflex: cannot bind probe sockets on %s: %s", local, exc)
            return
        self._ifname = {nic: self.routes.interface_of(addr) or nic for nic, addr in local.items()}
        self._live = live

    def _adopt(self) -> None:
        """Take over the overrides an earlier run left: they are returned when their rails prove healthy."""
        self._adopted = True
        by_address = {addr: peer for peer, addr in self._stable.value.items()}
        nic_of = {ifname: nic for nic, ifname in self._ifname.items()}
        for address, override in self.routes.overrides().items():
            base, peer = self.routes.base_route(address), by_address.get(address)
            if base is None or peer is None:
                continue
            used = {nh.ifname for nh in override.nexthops}
            avoided = frozenset(nic_of.get(nh.ifname, nh.ifname) for nh in base.nexthops if nh.ifname not in used)
            if avoided:
                self.avoided[peer] = avoided
                _log.info("reflex: adopted the override of %s (%s) avoiding %s", peer, address, sorted(avoided))


def _name_thread(name: bytes) -> None:
    """Give the calling thread an OS name (``top -H``, /proc/PID/task/TID/comm show it; CPU is counted by it)."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the name is cosmetic
        ctypes.CDLL(None).prctl(15, name[:15], 0, 0, 0)  # PR_SET_NAME


def from_config(cfg: AgentConfig, *, host_time: HostTime | None, clock: Callable[[], int],
                tracer_provider: TracerProvider | None) -> Reflex:
    """The reflex the agent's config asks for (``reflex_*`` fields, the probe peer table and port)."""
    health = HealthSettings(losses=cfg.reflex_losses, delay_s=cfg.reflex_delay_ms / 1e3,
                            holddown_s=cfg.reflex_holddown_s, holddown_max_s=cfg.reflex_holddown_max_s)
    settings = ReflexSettings(interval_s=cfg.reflex_interval_ms / 1e3, timeout_s=cfg.reflex_timeout_ms / 1e3,
                              max_rate=cfg.reflex_max_probes_per_s, flows=cfg.reflex_flows, health=health,
                              rto_min_ms=cfg.reflex_rto_min_ms, watch=cfg.reflex_watch)
    return Reflex(node=cfg.node_id, settings=settings, peers_file=cfg.probe_peers_file,
                  stable_file=cfg.reflex_peers_file, port=cfg.probe_port, host_time=host_time, clock=clock,
                  tracer_provider=tracer_provider)
