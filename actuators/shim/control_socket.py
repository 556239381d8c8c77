"""A running job's local control endpoint: a Unix socket per launcher, and its clients.

Why a local socket: the launcher is the one process on a node that knows the job (its ranks,
their GPUs, the coordinator's store), and whoever may drive a job on a node already acts
locally: the operator's ``ridethrough snapshot JOB``, and the node agent, which runs the
controller's signed, traced commands (``job.migrate``, ``job.status``;
`ridethrough.actuators.job_commands`) and relays them here. The socket is
``<run_dir>/<job>-node<N>.sock``, mode 0600 (the launcher's user; the agent runs as root or as
that user), so no new network port and no new credentials: the control plane's authentication
stays the only way in from outside.

Protocol: one JSON request line, one JSON reply line. Requests::

    {"cmd": "status"}
    {"cmd": "snapshot"}
    {"cmd": "migrate", "ranks": [3], "reason": "..."}     global ranks, or
    {"cmd": "migrate", "local": [0, 1], "reason": "..."}  this node's local ranks (a GPU index), or
    {"cmd": "migrate", "node": "all", "reason": "..."}    every rank on this node

Every launcher forwards a request through the job store to the node-0 coordinator and relays its
answer (`Forwarder`), so a request may be sent to any node's socket.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ridethrough.actuators.shim import keys

log = logging.getLogger(__name__)
_MAX_REQUEST = 64 << 10


def socket_path(run_dir: str | os.PathLike[str], job: str, node: int) -> Path:
    """Where node ``node``'s launcher of ``job`` listens."""
    return Path(run_dir) / f"{job.replace('/', '_')}-node{node}.sock"


def find_socket(run_dir: str | os.PathLike[str], job: str) -> Path:
    """This machine's socket for ``job`` (the lowest node's); FileNotFoundError naming where it looked."""
    found = sorted(Path(run_dir).glob(f"{job.replace('/', '_')}-node*.sock"),
                   key=lambda p: int(p.stem.rsplit("node", 1)[1]) if p.stem.rsplit("node", 1)[1].isdigit() else 1 << 30)
    if not found:
        raise FileNotFoundError(f"no launcher of job {job!r} on this machine (no {job}-node*.sock in {run_dir})")
    return found[0]


def request(path: Path, doc: Mapping[str, Any], *, timeout_s: float) -> dict[str, Any]:
    """Send one request to a launcher's socket; its reply (ConnectionError/TimeoutError if it cannot answer)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(str(path))
        sock.sendall(json.dumps(dict(doc)).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"{path}: the launcher closed the connection without answering")
            data += chunk
    reply = json.loads(data)
    if not isinstance(reply, dict):
        raise ConnectionError(f"{path}: not a reply: {data[:200]!r}")
    return reply


class Forwarder:
    """Relays requests into the job store for the coordinator, and its answers back."""

    def __init__(self, store: keys.Store, *, node: int, nproc_per_node: int, world_size: int,
                 timeout_s: float) -> None:
        self._store, self._node, self._nproc, self._world = store, node, nproc_per_node, world_size
        self._timeout_s = timeout_s

    def __call__(self, doc: dict[str, Any]) -> dict[str, Any]:
        """Answer one request (see the module docstring)."""
        cmd = doc.get("cmd")
        if cmd not in ("status", "snapshot", "migrate"):
            return {"ok": False, "error": f"unknown cmd {cmd!r}; known: status, snapshot, migrate"}
        if cmd == "migrate":
            try:
                doc = {"cmd": "migrate", "ranks": self._ranks(doc), "reason": str(doc.get("reason", ""))[:200]}
            except ValueError as exc:
                return {"ok": False, "error": str(exc)}
        n = keys.append(self._store, keys.REQ_SEQ, keys.request, doc)
        reply = keys.poll(self._store, keys.request(n, "reply"), timeout_s=self._timeout_s, interval_s=0.05)
        if reply is None:
            return {"ok": False, "error": f"the coordinator did not answer within {self._timeout_s:g} s"}
        return dict(reply)

    def _ranks(self, doc: Mapping[str, Any]) -> list[int]:
        local = range(self._node * self._nproc, (self._node + 1) * self._nproc)
        if doc.get("node") == "all":
            return list(local)
        if "local" in doc:
            wanted = doc["local"] if isinstance(doc["local"], list) else [doc["local"]]
            if not all(isinstance(i, int) and 0 <= i < self._nproc for i in wanted):
                raise ValueError(f"local ranks must be in 0..{self._nproc - 1}, got {wanted}")
            return [local[i] for i in wanted]
        ranks = doc.get("ranks")
        if not isinstance(ranks, list) or not ranks or not all(isinstance(r, int) and 0 <= r < self._world
                                                                 for r in ranks):
            raise ValueError(f"ranks must be a non-empty list of ranks in 0..{self._world - 1}, got {ranks!r}")
        return ranks


class Server:
    """The socket server: a thread that answers each connection with ``handle`` (one request each)."""

    def __init__(self, path: Path, handle: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        self.path = path
        self._handle = handle
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)  # left by a launcher that was killed; ours is bound next
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(path))
        os.chmod(path, 0o600)
        self._sock.listen(16)
        self._sock.settimeout(0.2)
        self._stop = threading.Event()
        self._answering: list[threading.Thread] = []
        self._thread = threading.Thread(target=self._serve, name="rt-job-socket", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            thread = threading.Thread(target=self._answer, args=(conn,), name="rt-job-request", daemon=True)
            self._answering = [t for t in self._answering if t.is_alive()] + [thread]
            thread.start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5.0)
            try:
                data = b""
                while not data.endswith(b"\n") and len(data) < _MAX_REQUEST:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                doc = json.loads(data)
                reply = self._handle(doc) if isinstance(doc, dict) else {"ok": False, "error": "not a JSON object"}
            except (ValueError, OSError) as exc:
                reply = {"ok": False, "error": f"bad request: {exc}"}
            try:
                conn.sendall(json.dumps(reply).encode() + b"\n")
            except OSError as exc:
                log.warning("job socket: could not answer: %s", exc)

    def close(self, wait_s: float = 2.0) -> None:
        """Stop serving, let answers being written finish (up to ``wait_s``), remove the socket file."""
        self._stop.set()
        self._sock.close()
        self._thread.join(1.0)
        for thread in list(self._answering):
            thread.join(wait_s)
        self.path.unlink(missing_ok=True)
