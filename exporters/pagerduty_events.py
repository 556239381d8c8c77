"""Events API v2 bodies built from incidents: pure functions, no I/O.

A trigger, as it leaves here (the sender adds ``routing_key`` at the last moment)::

    {"event_action": "trigger", "dedup_key": "ridethrough:prod:link_down:link:h3-leaf1r0",
     "client": "ridethrough", "client_url": "https://dash.example/incidents/9f…",
     "payload": {"summary": "link h3-leaf1r0 down (link_down on h3-leaf1r0, cluster prod)",
                 "source": "h3-leaf1r0", "severity": "critical", "timestamp": "2025-01-01T00:00:00.000+00:00",
                 "component": "link", "group": "prod", "class": "link_down",
                 "custom_details": {"incident_id": "9f…", "evidence": {…}, "time_to_failure_s": null,
                                    "actions_taken": [...], …}},
     "links": [{"href": "https://dash.example/incidents/9f…", "text": "Incident in ridethrough"}, …]}

Limits from the Events API v2 documentation: ``dedup_key`` at most 255 characters,
``payload.summary`` at most 1024, a whole event at most 512 KB.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from ridethrough.detectors.incidents import Incident, Transition
from ridethrough.exporters.pagerduty_config import pd_severity

MAX_DEDUP_KEY = 255
MAX_SUMMARY = 1024
MAX_EVENT_BYTES = 512_000
"""PagerDuty's 512 KB, counted in decimal kilobytes as Alertmanager does (the stricter reading)."""
MAX_EVIDENCE_BYTES = 64_000
"""Evidence larger than this is cut to a preview: a page must stay readable on a phone."""
INCIDENT_PATH = "/incidents/{incident_id}"
TRACE_PATH = "/traces/{trace_id}"
_ELLIPSIS = "…"
_JOINERS = frozenset("\u200d\ufe0e\ufe0f")  # zero-width joiner, variation selectors: part of the previous glyph


def _units(ch: str) -> int:
    # PagerDuty's limits are in characters of a JSON (JavaScript) string: UTF-16 code units.
    return 2 if ord(ch) > 0xFFFF else 1


def truncate(text: str, limit: int = MAX_SUMMARY) -> str:
    """``text`` on one line, at most ``limit`` UTF-16 code units, cut with ``…`` between whole characters.

    Never splits a surrogate pair, and never leaves a base character without the combining
    marks or joiners that followed it (a cut ``é`` as ``e`` + U+0301 loses both, not only the accent).
    """
    line = " ".join(text.split())
    if sum(map(_units, line)) <= limit:
        return line
    kept: list[str] = []
    used = 0
    budget = limit - _units(_ELLIPSIS)
    for ch in line:
        if used + _units(ch) > budget:
            if unicodedata.combining(ch) or ch in _JOINERS:
                while kept and (unicodedata.combining(kept[-1]) or kept[-1] in _JOINERS):
                    kept.pop()
                if kept:
                    kept.pop()  # the base character the cut-off marks belonged to
            break
        kept.append(ch)
        used += _units(ch)
    return "".join(kept).rstrip() + _ELLIPSIS


def dedup_key(key: str, *, cluster: str = "") -> str:
    """The PagerDuty ``dedup_key`` of an incident key: readable, at most 255 characters.

    ``ridethrough:[CLUSTER:]KEY``; a longer one keeps its readable head and replaces the tail
    with ``#`` and 32 hex digits of the SHA-256 of the whole, so two long keys stay distinct.
    """
    full = f"ridethrough:{cluster}:{key}" if cluster else f"ridethrough:{key}"
    if len(full) <= MAX_DEDUP_KEY and full.isascii():
        return full
    digest = hashlib.sha256(full.encode()).hexdigest()[:32]
    head = full.encode("ascii", "replace").decode()[: MAX_DEDUP_KEY - len(digest) - 1]
    return f"{head}#{digest}"


def iso8601(time_ns: int) -> str:
    """``2025-01-01T00:00:00.123+00:00``: the UTC time, to the millisecond."""
    return datetime.fromtimestamp(time_ns / 1e9, tz=UTC).isoformat(timespec="milliseconds")


def links(incident: Incident | None, dashboard_url: str) -> list[dict[str, str]]:
    """Links to the incident's dashboard page and its trace; none without a dashboard URL."""
    if incident is None:
        return []
    return incident_links(incident.incident_id, incident.trace_id, dashboard_url)


def incident_links(incident_id: str, trace_id: str, dashboard_url: str) -> list[dict[str, str]]:
    """Links to an incident's dashboard page and its trace, by id; none without a dashboard URL or an id."""
    if not dashboard_url or not incident_id:
        return []
    base = dashboard_url.rstrip("/")
    out = [{"href": base + INCIDENT_PATH.format(incident_id=incident_id), "text": "Incident in ridethrough"}]
    if trace_id:
        out.append({"href": base + TRACE_PATH.format(trace_id=trace_id), "text": "Incident trace"})
    return out


def source_and_component(incident: Incident) -> tuple[str, str]:
    """PagerDuty's ``source`` (the host, for ``h2/gpu3``) and ``component`` (``gpu3``, else the entity type)."""
    host, sep, part = incident.entity.partition("/")
    if sep and host and part:
        return host, part
    return incident.entity or incident.cluster or "ridethrough", incident.entity_type


def _evidence(raw: str) -> tuple[Any, Any]:
    """(evidence, time to failure) from an incident's evidence JSON; a bad or huge one is kept as a preview."""
    if len(raw.encode()) > MAX_EVIDENCE_BYTES:
        return {"truncated": True, "bytes": len(raw.encode()), "preview": raw[:4000]}, None
    try:
        doc = json.loads(raw) if raw else {}
    except ValueError:
        return {"unparsed": raw}, None
    ttf = doc.get("time_to_failure_s") if isinstance(doc, dict) else None
    return doc, ttf


def _fit(event: dict[str, Any]) -> dict[str, Any]:
    # The last guard on the 512 KB limit: drop the bulky details, keep everything a responder needs.
    if len(json.dumps(event).encode()) <= MAX_EVENT_BYTES:
        return event
    details = event["payload"]["custom_details"]
    slim = {k: details[k] for k in ("incident_id", "incident_key", "transition", "severity") if k in details}
    slim["truncated"] = f"details removed: the event exceeded {MAX_EVENT_BYTES} bytes"
    event["payload"]["custom_details"] = slim
    return event


def _summary(i: Incident) -> str:
    where = f"{i.kind} on {i.entity}" + (f", cluster {i.cluster}" if i.cluster else "")
    return truncate(f"{i.summary} ({where})")


def trigger(t: Transition, *, dashboard_url: str = "", client: str = "ridethrough",
            actions: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """The trigger event (no ``routing_key``) for an opened, escalated or reopened incident."""
    i = t.incident
    evidence, ttf = _evidence(i.evidence)
    if t.finding is not None and t.finding.time_to_failure_s is not None:
        ttf = t.finding.time_to_failure_s
    source, component = source_and_component(i)
    details = {"incident_id": i.incident_id, "incident_key": i.key, "transition": t.kind.value,
               "severity": pd_severity(i.severity), "detector": i.detector, "entity": i.entity,
               "entity_type": i.entity_type, "cluster": i.cluster, "findings": i.findings, "reopens": i.reopens,
               "opened_at": iso8601(i.opened_at_ns), "trace_id": i.trace_id, "time_to_failure_s": ttf,
               "evidence": evidence, "actions_taken": list(actions)}
    event: dict[str, Any] = {
        "event_action": "trigger", "dedup_key": dedup_key(i.key, cluster=i.cluster), "client": client,
        "payload": {"summary": _summary(i), "source": truncate(source, 255), "severity": pd_severity(i.severity),
                    "timestamp": iso8601(i.updated_at_ns), "component": truncate(component, 255),
                    "group": i.cluster or "default", "class": i.kind, "custom_details": details},
        "links": links(i, dashboard_url)}
    if event["links"]:
        event["client_url"] = event["links"][0]["href"]
    return _fit(event)


def _unique(items: list[dict[str, str]]) -> list[dict[str, str]]:
    """The first link to each href."""
    by_href: dict[str, dict[str, str]] = {}
    for item in items:
        by_href.setdefault(item["href"], item)
    return list(by_href.values())


def resolve(key: str) -> dict[str, Any]:
    """The resolve event (no ``routing_key``) of the alert with dedup key ``key``: the documented minimum."""
    return {"event_action": "resolve", "dedup_key": key}


def change(*, summary: str, at_ns: int, source: str, details: Mapping[str, Any],
           incident: Incident | None = None, dashboard_url: str = "",
           extra_links: Sequence[Mapping[str, str]] = ()) -> dict[str, Any]:
    """A change event (no ``routing_key``) for an action taken, linked to its incident when there is one
    (and to ``extra_links``, e.g. the incident's pages by id when the incident itself is not at hand)."""
    custom: dict[str, Any] = json.loads(json.dumps(dict(details), default=str))  # plain JSON from here on
    if incident is not None:
        custom.setdefault("incident_id", incident.incident_id)
        custom.setdefault("incident_key", incident.key)
    event: dict[str, Any] = {
        "payload": {"summary": truncate(summary), "timestamp": iso8601(at_ns), "source": truncate(source, 255),
                    "custom_details": custom},
        "links": _unique([*links(incident, dashboard_url), *(dict(link) for link in extra_links)])}
    if len(json.dumps(event).encode()) > MAX_EVENT_BYTES:
        event["payload"]["custom_details"] = {"truncated": f"details removed: over {MAX_EVENT_BYTES} bytes"}
    return event
