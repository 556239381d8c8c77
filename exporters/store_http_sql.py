"""The store HTTP endpoint's read-only rules, as pure code over URL parameters and SQL text.

`ridethrough.exporters.store_http` serves them, in its three layers: `require_read` (the first
keyword), `check_canonical` (the engine's canonical text of the one statement) and `runnable_sql`
(the ``SETTINGS ..., readonly = 1`` every statement ends with). A refusal is a `Failure`: a
ClickHouse-style error answer.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field

from clickhouse_connect.driver.exceptions import ClickHouseError

_READ_KEYWORDS = frozenset({"SELECT", "WITH", "SHOW", "DESCRIBE", "DESC", "EXPLAIN", "EXISTS"})
# HTTP-interface parameters that are not ClickHouse settings; consumed here or ignored.
_TRANSPORT_PARAMS = frozenset({
    "query", "database", "default_format", "query_id", "session_id", "session_timeout", "session_check",
    "close_session", "user", "password", "quota_key", "role", "buffer_size", "wait_end_of_query",
    "stacktrace", "client_protocol_version", "send_progress_in_http_headers",
    "http_headers_progress_interval_ms", "enable_http_compression", "compress", "decompress",
    "cancel_http_readonly_queries_on_client_close",
})  # fmt: skip
# Settings pinned by this endpoint: a request may repeat the pinned value, never change it.
_PINNED_SETTINGS = {"readonly": "1", "allow_ddl": "0"}
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_FORMAT_RE = re.compile(r"[A-Za-z0-9_]+\Z")
_CANONICAL_FORMAT_RE = re.compile(r"`?([A-Za-z0-9_]+)`?\Z")
_LEADING_NOISE_RE = re.compile(r"(?:\s+|--[^\n]*|#[^\n]*|/\*.*?\*/|\()*", re.S)
_WORD_RE = re.compile(r"[A-Za-z_]+")
# In canonical text each top-level clause starts a line; INTO OUTFILE writes a file even read-only.
_WRITING_CLAUSE_RE = re.compile(r"\bINTO\s+OUTFILE\b|^PARALLEL WITH\b", re.I | re.M)
# As strict as clickhouse-connect's own test, so a match always selects its server-side binding.
_PLACEHOLDER_RE = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*):[^}]+\}")
_STATUS_BY_CODE = {62: 400, 164: 403, 456: 400, 457: 400, 60: 404, 81: 404}
_TEXT_CONTENT_TYPES = (
    (("json",), "application/json"),
    (("csv",), "text/csv"),
    (("tabseparated", "tsv"), "text/tab-separated-values"),
    (("pretty", "vertical", "markdown", "values", "xml", "template"), "text/plain"),
)


class Failure(Exception):
    """A request answered with a ClickHouse-style error (`Code: N. DB::Exception: ... (NAME)`)."""

    def __init__(self, status: int, code: int, text: str) -> None:
        super().__init__(text)
        self.status, self.code, self.text = status, code, text

    @classmethod
    def of(cls, status: int, code: int, name: str, detail: str) -> Failure:
        """A failure with ClickHouse's message shape for error ``code`` named ``name``."""
        return cls(status, code, f"Code: {code}. DB::Exception: {detail}. ({name})")

    def answer(self) -> Answer:
        """The HTTP answer: the message, and the code in ``X-ClickHouse-Exception-Code``."""
        headers = {"X-ClickHouse-Exception-Code": str(self.code)}
        return Answer(self.status, self.text.encode() + b"\n", headers)

    @classmethod
    def readonly(cls, detail: str) -> Failure:
        """A refusal to write (ClickHouse's READONLY, HTTP 403)."""
        return cls.of(403, 164, "READONLY", f"Cannot execute query in readonly mode: {detail}")

    @classmethod
    def from_engine(cls, ex: ClickHouseError) -> Failure:
        """The engine's own error, with the HTTP status ClickHouse gives its code."""
        code = getattr(ex, "code", None) or 1001
        text = str(ex).strip()
        if "Multi-statements are not allowed" in text:
            return cls.readonly("multi-statement queries are not allowed")
        return cls(_STATUS_BY_CODE.get(code, 500), code, text if "Code:" in text else f"Code: {code}. {text}")


@dataclass
class Answer:
    """An HTTP answer: status, body and headers beyond the defaults."""

    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Request:
    """One query as the HTTP interface delivers it, split into SQL, bindings and settings."""

    sql: str
    binds: dict[str, str]
    settings: dict[str, str]
    default_format: str
    query_id: str
    database: str | None


def first_keyword(sql: str) -> str:
    """The statement's first word, upper-cased, after comments, whitespace and opening parens."""
    noise = _LEADING_NOISE_RE.match(sql)
    word = _WORD_RE.match(sql, noise.end() if noise else 0)
    return word.group(0).upper() if word else ""


def require_read(sql: str) -> None:
    """Refuse empty text and any statement whose first keyword is not a read."""
    if not sql.strip():
        raise Failure.of(400, 62, "SYNTAX_ERROR", "Empty query")
    keyword = first_keyword(sql)
    if keyword not in _READ_KEYWORDS:
        shown = keyword or "a statement that is not a query"
        raise Failure.readonly(f"only SELECT, WITH, SHOW, DESCRIBE, EXPLAIN, EXISTS may run, got {shown}")


def parse_request(pairs: list[tuple[str, str]], body: str) -> Request:
    """Split URL (or form) parameters the way ClickHouse's HTTP handler does."""
    values = dict(pairs)
    binds = {k[6:]: v for k, v in pairs if k.startswith("param_")}
    settings = {k: v for k, v in pairs if k not in _TRANSPORT_PARAMS and not k.startswith("param_")}
    for name in [*binds, *settings]:
        if not _NAME_RE.match(name):
            raise Failure.of(400, 36, "BAD_ARGUMENTS", f"invalid parameter name {name!r}")
    for name, value in settings.items():
        if name in _PINNED_SETTINGS and value != _PINNED_SETTINGS[name]:
            raise Failure.readonly(f"setting {name} is pinned to {_PINNED_SETTINGS[name]} on this endpoint")
    if values.get("compress", "0") != "0" or values.get("decompress", "0") != "0":
        raise Failure.of(400, 48, "NOT_IMPLEMENTED", "compress/decompress are not supported")
    query = values.get("query", "")
    sql = f"{query}\n{body}" if query and body else query or body
    fmt = values.get("default_format") or "TabSeparated"
    if not _FORMAT_RE.match(fmt):
        raise Failure.of(400, 73, "UNKNOWN_FORMAT", f"invalid format name {fmt!r}")
    query_id = values.get("query_id") or str(uuid.uuid4())
    settings = {k: v for k, v in settings.items() if k not in _PINNED_SETTINGS}
    return Request(sql, binds, settings, fmt, query_id, values.get("database") or None)


def _quote(value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace("'", "\\'")
    return f"'{escaped}'"


def runnable_sql(canonical: str, request: Request) -> tuple[str, str]:
    """Re-assemble the canonical statement with its FORMAT and a SETTINGS clause ending in
    `readonly = 1`. A setting later in one clause wins, and an earlier clause is checked under
    the read-only mode this one sets, so neither the SQL nor the URL can lift it."""
    head, sep, tail = canonical.rpartition("\nFORMAT ")
    if not sep:
        head, fmt, post = canonical, request.default_format, ""
    else:
        fmt_token, _, post = tail.partition("\n")
        fmt_name = _CANONICAL_FORMAT_RE.match(fmt_token)  # keywords such as Values come back quoted
        if not fmt_name or (post and not post.startswith("SETTINGS ")):
            raise Failure.of(400, 62, "SYNTAX_ERROR", "unsupported clause after FORMAT")
        fmt, post = fmt_name.group(1), post.removeprefix("SETTINGS ")
    changes = [post] if post else []
    changes += [f"{name} = {_quote(value)}" for name, value in request.settings.items()]
    changes.append("readonly = 1")
    return f"{head}\nFORMAT {fmt}\nSETTINGS {', '.join(changes)}", fmt


class BoundText:
    """A bind value already in ClickHouse's escaped text form, as `param_<name>` carries it.

    clickhouse-connect formats values it does not know with `str()`, so this hands the text to
    the engine unchanged instead of escaping it a second time.
    """

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __str__(self) -> str:
        return self.text


def content_type(fmt: str) -> str:
    """The Content-Type of an answer in output format ``fmt``."""
    name = fmt.lower()
    for prefixes, kind in _TEXT_CONTENT_TYPES:
        if name.startswith(prefixes):
            return f"{kind}; charset=UTF-8"
    return "application/octet-stream"


def check_canonical(text: str) -> None:
    """Refuse the engine's canonical text of a statement unless it is one read that writes nothing."""
    require_read(text)
    if _WRITING_CLAUSE_RE.search(text):
        raise Failure.readonly("INTO OUTFILE and PARALLEL WITH are not allowed")


def bindings(sql: str, request: Request) -> dict[str, object]:
    """The request's bound values for ``sql``, as clickhouse-connect should pass them."""
    # Bindings go only with placeholders: without one, clickhouse-connect would %-format the SQL.
    return {k: BoundText(v) for k, v in request.binds.items()} if _PLACEHOLDER_RE.search(sql) else {}
