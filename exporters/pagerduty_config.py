"""PagerDuty config, integration keys and routing: which key an incident pages through.

An integration key (``routing_key``) is a secret, so the config never holds one: it names
where each comes from (``env:VAR`` or ``file:PATH``), and `load_routing_keys` reads them
once, at start, into `RoutingKey` objects whose ``repr`` shows the reference, never the key.
The outbox stores the reference too, so no key is ever written to disk or to a log.

Routes, most specific first (``teams`` maps incident kinds or entity types to teams)::

    network:critical   team network, severity critical
    network            team network, any severity
    *:critical         any team, severity critical
    *                  everything else
"""

from __future__ import annotations

import os
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ridethrough.config_values import FrozenMap
from ridethrough.detectors.contract import EntityType, FindingKind, Severity
from ridethrough.suggest import did_you_mean

SEVERITIES = ("info", "warning", "error", "critical")
"""PagerDuty's severities, lowest first; `Severity` maps onto them by name."""
_KEY = re.compile(r"[A-Za-z0-9]{32}")
_TEAM = re.compile(r"[A-Za-z0-9_.-]+")
_REF_KINDS = ("env:", "file:")


class PagerDutyConfigError(ValueError):
    """A PagerDuty setting or integration key that cannot be used; the message never holds a key."""


def pd_severity(severity: Severity) -> str:
    """The PagerDuty severity of an incident severity (INFO → ``info`` … CRITICAL → ``critical``)."""
    return severity.name.lower()


def check_url(url: str) -> None:
    """An ``http(s)://HOST[/PATH]`` URL, or empty where the field allows it."""
    if not url:
        return
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"expected an http(s):// URL, got {url!r}")


def check_routes(routes: Mapping[str, str]) -> None:
    """Each route is ``TEAM[:SEVERITY]`` or ``*[:SEVERITY]`` and names ``env:VAR`` or ``file:PATH``."""
    for route, ref in routes.items():
        team, _, severity = route.partition(":")
        if not (team == "*" or _TEAM.fullmatch(team)):
            raise ValueError(f"route {route!r}: expected TEAM, TEAM:SEVERITY, * or *:SEVERITY")
        if ":" in route and severity not in SEVERITIES:
            raise ValueError(f"route {route!r}: severity must be one of {', '.join(SEVERITIES)}"
                             f"{did_you_mean(severity, SEVERITIES)}")
        if not ref.startswith(_REF_KINDS) or not ref.partition(":")[2]:
            # The value is not echoed: a mistake here is most likely a key pasted in place of a reference.
            raise ValueError(f"route {route!r}: expected env:VAR or file:PATH naming where its integration key "
                             "is (the key itself never goes in the config)")


def check_teams(teams: Mapping[str, str]) -> None:
    """Keys are incident kinds (``link_down``) or entity types (``gpu``); values are team names."""
    known = [k.value for k in FindingKind] + [e.value for e in EntityType]
    for what, team in teams.items():
        if what not in known:
            raise ValueError(f"teams: {what!r} is neither an incident kind nor an entity type"
                             f"{did_you_mean(what, known)}")
        if not _TEAM.fullmatch(team):
            raise ValueError(f"teams: {what}={team!r}: a team is letters, digits, '_', '.' or '-'")


def _help(text: str, **checks: Any) -> dict[str, Any]:
    return {"help": text, **checks}


@dataclass(frozen=True, slots=True, kw_only=True)
class PagerDutyConfig:
    """PagerDuty: pages incidents through the Events API v2 and reports actions as change events."""

    enabled: bool = field(default=False, metadata=_help("Page incidents in PagerDuty."))
    events_url: str = field(default="https://events.pagerduty.com/v2/enqueue", metadata=_help(
        "Events API v2 alert endpoint (trigger/resolve).", check=check_url))
    change_url: str = field(default="https://events.pagerduty.com/v2/change/enqueue", metadata=_help(
        "Events API v2 change-event endpoint (actions taken).", check=check_url))
    routing_keys: Mapping[str, str] = field(default=FrozenMap(), metadata=_help(
        "Integration key of each route, ROUTE=env:VAR or ROUTE=file:PATH; ROUTE is TEAM:SEVERITY, TEAM, "
        "*:SEVERITY or * (most specific wins). An incident with no route is not paged.", check=check_routes))
    teams: Mapping[str, str] = field(default=FrozenMap(), metadata=_help(
        "Team of each incident kind or entity type, e.g. link_down=network,gpu=compute (kind wins).",
        check=check_teams))
    min_severity: str = field(default="warning", metadata=_help(
        "Incidents below this severity are not paged (they page when they escalate to it).", choices=SEVERITIES))
    dashboard_url: str = field(default="", metadata=_help(
        "Dashboard base URL for the incident and trace links in pages; empty: no links.", check=check_url))
    outbox: str = field(default=".ridethrough/pagerduty.sqlite3", metadata=_help(
        "SQLite file of events waiting to be delivered (one process owns it)."))
    client: str = field(default="ridethrough", metadata=_help("Client name PagerDuty shows on alerts."))
    timeout_s: float = field(default=10.0, metadata=_help("Timeout of one request, in seconds.", min=0.1))
    initial_backoff_s: float = field(default=1.0, metadata=_help(
        "First wait before retrying a 429, 5xx or network error, in seconds (doubles, with jitter).", min=0.01))
    max_backoff_s: float = field(default=300.0, metadata=_help(
        "Longest wait between retries of one event, in seconds.", min=0.01))
    give_up_after_s: float = field(default=86400.0, metadata=_help(
        "An event still undelivered this long after it was queued is marked dead (kept, logged); 0: never.",
        min=0))
    rate_per_s: float = field(default=2.0, metadata=_help(
        "Events per second per integration key (PagerDuty allows about 120 a minute).", min=0.001))
    burst: int = field(default=10, metadata=_help("Events one integration key may send at once.", min=1))
    retention_s: float = field(default=7 * 86400.0, metadata=_help(
        "Delivered, rejected and dead events stay in the outbox this long, in seconds.", min=0))

    def __post_init__(self) -> None:
        # direct construction may pass plain dicts; keep the config immutable and hashable
        object.__setattr__(self, "routing_keys", FrozenMap(self.routing_keys))
        object.__setattr__(self, "teams", FrozenMap(self.teams))
        for f in fields(self):
            check = f.metadata.get("check")
            if check is not None:
                check(getattr(self, f.name))
        if self.min_severity not in SEVERITIES:
            raise ValueError(f"min_severity must be one of {', '.join(SEVERITIES)}, got {self.min_severity!r}")
        if self.initial_backoff_s > self.max_backoff_s:
            raise ValueError(f"initial_backoff_s ({self.initial_backoff_s}) must not exceed "
                             f"max_backoff_s ({self.max_backoff_s})")
        named = set(self.teams.values())
        for route in self.routing_keys:
            team = route.partition(":")[0]
            if team != "*" and team not in named:
                raise ValueError(f"routing_keys: route {route!r} names team {team!r}, which no incident kind "
                                 f"or entity type maps to in teams{did_you_mean(team, named)}")


class RoutingKey:
    """A PagerDuty integration key: ``reveal()`` gives it to the request body and nothing else prints it."""

    __slots__ = ("_value", "ref")

    def __init__(self, value: str, *, ref: str) -> None:
        if not _KEY.fullmatch(value):
            raise PagerDutyConfigError(f"integration key from {ref}: expected 32 letters and digits, got "
                                       f"{len(value)} characters")
        self._value = value
        self.ref = ref
        """Where the key came from (``env:VAR``, ``file:PATH``): safe to log, stored in the outbox."""

    def reveal(self) -> str:
        """The key itself, for the request body only."""
        return self._value

    def __repr__(self) -> str:
        return f"RoutingKey({self.ref}, <redacted>)"

    __str__ = __repr__

    def __reduce__(self) -> tuple[Any, ...]:
        raise TypeError("a RoutingKey is not pickled: it would write the key somewhere")


def read_secret(ref: str, env: Mapping[str, str]) -> RoutingKey:
    """The integration key ``ref`` names: ``env:VAR`` (a variable) or ``file:PATH`` (its stripped text)."""
    kind, _, where = ref.partition(":")
    if kind == "env":
        if where not in env:
            raise PagerDutyConfigError(f"integration key {ref}: environment variable {where} is not set")
        return RoutingKey(env[where].strip(), ref=ref)
    if kind == "file":
        try:
            text = Path(where).read_text()
        except OSError as exc:
            raise PagerDutyConfigError(f"integration key {ref}: cannot read the file ({exc.strerror})") from None
        return RoutingKey(text.strip(), ref=ref)
    raise PagerDutyConfigError(f"integration key reference must be env:VAR or file:PATH, got one starting {kind!r}")


def load_routing_keys(cfg: PagerDutyConfig, env: Mapping[str, str] | None = None) -> dict[str, RoutingKey]:
    """Every route's key, read once at start; a missing or malformed key stops the start here."""
    source = os.environ if env is None else env
    cache: dict[str, RoutingKey] = {}
    out: dict[str, RoutingKey] = {}
    for route, ref in cfg.routing_keys.items():
        if ref not in cache:
            cache[ref] = read_secret(ref, source)
        out[route] = cache[ref]
    return out


def team_of(cfg: PagerDutyConfig, *, kind: str, entity_type: str) -> str | None:
    """The team an incident belongs to: by kind first, then by entity type; None if neither is mapped."""
    return cfg.teams.get(kind) or cfg.teams.get(entity_type)


def route_for(cfg: PagerDutyConfig, *, kind: str, entity_type: str, severity: Severity) -> str | None:
    """The most specific configured route for an incident, or None (not paged)."""
    team = team_of(cfg, kind=kind, entity_type=entity_type)
    sev = pd_severity(severity)
    candidates = [f"{team}:{sev}", team] if team else []
    for route in [*candidates, f"*:{sev}", "*"]:
        if route in cfg.routing_keys:
            return route
    return None
