"""A durable outbox of PagerDuty events: one SQLite file, owned by one process.

Why SQLite and not an append-only journal: the sender needs, per route, the oldest event
still pending (an index), updates each event's state and next attempt in place, and needs
the triggered routes of an alert when it resolves; a journal would re-implement all of that
plus compaction. SQLite in WAL mode with ``synchronous=FULL`` fsyncs every commit, and a
commit is atomic, so a process killed at any instant leaves each event either queued or not.

Delivery is at-least-once: an event is marked ``sent`` only after PagerDuty answered 202, so
a process killed between the request and that mark sends it again after a restart; the
second trigger carries the same ``dedup_key`` and PagerDuty folds it into the same alert.
No integration key is ever stored: rows name their route, resolved to a key at send time.

States: ``pending`` → ``sent`` (202) | ``rejected`` (400: PagerDuty will never take it) |
``dead`` (undeliverable: too old, or its route is no longer configured). Nothing is deleted
until it is older than the retention; `events` shows what is there (``sqlite3 FILE`` too).
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    idem TEXT NOT NULL UNIQUE,
    endpoint TEXT NOT NULL CHECK (endpoint IN ('alert', 'change')),
    route TEXT NOT NULL,
    dedup_key TEXT NOT NULL,
    body TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'sent', 'rejected', 'dead')),
    attempts INTEGER NOT NULL DEFAULT 0,
    created_ns INTEGER NOT NULL,
    next_attempt_ns INTEGER NOT NULL,
    done_ns INTEGER NOT NULL DEFAULT 0,
    last_error TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS events_pending ON events (state, route, seq);
CREATE TABLE IF NOT EXISTS alerts (
    dedup_key TEXT NOT NULL, route TEXT NOT NULL, opened_ns INTEGER NOT NULL, PRIMARY KEY (dedup_key, route)
);
CREATE TABLE IF NOT EXISTS actions (
    idem TEXT NOT NULL UNIQUE, dedup_key TEXT NOT NULL, at_ns INTEGER NOT NULL, summary TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS actions_by_key ON actions (dedup_key, at_ns);
"""
_HEADS = """
SELECT e.seq, e.endpoint, e.route, e.dedup_key, e.body, e.attempts, e.created_ns, e.next_attempt_ns
FROM events e JOIN (SELECT route, MIN(seq) AS seq FROM events WHERE state = 'pending' GROUP BY route) h
ON e.seq = h.seq ORDER BY e.next_attempt_ns, e.seq
"""


class OutboxError(Exception):
    """The outbox file cannot be used (in use by another process, not an outbox, newer schema)."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One event to queue. ``alert``: ``open`` records the route as paged for the dedup key, ``close`` forgets it."""

    endpoint: str
    """``alert`` (/v2/enqueue) or ``change`` (/v2/change/enqueue)."""
    route: str
    dedup_key: str
    body: Mapping[str, Any]
    """The event without ``routing_key``."""
    idem: str
    """Idempotency key: a second entry with the same one is ignored."""
    alert: str = ""


@dataclass(frozen=True, slots=True)
class Pending:
    """An event waiting to be sent: the oldest pending one of its route."""

    seq: int
    endpoint: str
    route: str
    dedup_key: str
    body: str
    attempts: int
    created_ns: int
    next_attempt_ns: int


class Outbox:
    """The outbox file; every method is one transaction, safe to call from several threads."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # autocommit (isolation_level=None): transactions are explicit, see _tx
        self._db = sqlite3.connect(self.path, timeout=0, isolation_level=None, check_same_thread=False)
        try:
            self._open()
        except sqlite3.DatabaseError as exc:
            self._db.close()
            if "locked" in str(exc):
                raise OutboxError(f"PagerDuty outbox {self.path} is in use by another process") from None
            raise OutboxError(f"{self.path} is not a PagerDuty outbox ({exc}); it was left untouched: "
                              "move it aside to start a new one") from None

    def _open(self) -> None:
        # EXCLUSIVE: the lock taken by the first write is held until close, so a second process
        # sharing the file fails here instead of sending every page twice.
        self._db.execute("PRAGMA locking_mode=EXCLUSIVE")
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        (version,) = self._db.execute("PRAGMA user_version").fetchone()
        if version > SCHEMA_VERSION:
            raise sqlite3.DatabaseError(f"schema version {version} is newer than this ridethrough's "
                                        f"{SCHEMA_VERSION}")
        with self._tx() as db:
            db.executescript(f"BEGIN IMMEDIATE; {_SCHEMA} PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;")

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            yield self._db

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        with self._tx() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def add(self, entries: Sequence[Entry], *, now_ns: int,
            actions: Sequence[tuple[str, str, int, str]] = ()) -> list[Entry]:
        """Queue ``entries`` (and record ``actions`` as (idem, dedup_key, at_ns, summary)) in one commit.

        Returns the entries that were new; one whose ``idem`` is already there changes nothing.
        """
        added: list[Entry] = []
        with self._write() as db:
            for e in entries:
                cur = db.execute(
                    "INSERT OR IGNORE INTO events (idem, endpoint, route, dedup_key, body, created_ns, "
                    "next_attempt_ns) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (e.idem, e.endpoint, e.route, e.dedup_key, json.dumps(e.body, sort_keys=True), now_ns, now_ns))
                if cur.rowcount == 0:
                    continue
                added.append(e)
                if e.alert == "open":
                    db.execute("INSERT OR IGNORE INTO alerts VALUES (?, ?, ?)", (e.dedup_key, e.route, now_ns))
                elif e.alert == "close":
                    db.execute("DELETE FROM alerts WHERE dedup_key = ? AND route = ?", (e.dedup_key, e.route))
            db.executemany("INSERT OR IGNORE INTO actions (idem, dedup_key, at_ns, summary) VALUES (?, ?, ?, ?)",
                           actions)
        return added

    def heads(self) -> list[Pending]:
        """The oldest pending event of each route (events of one route go out in order), soonest due first."""
        with self._tx() as db:
            return [Pending(*row) for row in db.execute(_HEADS)]

    def mark_sent(self, seq: int, *, now_ns: int) -> None:
        """PagerDuty took the event (202)."""
        with self._write() as db:
            db.execute("UPDATE events SET state = 'sent', attempts = attempts + 1, done_ns = ?, last_error = '' "
                       "WHERE seq = ?", (now_ns, seq))

    def mark_retry(self, seq: int, *, next_attempt_ns: int, error: str) -> None:
        """The attempt failed in a way worth retrying; try again at ``next_attempt_ns``."""
        with self._write() as db:
            db.execute("UPDATE events SET attempts = attempts + 1, next_attempt_ns = ?, last_error = ? "
                       "WHERE seq = ?", (next_attempt_ns, error, seq))

    def mark_failed(self, seq: int, *, state: str, error: str, now_ns: int, attempted: bool = True) -> None:
        """The event will not be delivered: ``rejected`` (400) or ``dead``; it stays until the retention."""
        if state not in ("rejected", "dead"):
            raise ValueError(f"a failed event is 'rejected' or 'dead', not {state!r}")
        with self._write() as db:
            db.execute("UPDATE events SET state = ?, attempts = attempts + ?, done_ns = ?, last_error = ? "
                       "WHERE seq = ?", (state, int(attempted), now_ns, error, seq))

    def routes(self, dedup_key: str) -> list[str]:
        """The routes an alert was triggered through and not yet resolved on."""
        with self._tx() as db:
            return [r for (r,) in db.execute("SELECT route FROM alerts WHERE dedup_key = ? ORDER BY opened_ns, route",
                                             (dedup_key,))]

    def open_alerts(self) -> dict[str, list[str]]:
        """Every alert triggered and not yet resolved: dedup key → routes."""
        out: dict[str, list[str]] = {}
        with self._tx() as db:
            for key, route in db.execute("SELECT dedup_key, route FROM alerts ORDER BY opened_ns, route"):
                out.setdefault(key, []).append(route)
        return out

    def actions(self, dedup_key: str, *, limit: int = 10) -> list[dict[str, Any]]:
        """The newest ``limit`` actions recorded for an alert, oldest first."""
        with self._tx() as db:
            rows = db.execute("SELECT at_ns, summary FROM actions WHERE dedup_key = ? ORDER BY at_ns DESC LIMIT ?",
                              (dedup_key, limit)).fetchall()
        return [{"at_ns": at, "summary": s} for at, s in reversed(rows)]

    def counts(self) -> dict[str, int]:
        """Events by state (every state present, zero included)."""
        out = dict.fromkeys(("pending", "sent", "rejected", "dead"), 0)
        with self._tx() as db:
            out.update(db.execute("SELECT state, COUNT(*) FROM events GROUP BY state").fetchall())
        return out

    def events(self, state: str | None = None) -> list[dict[str, Any]]:
        """Every event (or those in ``state``) oldest first, as dicts: for operators and tests."""
        sql = "SELECT * FROM events" + (" WHERE state = ?" if state else "") + " ORDER BY seq"
        with self._tx() as db:
            cur = db.execute(sql, (state,) if state else ())
            names = [d[0] for d in cur.description]
            return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

    def prune(self, *, before_ns: int) -> int:
        """Delete finished events done before ``before_ns`` and actions older than it; returns events deleted."""
        with self._write() as db:
            cur = db.execute("DELETE FROM events WHERE state != 'pending' AND done_ns < ?", (before_ns,))
            db.execute("DELETE FROM actions WHERE at_ns < ?", (before_ns,))
            return cur.rowcount

    def close(self) -> None:
        """Release the file (and its lock)."""
        with self._tx() as db:
            db.close()
