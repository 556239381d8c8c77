#!/usr/bin/env python3
"""ridethrough-leader: run a command only while holding a Kubernetes Lease (one active controller).

    ridethrough-leader --lease NAME [--namespace NS] [--identity ID] -- ridethrough controller ...

Every replica runs this; one holds the Lease (``coordination.k8s.io/v1``) and runs the command,
the others wait as standbys. The rules are client-go's leader election:

* a candidate takes the Lease when it is free, or when its holder has not renewed it for
  ``lease_duration_s`` *as this candidate observed it* (its own monotonic clock, so clock skew
  between nodes does not matter);
* the leader renews every ``retry_period_s``; if it cannot renew for ``renew_deadline_s`` it
  stops the command (SIGTERM, then SIGKILL before the Lease can pass to another) and exits 1,
  so that Kubernetes restarts it as a standby;
* when the command exits, or the pod is told to stop, the Lease is released at once, so a
  standby takes over without waiting for it to expire.

``--health-listen`` serves ``GET /healthz`` (200 ``leader`` or ``standby`` while the loop runs).
Standard library only: it runs in the server image beside ``ridethrough``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("ridethrough-leader")
SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
Lease = dict[str, Any]


class Conflict(Exception):
    """Someone else changed the Lease first (HTTP 409): this attempt lost."""


class LeaseApi(Protocol):
    """Get, create and update one Lease; ``update`` fails with `Conflict` on a stale resourceVersion."""

    def get(self) -> Lease | None: ...
    def create(self, lease: Lease) -> Lease: ...
    def update(self, lease: Lease) -> Lease: ...


def micro_time(t: float) -> str:
    """A Kubernetes MicroTime: RFC 3339 in UTC with microseconds."""
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class KubeLeaseApi:
    """The Lease through the Kubernetes API, with the pod's service-account token (re-read: it rotates)."""

    base_url: str
    namespace: str
    name: str
    token_file: Path = SA_DIR / "token"
    ca_file: Path | None = SA_DIR / "ca.crt"
    timeout_s: float = 5.0

    def _url(self, named: bool) -> str:
        path = f"/apis/coordination.k8s.io/v1/namespaces/{self.namespace}/leases"
        return f"{self.base_url}{path}/{self.name}" if named else f"{self.base_url}{path}"

    def _call(self, method: str, url: str, body: Lease | None = None) -> Lease | None:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, method=method, headers={
            "Authorization": f"Bearer {self.token_file.read_text().strip()}",
            "Content-Type": "application/json", "Accept": "application/json"})
        context = ssl.create_default_context(cafile=str(self.ca_file)) if self.ca_file else None
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s, context=context) as response:
                answer: Lease = json.loads(response.read())
                return answer
        except urllib.error.HTTPError as exc:
            if exc.code == 404 and method == "GET":
                return None
            if exc.code == 409:
                raise Conflict(f"{method} {self.name}: conflict") from None
            raise

    def get(self) -> Lease | None:
        return self._call("GET", self._url(True))

    def create(self, lease: Lease) -> Lease:
        created = self._call("POST", self._url(False), lease)
        assert created is not None  # POST answers the object or raises
        return created

    def update(self, lease: Lease) -> Lease:
        updated = self._call("PUT", self._url(True), lease)
        assert updated is not None
        return updated


@dataclass
class Elector:
    """Acquire-or-renew one Lease for ``identity``; `try_acquire_or_renew` says whether it holds it now."""

    api: LeaseApi
    name: str
    identity: str
    lease_duration_s: float
    monotonic: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    _observed: tuple[str, str] | None = field(default=None, init=False)
    _observed_at: float = field(default=0.0, init=False)

    def _spec(self, now: float, old: dict[str, Any]) -> dict[str, Any]:
        spec = {**old, "holderIdentity": self.identity, "leaseDurationSeconds": int(self.lease_duration_s),
                "renewTime": micro_time(now)}
        if old.get("holderIdentity") != self.identity:
            spec["acquireTime"] = micro_time(now)
            spec["leaseTransitions"] = int(old.get("leaseTransitions", -1)) + 1
        return spec

    def try_acquire_or_renew(self) -> bool:
        """One attempt; False when another holds a live Lease or won the race (API errors propagate)."""
        lease = self.api.get()
        now = self.wall()
        if lease is None:
            try:
                self.api.create({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                                 "metadata": {"name": self.name}, "spec": self._spec(now, {})})
            except Conflict:
                return False
            return True
        spec = lease.get("spec", {})
        holder = spec.get("holderIdentity") or ""
        record = (holder, str(spec.get("renewTime", "")))
        if record != self._observed:
            self._observed, self._observed_at = record, self.monotonic()
        duration = float(spec.get("leaseDurationSeconds") or self.lease_duration_s)
        if holder and holder != self.identity and self.monotonic() - self._observed_at < duration:
            return False
        try:
            self.api.update({**lease, "spec": self._spec(now, spec)})
        except Conflict:
            return False
        return True

    def release(self) -> None:
        """Give the Lease up now if this identity holds it (best effort: it expires anyway)."""
        try:
            lease = self.api.get()
            if lease and lease.get("spec", {}).get("holderIdentity") == self.identity:
                spec = {**lease["spec"], "holderIdentity": "", "leaseDurationSeconds": 1,
                        "renewTime": micro_time(self.wall())}
                self.api.update({**lease, "spec": spec})
        except (Conflict, OSError) as exc:
            log.warning("could not release the lease (it will expire): %s", exc)


@dataclass
class Timing:
    """How often to try and how long a leader may go without renewing."""

    lease_duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_period_s < self.renew_deadline_s < self.lease_duration_s:
            raise ValueError("need 0 < retry_period_s < renew_deadline_s < lease_duration_s, got "
                             f"{self.retry_period_s}, {self.renew_deadline_s}, {self.lease_duration_s}")


@dataclass
class Leader:
    """The loop: wait as a standby, run ``command`` while leader, stop it when the Lease is lost."""

    elector: Elector
    command: Sequence[str]
    timing: Timing
    stop: threading.Event = field(default_factory=threading.Event)
    state: str = "standby"
    beat: float = field(default_factory=time.monotonic)

    def _attempt(self) -> bool:
        self.beat = time.monotonic()
        try:
            return self.elector.try_acquire_or_renew()
        except (OSError, ValueError) as exc:  # API unreachable or an answer that is not JSON
            log.warning("lease %s: %s", self.elector.name, exc)
            return False

    def run(self) -> int:
        """Block until the command ends, the Lease is lost (1) or `stop` is set (0 as a standby)."""
        while not self._attempt():
            if self.stop.wait(self.timing.retry_period_s):
                return 0
        log.info("%s leads %s: starting %s", self.elector.identity, self.elector.name, " ".join(self.command))
        self.state = "leader"
        child = subprocess.Popen(list(self.command))
        try:
            return self._lead(child)
        finally:
            self.elector.release()

    def _lead(self, child: subprocess.Popen[bytes]) -> int:
        renewed = time.monotonic()
        while True:
            if child.poll() is not None:
                return child.returncode
            if self.stop.wait(self.timing.retry_period_s):
                return _end(child, grace_s=self.timing.lease_duration_s)
            if self._attempt():
                renewed = time.monotonic()
            elif time.monotonic() - renewed > self.timing.renew_deadline_s:
                log.error("lease %s not renewed for %.1f s: stopping the command", self.elector.name,
                          self.timing.renew_deadline_s)
                # It must be dead before a standby may take the Lease over.
                _end(child, grace_s=max(0.1, self.timing.lease_duration_s - self.timing.renew_deadline_s - 1))
                return 1


def _end(child: subprocess.Popen[bytes], *, grace_s: float) -> int:
    child.terminate()
    try:
        return child.wait(grace_s)
    except subprocess.TimeoutExpired:
        child.kill()
        return child.wait()


def serve_health(leader: Leader, listen: str) -> ThreadingHTTPServer:
    """``GET /healthz``: 200 with the state while the loop has run lately, else 503."""
    host, _, port = listen.rpartition(":")
    stale_s = 3 * leader.timing.retry_period_s + leader.timing.renew_deadline_s

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            fresh = time.monotonic() - leader.beat < stale_s
            code = 200 if self.path == "/healthz" and fresh else (503 if self.path == "/healthz" else 404)
            body = (leader.state if code == 200 else "stale").encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # kubelet probes every few seconds: no access log
            pass

    server = ThreadingHTTPServer((host or "0.0.0.0", int(port)), Handler)
    threading.Thread(target=server.serve_forever, name="healthz", daemon=True).start()
    return server


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; the command to run follows ``--``."""
    args = list(sys.argv[1:] if argv is None else argv)
    command = args[args.index("--") + 1:] if "--" in args else []
    ap = argparse.ArgumentParser(prog="ridethrough-leader", description=__doc__.splitlines()[0])
    ap.add_argument("--lease", required=True)
    ap.add_argument("--namespace", default=os.environ.get("POD_NAMESPACE", ""))
    ap.add_argument("--identity", default=os.environ.get("POD_NAME", ""))
    ap.add_argument("--lease-duration-s", type=float, default=15.0)
    ap.add_argument("--renew-deadline-s", type=float, default=10.0)
    ap.add_argument("--retry-period-s", type=float, default=2.0)
    ap.add_argument("--health-listen", default="")
    opts = ap.parse_args(args[: args.index("--")] if "--" in args else args)
    if not command or not opts.namespace or not opts.identity:
        ap.error("needs a command after --, and --namespace/--identity (or POD_NAMESPACE/POD_NAME)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    timing = Timing(opts.lease_duration_s, opts.renew_deadline_s, opts.retry_period_s)
    host = os.environ.get("KUBERNETES_SERVICE_HOST", "kubernetes.default.svc")
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    api = KubeLeaseApi(f"https://{host}:{port}", opts.namespace, opts.lease)
    leader = Leader(Elector(api, opts.lease, opts.identity, timing.lease_duration_s), command, timing)
    signal.signal(signal.SIGTERM, lambda *_: leader.stop.set())
    signal.signal(signal.SIGINT, lambda *_: leader.stop.set())
    if opts.health_listen:
        serve_health(leader, opts.health_listen)
    return leader.run()


if __name__ == "__main__":
    sys.exit(main())
