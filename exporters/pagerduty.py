"""PagerDuty: incident transitions become Events API v2 alerts, actions become change events.

    Controller ── emit(transitions) ─┐                     ┌─ token bucket per integration key
    actuators ─── change(action) ────┴─▶ outbox (SQLite) ◀─┴─ sender thread ── POST ──▶ PagerDuty
                                        one commit, fsync      202 sent · 400 rejected · 429/5xx/network:
                                                               retried with exponential backoff and jitter

Opened, escalated and reopened incidents trigger; resolved ones resolve every route they
triggered on (an escalation may have paged a second team). ``emit`` only writes the outbox,
so the controller never waits on PagerDuty; events of one route go out in the order queued.
See docs/pagerduty.md for the operator's view and `ridethrough.exporters.pagerduty_outbox`
for the delivery guarantee (at-least-once, deduplicated by PagerDuty on ``dedup_key``).
"""

from __future__ import annotations

import http.client
import json
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ridethrough.detectors.contract import Severity
from ridethrough.detectors.incidents import Incident, Transition, TransitionKind
from ridethrough.exporters import pagerduty_events as events
from ridethrough.exporters.pagerduty_config import (
    PagerDutyConfig,
    PagerDutyConfigError,
    RoutingKey,
    load_routing_keys,
    pd_severity,
    route_for,
)
from ridethrough.exporters.pagerduty_delivery import (
    Outcome,
    PagerDutyMetrics,
    TokenBucket,
    backoff_s,
    classify,
    post_json,
    scrub,
)
from ridethrough.exporters.pagerduty_outbox import Entry, Outbox, Pending

log = logging.getLogger(__name__)

_NS = 1_000_000_000
_IDLE_S = 5.0
_PRUNE_EVERY_S = 3600.0
_PAGED = (TransitionKind.OPENED, TransitionKind.ESCALATED, TransitionKind.REOPENED)


class PagerDutyExporter:
    """``emit`` for the `Controller` and ``change`` for actions; a sender thread delivers (``start``/``stop``)."""

    def __init__(self, *, config: PagerDutyConfig, routing_keys: Mapping[str, RoutingKey], outbox: Outbox,
                 clock: Callable[[], int] = time.time_ns, metrics: PagerDutyMetrics | None = None,
                 rng: random.Random | None = None) -> None:
        self._cfg = config
        self._keys = dict(routing_keys)
        self._outbox = outbox
        self._clock = clock
        self.metrics = metrics if metrics is not None else PagerDutyMetrics.create()
        self._rng = rng if rng is not None else random.Random()
        self._min = Severity[config.min_severity.upper()]
        self._buckets: dict[str, TokenBucket] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_config(cls, config: PagerDutyConfig, *, env: Mapping[str, str] | None = None,
                    metrics: PagerDutyMetrics | None = None) -> PagerDutyExporter:
        """Read the integration keys (``env``: default the process environment) and open the outbox."""
        if not config.routing_keys:
            raise PagerDutyConfigError("pagerduty.routing_keys is empty: no incident could be paged")
        keys = load_routing_keys(config, env)
        return cls(config=config, routing_keys=keys, outbox=Outbox(config.outbox), metrics=metrics)

    def __repr__(self) -> str:
        routes = ", ".join(f"{r}={k.ref}" for r, k in sorted(self._keys.items()))
        return f"PagerDutyExporter(outbox={str(self._outbox.path)!r}, routes=[{routes}])"

    @property
    def outbox(self) -> Outbox:
        """The outbox (read its `Outbox.counts` and `Outbox.events`)."""
        return self._outbox

    # -- queueing (the caller's thread) ---------------------------------------------------------

    def emit(self, transitions: Sequence[Transition]) -> None:
        """Queue the events of ``transitions`` in one durable commit and wake the sender; never sends."""
        entries: list[Entry] = []
        for t in transitions:
            entries += self._entries(t, entries)
        self._queue(entries)

    @property
    def dashboard_url(self) -> str:
        """The dashboard base URL events link to ('' when not configured)."""
        return self._cfg.dashboard_url

    def change(self, *, summary: str, at_ns: int, source: str, details: Mapping[str, Any] | None = None,
               incident: Incident | None = None, idempotency_key: str = "",
               links: Sequence[Mapping[str, str]] = (), incident_key: str = "", cluster: str = "") -> None:
        """Queue a change event for an action taken; with ``incident`` it goes where that incident paged, its
        links point at it, and later triggers of it list the action. Without it, ``incident_key`` (and its
        ``cluster``) still finds the routes its alert is open on; else the catch-all route ``*`` takes it.
        The same ``idempotency_key`` queues once; ``links`` are added to the incident's."""
        idem = idempotency_key or uuid.uuid4().hex
        body = events.change(summary=summary, at_ns=at_ns, source=source, details=details or {},
                             incident=incident, dashboard_url=self._cfg.dashboard_url, extra_links=links)
        key = ""
        routes = ["*"] if "*" in self._cfg.routing_keys else []  # an action on no incident: the catch-all
        actions: list[tuple[str, str, int, str]] = []
        if incident is not None or incident_key:
            key = (events.dedup_key(incident.key, cluster=incident.cluster) if incident is not None
                   else events.dedup_key(incident_key, cluster=cluster))
            own = [r for r in (self._route(incident),) if r] if incident is not None else []
            routes = self._outbox.routes(key) or own or routes
            actions.append((f"action:{idem}", key, at_ns, events.truncate(summary, 256)))
        if not routes:
            self.metrics.unrouted.inc()
            log.warning("change event %r matches no PagerDuty route; not sent", events.truncate(summary, 80))
        self._queue([Entry("change", r, key, body, f"change:{idem}:{r}") for r in routes], actions=actions)

    def reconcile(self, open_incidents: Sequence[Incident]) -> int:
        """Make PagerDuty match the store after a restart: trigger open incidents that never paged, resolve
        alerts whose incidents are no longer open (their transitions were lost). Returns events queued."""
        now = self._clock()
        by_key = {events.dedup_key(i.key, cluster=i.cluster): i for i in open_incidents}
        paged = self._outbox.open_alerts()
        entries = [e for key, i in by_key.items() if key not in paged
                   for e in self._entries(Transition(TransitionKind.OPENED, i, None), [])]
        entries += [Entry("alert", r, key, events.resolve(key), f"reconcile:{key}:{r}:{now}", alert="close")
                    for key, routes in paged.items() if key not in by_key for r in routes]
        return self._queue(entries)

    def _queue(self, entries: list[Entry], *, actions: Sequence[tuple[str, str, int, str]] = ()) -> int:
        if not entries and not actions:
            return 0
        added = self._outbox.add(entries, now_ns=self._clock(), actions=actions)
        for e in added:
            self.metrics.events.labels(endpoint=e.endpoint, outcome="queued").inc()
        self._wake.set()
        return len(added)

    def _route(self, i: Incident) -> str | None:
        return route_for(self._cfg, kind=i.kind, entity_type=i.entity_type, severity=i.severity)

    def _paged_routes(self, key: str, batch: Sequence[Entry]) -> list[str]:
        # The outbox's routes for the alert, and what earlier entries of this (uncommitted) batch did to them.
        routes = self._outbox.routes(key)
        for e in batch:
            if e.dedup_key == key and e.alert == "open" and e.route not in routes:
                routes.append(e.route)
            elif e.dedup_key == key and e.alert == "close" and e.route in routes:
                routes.remove(e.route)
        return routes

    def _entries(self, t: Transition, batch: Sequence[Entry]) -> list[Entry]:
        i = t.incident
        key = events.dedup_key(i.key, cluster=i.cluster)
        idem = f"{i.incident_id}:{i.version}"
        if t.kind is TransitionKind.RESOLVED:
            routes = self._paged_routes(key, batch)
            if not routes and i.severity >= self._min:  # paged before this outbox existed, perhaps
                routes = [r for r in (self._route(i),) if r]
            return [Entry("alert", r, key, events.resolve(key), f"{idem}:{r}", alert="close") for r in routes]
        if t.kind not in _PAGED or i.severity < self._min:
            return []
        route = self._route(i)
        if route is None:
            self.metrics.unrouted.inc()
            log.warning("incident %s (%s, %s) matches no PagerDuty route; not paged", i.key,
                        pd_severity(i.severity), i.kind)
            return []
        body = events.trigger(t, dashboard_url=self._cfg.dashboard_url, client=self._cfg.client,
                              actions=self._outbox.actions(key))
        return [Entry("alert", route, key, body, f"{idem}:{route}", alert="open")]

    # -- delivery (the sender thread) -------------------------------------------------------------

    def send_due(self) -> float:
        """Send every event that is due and within its key's rate; returns seconds until one may be sendable."""
        while True:
            wait, progressed = _IDLE_S, False
            for p in self._outbox.heads():
                if self._stop.is_set():
                    return 0.0
                delay = self._try(p)
                progressed |= delay == 0.0
                wait = min(wait, delay) if delay > 0 else wait
            if not progressed:
                return wait

    def _try(self, p: Pending) -> float:
        now = self._clock()
        if p.next_attempt_ns > now:
            return (p.next_attempt_ns - now) / _NS
        key = self._keys.get(p.route)
        if key is None:
            return self._dead(p, f"route {p.route!r} is no longer configured in pagerduty.routing_keys", now)
        give_up = self._cfg.give_up_after_s
        if give_up and now - p.created_ns > give_up * _NS:
            return self._dead(p, f"undelivered after {give_up:g} s (last attempt {p.attempts})", now)
        bucket = self._buckets.get(key.ref)
        if bucket is None:
            bucket = self._buckets[key.ref] = TokenBucket(rate_per_s=self._cfg.rate_per_s, burst=self._cfg.burst,
                                                          now_s=now / _NS)
        delay = bucket.take(now / _NS)
        if delay > 0:
            return delay
        self._deliver(p, key)
        return 0.0

    def _dead(self, p: Pending, why: str, now: int) -> float:
        log.error("PagerDuty %s event %s (seq %d) is dead: %s; kept in %s", p.endpoint, p.dedup_key, p.seq, why,
                  self._outbox.path)
        self._outbox.mark_failed(p.seq, state="dead", error=why, now_ns=now, attempted=False)
        self.metrics.events.labels(endpoint=p.endpoint, outcome="dead").inc()
        return 0.0

    def _deliver(self, p: Pending, key: RoutingKey) -> None:
        try:
            doc = json.loads(p.body)
        except ValueError as exc:  # only a hand-edited outbox gets here; do not let it block its route
            self._dead(p, f"stored body is not JSON ({exc})", self._clock())
            return
        doc["routing_key"] = key.reveal()
        url = self._cfg.events_url if p.endpoint == "alert" else self._cfg.change_url
        try:
            resp = post_json(url, json.dumps(doc).encode(), timeout_s=self._cfg.timeout_s)
        except (OSError, http.client.HTTPException) as exc:
            self.metrics.events.labels(endpoint=p.endpoint, outcome=Outcome.RETRY.value).inc()
            self._retry(p, f"network error: {scrub(str(exc), key)}", None)
            return
        outcome = classify(resp.status)
        self.metrics.events.labels(endpoint=p.endpoint, outcome=outcome.value).inc()
        if outcome is Outcome.SENT:
            self._outbox.mark_sent(p.seq, now_ns=self._clock())
            log.debug("PagerDuty took %s event %s via %s (seq %d)", p.endpoint, p.dedup_key, key.ref, p.seq)
        elif outcome is Outcome.REJECTED:
            error = f"HTTP {resp.status}: {scrub(resp.body, key)}"
            log.error("PagerDuty rejected %s event %s via route %s (seq %d), not retried: %s", p.endpoint,
                      p.dedup_key, p.route, p.seq, error)
            self._outbox.mark_failed(p.seq, state="rejected", error=error, now_ns=self._clock())
        else:
            self._retry(p, f"HTTP {resp.status}: {scrub(resp.body, key)}", resp.retry_after_s)

    def _retry(self, p: Pending, error: str, retry_after_s: float | None) -> None:
        cfg = self._cfg
        delay = backoff_s(p.attempts + 1, initial_s=cfg.initial_backoff_s, max_s=cfg.max_backoff_s, rng=self._rng)
        if retry_after_s is not None:
            delay = max(delay, min(retry_after_s, cfg.max_backoff_s))
        log.warning("PagerDuty %s event %s via route %s (seq %d, attempt %d) failed, retrying in %.2f s: %s",
                    p.endpoint, p.dedup_key, p.route, p.seq, p.attempts + 1, delay, error)
        self._outbox.mark_retry(p.seq, next_attempt_ns=self._clock() + round(delay * _NS), error=error)

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        """Deliver in a background thread until `stop`."""
        if self._thread is not None:
            if not self._stop.is_set():
                return  # running
            self._thread.join()  # a stop that timed out: its request ends within the config's timeout_s
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="pagerduty-sender", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the sender after the request in flight (bounded by the config's ``timeout_s``); waits up to
        ``timeout_s`` here. What is queued stays queued for the next start."""
        self._stop.set()
        self._wake.set()
        if self._thread is None:
            return
        self._thread.join(timeout_s)
        if self._thread.is_alive():  # stuck in a request: it exits after it, as the stop flag stays set
            log.warning("PagerDuty sender still busy after %.1f s; it stops after its request", timeout_s)
            return
        self._thread = None
        self._stop.clear()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """`stop`, then release the outbox file."""
        self.stop(timeout_s)
        self._outbox.close()

    def flush(self, timeout_s: float) -> bool:
        """Wait until nothing is pending (delivered, rejected or dead); False at the deadline.

        Without a running sender thread, delivers in the calling thread.
        """
        deadline = time.monotonic() + timeout_s
        while self._outbox.counts()["pending"]:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self._thread is None:
                wait = self.send_due()
                if self._outbox.counts()["pending"]:
                    self._wake.wait(min(wait, left))
                    self._wake.clear()
            else:
                self._wake.set()
                time.sleep(min(0.02, left))  # the sender thread does the work; poll its progress
        return True

    def _loop(self) -> None:
        next_prune = 0.0
        while not self._stop.is_set():
            self._wake.clear()  # before the pass: an emit during it leaves the flag set and skips the wait
            wait = 1.0
            try:
                wait = self.send_due()
                if time.monotonic() >= next_prune:
                    cutoff = self._clock() - round(self._cfg.retention_s * _NS)
                    self._outbox.prune(before_ns=cutoff)
                    next_prune = time.monotonic() + _PRUNE_EVERY_S
                self.metrics.pending.set(self._outbox.counts()["pending"])
            except Exception:  # a full disk or a bug must not end paging for good: log it, try again
                log.exception("PagerDuty sender pass failed")
            self._wake.wait(wait)

