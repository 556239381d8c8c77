"""A local server that honours the PagerDuty Events API v2 contract, for tests.

A real HTTP server (port 0, a thread) at ``/v2/enqueue`` and ``/v2/change/enqueue`` that
validates each event as the documentation describes it (PagerDuty/developer-docs,
events-API-v2: required fields, ``routing_key`` of 32 characters, ``event_action``,
``dedup_key`` up to 255 characters, ``payload.summary`` up to 1024, severities, ISO 8601
timestamps, ``links``/``images`` shapes, events up to 512 KB) and answers 202 or 400 with
the errors. Change events (03-Change-Events.md) take only ``routing_key``, ``payload``
(``summary`` required, up to 1024; ``source``, ``timestamp``, ``custom_details``) and
``links`` (each an ``href`` URL, optional ``text``): no ``event_action``, ``dedup_key``,
``severity`` or ``images``. It keeps alerts as PagerDuty does: a trigger opens an alert unless one with its
(routing key, dedup key) is open, a resolve closes it, so `pages` counts what would have paged.

On demand it answers the next requests with 429/500/400 (`fail_next`), or records an event
and then holds the answer until `release` (`hold_next`: a client killed meanwhile never hears it).
"""

from __future__ import annotations

import json
import threading
import urllib.parse
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MAX_BYTES = 512_000
SEVERITIES = ("critical", "error", "warning", "info")
ACTIONS = ("trigger", "acknowledge", "resolve")
_ALERT_KEYS = {"routing_key", "event_action", "dedup_key", "payload", "images", "links", "client", "client_url"}
_PAYLOAD_KEYS = {"summary", "source", "severity", "timestamp", "component", "group", "class", "custom_details"}
_CHANGE_KEYS = {"routing_key", "payload", "links"}
_CHANGE_PAYLOAD_KEYS = {"summary", "source", "timestamp", "custom_details"}


def _chars(text: str) -> int:
    # A JSON string's length as PagerDuty (JavaScript) counts it: UTF-16 code units.
    return len(text.encode("utf-16-le")) // 2


def _string(doc: dict[str, Any], key: str, where: str, errors: list[str], *, required: bool = False,
            max_chars: int | None = None) -> None:
    if key not in doc:
        if required:
            errors.append(f"'{where}{key}' is missing")
        return
    value = doc[key]
    if not isinstance(value, str) or (required and not value):
        errors.append(f"'{where}{key}' must be a non-empty string" if required else f"'{where}{key}' must be a string")
    elif max_chars is not None and _chars(value) > max_chars:
        errors.append(f"'{where}{key}' is longer than {max_chars} characters")


def _unknown(doc: dict[str, Any], allowed: set[str], where: str, errors: list[str]) -> None:
    errors += [f"'{where}{k}' is not a known field" for k in sorted(set(doc) - allowed)]


def _routing_key(doc: dict[str, Any], known: Collection[str] | None, errors: list[str]) -> None:
    key = doc.get("routing_key")
    if not isinstance(key, str) or len(key) != 32:
        errors.append("'routing_key' must be a 32 character integration key")
    elif known is not None and key not in known:
        errors.append("'routing_key' is not a known integration key")


def _timestamp(payload: dict[str, Any], errors: list[str]) -> None:
    if "timestamp" not in payload:
        return
    try:
        datetime.fromisoformat(payload["timestamp"])
    except (TypeError, ValueError):
        errors.append("'payload.timestamp' must be an ISO 8601 timestamp")


def _objects(doc: dict[str, Any], key: str, required: str, optional: set[str], errors: list[str]) -> None:
    items = doc.get(key, [])
    if not isinstance(items, list):
        errors.append(f"'{key}' must be an array")
        return
    for n, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get(required), str) or not item[required]:
            errors.append(f"'{key}[{n}].{required}' is required")
        elif set(item) - {required, *optional} or not all(isinstance(v, str) for v in item.values()):
            errors.append(f"'{key}[{n}]' has unknown or non-string fields")


def validate_alert(doc: Any, *, routing_keys: Collection[str] | None = None) -> list[str]:
    """The contract violations of an alert event (an empty list: valid)."""
    if not isinstance(doc, dict):
        return ["the event must be a JSON object"]
    errors: list[str] = []
    _unknown(doc, _ALERT_KEYS, "", errors)
    _routing_key(doc, routing_keys, errors)
    action = doc.get("event_action")
    if action not in ACTIONS:
        errors.append(f"'event_action' must be one of {', '.join(ACTIONS)}")
    _string(doc, "dedup_key", "", errors, required=action in ("acknowledge", "resolve"), max_chars=255)
    for key in ("client", "client_url"):
        _string(doc, key, "", errors)
    _objects(doc, "links", "href", {"text"}, errors)
    _objects(doc, "images", "src", {"href", "alt"}, errors)
    payload = doc.get("payload")
    if payload is None and action != "trigger":
        return errors  # acknowledge and resolve need no payload
    if not isinstance(payload, dict):
        return [*errors, "'payload' is missing or not an object"]
    _unknown(payload, _PAYLOAD_KEYS, "payload.", errors)
    _string(payload, "summary", "payload.", errors, required=True, max_chars=1024)
    _string(payload, "source", "payload.", errors, required=True)
    if payload.get("severity") not in SEVERITIES:
        errors.append(f"'payload.severity' must be one of {', '.join(SEVERITIES)}")
    _timestamp(payload, errors)
    for key in ("component", "group", "class"):
        _string(payload, key, "payload.", errors)
    if not isinstance(payload.get("custom_details", {}), dict):
        errors.append("'payload.custom_details' must be an object")
    return errors


def _urls(doc: dict[str, Any], key: str, field: str, errors: list[str]) -> None:
    items = doc.get(key, [])
    for n, item in enumerate(items if isinstance(items, list) else []):
        value = item.get(field) if isinstance(item, dict) else None
        if isinstance(value, str) and value:
            url = urllib.parse.urlsplit(value)
            if url.scheme not in ("http", "https") or not url.netloc:
                errors.append(f"'{key}[{n}].{field}' must be an absolute http(s) URL")


def validate_change(doc: Any, *, routing_keys: Collection[str] | None = None) -> list[str]:
    """The contract violations of a change event (an empty list: valid)."""
    if not isinstance(doc, dict):
        return ["the event must be a JSON object"]
    errors: list[str] = []
    _unknown(doc, _CHANGE_KEYS, "", errors)
    _routing_key(doc, routing_keys, errors)
    _objects(doc, "links", "href", {"text"}, errors)
    _urls(doc, "links", "href", errors)
    payload = doc.get("payload")
    if not isinstance(payload, dict):
        return [*errors, "'payload' is missing or not an object"]
    _unknown(payload, _CHANGE_PAYLOAD_KEYS, "payload.", errors)
    _string(payload, "summary", "payload.", errors, required=True, max_chars=1024)
    _string(payload, "source", "payload.", errors)
    _timestamp(payload, errors)
    if not isinstance(payload.get("custom_details", {}), dict):
        errors.append("'payload.custom_details' must be an object")
    return errors


@dataclass
class Alert:
    """One PagerDuty alert: what a trigger opened (a page) and every event applied to it."""

    routing_key: str
    dedup_key: str
    state: str = "triggered"
    events: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class _Failure:
    status: int
    body: str
    retry_after: str | None


class PagerDutyServer:
    """The server; use as a context manager (see the module docstring)."""

    def __init__(self, *, routing_keys: Collection[str] | None = None) -> None:
        self.routing_keys = routing_keys
        self.accepted: list[dict[str, Any]] = []
        """Alert events answered 202 (or held), in arrival order."""
        self.changes: list[dict[str, Any]] = []
        self.rejected: list[tuple[Any, list[str]]] = []
        """(body, errors) of every event answered 400 by validation."""
        self.alerts: list[Alert] = []
        self.requests = 0
        self.held = 0
        """Requests currently held (recorded, not yet answered)."""
        self._lock = threading.Lock()
        self._failures: list[_Failure] = []
        self._holds = 0
        self._release = threading.Event()
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._http.daemon_threads = True
        # a short poll interval: shutting the server down at the end of each test should not take half a second
        self._thread = threading.Thread(target=self._http.serve_forever, args=(0.02,), name="pagerduty-server",
                                        daemon=True)

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self._http.server_address[1]}"

    @property
    def events_url(self) -> str:
        """The alert endpoint."""
        return self.base_url + "/v2/enqueue"

    @property
    def change_url(self) -> str:
        """The change-event endpoint."""
        return self.base_url + "/v2/change/enqueue"

    @property
    def pages(self) -> int:
        """Alerts opened so far: each would have paged someone."""
        with self._lock:
            return len(self.alerts)

    def __enter__(self) -> PagerDutyServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._release.set()
        self._http.shutdown()
        self._http.server_close()

    def fail_next(self, status: int, *, times: int = 1, body: str = "", retry_after: str | None = None) -> None:
        """Answer the next ``times`` requests with ``status`` and ``body`` (recording nothing)."""
        with self._lock:
            self._failures += [_Failure(status, body, retry_after)] * times

    def hold_next(self, times: int = 1) -> None:
        """Record the next ``times`` valid events, then hold their answers until `release`."""
        with self._lock:
            self._holds += times
            self._release.clear()

    def release(self) -> None:
        """Answer every held request (a client that has gone away gets nothing)."""
        self._release.set()

    def changes_for(self, routing_key: str) -> list[dict[str, Any]]:
        """Accepted change events sent with this integration key, in order."""
        with self._lock:
            return [c for c in self.changes if c.get("routing_key") == routing_key]

    def events_for(self, dedup_key: str) -> list[dict[str, Any]]:
        """Accepted alert events with this dedup key, in order."""
        with self._lock:
            return [e for e in self.accepted if e.get("dedup_key") == dedup_key]

    def handle(self, path: str, raw: bytes) -> tuple[int, dict[str, Any] | str, _Failure | None, bool]:
        """(status, answer, injected failure, hold) for one request; records what it accepts."""
        with self._lock:
            self.requests += 1
            if self._failures:
                failure = self._failures.pop(0)
                return failure.status, failure.body, failure, False
        if path not in ("/v2/enqueue", "/v2/change/enqueue"):
            return 404, {"status": "not found"}, None, False
        doc: Any
        try:
            doc = json.loads(raw) if len(raw) <= MAX_BYTES else None
            errors = ["the event is larger than 512 KB"] if doc is None else []
        except ValueError:
            doc, errors = raw.decode(errors="replace"), ["the body is not valid JSON"]
        change = path == "/v2/change/enqueue"
        if not errors:
            errors = (validate_change if change else validate_alert)(doc, routing_keys=self.routing_keys)
        if errors:
            with self._lock:
                self.rejected.append((doc, errors))
            return 400, {"status": "invalid event", "message": "Event object is invalid", "errors": errors}, None, False
        with self._lock:
            hold = self._holds > 0
            self._holds -= hold
            if change:
                self.changes.append(doc)
                return 202, {"status": "success", "message": "Change event processed"}, None, hold
            doc.setdefault("dedup_key", uuid.uuid4().hex)
            self.accepted.append(doc)
            self._apply(doc)
            return 202, {"status": "success", "message": "Event processed", "dedup_key": doc["dedup_key"]}, None, hold

    def _apply(self, doc: dict[str, Any]) -> None:
        current = next((a for a in self.alerts if a.routing_key == doc["routing_key"]
                        and a.dedup_key == doc["dedup_key"] and a.state != "resolved"), None)
        action = doc["event_action"]
        if current is None and action == "trigger":
            current = Alert(doc["routing_key"], doc["dedup_key"])
            self.alerts.append(current)
        if current is None:
            return  # PagerDuty drops an acknowledge or resolve with no open alert
        current.events.append(doc)
        if action != "trigger":
            current.state = "resolved" if action == "resolve" else "acknowledged"

    def wait_released(self) -> None:
        """Block a handler until `release` (or a minute: a forgotten hold must not hang the suite)."""
        with self._lock:
            self.held += 1
        self._release.wait(60)
        with self._lock:
            self.held -= 1


def _handler(server: PagerDutyServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.headers.get_content_type() != "application/json":
                self._answer(400, {"status": "invalid event", "message": "Content-Type must be application/json",
                                   "errors": ["not JSON"]}, None)
                return
            status, answer, failure, hold = server.handle(self.path, raw)
            if hold:
                server.wait_released()
            self._answer(status, answer, failure)

        def _answer(self, status: int, answer: dict[str, Any] | str, failure: _Failure | None) -> None:
            body = (answer if isinstance(answer, str) else json.dumps(answer)).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                if failure is not None and failure.retry_after is not None:
                    self.send_header("Retry-After", failure.retry_after)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except OSError:
                pass  # the client went away (killed while its request was held): it never hears the answer

        def log_message(self, format: str, *args: Any) -> None:
            pass  # the suite's output stays clean; tests read the recorded events instead

    return Handler
