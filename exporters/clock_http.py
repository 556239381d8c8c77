"""``GET /clock/corrections``: the clock service's latest per-node corrections, as JSON.

A stdlib threaded HTTP server: agents poll it every window, so it is small and read-only. It
answers 503 until the service has a first solution.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ridethrough.exporters.clock_service import Snapshot

PATH = "/clock/corrections"


class ClockEndpoint:
    """Serves ``snapshot()`` at `PATH` on ``host:port`` (port 0: any free port)."""

    def __init__(self, *, snapshot: Callable[[], Snapshot | None], host: str, port: int) -> None:
        self._snapshot = snapshot
        self._host, self._port = host, port
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> tuple[str, int]:
        """Bind and serve in a thread; the bound (host, port)."""
        snapshot = self._snapshot

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?", 1)[0] != PATH:
                    self._reply(404, {"error": f"not found; try {PATH}"})
                    return
                snap = snapshot()
                if snap is None:
                    self._reply(503, {"error": "no clock solution yet"})
                else:
                    self._reply(200, snap.to_json())

            def _reply(self, status: int, doc: object) -> None:
                body = json.dumps(doc).encode()
                # an agent that gave up waiting (its poll timed out) asks again next window: no traceback
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # agents poll every window: no access log
                pass

        self._server = ThreadingHTTPServer((self._host, self._port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="clock-http", daemon=True)
        self._thread.start()
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def stop(self) -> None:
        """Stop serving and release the port."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
