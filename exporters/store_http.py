"""Read-only ClickHouse HTTP endpoint over the store client this process owns.

A chDB store opens in one process only, so readers in other processes (query CLI, dashboard,
Grafana, curl) reach the owner's store through this endpoint with a plain `http://host:port` DSN.

Read-only holds at three layers: the first keyword must name a read statement; the engine's own
parser (`formatQuery`) must accept the text as one statement, and its canonical text is what runs;
and every statement ends with `SETTINGS ..., readonly = 1`, query-scoped, so the owner's session
never turns read-only (a `SET readonly` could not be undone on it).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Mapping
from contextlib import AbstractContextManager
from email import policy
from email.parser import BytesParser
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, cast
from urllib.parse import parse_qsl, urlsplit

from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.exceptions import ClickHouseError

from ridethrough.exporters.store_http_sql import (
    Answer,
    Failure,
    Request,
    bindings,
    check_canonical,
    content_type,
    parse_request,
    require_read,
    runnable_sql,
)

logger = logging.getLogger(__name__)

_DRAIN_LIMIT_BYTES = 64 << 20


class _Gate:
    """Validates a request and runs it on the owned client, one engine call at a time."""

    def __init__(self, client: Client, lock: AbstractContextManager[Any] | None) -> None:
        self._client = client
        # chDB serialises calls per handle itself, and an HTTP client refuses concurrent
        # queries in one session; one lock keeps both safe whichever client we were given.
        # The owner passes its own lock so its writes and these reads take turns too.
        self._lock: AbstractContextManager[Any] = lock if lock is not None else threading.Lock()
        self.timezone = "UTC"
        self.database = "default"
        self.display_name = "ridethrough"

    def learn_server(self) -> None:
        """Read what response headers report: time zone, current database, display name."""
        with self._lock:
            raw = self._client.raw_query("SELECT timezone(), currentDatabase() FORMAT TSVRaw")
        self.timezone, self.database = raw.decode().rstrip("\n").split("\t")
        self.display_name = socket.gethostname()

    def answer(self, request: Request) -> Answer:
        """Run one read-only query and answer with its bytes in the requested format."""
        started_ns = time.monotonic_ns()
        if request.database not in (None, self.database):
            detail = f"this endpoint serves database {self.database} only; qualify table names"
            raise Failure.of(400, 81, "UNKNOWN_DATABASE", detail)
        canonical = self._raw("SELECT formatQuery({q:String}) FORMAT RawBLOB", {"q": request.sql}, "parse")
        text = canonical.decode()
        check_canonical(text)
        sql, fmt = runnable_sql(text, request)
        body = self._raw(sql, bindings(sql, request), "query")
        return Answer(200, body, self._headers(request, fmt, len(body), started_ns))

    def _raw(self, sql: str, binds: Mapping[str, object], what: str) -> bytes:
        try:
            with self._lock:
                return self._client.raw_query(sql, parameters=dict(binds) or None)
        except ClickHouseError as ex:
            logger.debug("store endpoint %s failed: %s", what, ex)
            raise Failure.from_engine(ex) from ex

    def _headers(self, request: Request, fmt: str, size: int, started_ns: int) -> dict[str, str]:
        summary = {"read_rows": "0", "read_bytes": "0", "written_rows": "0", "written_bytes": "0",
                   "total_rows_to_read": "0", "result_rows": "0", "result_bytes": str(size),
                   "elapsed_ns": str(time.monotonic_ns() - started_ns)}  # fmt: skip
        return {
            "Content-Type": content_type(fmt),
            "X-ClickHouse-Format": fmt,
            "X-ClickHouse-Query-Id": request.query_id,
            "X-ClickHouse-Timezone": request.settings.get("session_timezone") or self.timezone,
            "X-ClickHouse-Server-Display-Name": self.display_name,
            "X-ClickHouse-Summary": json.dumps(summary),
        }


def _form_fields(content_type: str, body: bytes) -> list[tuple[str, str]]:
    """Fields of a multipart/form-data body (clickhouse-connect sends long bindings this way)."""
    head = f"Content-Type: {content_type}\r\n\r\n".encode("latin-1")
    message = BytesParser(policy=policy.HTTP).parsebytes(head + body)
    fields = []
    for part in message.iter_parts():
        if part.get_filename():
            raise Failure.of(400, 48, "NOT_IMPLEMENTED", "external data tables are not supported")
        payload = cast(bytes, part.get_payload(decode=True) or b"")
        fields.append((str(part.get_param("name", "", header="content-disposition")), payload.decode()))
    return fields


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], gate: _Gate, max_query_bytes: int) -> None:
        self.gate, self.max_query_bytes = gate, max_query_bytes
        super().__init__(address, _Handler)

    def handle_error(self, request: object, client_address: object) -> None:
        logger.warning("store endpoint: connection from %s failed", client_address, exc_info=True)


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 60.0  # a stalled client cannot pin a handler thread for longer than this

    def do_GET(self) -> None:
        self._serve()

    def do_POST(self) -> None:
        self._serve()

    def log_message(self, format: str, *args: object) -> None:
        logger.debug("store endpoint %s: " + format, self.client_address[0], *args)

    def _serve(self) -> None:
        try:
            answer = self._answer()
        except Failure as failure:
            answer = failure.answer()
        except Exception as ex:  # one bad request must never take the endpoint down
            logger.exception("store endpoint: unexpected error on %s %s", self.command, self.path)
            answer = Failure.of(500, 1001, "STD_EXCEPTION", repr(ex)).answer()
        self._send(answer)

    def _answer(self) -> Answer:
        server = cast(_Server, self.server)
        url = urlsplit(self.path)
        if url.path == "/ping" or (url.path == "/" and not url.query and self.command == "GET"):
            return Answer(200, b"Ok.\n", {"Content-Type": "text/plain; charset=UTF-8"})
        if url.path != "/":
            raise Failure.of(404, 36, "BAD_ARGUMENTS", f"no handler for {url.path}")
        body = self._read_body(server.max_query_bytes)
        encoding = self.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding != "identity":  # clients compress request bodies for inserts only
            raise Failure.readonly(f"a body with Content-Encoding {encoding} is insert data")
        pairs = parse_qsl(url.query, keep_blank_values=True)
        content_type = self.headers.get("Content-Type", "")
        if content_type.lower().startswith("multipart/form-data"):
            pairs, body = pairs + _form_fields(content_type, body), b""
        # Refuse writes before decoding: an insert body is binary and must still read as READONLY.
        require_read(dict(pairs).get("query", "") + "\n" + body.decode("utf-8", "replace"))
        try:
            text = body.decode()
        except UnicodeDecodeError as ex:
            raise Failure.of(400, 36, "BAD_ARGUMENTS", "query is not valid UTF-8") from ex
        return server.gate.answer(parse_request(pairs, text))

    def _read_body(self, limit: int) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return self._read_chunked(limit)
        length_text = self.headers.get("Content-Length") or "0"
        if not length_text.isdigit():
            raise Failure.of(400, 36, "BAD_ARGUMENTS", f"bad Content-Length {length_text!r}")
        length = int(length_text)
        if length > limit:
            self._discard(length)
            raise Failure.of(413, 229, "QUERY_IS_TOO_LARGE", f"body of {length} bytes exceeds {limit}")
        return self.rfile.read(length)

    def _read_chunked(self, limit: int) -> bytes:
        data = bytearray()
        while True:
            try:
                size = int(self.rfile.readline(1024).split(b";")[0].strip(), 16)
            except ValueError as ex:
                raise Failure.of(400, 36, "BAD_ARGUMENTS", "bad chunked encoding") from ex
            if size <= 0:
                break
            if len(data) + size > limit:
                raise Failure.of(413, 229, "QUERY_IS_TOO_LARGE", f"chunked body exceeds {limit} bytes")
            data += self.rfile.read(size)
            self.rfile.readline(8)
        while self.rfile.readline(1024).strip():  # trailer fields, up to the blank line
            pass
        return bytes(data)

    def _discard(self, length: int) -> None:
        """Read a refused body so the client sees our answer rather than a reset connection."""
        remaining = min(length, _DRAIN_LIMIT_BYTES)
        while remaining > 0 and (chunk := self.rfile.read(min(remaining, 1 << 16))):
            remaining -= len(chunk)

    def _send(self, answer: Answer) -> None:
        self.send_response(answer.status)
        headers = {"Content-Type": "text/plain; charset=UTF-8", **answer.headers}
        if answer.status >= 400:
            # A failed request may leave body bytes unread; do not reuse the connection.
            self.close_connection = True
            headers["Connection"] = "close"
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(answer.body)))
        self.end_headers()
        self.wfile.write(answer.body)


class StoreHttpEndpoint:
    """Serves the owned store client read-only over ClickHouse's HTTP interface.

    Args:
        client: the one store client of this process (chDB or HTTP); never opened here.
        host: address to bind, e.g. "127.0.0.1"; there is no authentication, so bind narrowly.
        port: port to bind; 0 picks a free one (see `start`'s result).
        max_query_bytes: largest request body accepted; larger ones get HTTP 413.
    """

    def __init__(self, *, client: Client, host: str, port: int, max_query_bytes: int = 1 << 20,
                 lock: AbstractContextManager[Any] | None = None) -> None:
        self._gate = _Gate(client, lock)
        self._host, self._port, self._max_query_bytes = host, port, max_query_bytes
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> tuple[str, int]:
        """Bind, serve in a daemon thread, and return the bound (host, port)."""
        if self._server is not None:
            raise RuntimeError("store HTTP endpoint already started")
        self._gate.learn_server()
        server_class = _Server6 if ":" in self._host else _Server
        self._server = server_class((self._host, self._port), self._gate, self._max_query_bytes)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, name="store-http", daemon=True
        )
        self._thread.start()
        logger.info("store HTTP endpoint serving read-only on %s:%s", *self.address)
        return self.address

    @property
    def address(self) -> tuple[str, int]:
        """The bound (host, port) while serving."""
        if self._server is None:
            raise RuntimeError("store HTTP endpoint is not serving")
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop accepting requests, close the socket and wait up to `timeout_s` for the thread."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout_s)

    def __enter__(self) -> StoreHttpEndpoint:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
