"""Responder and prober on loopback: kernel stamps, coded pairs, spoofed and malformed packets, suspension."""

from __future__ import annotations

import contextlib
import errno
import random
import select
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ridethrough.collector.clock import ClockScript, ScriptedClock
from ridethrough.collector.probe_responder import Responder
from ridethrough.collector.probe_sample import ProbeSample, TimestampKind
from ridethrough.collector.probe_stall import StallMeter
from ridethrough.collector.probe_wire import (
    DropReason,
    Endpoint,
    Probe,
    Reply,
    decode,
    encode,
    reply_to,
)
from ridethrough.collector.prober import PathStatus, Prober, ProberSettings
from ridethrough.collector.timestamps import (
    SO_TIMESTAMPING,
    SO_TIMESTAMPNS,
    HostTime,
    Received,
    _with_timestamps,
    open_probe_socket,
    parse_errqueue,
    parse_rx_cmsgs,
)
from tests.conftest import wait_for

LINUX = sys.platform.startswith("linux")
FAST = ProberSettings(interval_s=0.05, timeout_s=0.5)
A0, B0, B1 = Endpoint("a", "nic0"), Endpoint("b", "nic0"), Endpoint("b", "nic1")


class FakeMono:
    """Monotonic seconds that move only when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@contextlib.contextmanager
def pair(*, settings: ProberSettings = FAST, responder_time: HostTime | None = None,
         **responder_kw: object) -> Iterator[tuple[Responder, Prober, list[ProbeSample]]]:
    """Node b answering on 127.0.0.2/.3, node a probing it from 127.0.0.4/.5, both running."""
    responder = Responder(node="b", listen={"nic0": ("127.0.0.2", 0), "nic1": ("127.0.0.3", 0)},
                          host_time=responder_time, **responder_kw)  # type: ignore[arg-type]
    responder.start()
    samples: list[ProbeSample] = []
    prober = Prober(node="a", local={"nic0": "127.0.0.4", "nic1": "127.0.0.5"}, peers={"b": responder.addresses},
                    on_sample=samples.append, settings=settings)
    prober.start()
    try:
        yield responder, prober, samples
    finally:
        prober.stop(timeout_s=2.0)
        responder.stop(timeout_s=2.0)


def probe_bytes(seq: int, *, src: Endpoint = A0, dst: Endpoint = B0, t1_ns: int | None = None) -> bytes:
    return encode(Probe(seq, seq, 0, 42, t1_ns or time.time_ns(), TimestampKind.USER, src, dst))


def free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


# -- the happy path --------------------------------------------------------------------------------------


def test_a_settled_prober_sends_no_more_and_its_counts_add_up() -> None:
    with pair() as (_, prober, samples):
        wait_for(lambda: len(samples) >= 10, timeout_s=10, what="10 samples")
        assert prober.settle(2.0)
        before = prober.paths()
        time.sleep(3 * FAST.interval_s)
        after = prober.paths()
    assert [p.sent for p in after] == [p.sent for p in before]  # no round went out while settling
    assert all(p.sent == p.received + p.lost and p.sent > 0 for p in after), after


@pytest.mark.skipif(not LINUX, reason="kernel timestamps are Linux's")
def test_probes_over_both_nics_give_kernel_stamped_samples_in_coded_pairs() -> None:
    with pair() as (responder, prober, samples):
        wait_for(lambda: len(samples) >= 40, timeout_s=10, what="40 samples")
        paths = prober.paths()
    assert {s.path for s in samples} == {("a", "nic0", "b", "nic0"), ("a", "nic1", "b", "nic1")}
    for s in samples:
        assert s.rx_kind is TimestampKind.KERNEL
        assert s.t1_ns <= s.t2_ns <= s.t3_ns <= s.t4_ns  # one clock on one host
        assert 0 < s.rtt_ns < 50_000_000
    assert prober.tx_stamped > 0  # loopback gives send stamps from the error queue
    by_pair: dict[int, set[int]] = {}
    for s in samples:
        by_pair.setdefault(s.pair_id, set()).add(s.pair_index)
    assert sum(indices == {0, 1} for indices in by_pair.values()) >= 15
    gaps = [b.t1_ns - a.t1_ns for a in samples for b in samples
            if a.pair_id == b.pair_id and a.path == b.path and (a.pair_index, b.pair_index) == (0, 1)]
    # the 20 µs gap between the sends, give or take how long each took before the kernel stamped it
    assert min(gaps) >= 5_000 and sorted(gaps)[len(gaps) // 2] >= 15_000
    assert all(p.lost == 0 and p.received > 0 and not p.suspended for p in paths)
    assert sum(responder.answered().values()) >= 40
    assert not any(prober.dropped().values()) and not any(responder.dropped().values())


def test_every_stamp_is_on_the_hosts_clock(tmp_path: Path) -> None:
    """The responder's clock runs 5 ms ahead: its t2 and t3 (kernel and user stamps alike) show it."""
    ClockScript(tmp_path / "clock.json").set(5_000_000, 0.0)
    with pair(responder_time=HostTime(ScriptedClock(tmp_path / "clock.json"))) as (_, _, samples):
        wait_for(lambda: len(samples) >= 10, timeout_s=10, what="samples")
    for s in samples:
        assert 5_000_000 <= s.t2_ns - s.t1_ns < 6_000_000
        assert -5_000_000 < s.t4_ns - s.t3_ns <= -4_000_000
        assert 0 < s.rtt_ns < 1_000_000


def test_host_time_maps_true_time_onto_any_clock(tmp_path: Path) -> None:
    assert HostTime().to_local(123) == 123
    ClockScript(tmp_path / "c.json").set(-2_000_000, 0.0, epoch_ns=0)
    assert HostTime(ScriptedClock(tmp_path / "c.json")).to_local(10**18) == 10**18 - 2_000_000
    ahead = HostTime(lambda: time.time_ns() + 7_000_000)
    assert abs(ahead.to_local(10**18) - (10**18 + 7_000_000)) < 1_000_000


def test_cmsg_parsers_read_captured_stamps() -> None:
    ts = b"\x1e\x1a\rk\x00\x00\x00\x00\x0e\xa7w\x02\x00\x00\x00\x00"
    expected = 0x6B0D1A1E * 10**9 + 0x0277A70E
    assert parse_rx_cmsgs([(1, 37, ts + b"\0" * 32)]) == (expected, TimestampKind.KERNEL)
    assert parse_rx_cmsgs([(1, 35, ts)]) == (expected, TimestampKind.KERNEL)
    assert parse_rx_cmsgs([(1, 37, ts + b"\0" * 16 + ts)]) == (expected, TimestampKind.HARDWARE)
    assert parse_rx_cmsgs([(1, 37, b"\0" * 48), (0, 8, b"xx"), (1, 37, b"short")]) is None
    err = b"*\x00\x00\x00\x04\x00\x00\x00\x00\x00\x00\x00\x07\x00\x00\x00" + b"\0" * 16
    stamp = parse_errqueue([(1, 37, ts + b"\0" * 32), (0, 11, err)])
    assert stamp is not None and (stamp.key, stamp.true_ns, stamp.kind) == (7, expected, TimestampKind.KERNEL)
    icmp = b"\x6f\x00\x00\x00\x02" + b"\0" * 27  # ECONNREFUSED from ICMP: not a stamp
    assert parse_errqueue([(0, 11, icmp)]) is None and parse_errqueue([(1, 37, ts + b"\0" * 32)]) is None


@pytest.mark.skipif(not LINUX, reason="Linux socket options")
def test_a_probe_socket_reports_what_it_can_stamp() -> None:
    sock = open_probe_socket("127.0.0.1", 0)
    try:
        assert sock.rx_kind is TimestampKind.KERNEL and sock.tx_timestamps
        # The kernel turns receive stamping on for the whole stack a moment after the first socket asks
        # (net_enable_timestamp defers it), so a datagram in that moment may come unstamped: send until
        # one is kernel-stamped.
        for attempt in range(50):
            key, before = sock.send(b"x" * 10, sock.address)
            assert key == attempt and before > 0
            got = wait_for(sock.recv, timeout_s=5, what="own datagram")
            assert got.payload == b"x" * 10
            if got.kind is TimestampKind.KERNEL:
                break
            time.sleep(0.05)
        assert got.kind is TimestampKind.KERNEL and got.rx_true_ns >= before
        stamps: list[Any] = []
        wait_for(lambda: stamps.extend(sock.tx_stamps()) or any(s.key == key for s in stamps), timeout_s=5,
                 what="send stamp")
        stamp = next(s for s in stamps if s.key == key)
        assert before <= stamp.true_ns <= got.rx_true_ns
    finally:
        sock.close()


class _OldKernel(socket.socket):
    """A socket refusing the socket options a kernel may lack (``refused``)."""

    refused: frozenset[int] = frozenset()

    def setsockopt(self, level: int, option: int, value: object) -> None:  # type: ignore[override]
        if option in self.refused:
            raise OSError(errno.ENOPROTOOPT, "Protocol not available")
        super().setsockopt(level, option, value)  # type: ignore[call-overload]


@pytest.mark.parametrize(("refused", "rx_kind", "tx"), [
    (frozenset({SO_TIMESTAMPING}), TimestampKind.KERNEL, False),
    (frozenset({SO_TIMESTAMPING, SO_TIMESTAMPNS}), TimestampKind.USER, False),
])
def test_probe_sockets_fall_back_to_what_the_kernel_offers(refused: frozenset[int], rx_kind: TimestampKind,
                                                           tx: bool) -> None:
    sock = _OldKernel(socket.AF_INET, socket.SOCK_DGRAM)
    sock.refused = refused
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    probe_sock = _with_timestamps(sock, True, False)
    try:
        assert (probe_sock.rx_kind, probe_sock.tx_timestamps) == (rx_kind, tx)
        before = time.time_ns()
        assert probe_sock.send(b"x", probe_sock.address)[0] == -1  # no send stamp to key
        got = wait_for(probe_sock.recv, timeout_s=5, what="own datagram")
        assert got.kind is rx_kind and before <= got.rx_true_ns <= time.time_ns()
        assert probe_sock.tx_stamps() == []
    finally:
        probe_sock.close()


# -- the responder's checks ------------------------------------------------------------------------------


def test_the_responder_drops_and_counts_spoofed_probes_and_answers_the_rest() -> None:
    responder = Responder(node="b", listen={"nic0": ("127.0.0.2", 0)}, known_nodes=lambda: {"a", "b"})
    responder.start()
    attacker = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    attacker.bind(("127.0.0.9", 0))
    attacker.settimeout(5)
    to = responder.addresses["nic0"]
    try:
        attacker.sendto(probe_bytes(1), to)
        reply = decode(attacker.recv(1000))
        assert isinstance(reply, Reply) and (reply.seq, reply.rx_count, reply.epoch) == (1, 1, responder.epoch)
        assert reply.t1_ns <= reply.t2_ns <= reply.t3_ns and reply.rx_kind is TimestampKind.KERNEL
        bad = {DropReason.REPLAYED: probe_bytes(1),
               DropReason.UNKNOWN_NODE: probe_bytes(2, src=Endpoint("mallory", "nic0")),
               DropReason.WRONG_DESTINATION: probe_bytes(3, dst=B1),
               DropReason.FUTURE: probe_bytes(4, t1_ns=time.time_ns() + 5 * 10**9),
               DropReason.PAST: probe_bytes(5, t1_ns=time.time_ns() - 5 * 10**9),
               DropReason.UNEXPECTED_TYPE: encode(reply),
               DropReason.LENGTH: b"RT\x01",
               DropReason.MAGIC: b"\0" * 192}
        for packet in bad.values():
            attacker.sendto(packet, to)
        attacker.sendto(probe_bytes(6), to)
        reply = decode(attacker.recv(1000))
        assert isinstance(reply, Reply) and (reply.seq, reply.rx_count) == (6, 2)
        wait_for(lambda: all(responder.dropped()[r] == 1 for r in bad), timeout_s=5, what="every drop counted")
        wait_for(lambda: responder.answered() == {"nic0": 2}, timeout_s=5, what="two answered")
    finally:
        attacker.close()
        responder.stop(timeout_s=2.0)


def test_a_flood_from_one_source_is_rate_limited() -> None:
    responder = Responder(node="b", listen={"nic0": ("127.0.0.2", 0)}, per_source_rate=1.0, per_source_burst=5.0,
                          monotonic=FakeMono())
    responder.start()
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as flood:
            for seq in range(1, 31):
                flood.sendto(probe_bytes(seq), responder.addresses["nic0"])
            wait_for(lambda: sum(responder.answered().values()) + responder.dropped()[DropReason.RATE_LIMITED] == 30,
                     timeout_s=5, what="30 probes handled")
        assert responder.answered() == {"nic0": 5}
    finally:
        responder.stop(timeout_s=2.0)


def test_a_starved_responder_judges_what_it_drains_by_when_it_arrived() -> None:
    """Two seconds of probes read at once: within the rate by their arrival, and sent in time, so all answered."""
    responder = Responder(node="b", listen={"nic0": ("127.0.0.2", 0)}, per_source_rate=10.0, per_source_burst=2.0,
                          max_skew_s=1.0, monotonic=FakeMono())
    responder.open()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as prober:
        prober.bind(("127.0.0.9", 0))
        prober.settimeout(5)
        now = time.time_ns()
        # 10 probes, one every 0.2 s (5 a second, half the limit); each sent 1 ms before it arrived, the first
        # 2.2 s ago: the responder reads them all now
        for i in range(10):
            arrived = now - 2_200_000_000 + i * 200_000_000
            received = Received(probe_bytes(i + 1, t1_ns=arrived - 1_000_000), prober.getsockname(), arrived,
                                TimestampKind.KERNEL)
            responder.handle("nic0", responder._sockets["nic0"], received)
        assert responder.answered() == {"nic0": 10}, responder.dropped()
        late = Received(probe_bytes(11, t1_ns=now - 1_500_000_000), prober.getsockname(), now - 100_000_000,
                        TimestampKind.KERNEL)
        responder.handle("nic0", responder._sockets["nic0"], late)  # it did take 1.4 s to arrive: too old
        assert responder.dropped()[DropReason.PAST] == 1
        for i in range(5):  # a flood is still one: five arriving at once, the burst is two
            responder.handle("nic0", responder._sockets["nic0"], Received(
                probe_bytes(20 + i), prober.getsockname(), time.time_ns(), TimestampKind.KERNEL))
        assert responder.dropped()[DropReason.RATE_LIMITED] >= 3
    responder.close()


@pytest.mark.skipif(not LINUX, reason="kernel timestamps are Linux's")
def test_garbage_at_the_responder_and_the_prober_is_dropped_while_probing_goes_on() -> None:
    with pair() as (responder, prober, samples):
        attacker = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        targets = [responder.addresses["nic0"], prober.addresses["nic0"]]
        sent = [0, 0]
        valid = encode(Probe(1, 1, 0, 1, time.time_ns(), TimestampKind.USER, A0, B0))

        @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(st.one_of(st.binary(max_size=300), st.binary(min_size=1, max_size=40).map(lambda b: valid[:-len(b)] + b),
                         st.tuples(st.integers(0, 191), st.integers(0, 255)).map(
                             lambda c: valid[:c[0]] + bytes([c[1]]) + valid[c[0] + 1:])), st.integers(0, 1))
        def send(data: bytes, where: int) -> None:
            attacker.sendto(data, targets[where])
            sent[where] += 1
            time.sleep(0.001)  # stay under the responder's per-source rate limit now and then

        try:
            send()
            handled = lambda: (sum(responder.dropped().values()) + responder.answered()["nic0"],  # noqa: E731
                               sum(prober.dropped().values()))
            wait_for(lambda: handled()[0] >= sent[0] and handled()[1] >= sent[1], timeout_s=10,
                     what=f"{sent} garbage datagrams counted")
            before = len(samples)
            wait_for(lambda: len(samples) > before + 10, timeout_s=10, what="probing to go on")
        finally:
            attacker.close()
        assert all(p.lost == 0 for p in prober.paths())


# -- the prober's checks ---------------------------------------------------------------------------------


class ScriptedPeer:
    """A peer whose replies the test writes: node b's nic0 as a plain socket."""

    def __init__(self, addr: str = "127.0.0.12") -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((addr, 0))
        self.sock.settimeout(5)
        self.address: tuple[str, int] = self.sock.getsockname()

    def probe(self) -> tuple[Probe, tuple[str, int]]:
        data, sender = self.sock.recvfrom(1000)
        packet = decode(data)
        assert isinstance(packet, Probe)
        return packet, sender

    def reply(self, probe: Probe, to: tuple[str, int], **over: int) -> bytes:
        t2 = over.pop("t2_ns", time.time_ns())
        fields = {"t2_ns": t2, "t3_ns": t2 + 1000, "rx_count": 1, "epoch": 9, **over}
        data = encode(reply_to(probe, rx_kind=TimestampKind.KERNEL, tx_kind=TimestampKind.USER, **fields))
        self.sock.sendto(data, to)
        return data


def test_the_prober_drops_spoofed_replayed_and_impossible_replies() -> None:
    peer, samples, mono = ScriptedPeer(), [], FakeMono()
    prober = Prober(node="a", local={"nic0": "127.0.0.11"}, peers={"b": {"nic0": peer.address}},
                    on_sample=samples.append, settings=ProberSettings(interval_s=1.0, timeout_s=5.0), monotonic=mono)
    prober.open()
    stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        mono.now += 2.0
        prober.tick(mono.now)
        (first, to), (second, _) = peer.probe(), peer.probe()
        assert (first.pair_id, first.pair_index, second.pair_id, second.pair_index) == (
            first.pair_id, 0, first.pair_id, 1)
        replies = {
            DropReason.UNKNOWN_SEQ: lambda: peer.reply(Probe(first.seq + 99, *_rest(first)), to),
            DropReason.BAD_COOKIE: lambda: peer.reply(Probe(first.seq, first.pair_id, 0, first.cookie ^ 1,
                                                            *_rest(first)[3:]), to),
            DropReason.FUTURE: lambda: peer.reply(first, to, t2_ns=first.t1_ns + 3 * 10**9),
            DropReason.PAST: lambda: peer.reply(first, to, t2_ns=first.t1_ns - 3 * 10**9),
            DropReason.INCONSISTENT: lambda: peer.reply(first, to, t3_ns=first.t1_ns + 4 * 10**9),
            DropReason.UNEXPECTED_TYPE: lambda: peer.sock.sendto(encode(first), to),
            DropReason.WRONG_PEER: lambda: stranger.sendto(encode(reply_to(
                first, t2_ns=time.time_ns(), t3_ns=time.time_ns(), rx_kind=TimestampKind.KERNEL,
                tx_kind=TimestampKind.USER, rx_count=1, epoch=9)), to),
        }
        for send in replies.values():
            send()
        good = peer.reply(first, to)
        peer.sock.sendto(good, to)  # the same reply again: a replay
        wait_for(lambda: pump(prober) and len(samples) == 1 and prober.dropped()[DropReason.REPLAYED] == 1,
                 timeout_s=5, what="the good reply and its replay")
        dropped = prober.dropped()
        assert {r: dropped[r] for r in replies} == dict.fromkeys(replies, 1)
        assert samples[0].seq == first.seq and samples[0].pair_index == 0
        mono.now += 16.0
        prober.tick(mono.now)  # the second probe is judged: no later round answered by the end of late_s
        peer.reply(second, to)
        wait_for(lambda: pump(prober) and prober.dropped()[DropReason.LATE] == 1, timeout_s=5, what="late")
        status = prober.paths()[0]
        assert (status.sent, status.received, status.lost, status.unknown) == (4, 1, 0, 1)  # a new round went out
    finally:
        stranger.close()
        prober.close()
        peer.sock.close()


@pytest.mark.skipif(not LINUX, reason="kernel timestamps are Linux's")
def test_answers_waiting_while_the_prober_was_stalled_are_received_not_lost() -> None:
    """The prober's thread did not run for 6 s (a starved host); both probes were answered at once, and the
    answers waited in its socket: they are received. The control: of a later pair the peer answers one in time
    (by the kernel's stamps) only after the prober stopped waiting; the other, of the same round, waits for a
    later round's answer, or for the end of ``late_s``: unknown then, as the peer said nothing since."""
    peer, samples, mono = ScriptedPeer(), [], FakeMono()
    prober = Prober(node="a", local={"nic0": "127.0.0.13"}, peers={"b": {"nic0": peer.address}},
                    on_sample=samples.append, settings=ProberSettings(interval_s=1.0, timeout_s=5.0), monotonic=mono)
    prober.open()
    try:
        mono.now += 2.0
        prober.tick(mono.now)  # the first round (its phase is under a second)
        (first, to), (second, _) = peer.probe(), peer.probe()
        peer.reply(first, to)
        peer.reply(second, to)
        time.sleep(0.2)  # both reach the prober's socket; nothing reads it
        mono.now += 6.0
        prober.tick(mono.now)  # and a second round goes out
        status = prober.paths()[0]
        assert (status.received, status.lost, len(samples)) == (2, 0, 2)
        (third, _), _ = peer.probe(), peer.probe()
        mono.now += 6.0
        prober.tick(mono.now)  # the second round is overdue: the peer has answered nothing sent since
        assert (prober.paths()[0].lost, prober.paths()[0].unknown) == (0, 0)
        peer.reply(third, to)
        wait_for(lambda: pump(prober) and prober.paths()[0].received == 3, timeout_s=5, what="the third reply")
        prober.tick(mono.now)
        status = prober.paths()[0]
        assert (status.received, status.late, status.lost, status.unknown) == (3, 0, 0, 0)
        mono.now += 10.0
        prober.tick(mono.now)
        status = prober.paths()[0]
        assert (status.received, status.late, status.lost, status.unknown) == (3, 0, 0, 1)
    finally:
        prober.close()
        peer.sock.close()


def pump(prober: Prober) -> bool:
    """Handle what reached a prober that runs without its thread; True, for use in a condition."""
    prober.poll(0.05)
    return True


def _rest(p: Probe) -> tuple[object, ...]:
    return p.pair_id, p.pair_index, p.cookie, p.t1_ns, p.tx_kind, p.src, p.dst


def test_a_silent_path_is_suspended_then_retried_with_backoff_until_it_answers() -> None:
    samples: list[ProbeSample] = []
    run = Stepped("127.0.0.21", "127.0.0.22", ProberSettings(interval_s=0.5, timeout_s=1.0, losses_to_suspend=4,
                                                             backoff_min_s=5.0, backoff_max_s=60.0,
                                                             first_contact_s=0.0, late_s=0.0),
                  5, witness=("127.0.0.23", "127.0.0.24"), samples=samples)
    mono, port, path = run.mono, run.port, run.path

    def run_until(done: Callable[[], bool], limit_s: float) -> float:
        """Step fake time until ``done()``; the time it took."""
        start = mono.now
        while not done():
            assert mono.now - start < limit_s, f"not done after {limit_s} s"
            run.step(0.02)
        return mono.now - start

    def sent() -> int:
        return path().sent

    try:
        run_until(lambda: path().suspended, 4.0)  # rounds every ~0.5 s, 4 losses after ~2.5 s
        before = sent()
        assert path().lost >= 4
        assert 4.0 <= run_until(lambda: sent() > before, 7.0) <= 6.1  # 5 s ± 20 %, then one retry pair
        assert sent() == before + 2
        assert 0.9 <= run_until(lambda: path().suspended, 3.0) <= 1.1  # it is lost: suspended again
        assert sent() == before + 2
        responder = Responder(node="b", listen={"nic0": ("127.0.0.22", port)})
        responder.start()
        try:
            assert 8.0 <= run_until(lambda: sent() > before + 2, 13.0) <= 12.1  # twice as long: 10 s ± 20 %
            run_until(lambda: any(x.src_nic == "nic0" for x in samples) and not path().suspended, 2.0)
            run_until(lambda: sent() > before + 8, 3.0)  # probing as before
        finally:
            responder.stop(timeout_s=2.0)
    finally:
        run.close()


def test_a_peer_silent_on_every_path_is_unknown_not_lost() -> None:
    """Nothing from b at all (starved, frozen, or every rail cut: this prober cannot tell): its probes are unknown,
    not lost, and its path is not suspended; the controller judges with b's own account of its stalls."""
    run = Stepped("127.0.0.25", "127.0.0.26", ProberSettings(interval_s=0.5, timeout_s=1.0, losses_to_suspend=2,
                                                             first_contact_s=0.0, late_s=2.0), 6)
    try:
        run.step(8.0)
        status = run.path()
        assert status.unknown >= 8 and status.lost == 0 and not status.suspended, status
    finally:
        run.close()


class Stepped:
    """A prober of node a on ``mine`` probing b's NIC at ``theirs`` (nobody answering yet), on fake time.

    b answers all along on its other NIC (``witness``: our NIC's address, then b's), as a live host does over
    the rails that still work: so b's silence on nic0 is that path's, and its probes there are judged lost.
    """

    def __init__(self, mine: str, theirs: str, settings: ProberSettings, seed: int,
                 witness: tuple[str, str] | None = None, samples: list[ProbeSample] | None = None) -> None:
        self.port, self.mono = free_port(theirs), FakeMono()
        local, peer = {"nic0": mine}, {"nic0": (theirs, self.port)}
        self.witness = None
        if witness is not None:
            self.witness = Responder(node="b", listen={"nic1": (witness[1], 0)})
            self.witness.start()
            local["nic1"], peer["nic1"] = witness[0], self.witness.addresses["nic1"]
        self.prober = Prober(node="a", local=local, peers={"b": peer},
                             on_sample=(samples.append if samples is not None else lambda _: None),
                             settings=settings, monotonic=self.mono, rng=random.Random(seed))
        self.prober.open()
        self.prober.tick(self.mono.now)

    def step(self, seconds: float) -> None:
        """Move fake time on in 20 ms steps, sending and handling replies as the thread would."""
        for _ in range(round(seconds / 0.02)):
            self.mono.now += 0.02
            self.prober.tick(self.mono.now)
            self.prober.poll(0.002)

    def path(self) -> PathStatus:
        """The path under test: our nic0 to b's."""
        return next(s for s in self.prober.paths() if s.path.local.nic == "nic0")

    def close(self) -> None:
        self.prober.close()
        if self.witness is not None:
            self.witness.stop(timeout_s=2.0)


def test_a_peer_not_answered_yet_is_unreached_not_lost_until_its_first_contact_grace_ends() -> None:
    # An agent starting seconds after its peers: their probes to it before then are not link loss.
    run = Stepped("127.0.0.31", "127.0.0.32",
                  ProberSettings(interval_s=0.5, timeout_s=1.0, losses_to_suspend=4, first_contact_s=10.0,
                                 late_s=0.0), 7, witness=("127.0.0.37", "127.0.0.38"))
    step = run.step
    try:
        step(4.0)
        status = run.path()
        assert status.unreached >= 4 and status.lost == 0 and not status.suspended, status
        responder = Responder(node="b", listen={"nic0": ("127.0.0.32", run.port)})
        responder.start()
        try:
            wait_for(lambda: step(0.1) is None and run.path().received > 0, timeout_s=5, what="a first reply")
        finally:
            responder.stop(timeout_s=2.0)
        unreached = run.path().unreached
        step(4.0)  # answered once, well within the grace: from now on silence is loss
        status = run.path()
        assert status.lost >= 4 and status.suspended and status.unreached == unreached, status
    finally:
        run.close()


def test_a_peer_never_answered_loses_probes_once_the_grace_is_over() -> None:
    run = Stepped("127.0.0.33", "127.0.0.34",
                  ProberSettings(interval_s=0.5, timeout_s=1.0, losses_to_suspend=100, first_contact_s=3.0,
                                 late_s=0.0), 8, witness=("127.0.0.39", "127.0.0.40"))
    prober = run.prober
    try:
        run.step(8.0)
        status = run.path()
        # sent in the first 2 s timed out within the grace; every later one is lost (a black hole from the start)
        assert 6 <= status.unreached <= 10 and status.lost >= 16, status  # a pair per ~0.5 s round
        assert status.sent == status.unreached + status.lost + prober._states[("nic0", "b", "nic0")].outstanding
        assert prober.unreached() == status.unreached  # the node's total, exported as ridethrough.probe.unreached
    finally:
        run.close()


def test_a_peer_probing_us_again_ends_our_suspension_of_its_paths_at_once() -> None:
    # A path back after a long outage: our backoff on it has grown; the peer's own probes over it say it is up now.
    run = Stepped("127.0.0.35", "127.0.0.36", ProberSettings(interval_s=0.5, timeout_s=1.0, losses_to_suspend=2,
                                                             backoff_min_s=200.0, backoff_max_s=300.0,
                                                             first_contact_s=0.0, late_s=0.0), 9,
                  witness=("127.0.0.47", "127.0.0.48"))
    prober, step, mono, port = run.prober, run.step, run.mono, run.port
    ours = Responder(node="a", listen={"nic0": ("127.0.0.35", 0)}, on_probe=prober.heard_from)  # a's responder
    theirs = Responder(node="b", listen={"nic0": ("127.0.0.36", port)})
    ours.start()
    try:
        step(3.0)
        assert run.path().suspended
        prober.heard_from("nic0", "c", "nic0")  # another node: nothing changes
        theirs.start()  # b is back, but our backoff would wait 200 s
        step(2.0)
        assert run.path().suspended
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as b_prober:  # b's own probe reaches a's responder
            b_prober.bind(("127.0.0.36", 0))
            b_prober.sendto(probe_bytes(1, src=Endpoint("b", "nic0"), dst=Endpoint("a", "nic0")),
                            ours.addresses["nic0"])
            wait_for(lambda: ours.answered()["nic0"] == 1, timeout_s=5, what="a answering b")
        woken = mono.now
        wait_for(lambda: step(0.1) is None and not run.path().suspended and run.path().received > 0,
                 timeout_s=10, what="the path probed and answered again")
        assert mono.now - woken < 5.0, "retried at the next round, not after its 200 s backoff"
    finally:
        theirs.stop(timeout_s=2.0)
        ours.stop(timeout_s=2.0)
        run.close()


def test_first_contact_grace_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="first_contact_s"):
        ProberSettings(first_contact_s=-1.0)


def test_paths_follow_the_peer_table() -> None:
    with pair() as (responder, prober, samples):
        wait_for(lambda: len(samples) >= 4, timeout_s=10, what="samples")
        prober.set_peers({"b": {"nic0": responder.addresses["nic0"]}})
        wait_for(lambda: len(prober.paths()) == 1, timeout_s=5, what="one path left")
        prober.set_peers({})
        wait_for(lambda: prober.paths() == [], timeout_s=5, what="no paths")


class Judged:
    """A prober of node a probing b (a scripted peer) with a short real timeout, one round only, stepped by hand."""

    def __init__(self, mine: str, theirs: str, interval_s: float = 100.0) -> None:
        self.peer, self.mono = ScriptedPeer(theirs), FakeMono()
        self.prober = Prober(node="a", local={"nic0": mine}, peers={"b": {"nic0": self.peer.address}},
                             on_sample=lambda _: None, monotonic=self.mono,
                             settings=ProberSettings(interval_s=interval_s, timeout_s=0.3, late_s=5.0,
                                                     first_contact_s=0.0))
        self.prober.open()
        (self.first, self.to), (self.second, _) = self.next_round()

    def next_round(self) -> tuple[tuple[Probe, tuple[str, int]], tuple[Probe, tuple[str, int]]]:
        """Step fake time until the prober sends a round: its pair."""
        while not select.select([self.peer.sock], [], [], 0.01)[0]:
            self.mono.now += 0.1
            self.prober.tick(self.mono.now)
        return self.peer.probe(), self.peer.probe()

    def step(self, seconds: float) -> None:
        self.mono.now += seconds
        pump(self.prober)
        self.prober.tick(self.mono.now)

    def counts(self) -> tuple[int, int, int, int]:
        s = self.prober.paths()[0]
        return s.received, s.late, s.lost, s.unknown

    def close(self) -> None:
        self.prober.close()
        self.peer.sock.close()


def test_a_reply_held_by_a_stalled_responder_is_late_and_its_unanswered_twin_unknown() -> None:
    """The peer's responder ran 0.5 s late (a starved agent): it answered the first probe after our 0.3 s timeout,
    its turnaround (t3 - t2) saying it held it; the second probe's reply never came. Neither is charged to the
    path: late, and unknown (no later round answered to show the responder running)."""
    j = Judged("127.0.0.41", "127.0.0.42")
    try:
        j.step(0.4)  # past the timeout: the peer has answered nothing since, so both are overdue, not lost
        assert j.counts() == (0, 0, 0, 0)
        time.sleep(0.5)
        j.peer.reply(j.first, j.to, t2_ns=j.first.t1_ns + 50_000, t3_ns=time.time_ns())
        wait_for(lambda: pump(j.prober) and j.counts()[1] == 1, timeout_s=5, what="the late reply")
        j.step(6.0)  # late_s is over for the second
        assert j.counts() == (1, 1, 0, 1)
    finally:
        j.close()


def test_probes_unanswered_while_their_peer_answers_a_later_round_in_time_are_lost() -> None:
    """The peer answers in the order probes reached it: a later round's answer in time says the responder was
    running, so the earlier, unanswered ones were lost on the way (not queued behind a stall)."""
    j = Judged("127.0.0.43", "127.0.0.44", interval_s=1.0)
    try:
        j.step(0.4)  # the first round overdue: nothing answered yet
        (third, to), _ = j.next_round()
        j.peer.reply(third, to)
        wait_for(lambda: pump(j.prober) and j.counts()[0] == 1, timeout_s=5, what="the reply")
        j.step(0.0)
        assert j.counts() == (1, 0, 2, 0), "the first round lost; the fourth probe, of the answered round, waits"
    finally:
        j.close()


def test_a_reply_slow_on_the_network_is_lost_and_its_twin_unanswered_since_unknown() -> None:
    """A reply whose round trip less the responder's turnaround exceeds the timeout was slowed by the network:
    lost. Its twin, unanswered by a peer that answered nothing later, is unknown once ``late_s`` is over."""
    j = Judged("127.0.0.45", "127.0.0.46")
    try:
        j.step(0.4)
        time.sleep(0.5)
        j.peer.reply(j.first, j.to)  # t2 and t3 now: turned round at once, 0.5 s on the wire
        wait_for(lambda: pump(j.prober) and j.counts()[2] == 1, timeout_s=5, what="the slow reply")
        j.step(6.0)
        assert j.counts() == (0, 0, 1, 1)
    finally:
        j.close()


def test_stalls_add_up_as_the_union_of_late_intervals() -> None:
    meter = StallMeter(min_gap_s=0.05)
    meter.note_wake(0.1, 0, 1_100_000_000)  # asked for 0.1 s, woke after 1.1 s: a 1 s stall
    meter.note_read(600_000_000, 1_100_000_000)  # a datagram of that stall, read at its end: counted once
    meter.note_read(2_000_000_000, 2_010_000_000)  # 10 ms: ordinary scheduling
    meter.note_read(3_000_000_000, 3_500_000_000)
    assert meter.stalled_s == pytest.approx(1.5)
    assert meter.stalled_since(3_400_000_000) and not meter.stalled_since(3_500_000_000)
