"""``ridethrough query``: read-only SQL against the store, printed as a table, JSON or CSV."""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Sequence
from typing import Any

from ridethrough.exporters.store import Store, StoreError, StoreUnavailable

READ_ONLY_KEYWORDS = ("SELECT", "SHOW", "DESCRIBE", "DESC", "EXPLAIN", "WITH", "EXISTS")
_COMMENT = re.compile(r"--[^\n]*|/\*.*?\*/", re.S)
_FORMATS = ("table", "json", "csv")


class QueryRefused(Exception):
    """The statement is not a read-only query."""


class QueryFailed(Exception):
    """The store could not run the query."""


def first_keyword(sql: str) -> str:
    """The statement's first keyword, upper-cased, comments and brackets skipped."""
    text = _COMMENT.sub(" ", sql).lstrip(" \t\r\n(")
    match = re.match(r"[A-Za-z]+", text)
    return match.group(0).upper() if match else ""


def check_read_only(sql: str) -> None:
    """Raise `QueryRefused` unless ``sql`` is one read-only statement."""
    keyword = first_keyword(sql)
    if keyword not in READ_ONLY_KEYWORDS:
        raise QueryRefused(f"only {', '.join(READ_ONLY_KEYWORDS)} statements are allowed, got {keyword or 'nothing'!r}")
    body = _COMMENT.sub(" ", sql).strip().rstrip(";")
    if ";" in _strip_strings(body):
        raise QueryRefused("one statement at a time")


def _strip_strings(sql: str) -> str:
    return re.sub(r"'(?:[^'\\]|\\.|'')*'|\"(?:[^\"\\]|\\.)*\"|`(?:[^`\\]|\\.)*`", "''", sql)


def run(dsn: str, sql: str, *, fmt: str = "table") -> str:
    """Run ``sql`` read-only on the store at ``dsn`` and format the result."""
    if fmt not in _FORMATS:
        raise QueryRefused(f"--format must be one of {', '.join(_FORMATS)}, got {fmt!r}")
    store = Store(dsn)
    # An embedded store is opened here, so enforce read-only in the engine too (readonly=2
    # still lets a query set its own settings). A server decides for its own users: a
    # read-only user may not even name the setting.
    settings = {"readonly": 2} if store.embedded else None
    try:
        names, rows = store.query(sql, settings=settings)
    except (StoreUnavailable, StoreError) as exc:
        raise QueryFailed(str(exc)) from exc
    finally:
        store.close()
    return {"table": format_table, "json": format_json, "csv": format_csv}[fmt](names, rows)


def format_table(names: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Aligned columns with a header line."""
    cells = [list(names)] + [[_text(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(names))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + f"\n({len(rows)} row{'s' if len(rows) != 1 else ''})\n"


def format_json(names: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """One JSON array of objects."""
    return json.dumps([dict(zip(names, row, strict=True)) for row in rows], default=str, indent=1) + "\n"


def format_csv(names: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """CSV with a header row."""
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(names)
    writer.writerows([[_text(v) for v in row] for row in rows])
    return out.getvalue()


def _text(value: Any) -> str:
    if isinstance(value, dict):
        return json.dumps(value, default=str, ensure_ascii=False)
    return str(value)
