"""Hear link changes from the kernel as they happen, so a port that goes down is reported at once.

Polling sysfs every interval finds a carrier loss up to an interval late, and the export after it
adds up to another: two seconds before a controller can see a cut cable. The kernel announces every
change of an interface's state (carrier, operstate, flags, MTU, an interface added or removed) to
the rtnetlink link group (``RTNLGRP_LINK``) the moment it happens. `LinkWatch` listens there from
a thread of its own and calls ``on_change``: the agent then reads its link-state sources and exports
straight away (`ridethrough.collector.agent.Agent.collect_now`). The messages only say *when* to
look; what is reported is still what sysfs reads, so polling and waking give the same samples.

A burst (a flapping link, a host bringing up many interfaces) is coalesced: at most one call per
``min_gap_s``, the last change of a burst never lost. A receive buffer that overflows (``ENOBUFS``:
changes were dropped by the kernel) counts as a change. A message too short to parse is counted and
skipped. Where no rtnetlink socket can be opened (not Linux, no permission), `start` says so and
the agent keeps polling.
"""

from __future__ import annotations

import errno
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

NETLINK_ROUTE = 0
RTMGRP_LINK = 0x1
"""The link group's bit in a netlink socket's legacy group mask (``RTNLGRP_LINK`` is group 1)."""
RTM_NEWLINK, RTM_DELLINK = 16, 17
_HDR = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, seq, pid
RECV_BYTES = 65536
POLL_S = 0.5  # how often the thread looks at its stop flag when the kernel is quiet


def link_messages(data: bytes) -> tuple[int, int]:
    """(link change messages, malformed messages) in one datagram of netlink messages."""
    changes = bad = 0
    offset = 0
    while offset + _HDR.size <= len(data):
        length, kind, _, _, _ = _HDR.unpack_from(data, offset)
        if length < _HDR.size or offset + length > len(data):
            return changes, bad + 1  # the rest cannot be framed
        if kind in (RTM_NEWLINK, RTM_DELLINK):
            changes += 1
        offset += (length + 3) & ~3  # NLMSG_ALIGN
    if offset < len(data) and len(data) - offset >= 4:  # trailing bytes too short for a header
        bad += 1
    return changes, bad


class LinkWatch:
    """A thread on an rtnetlink socket subscribed to link changes; calls ``on_change`` for each burst."""

    def __init__(self, on_change: Callable[[], None], *, min_gap_s: float = 0.2,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._on_change = on_change
        self._gap = min_gap_s
        self._clock = clock
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_call = float("-inf")
        self._owed = False  # a change arrived within the gap: call once it has passed
        self.changes = 0
        """Link change messages received (an overflow counts as one)."""
        self.calls = 0
        """Times ``on_change`` was called."""
        self.malformed = 0
        """Messages that could not be parsed."""

    def start(self) -> bool:
        """Subscribe and start the thread; False (and a log line) where rtnetlink is not available."""
        try:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE)
        except (OSError, AttributeError) as exc:  # AttributeError: no AF_NETLINK on this platform
            log.info("link changes will be polled, not heard: no rtnetlink socket (%s)", exc)
            return False
        try:
            sock.bind((0, RTMGRP_LINK))
        except OSError as exc:
            sock.close()
            log.info("link changes will be polled, not heard: cannot join the link group (%s)", exc)
            return False
        self._sock = sock
        self._thread = threading.Thread(target=self._run, name="rt-agent-links", daemon=True)
        self._thread.start()
        return True

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop the thread and close the socket."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _run(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            changed = self._receive(self._sock)
            self._owed = self._owed or changed
            if self._owed and self._clock() - self._last_call >= self._gap:
                self._owed = False
                self._last_call = self._clock()
                self.calls += 1
                try:
                    self._on_change()
                except Exception:  # the watcher outlives a bad callback; the agent still polls
                    log.exception("link change callback failed")

    def _receive(self, sock: socket.socket) -> bool:
        """Wait for one datagram (at most one poll, or what is left of the gap when a call is owed)."""
        wait_s = max(0.001, self._gap - (self._clock() - self._last_call)) if self._owed else POLL_S
        try:
            sock.settimeout(wait_s)
            data = sock.recv(RECV_BYTES)
        except TimeoutError:
            return False
        except OSError as exc:
            if exc.errno == errno.ENOBUFS:  # the kernel dropped changes: something did change
                self.changes += 1
                return True
            if self._stop.is_set():
                return False
            log.warning("link watch receive failed: %s", exc)
            self._stop.wait(POLL_S)
            return False
        changes, bad = link_messages(data)
        self.changes += changes
        self.malformed += bad
        return changes > 0
