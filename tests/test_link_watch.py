"""The agent hears the kernel's link changes: parsing what rtnetlink sends, and a real interface going down."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import threading
import uuid
from collections.abc import Iterator

import pytest

from ridethrough.collector.link_watch import RTM_DELLINK, RTM_NEWLINK, LinkWatch, link_messages
from ridethrough.lab import netns
from tests.conftest import wait_for

REASON = netns.unavailable_reason()


def message(kind: int, body: bytes = b"\0" * 16) -> bytes:
    raw = struct.pack("=IHHII", 16 + len(body), kind, 0, 0, 0) + body
    return raw + b"\0" * (-len(raw) % 4)


def test_link_messages_are_counted_and_others_ignored() -> None:
    assert link_messages(message(RTM_NEWLINK) + message(24) + message(RTM_DELLINK)) == (2, 0)
    assert link_messages(b"") == (0, 0)


@pytest.mark.parametrize("data", [
    struct.pack("=IHHII", 8, RTM_NEWLINK, 0, 0, 0),  # a length shorter than the header itself
    struct.pack("=IHHII", 400, RTM_NEWLINK, 0, 0, 0) + b"\0" * 16,  # a length past the datagram
    message(RTM_NEWLINK) + b"\x01\x02\x03\x04\x05",  # trailing bytes that frame nothing
])
def test_malformed_messages_are_counted_not_fatal(data: bytes) -> None:
    changes, bad = link_messages(data)
    assert bad == 1 and changes <= 1


def test_a_burst_is_coalesced_and_its_last_change_kept() -> None:
    calls: list[int] = []
    watch = LinkWatch(lambda: calls.append(1), min_gap_s=0.3)
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    watch._sock = right  # the watcher's loop over a socket we write the kernel's side of
    watch._thread = threading.Thread(target=watch._run, daemon=True)
    watch._thread.start()
    try:
        for _ in range(20):
            left.send(message(RTM_NEWLINK))
        wait_for(lambda: watch.changes == 20 and len(calls) == 2, timeout_s=10,
                 what="one call for the first change, one for the rest of the burst")
    finally:
        watch.stop()
        left.close()
    assert len(calls) == 2


@pytest.fixture
def namespace() -> Iterator[str]:
    if REASON is not None:
        pytest.skip(REASON)
    name = f"rtlw{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    yield name
    subprocess.run(["ip", "netns", "del", name], check=False)


def _start_in(name: str, watch: LinkWatch) -> bool:
    """Start ``watch`` from a thread inside namespace ``name`` (its socket hears that namespace)."""
    started: list[bool] = []

    def enter_and_start() -> None:
        fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
        try:
            netns.setns(fd)
        finally:
            os.close(fd)
        started.append(watch.start())

    worker = threading.Thread(target=enter_and_start)
    worker.start()
    worker.join()
    return started == [True]


@pytest.mark.integration
def test_an_interface_going_down_is_heard_at_once(namespace: str) -> None:
    calls: list[int] = []
    watch = LinkWatch(lambda: calls.append(1), min_gap_s=0.05)
    subprocess.run(["ip", "-n", namespace, "link", "add", "a0", "type", "veth", "peer", "name", "b0"], check=True)
    subprocess.run(["ip", "-n", namespace, "link", "set", "b0", "up"], check=True)
    assert _start_in(namespace, watch)
    try:
        subprocess.run(["ip", "-n", namespace, "link", "set", "a0", "up"], check=True)
        wait_for(lambda: calls, timeout_s=10, what="the link change heard")
        before = len(calls)
        subprocess.run(["ip", "-n", namespace, "link", "set", "a0", "down"], check=True)
        wait_for(lambda: len(calls) > before, timeout_s=10, what="the link going down heard")
    finally:
        watch.stop()
    assert watch.malformed == 0
