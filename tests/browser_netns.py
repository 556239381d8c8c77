"""Chromium in a network namespace of its own, so the host's network changes never reach it.

Chromium watches the addresses of its network namespace (rtnetlink) and, when one is added or removed,
aborts every request in flight with ``net::ERR_NETWORK_CHANGED``, loopback ones included. A lab adds and
removes addresses in the root namespace each time one comes up or goes down (its management bridge and
the root ends of its management veths), and in CI a lab test runs beside the browser tests: a Dash
callback aborted that way is never retried, its figure keeps its "loading…" placeholder, and the page never
renders. In a namespace of its own Chromium sees only its loopback, which nothing changes.

The namespace is unnamed (``ip netns list`` does not show it; it goes with its last process): a holder
process made by ``unshare --net`` keeps it, Chromium is started in it through ``nsenter``, and each server a
test opens is forwarded into it at the same address and port, so URLs stay as they are. The forwarder
copies TCP bytes both ways and nothing else: Chromium still speaks HTTP (and basic auth) to the real server.
Where this process cannot make namespaces (not root, a container that forbids it), `BrowserNetns.start`
returns None and Chromium runs in the host's namespace; no lab can run there either.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

from ridethrough.lab.netns import setns, unavailable_reason

_CHUNK = 64 * 1024


class BrowserNetns:
    """An unnamed network namespace with its loopback up, and forwarders into it from this namespace."""

    def __init__(self, holder: subprocess.Popen[bytes], ns_fd: int) -> None:
        self._holder = holder
        self._ns_fd = ns_fd
        self._listeners: dict[tuple[str, int], socket.socket] = {}
        self._lock = threading.Lock()

    @classmethod
    def start(cls, *, timeout_s: float = 30.0) -> BrowserNetns | None:
        """A new namespace, or None where this process cannot make one (RuntimeError if making it fails)."""
        tools = [shutil.which(t) for t in ("unshare", "nsenter", "ip")]
        if unavailable_reason() is not None or not all(tools):
            return None
        # The holder brings the loopback up, then waits for its stdin to end: closed by `close`, or by the
        # kernel when this process dies, so no holder outlives its test run. /proc/PID/ns/net is the namespace.
        hold = "ip link set lo up && exec head -c 1"
        holder = subprocess.Popen([str(tools[0]), "--net", "--", "sh", "-c", hold],
                                  stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        while _comm(holder.pid) != "head":
            if holder.poll() is not None or time.monotonic() > deadline:
                holder.kill()
                _, err = holder.communicate()
                raise RuntimeError(f"could not make Chromium's network namespace: {err.decode(errors='replace')}")
            time.sleep(0.02)
        return cls(holder, os.open(f"/proc/{holder.pid}/ns/net", os.O_RDONLY))

    def launcher(self, executable: Path, where: Path) -> Path:
        """A script that runs ``executable`` (with its arguments) in the namespace: Playwright's executable_path.

        ``nsenter`` keeps the open file descriptors, among them the pipe Playwright drives Chromium through.
        """
        script = where / "chromium-in-netns"
        script.write_text(f'#!/bin/sh\nexec nsenter --net=/proc/{self._holder.pid}/ns/net -- {executable} "$@"\n')
        script.chmod(0o755)
        return script

    def expose(self, url: str) -> str:
        """Forward ``url``'s host and port from the namespace to this one; returns ``url`` (it holds in both)."""
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
        if host is None or port is None:
            raise ValueError(f"{url!r} names no host and port to forward")
        with self._lock:
            if (host, port) not in self._listeners:
                listener = self._listen_inside(host, port)
                self._listeners[(host, port)] = listener
                threading.Thread(target=self._accept, args=(listener, host, port), daemon=True,
                                 name=f"browser-netns-{port}").start()
        return url

    def close(self) -> None:
        """Stop forwarding and let the namespace go (Chromium, in it, is to be closed first)."""
        with self._lock:
            for listener in self._listeners.values():
                with contextlib.suppress(OSError):  # wakes the accept loop (close alone may not)
                    listener.shutdown(socket.SHUT_RDWR)
                _close(listener)
            self._listeners.clear()
        self._holder.kill()
        self._holder.wait(10)
        for pipe in (self._holder.stdin, self._holder.stderr):
            if pipe is not None:
                pipe.close()
        os.close(self._ns_fd)

    def _listen_inside(self, host: str, port: int) -> socket.socket:
        # A socket belongs to the namespace of the thread that made it: a short-lived thread moves in, makes
        # the listener and ends (setns moves only the calling thread, and this one is gone with it).
        made: list[socket.socket] = []
        failed: list[BaseException] = []

        def make() -> None:
            try:
                setns(self._ns_fd)
                made.append(socket.create_server((host, port)))
            except OSError as exc:
                failed.append(exc)

        thread = threading.Thread(target=make, name="browser-netns-listen")
        thread.start()
        thread.join()
        if failed:
            raise RuntimeError(f"cannot listen on {host}:{port} in Chromium's namespace: {failed[0]}") from failed[0]
        return made[0]

    def _accept(self, listener: socket.socket, host: str, port: int) -> None:
        while True:
            try:
                inside, _ = listener.accept()
            except OSError:  # closed: forwarding is over
                return
            try:
                outside = socket.create_connection((host, port), timeout=30)
                outside.settimeout(None)
            except OSError:  # the server is gone: Chromium sees its connection close, as it would
                _close(inside)
                continue
            threading.Thread(target=_bridge, args=(inside, outside), daemon=True, name="browser-netns-conn").start()


def _bridge(inside: socket.socket, outside: socket.socket) -> None:
    """Copy both ways until both ends have finished, then close both."""
    other = threading.Thread(target=_pump, args=(outside, inside), daemon=True, name="browser-netns-pump")
    other.start()
    _pump(inside, outside)
    other.join()
    _close(inside)
    _close(outside)


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy ``src`` to ``dst`` until ``src`` ends, then pass the end on (the other direction may go on)."""
    try:
        while data := src.recv(_CHUNK):
            dst.sendall(data)
        dst.shutdown(socket.SHUT_WR)
    except OSError:  # a reset on either side ends both directions
        _close(src)
        _close(dst)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""
