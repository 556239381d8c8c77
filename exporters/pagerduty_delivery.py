"""Delivery to PagerDuty, one request at a time: the HTTP call, what its answer means, backoff, rate.

PagerDuty's documented answers: 202 accepted; 400 invalid (do not retry); 429 too many
requests and 5xx server errors (retry later, with backoff); a network error is retried too.
The Events API v2 allows about 120 events a minute per integration key, hence a token
bucket per key in front of it.
"""

from __future__ import annotations

import enum
import random
import urllib.error
import urllib.request
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from ridethrough.exporters.pagerduty_config import RoutingKey

_REJECTED = frozenset({400, 413})
"""Not retried: PagerDuty documents 400 as final; 413 (too large) cannot change either."""


@dataclass(frozen=True)
class PagerDutyMetrics:
    """The exporter's health on /metrics."""

    registry: CollectorRegistry
    events: Counter
    unrouted: Counter
    pending: Gauge

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> PagerDutyMetrics:
        """Metrics in ``registry`` (a fresh one by default: no global state)."""
        reg = registry if registry is not None else CollectorRegistry()
        return cls(
            registry=reg,
            events=Counter("ridethrough_pagerduty_events", "PagerDuty events by endpoint and outcome "
                           "(queued, sent, retried, rejected, dead)", ["endpoint", "outcome"], registry=reg),
            unrouted=Counter("ridethrough_pagerduty_unrouted", "Incident transitions no configured route matched "
                             "(not paged)", registry=reg),
            pending=Gauge("ridethrough_pagerduty_outbox_pending", "Events waiting in the outbox", registry=reg),
        )


class TokenBucket:
    """``rate_per_s`` tokens a second, at most ``burst`` saved up; one event costs one token."""

    def __init__(self, *, rate_per_s: float, burst: int, now_s: float) -> None:
        self._rate = rate_per_s
        self._burst = float(burst)
        self._tokens = float(burst)
        self._at = now_s

    def take(self, now_s: float) -> float:
        """0 if a token was taken; otherwise the seconds until one will be there (nothing taken)."""
        self._tokens = min(self._burst, self._tokens + max(0.0, now_s - self._at) * self._rate)
        self._at = max(self._at, now_s)
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return 0.0
        return (1.0 - self._tokens) / self._rate


def backoff_s(attempt: int, *, initial_s: float, max_s: float, rng: random.Random) -> float:
    """Wait before retry number ``attempt`` (1, 2, …): doubling from ``initial_s`` up to ``max_s``, jittered
    down by up to half so that many events failing together do not retry together."""
    base = min(max_s, initial_s * 2.0 ** min(attempt - 1, 60))
    return base * (0.5 + 0.5 * rng.random())


@dataclass(frozen=True, slots=True)
class Response:
    """What PagerDuty answered."""

    status: int
    body: str
    retry_after_s: float | None


def post_json(url: str, body: bytes, *, timeout_s: float) -> Response:
    """POST ``body`` as JSON; any HTTP status is a `Response`, a network failure raises OSError/HTTPException."""
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "application/json", "Accept": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return Response(resp.status, resp.read(65536).decode(errors="replace"), None)
    except urllib.error.HTTPError as err:
        with err:
            text = err.read(65536).decode(errors="replace")
            return Response(err.code, text, _retry_after(err.headers.get("Retry-After")))


def _retry_after(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value else None
    except ValueError:
        return None  # the HTTP-date form: fall back to our own backoff


class Outcome(enum.Enum):
    """What one delivery attempt came to."""

    SENT = "sent"
    RETRY = "retried"
    REJECTED = "rejected"


def classify(status: int) -> Outcome:
    """2xx is delivered (PagerDuty answers 202); 400 and 413 are final; everything else is worth a retry."""
    if 200 <= status < 300:
        return Outcome.SENT
    return Outcome.REJECTED if status in _REJECTED else Outcome.RETRY


def scrub(text: str, key: RoutingKey) -> str:
    """``text`` safe to log: without the key (were a server to echo it) and at most 2000 characters."""
    return text.replace(key.reveal(), "<redacted>")[:2000]
