"""Weight publishing: versions reach every subscriber whole and in order; bad frames are refused."""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import subprocess
import sys
import threading
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.conftest import ROOT, wait_for

torch = pytest.importorskip("torch")

from ridethrough.actuators.publish import (  # noqa: E402 - after the torch skip
    MAGIC,
    BadFrame,
    Kind,
    WeightPublisher,
    WeightSubscriber,
    read_head,
    send_frame,
)


def _state(value: float) -> dict[str, Any]:
    return {"embed": torch.full((64, 16), value), "head.bias": torch.full((7,), value, dtype=torch.bfloat16),
            "steps": torch.tensor(int(value)), "mask": torch.ones(3, dtype=torch.bool)}


@pytest.fixture
def publisher() -> Iterator[WeightPublisher]:
    pub = WeightPublisher()
    yield pub
    pub.close()


@pytest.fixture
def subscribe(publisher: WeightPublisher) -> Iterator[Callable[..., WeightSubscriber]]:
    subs: list[WeightSubscriber] = []

    def make(name: str, address: tuple[str, int] | None = None) -> WeightSubscriber:
        subs.append(WeightSubscriber(address or publisher.address, name=name, retry_s=0.05))
        return subs[-1]

    yield make
    for sub in subs:
        sub.close()


_REPLICA = r"""
import sys
from ridethrough.actuators.publish import WeightSubscriber
sub = WeightSubscriber(("127.0.0.1", int(sys.argv[1])), name=sys.argv[2])
have = sub.wait_for(3, timeout_s=120)
print(have.version, float(have.state["embed"].sum()), flush=True)
sub.close()
"""


@pytest.mark.integration
def test_every_subscriber_process_gets_each_version(publisher: WeightPublisher) -> None:
    replicas = [subprocess.Popen([sys.executable, "-c", _REPLICA, str(publisher.address[1]), f"replica-{i}"],
                                 stdout=subprocess.PIPE, text=True, cwd=ROOT) for i in range(3)]
    try:
        for version in (1, 2, 3):
            assert publisher.publish(_state(float(version))) == version
            assert publisher.wait_delivered(version, count=3, timeout_s=120)
            if version < 3:  # every replica swapped this one in (after the last one they leave the table)
                assert publisher.acked() == {f"replica-{i}": version for i in range(3)}
        for proc in replicas:
            out, _ = proc.communicate(timeout=60)
            assert out.split() == ["3", "3072.0"]
    finally:
        for proc in replicas:
            proc.kill()
            proc.wait(10)


def test_versions_only_grow_and_late_joiners_get_the_newest(publisher: WeightPublisher, subscribe) -> None:
    early = subscribe("early")
    assert publisher.publish(_state(1.0), version=5) == 5
    with pytest.raises(ValueError, match="not newer than the published 5"):
        publisher.publish(_state(2.0), version=5)
    assert publisher.publish(_state(2.0)) == 6
    late = subscribe("late")
    for sub in (early, late):
        have = sub.wait_for(6, timeout_s=30)
        assert have.version == 6 and torch.equal(have.state["embed"], torch.full((64, 16), 2.0))
    assert publisher.wait_delivered(6, count=2, timeout_s=30)


def test_a_reader_never_sees_a_torn_or_older_model(publisher: WeightPublisher, subscribe) -> None:
    sub = subscribe("replica")
    seen: list[int] = []
    problems: list[str] = []
    stop = threading.Event()

    def serve_requests() -> None:  # what a replica does per request: take one (version, state) pair
        while not stop.is_set():
            current = sub.current()
            if current is None:
                continue
            if seen and current.version < seen[-1]:
                problems.append(f"version went back from {seen[-1]} to {current.version}")
            values = {float(t.float().max()) for k, t in current.state.items() if k != "mask"}
            if values != {float(current.version)}:
                problems.append(f"version {current.version} holds values {values}")
            seen.append(current.version)

    reader = threading.Thread(target=serve_requests)
    reader.start()
    held = None
    try:
        for version in range(1, 31):
            publisher.publish(_state(float(version)))
            sub.wait_for(version, timeout_s=30)
            held = held or sub.current()
    finally:
        stop.set()
        reader.join(10)
    assert problems == []
    assert len(set(seen)) > 1
    assert held is not None and torch.equal(held.state["embed"], torch.full((64, 16), 1.0))  # old versions stay whole
    with pytest.raises(TypeError):
        held.state["embed"] = torch.zeros(1)  # a version is read-only


def _frame(kind: int, meta: dict[str, Any], payload: bytes = b"", *, magic: bytes = MAGIC, proto: int = 1,
           meta_crc: int | None = None, meta_len: int | None = None) -> bytes:
    body = json.dumps(meta).encode()
    crc = zlib.crc32(body) if meta_crc is None else meta_crc
    header = struct.pack("<4sBBHIQI", magic, proto, kind, 0, len(body) if meta_len is None else meta_len,
                         len(payload), crc)
    return header + body + payload


def _weights(version: int, payload: bytes, **entry) -> bytes:
    tensor = {"key": "w", "dtype": "float32", "shape": [len(payload) // 4], "offset": 0, "nbytes": len(payload),
              "crc32": zlib.crc32(payload), **entry}
    return _frame(Kind.WEIGHTS, {"version": version, "tensors": [tensor]}, payload)


GOOD = torch.arange(4, dtype=torch.float32).numpy().tobytes()

BAD_FRAMES = [
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "bad magic"),
    (_frame(Kind.WEIGHTS, {"version": 2}, proto=9), "protocol 9"),
    (_frame(Kind.WEIGHTS, {"version": 2}, meta_len=1 << 30), "over the limits"),
    (_frame(Kind.WEIGHTS, {"version": 2}, meta_crc=1), "meta fails its checksum"),
    (_weights(2, GOOD, crc32=12345), "tensor w fails its checksum"),
    (_weights(2, GOOD, shape=[5]), "do not fit shape"),
    (_weights(2, GOOD, dtype="evil"), "unknown dtype 'evil'"),
    (_weights(2, GOOD + bytes(4096), shape=[4], nbytes=16, crc32=zlib.crc32(GOOD)),
     "4112 payload bytes for tensors ending at 64"),
    (_weights(1, GOOD), "newer than version 1"),
    (_frame(Kind.ACK, {"version": 2}), "expected WEIGHTS"),
]


@pytest.mark.parametrize(("frame", "message"), BAD_FRAMES, ids=[m for _, m in BAD_FRAMES])
def test_a_bad_frame_is_refused_and_the_replica_keeps_its_version(frame: bytes, message: str, subscribe) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(30)
    sub = subscribe("replica", server.getsockname()[:2])
    conn, _ = server.accept()
    with conn:
        kind, meta, _ = read_head(conn, max_payload=0)
        assert (kind, meta) == (Kind.HELLO, {"name": "replica", "version": 0})
        conn.sendall(_weights(1, GOOD))
        kind, meta, _ = read_head(conn, max_payload=0)
        assert (kind, meta) == (Kind.ACK, {"version": 1})
        conn.sendall(frame)
        wait_for(lambda: sub.errors >= 1, timeout_s=30, what="the frame refused")
    assert message in (sub.last_error or "")
    current = sub.current()
    assert current is not None and current.version == 1
    assert torch.equal(current.state["w"], torch.arange(4, dtype=torch.float32))
    again, _ = server.accept()  # the replica drops the stream it can no longer trust and reconnects
    with again:
        assert read_head(again, max_payload=0)[1] == {"name": "replica", "version": 1}
    server.close()


def test_the_publisher_drops_a_peer_that_is_not_a_subscriber(publisher: WeightPublisher, subscribe) -> None:
    with socket.create_connection(publisher.address, timeout=30) as stranger:
        stranger.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        with contextlib.suppress(ConnectionResetError):  # reset, as the rest of what it sent was never read
            assert stranger.recv(1) == b""  # or closed on us
    assert "bad magic" in (publisher.last_error or "")
    publisher.publish(_state(1.0))
    assert subscribe("replica").wait_for(1, timeout_s=30).version == 1


def test_read_head_bounds_the_payload_before_reading_it() -> None:
    a, b = socket.socketpair()
    with a, b:
        send_frame(a, Kind.WEIGHTS, {"version": 1}, memoryview(bytes(100)))
        with pytest.raises(BadFrame, match="100 payload bytes is over the limits"):
            read_head(b, max_payload=99)


def test_a_subscriber_reconnects_to_a_restarted_publisher(subscribe) -> None:
    first = WeightPublisher()
    port = first.address[1]
    sub = subscribe("replica", first.address)
    first.publish(_state(1.0))
    sub.wait_for(1, timeout_s=30)
    first.close()  # the trainer goes away; the replica keeps serving version 1
    wait_for(lambda: sub.errors >= 1, timeout_s=30, what="the replica to notice")
    assert sub.current() is not None and sub.current().version == 1
    second = WeightPublisher(port=port)
    try:
        second.publish(_state(2.0), version=2)  # a restarted trainer goes on from its old numbers
        assert sub.wait_for(2, timeout_s=30).version == 2
        assert second.wait_delivered(2, count=1, timeout_s=30)
    finally:
        second.close()
