"""A local PagerDuty Events API v2 endpoint for the demo: it validates, records and keeps alerts as PagerDuty does.

    sink = PagerDutySink(record_file=Path(".ridethrough/pagerduty-sink.jsonl"))
    base = sink.start()                 # http://127.0.0.1:PORT
    # RIDETHROUGH_PAGERDUTY_EVENTS_URL = base + "/v2/enqueue", ..._CHANGE_URL = base + "/v2/change/enqueue"
    sink.pages()                        # alerts opened (trigger), and which of them resolved
    sink.stop()

``POST /v2/enqueue`` takes alert events (``trigger``, ``acknowledge``, ``resolve``) and ``POST
/v2/change/enqueue`` change events, checked against the public contract (PagerDuty developer
docs, "Events API v2"): a 32-character ``routing_key``, a known ``event_action``, ``dedup_key``
up to 255 characters (required to acknowledge or resolve), for a trigger a ``payload`` with
``summary`` (up to 1024 characters), ``source`` and a known ``severity``, ISO 8601 timestamps,
bodies up to 512 KB. A valid event is answered 202 and appended to ``record_file`` (one JSON
line, the routing key left out); an invalid one 400 with the errors, and recorded as rejected.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

MAX_BODY_BYTES = 512_000
SEVERITIES = frozenset({"critical", "error", "warning", "info"})
EVENT_ACTIONS = frozenset({"trigger", "acknowledge", "resolve"})
ALERT_PATH = "/v2/enqueue"
CHANGE_PATH = "/v2/change/enqueue"


def _utf16_len(text: str) -> int:
    # PagerDuty counts characters as JavaScript does: UTF-16 code units.
    return len(text.encode("utf-16-le")) // 2


def _check_string(doc: dict[str, Any], key: str, where: str, *, required: bool, max_chars: int | None = None,
                  ) -> list[str]:
    if key not in doc:
        return [f"'{where}{key}' is missing"] if required else []
    value = doc[key]
    if not isinstance(value, str) or (required and not value):
        return [f"'{where}{key}' must be a {'non-empty ' if required else ''}string"]
    if max_chars is not None and _utf16_len(value) > max_chars:
        return [f"'{where}{key}' is longer than {max_chars} characters"]
    return []


def _check_timestamp(payload: dict[str, Any], where: str) -> list[str]:
    stamp = payload.get("timestamp")
    if stamp is None:
        return []
    try:
        datetime.fromisoformat(str(stamp).replace("Z", "+00:00"))
    except ValueError:
        return [f"'{where}timestamp' is not an ISO 8601 date-time: {stamp!r}"]
    return []


def _check_routing_key(doc: dict[str, Any]) -> list[str]:
    key = doc.get("routing_key")
    return [] if isinstance(key, str) and len(key) == 32 else ["'routing_key' must be a 32 character integration key"]


def check_alert(doc: dict[str, Any]) -> list[str]:
    """What is wrong with an alert event (empty: valid)."""
    errors = _check_routing_key(doc)
    action = doc.get("event_action")
    if action not in EVENT_ACTIONS:
        errors.append(f"'event_action' must be one of {', '.join(sorted(EVENT_ACTIONS))}")
    errors += _check_string(doc, "dedup_key", "", required=action in ("acknowledge", "resolve"), max_chars=255)
    if action != "trigger":
        return errors
    payload = doc.get("payload")
    if not isinstance(payload, dict):
        return [*errors, "'payload' is missing or not an object"]
    errors += _check_string(payload, "summary", "payload.", required=True, max_chars=1024)
    errors += _check_string(payload, "source", "payload.", required=True)
    if payload.get("severity") not in SEVERITIES:
        errors.append(f"'payload.severity' must be one of {', '.join(sorted(SEVERITIES))}")
    errors += _check_timestamp(payload, "payload.")
    for key in ("links", "images"):
        if key in doc and not (isinstance(doc[key], list) and all(isinstance(x, dict) for x in doc[key])):
            errors.append(f"'{key}' must be a list of objects")
    return errors


def check_change(doc: dict[str, Any]) -> list[str]:
    """What is wrong with a change event (empty: valid)."""
    errors = _check_routing_key(doc)
    payload = doc.get("payload")
    if not isinstance(payload, dict):
        return [*errors, "'payload' is missing or not an object"]
    errors += _check_string(payload, "summary", "payload.", required=True, max_chars=1024)
    errors += _check_string(payload, "source", "payload.", required=False)
    return errors + _check_timestamp(payload, "payload.")


@dataclass
class Page:
    """One alert as PagerDuty keeps it: opened by a trigger, closed by a resolve of its dedup key."""

    dedup_key: str
    summary: str
    severity: str
    triggered_at: str
    resolved_at: str = ""


@dataclass
class PagerDutySink:
    """The endpoint (a thread); `pages` and `changes` say what it accepted so far."""

    record_file: Path
    host: str = "127.0.0.1"
    _pages: dict[str, Page] = field(default_factory=dict)
    _changes: list[str] = field(default_factory=list)
    _rejected: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: ThreadingHTTPServer | None = None

    def start(self) -> str:
        """Listen on a free port; returns the base URL."""
        self.record_file.parent.mkdir(parents=True, exist_ok=True)
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                status, answer = sink.handle(self.path, self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                body = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return  # the record file is the log

        self._server = ThreadingHTTPServer((self.host, 0), Handler)
        threading.Thread(target=self._server.serve_forever, name="pagerduty-sink", daemon=True).start()
        return f"http://{self.host}:{self._server.server_address[1]}"

    def stop(self) -> None:
        """Stop listening."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def handle(self, path: str, body: bytes) -> tuple[int, dict[str, Any]]:
        """Validate and record one request; the HTTP status and the JSON answer."""
        if path not in (ALERT_PATH, CHANGE_PATH):
            return 404, {"status": "not found", "message": f"no endpoint {path}"}
        errors: list[str] = []
        doc: dict[str, Any] = {}
        if len(body) > MAX_BODY_BYTES:
            errors.append(f"the event is larger than {MAX_BODY_BYTES} bytes")
        else:
            try:
                parsed = json.loads(body)
                doc = parsed if isinstance(parsed, dict) else {}
                errors += [] if isinstance(parsed, dict) else ["the body must be a JSON object"]
            except (ValueError, UnicodeDecodeError) as exc:
                errors.append(f"the body is not JSON: {exc}")
        if not errors:
            errors = check_alert(doc) if path == ALERT_PATH else check_change(doc)
        self._record(path, doc, errors)
        if errors:
            return 400, {"status": "invalid event", "message": "Event object is invalid", "errors": errors}
        if path == CHANGE_PATH:
            return 202, {"status": "success", "message": "Change event processed"}
        return 202, {"status": "success", "message": "Event processed", "dedup_key": doc.get("dedup_key", "")}

    def _record(self, path: str, doc: dict[str, Any], errors: list[str]) -> None:
        now = datetime.now().astimezone().isoformat()
        kept = {k: v for k, v in doc.items() if k != "routing_key"}  # a secret: never written down
        line = {"received_at": now, "endpoint": "change" if path == CHANGE_PATH else "alert", "event": kept,
                "errors": errors}
        with self._lock:
            if errors:
                self._rejected += 1
            elif path == CHANGE_PATH:
                self._changes.append(str(doc["payload"]["summary"]))
            else:
                self._track(doc, now)
            with self.record_file.open("a", encoding="utf-8") as out:
                out.write(json.dumps(line) + "\n")

    def _track(self, doc: dict[str, Any], now: str) -> None:
        key, action = str(doc.get("dedup_key", "")), doc["event_action"]
        page = self._pages.get(key)
        if action == "trigger" and (page is None or page.resolved_at):
            payload = doc["payload"]
            self._pages[key] = Page(key, str(payload["summary"]), str(payload["severity"]), now)
        elif action == "resolve" and page is not None and not page.resolved_at:
            page.resolved_at = now

    def pages(self) -> list[Page]:
        """Every alert opened so far (resolved ones have ``resolved_at``)."""
        with self._lock:
            return [Page(**vars(p)) for p in self._pages.values()]

    def changes(self) -> list[str]:
        """Summaries of the change events accepted so far."""
        with self._lock:
            return list(self._changes)

    @property
    def rejected(self) -> int:
        """Requests answered 400."""
        with self._lock:
            return self._rejected
