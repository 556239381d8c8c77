"""The job socket: step reports become metrics and events; anything else is dropped and counted."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import tempfile
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ridethrough.catalogue import metric, metrics_of
from ridethrough.collector.job_client import JobReporter
from ridethrough.collector.job_protocol import MAX_DATAGRAM_BYTES, DropReason, ProtocolError, decode
from ridethrough.collector.job_socket import DEFAULT_SOCKET_MODE
from ridethrough.collector.registry import build_sources
from ridethrough.collector.sample import BackgroundSource, Event, MetricKind, Sample
from ridethrough.collector.sources.job import (
    EVENT_BURST,
    EVENTS_PER_S,
    TOTAL_EVENT_BURST,
    JobSource,
)
from ridethrough.settings import AgentConfig
from tests.conftest import wait_for

T0 = 1_718_000_000_000_000_000
WHO = {"v": 1, "job": "llama-70b-run3", "customer": "acme", "rank": 3, "world_size": 64}
RANK3 = {"job.id": "llama-70b-run3", "job.customer": "acme", "job.rank": "3"}


def step_msg(step: Any = 1, **over: Any) -> dict[str, Any]:
    """A valid step report (step n runs from T0 + 2n s for 1.5 s), with fields replaced or (None) removed."""
    start = T0 + (step if type(step) is int and 0 <= step < 1 << 20 else 0) * 2_000_000_000
    msg = {**WHO, "type": "step", "step": step, "start_ns": start, "end_ns": start + 1_500_000_000,
           "tokens": 4096, "samples": 8, "phases": {"compute_s": 1.25, "checkpoint_s": 0.0, "wait_s": 0.25}}
    msg.update(over)
    return {k: v for k, v in msg.items() if v is not None}


class FakeClock:
    """Monotonic seconds that move only when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Harness:
    """A started JobSource at a short socket path, the events it emitted, and a raw sender."""

    def __init__(self, path: Path, **kw: Any) -> None:
        self.path = path
        self.events: list[Event] = []
        self.source = JobSource(socket_path=path, **kw)
        self.source.start(emit=self.events.append)
        self._tx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # blocking: every datagram arrives

    def send(self, *messages: dict[str, Any] | bytes) -> None:
        before = self.source.handled
        for m in messages:
            self._tx.sendto(m if isinstance(m, bytes) else json.dumps(m).encode(), os.fspath(self.path))
        self.wait(before + len(messages))

    def wait(self, handled: int) -> None:
        wait_for(lambda: self.source.handled >= handled, timeout_s=10, interval_s=0.005,
                 what=f"{handled} messages handled")

    def values(self, name: str) -> dict[tuple[tuple[str, str], ...], float]:
        return {tuple(sorted(s.attributes.items())): s.value for s in self.source.collect(0) if s.name == name}

    def value(self, name: str, **attrs: str) -> float | None:
        return self.values(name).get(tuple(sorted(attrs.items())))

    def dropped(self, reason: str) -> float | None:
        return self.value("ridethrough.job.messages.dropped", reason=reason)

    def close(self) -> None:
        self._tx.close()
        self.source.stop(timeout_s=5)


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    # AF_UNIX paths are limited to 107 bytes; pytest's tmp_path can be longer
    path = Path(tempfile.mkdtemp(prefix="rtjob-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def harness(sock_dir: Path) -> Iterator[Callable[..., Harness]]:
    made: list[Harness] = []

    def make(**kw: Any) -> Harness:
        made.append(Harness(sock_dir / "job.sock", **kw))
        return made[-1]

    yield make
    for h in made:
        h.close()


# --- valid traffic ---------------------------------------------------------------------------


def test_job_source_is_a_background_source_built_from_config(sock_dir: Path) -> None:
    cfg = AgentConfig(sources=("job",), job_socket=str(sock_dir / "j.sock"), interval_s=2.5)
    (source,) = build_sources(cfg)
    assert isinstance(source, JobSource) and isinstance(source, BackgroundSource)
    assert (source.name, source.interval_s, source.socket_path) == ("job", 2.5, sock_dir / "j.sock")


def test_steps_become_per_rank_metrics(harness: Callable[..., Harness]) -> None:
    h = harness()
    h.send({**WHO, "type": "start", "time_ns": T0}, step_msg(1), step_msg(2, tokens=100, samples=None,
                                                                         phases={"wait_s": 0.5}))
    assert h.value("ridethrough.job.steps", **RANK3) == 2
    assert h.value("ridethrough.job.tokens", **RANK3) == 4196
    assert h.value("ridethrough.job.samples", **RANK3) == 8
    assert h.value("ridethrough.job.step.last", **RANK3) == 2
    assert h.value("ridethrough.job.step.duration", **RANK3) == 1.5
    assert h.value("ridethrough.job.rank.running", **RANK3) == 1
    phases = {dict(k)["job.phase"]: v for k, v in h.values("ridethrough.job.phase.time").items()}
    assert phases == {"compute": 1.25, "checkpoint": 0.0, "wait": 0.75}
    assert h.value("ridethrough.job.messages.received", type="step") == 2
    assert h.value("ridethrough.job.messages.received", type="start") == 1
    assert h.value("ridethrough.job.series") == 1
    assert set(h.values("ridethrough.job.messages.dropped").values()) == {0}


def test_steps_and_lifecycle_become_events_with_the_senders_pid(harness: Callable[..., Harness]) -> None:
    h = harness()
    h.send({**WHO, "type": "start", "time_ns": T0}, step_msg(7),
           {**WHO, "type": "end", "time_ns": T0 + 1, "reason": "preempted", "detail": "SIGTERM from the scheduler"})
    assert [e.name for e in h.events] == ["job.started", "job.step", "job.ended"]
    started, stepped, ended = h.events
    pid = str(os.getpid())
    assert {**RANK3, "job.world_size": "64", "process.pid": pid}.items() <= started.attributes.items()
    assert stepped.attributes == {
        **RANK3, "job.world_size": "64", "process.pid": pid, "job.step": "7",
        "job.step.start_ns": str(T0 + 14_000_000_000), "job.step.end_ns": str(T0 + 15_500_000_000),
        "job.step.duration_s": "1.5", "job.tokens": "4096", "job.samples": "8",
        "job.phase.compute_s": "1.25", "job.phase.checkpoint_s": "0.0", "job.phase.wait_s": "0.25"}
    assert all(isinstance(v, str) for e in h.events for v in e.attributes.values())
    assert stepped.body == "job llama-70b-run3 rank 3/64 step 7: 1.500 s"
    assert (ended.severity, ended.attributes["job.end.reason"]) == ("WARN", "preempted")
    assert ended.attributes["job.end.detail"] == "SIGTERM from the scheduler"
    assert h.value("ridethrough.job.rank.running", **RANK3) == 0
    (rank,) = h.source.ranks()
    assert (rank.job, rank.rank, rank.pid, rank.uid, rank.last_step, rank.running) == \
        ("llama-70b-run3", 3, os.getpid(), os.getuid(), 7, False)


# --- malformed traffic -----------------------------------------------------------------------


def _raw(text: str) -> bytes:
    return text.encode()


_TEN_KB = "x" * 10_000
MALFORMED: dict[str, tuple[dict[str, Any] | bytes, DropReason]] = {
    "not json": (b"hello", DropReason.NOT_JSON),
    "empty datagram": (b"", DropReason.NOT_JSON),
    "bad utf-8": (b'{"v":1,"job":"\xff\xfe"}', DropReason.NOT_JSON),
    "truncated json": (json.dumps(step_msg()).encode()[:-5], DropReason.NOT_JSON),
    "deep nesting": (b"[" * 2000 + b"]" * 2000, DropReason.NOT_JSON),
    "array": (b"[1, 2, 3]", DropReason.NOT_OBJECT),
    "string": (b'"step"', DropReason.NOT_OBJECT),
    "no version": (step_msg(v=None), DropReason.BAD_VERSION),
    "version 2": (step_msg(v=2), DropReason.BAD_VERSION),
    "version true": (step_msg(v=True), DropReason.BAD_VERSION),
    "version 1.0": (step_msg(v=1.0), DropReason.BAD_VERSION),
    "unknown type": (step_msg(type="reboot"), DropReason.UNKNOWN_TYPE),
    "unknown field": (step_msg(token=5), DropReason.UNKNOWN_FIELD),
    "unknown phase": (step_msg(phases={"io_s": 1.0}), DropReason.UNKNOWN_FIELD),
    "missing end_ns": (step_msg(end_ns=None), DropReason.MISSING_FIELD),
    "missing job": (step_msg(job=None), DropReason.MISSING_FIELD),
    "end without reason": ({**WHO, "type": "end", "time_ns": T0}, DropReason.MISSING_FIELD),
    "step as string": (step_msg(step="12"), DropReason.WRONG_TYPE),
    "step as float": (step_msg(step=12.0), DropReason.WRONG_TYPE),
    "tokens as bool": (step_msg(tokens=True), DropReason.WRONG_TYPE),
    "job as number": (step_msg(job=42), DropReason.WRONG_TYPE),
    "phases as list": (step_msg(phases=[1.0]), DropReason.WRONG_TYPE),
    "phase as string": (step_msg(phases={"wait_s": "1"}), DropReason.WRONG_TYPE),
    "1e400 as an int": (_raw(json.dumps(step_msg()).replace(f'"start_ns": {T0 + 2_000_000_000}',
                                                            '"start_ns": 1e400')), DropReason.WRONG_TYPE),
    "NaN phase": (_raw(json.dumps(step_msg(phases={"wait_s": float("nan")}))), DropReason.NOT_FINITE),
    "Infinity phase": (_raw(json.dumps(step_msg(phases={"wait_s": float("inf")}))), DropReason.NOT_FINITE),
    "1e400 phase": (_raw(json.dumps(step_msg(phases={"wait_s": 1.0})).replace("1.0}", "1e400}")),
                    DropReason.NOT_FINITE),
    "negative step": (step_msg(step=-1), DropReason.OUT_OF_RANGE),
    "end before start": (step_msg(end_ns=T0), DropReason.OUT_OF_RANGE),
    "rank = world_size": (step_msg(rank=64), DropReason.OUT_OF_RANGE),
    "world_size 0": (step_msg(rank=0, world_size=0), DropReason.OUT_OF_RANGE),
    "negative phase": (step_msg(phases={"wait_s": -0.1}), DropReason.OUT_OF_RANGE),
    "step beyond int64": (step_msg(step=1 << 64), DropReason.OUT_OF_RANGE),
    "3500-digit step": (step_msg(step=int("9" * 3500)), DropReason.OUT_OF_RANGE),
    "phase beyond float": (step_msg(phases={"wait_s": 10**400}), DropReason.OUT_OF_RANGE),
    "oversized": (step_msg(job="j" * 5000), DropReason.OVERSIZED),
    "10 kB job id": (step_msg(job=_TEN_KB), DropReason.OVERSIZED),
    "64 kB datagram": (b" " * 65_000, DropReason.OVERSIZED),
    "empty job": (step_msg(job=""), DropReason.BAD_STRING),
    "quote in job": (step_msg(job='run"3'), DropReason.BAD_STRING),
    "sql in customer": (step_msg(customer="x'; DROP TABLE otel_logs; --"), DropReason.BAD_STRING),
    "unicode job": (step_msg(job="llamá-70b"), DropReason.BAD_STRING),
    "emoji customer": (step_msg(customer="acme\U0001f680"), DropReason.BAD_STRING),
    "newline in job": (step_msg(job="run3\n"), DropReason.BAD_STRING),
    "3 kB job id": (step_msg(job="j" * 3000), DropReason.BAD_STRING),
    "129-char job id": (step_msg(job="j" * 129), DropReason.BAD_STRING),
    "control char in detail": ({**WHO, "type": "end", "time_ns": T0, "reason": "failed", "detail": "a\x1bb"},
                               DropReason.BAD_STRING),
    "lone surrogate in detail": (_raw(json.dumps({**WHO, "type": "end", "time_ns": T0, "reason": "failed",
                                                  "detail": "x"}).replace('"x"', '"\\ud800"')),
                                 DropReason.BAD_STRING),
    "spaces in reason": ({**WHO, "type": "end", "time_ns": T0, "reason": "it broke"}, DropReason.BAD_STRING),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_message_is_dropped_and_counted_while_valid_traffic_continues(
        harness: Callable[..., Harness], case: str) -> None:
    bad, reason = MALFORMED[case]
    h = harness()
    h.send(step_msg(1), bad, step_msg(2))
    counts = {dict(k)["reason"]: v for k, v in h.values("ridethrough.job.messages.dropped").items()}
    assert counts == {r.value: (1 if r is reason else 0) for r in DropReason}
    assert h.value("ridethrough.job.steps", **RANK3) == 2
    assert [e.attributes["job.step"] for e in h.events] == ["1", "2"]


@pytest.mark.parametrize("case", list(MALFORMED))
def test_protocol_rejects_each_case_with_its_reason(case: str) -> None:
    bad, reason = MALFORMED[case]
    data = bad if isinstance(bad, bytes) else json.dumps(bad).encode()
    with pytest.raises(ProtocolError) as err:
        decode(data[:MAX_DATAGRAM_BYTES + 1])  # the socket hands over at most one byte past the limit
    assert err.value.reason is reason


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=20)
_STEP_WITH_ODD_FIELDS = st.dictionaries(st.sampled_from(sorted(step_msg())), _JSON).map(
    lambda fields: json.dumps({**step_msg(), **fields}).encode())


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=MAX_DATAGRAM_BYTES + 1) | _JSON.map(lambda v: json.dumps(v).encode())
       | _STEP_WITH_ODD_FIELDS)
def test_decode_only_ever_accepts_or_raises_protocol_error(data: bytes) -> None:
    try:
        decode(data[:MAX_DATAGRAM_BYTES + 1])
    except ProtocolError as exc:
        assert isinstance(exc.reason, DropReason)


def test_a_message_of_exactly_the_size_limit_is_accepted(harness: Callable[..., Harness]) -> None:
    data = json.dumps(step_msg(1)).encode()
    padded = data[:-1] + b" " * (MAX_DATAGRAM_BYTES - len(data)) + b"}"
    assert len(padded) == MAX_DATAGRAM_BYTES
    h = harness()
    h.send(padded, padded + b" ")
    assert h.value("ridethrough.job.steps", **RANK3) == 1
    assert h.dropped("oversized") == 1


def test_a_failing_event_sink_costs_nothing_but_the_event(sock_dir: Path) -> None:
    def explode(event: Event) -> None:
        raise RuntimeError("sink is broken")

    source = JobSource(socket_path=sock_dir / "j.sock")
    source.start(emit=explode)
    try:
        reporter = JobReporter(socket_path=sock_dir / "j.sock", job="j", customer="c", rank=0, world_size=1)
        for i in range(3):
            assert reporter.step(i, T0, T0 + 1)
        wait_for(lambda: source.handled == 3, timeout_s=10, interval_s=0.005)
        steps = [s.value for s in source.collect(0) if s.name == "ridethrough.job.steps"]
        assert steps == [3]
    finally:
        source.stop(timeout_s=5)


# --- bounds ----------------------------------------------------------------------------------


def test_series_beyond_the_cap_are_dropped_and_known_ranks_keep_reporting(harness: Callable[..., Harness]) -> None:
    h = harness(max_series=3)
    h.send(*(step_msg(1, rank=r) for r in range(5)))
    assert h.value("ridethrough.job.series") == 3
    assert h.dropped("too_many_series") == 2
    h.send(step_msg(2, rank=0))
    assert h.value("ridethrough.job.steps", **{**RANK3, "job.rank": "0"}) == 2
    assert h.value("ridethrough.job.steps", **{**RANK3, "job.rank": "4"}) is None


def test_idle_series_are_forgotten(harness: Callable[..., Harness]) -> None:
    clock = FakeClock()
    h = harness(clock=clock, idle_forget_s=60)
    h.send(step_msg(1, rank=0), step_msg(1, rank=1))
    clock.now += 45
    h.send(step_msg(2, rank=1))
    clock.now += 30
    assert [r.rank for r in h.source.ranks()] == [0, 1]
    assert h.value("ridethrough.job.series") == 1  # collect forgets rank 0
    assert [r.rank for r in h.source.ranks()] == [1]


def test_events_are_rate_limited_per_rank_but_steps_all_count(harness: Callable[..., Harness]) -> None:
    clock = FakeClock()
    h = harness(clock=clock)
    burst = int(EVENT_BURST)
    h.send(*(step_msg(i) for i in range(burst + 5)))
    h.send(step_msg(0, rank=4))  # another rank has its own allowance
    assert len(h.events) == burst + 1
    assert h.value("ridethrough.job.events.suppressed") == 5
    assert h.value("ridethrough.job.steps", **RANK3) == burst + 5
    clock.now += 1.0
    h.send(*(step_msg(i) for i in range(5)))
    assert len(h.events) == burst + 1 + int(EVENTS_PER_S)


def test_events_are_rate_limited_for_the_whole_source_too(harness: Callable[..., Harness]) -> None:
    h = harness(clock=FakeClock())
    ranks = int(TOTAL_EVENT_BURST) + 50
    h.send(*(step_msg(1, rank=r, world_size=ranks) for r in range(ranks)))
    assert len(h.events) == TOTAL_EVENT_BURST
    assert h.value("ridethrough.job.events.suppressed") == 50
    assert sum(h.values("ridethrough.job.steps").values()) == ranks


def test_a_burst_of_10000_messages_does_not_grow_memory(harness: Callable[..., Harness]) -> None:
    h = harness(max_series=64)
    world = {"world_size": 1 << 20}
    tracemalloc.start()
    try:
        h.send(*(step_msg(i, rank=i, **world) for i in range(5_000)))
        first, _ = tracemalloc.get_traced_memory()
        h.send(*(step_msg(i, rank=i, **world) for i in range(5_000, 10_000)))
        second, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert h.source.handled == 10_000
    assert h.value("ridethrough.job.series") == 64
    assert h.dropped("too_many_series") == 10_000 - 64
    assert second - first < 256 * 1024, f"grew {second - first} bytes over the second 5,000 messages"


# --- socket hygiene --------------------------------------------------------------------------


def test_socket_is_created_with_its_directory_and_mode_and_unlinked_at_stop(sock_dir: Path) -> None:
    path = sock_dir / "run" / "ridethrough" / "job.sock"
    source = JobSource(socket_path=path)
    source.start(emit=lambda e: None)
    assert stat.S_ISSOCK(path.lstat().st_mode)
    assert stat.S_IMODE(path.lstat().st_mode) == DEFAULT_SOCKET_MODE
    source.stop(timeout_s=5)
    assert not path.exists()


def test_stop_leaves_a_socket_another_agent_bound_since(sock_dir: Path) -> None:
    path = sock_dir / "job.sock"
    source = JobSource(socket_path=path)
    source.start(emit=lambda e: None)
    path.unlink()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as other:
        other.bind(os.fspath(path))
        source.stop(timeout_s=5)
        assert path.exists()


def test_a_stale_socket_file_is_replaced(sock_dir: Path) -> None:
    path = sock_dir / "job.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as crashed:
        crashed.bind(os.fspath(path))
    assert stat.S_ISSOCK(path.lstat().st_mode)
    source = JobSource(socket_path=path)
    source.start(emit=lambda e: None)
    try:
        assert JobReporter(socket_path=path, job="j", customer="c", rank=0, world_size=1).started()
        wait_for(lambda: source.handled == 1, timeout_s=10, interval_s=0.005)
    finally:
        source.stop(timeout_s=5)


def test_a_socket_someone_serves_is_refused(sock_dir: Path) -> None:
    path = sock_dir / "job.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as live:
        live.bind(os.fspath(path))
        with pytest.raises(OSError, match="in use by another process"):
            JobSource(socket_path=path).start(emit=lambda e: None)
        assert path.exists()


def test_a_regular_file_at_the_path_is_refused_and_left_alone(sock_dir: Path) -> None:
    path = sock_dir / "job.sock"
    path.write_text("precious")
    with pytest.raises(FileExistsError, match="exists and is not a socket; refusing to replace it"):
        JobSource(socket_path=path).start(emit=lambda e: None)
    assert path.read_text() == "precious"


def test_a_path_too_long_for_a_unix_socket_is_refused(sock_dir: Path) -> None:
    with pytest.raises(OSError, match="longer than 107 bytes"):
        JobSource(socket_path=sock_dir / ("x" * 120)).start(emit=lambda e: None)


# --- the client ------------------------------------------------------------------------------


def test_client_reports_reach_the_source(harness: Callable[..., Harness]) -> None:
    h = harness()
    with JobReporter(socket_path=h.path, job="llama-70b-run3", customer="acme", rank=3, world_size=64) as r:
        assert r.started()
        assert r.step(1, T0, T0 + 2_000_000_000, tokens=10, samples=2, phases={"compute_s": 2})
        assert r.ended("completed")
    h.wait(3)
    assert [e.name for e in h.events] == ["job.started", "job.step", "job.ended"]
    assert h.events[2].severity == "INFO"
    assert h.value("ridethrough.job.phase.time", **RANK3, **{"job.phase": "compute"}) == 2.0
    assert (r.sent, r.dropped) == (3, 0)


def test_client_never_raises_with_no_agent_and_counts_what_it_dropped(sock_dir: Path) -> None:
    stale = sock_dir / "stale.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as gone:
        gone.bind(os.fspath(stale))
    for path in (sock_dir / "absent.sock", stale, sock_dir / "no" / "dir.sock"):
        r = JobReporter(socket_path=path, job="j", customer="c", rank=0, world_size=1)
        assert not r.started()
        assert not r.step(1, T0, T0 + 1, tokens=1, phases={"wait_s": 0.1})
        assert not r.ended("completed")
        assert (r.sent, r.dropped, r.drops) == (0, 3, {"no_agent": 3})
        assert r.last_error.startswith("no_agent")


def test_client_drops_what_the_agent_would_reject_without_raising(sock_dir: Path) -> None:
    r = JobReporter(socket_path=sock_dir / "absent.sock", job="j", customer="c", rank=0, world_size=1)
    assert not r.step(1, T0, T0 - 1)
    assert not r.step(-1, T0, T0)
    assert not r.step(1, T0, T0, phases={"wait_s": float("nan")})
    assert not r.step(1, T0, T0, phases={"io_s": 1.0})
    one, slow = "one", "slow"  # what the types forbid, a training script may still pass
    assert not r.step(cast(Any, one), T0, T0)
    assert not r.step(1, T0, T0, phases={"wait_s": cast(Any, slow)})
    assert not r.ended("it broke")
    assert not r.ended("failed", detail="x" * 10_000)
    assert r.drops == {"out_of_range": 2, "not_finite": 1, "unknown_field": 1, "wrong_type": 2, "bad_string": 2}
    assert r.dropped == 8 and r.sent == 0


def test_client_takes_scalars_that_are_integers_but_not_int(harness: Callable[..., Harness]) -> None:
    class Index:  # what numpy and torch integer scalars look like to the client
        def __init__(self, n: int) -> None:
            self.n = n

        def __index__(self) -> int:
            return self.n

        def __float__(self) -> float:
            return float(self.n)

    h = harness()
    r = JobReporter(socket_path=h.path, job="llama-70b-run3", customer="acme", rank=3, world_size=64)
    assert r.step(Index(5), T0, T0 + 1, tokens=Index(7), phases={"wait_s": Index(1)})
    h.wait(1)
    assert h.value("ridethrough.job.tokens", **RANK3) == 7


def test_client_never_blocks_on_an_agent_that_does_not_read(sock_dir: Path) -> None:
    path = sock_dir / "busy.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as stuck:
        stuck.bind(os.fspath(path))
        r = JobReporter(socket_path=path, job="j", customer="c", rank=0, world_size=1)
        done = threading.Event()

        def burst() -> None:
            for i in range(1000):
                r.step(i, T0, T0 + 1)
            done.set()

        threading.Thread(target=burst, daemon=True).start()
        assert done.wait(10), "the reporter blocked on a full socket"
    assert r.sent + r.dropped == 1000
    assert r.drops.get("agent_busy", 0) > 0 and set(r.drops) == {"agent_busy"}


def test_client_constructor_rejects_an_identity_the_agent_would_drop() -> None:
    with pytest.raises(ValueError, match="rank 8 is not below world_size 8"):
        JobReporter(socket_path="/nonexistent", job="j", customer="c", rank=8, world_size=8)
    with pytest.raises(ValueError, match="bad_string: job must match"):
        JobReporter(socket_path="/nonexistent", job="j o b", customer="c", rank=0, world_size=1)


# --- the catalogue ---------------------------------------------------------------------------


def _all_metrics(h: Harness) -> list[Sample]:
    h.send(step_msg(1), step_msg(2, rank=0), {**WHO, "type": "end", "time_ns": T0, "reason": "completed"}, b"junk")
    return h.source.collect(0)


def test_job_source_emits_only_catalogued_metrics_exactly_as_catalogued(harness: Callable[..., Harness]) -> None:
    for sample in _all_metrics(harness()):
        spec = metric(sample.name)
        assert spec.source == "job", sample.name
        assert (sample.unit, sample.kind) == (spec.unit, spec.kind), sample.name
        assert sorted(sample.attributes) == sorted(spec.attributes), sample.name
        assert all(isinstance(v, str) and v for v in sample.attributes.values()), sample.name


def test_every_catalogued_job_metric_is_emitted(harness: Callable[..., Harness]) -> None:
    seen = {s.name for s in _all_metrics(harness())}
    catalogued = {spec.name for spec in metrics_of("job")}
    assert catalogued and catalogued == seen
    assert all(spec.name.startswith("ridethrough.job.") for spec in metrics_of("job"))
    assert metric("ridethrough.job.steps").kind is MetricKind.COUNTER


# --- through the agent -----------------------------------------------------------------------


@pytest.mark.integration
def test_through_the_agent_steps_reach_otlp_as_log_records_and_metrics(sock_dir: Path) -> None:
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
    from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc

    from ridethrough.collector.agent import Agent
    from ridethrough.collector.identity import AgentIdentity

    records: list[dict[str, str]] = []
    metric_names: set[str] = set()

    class Logs(logs_service_pb2_grpc.LogsServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:
            records.extend({kv.key: kv.value.string_value for kv in rec.attributes} for rl in request.resource_logs
                           for sl in rl.scope_logs for rec in sl.log_records)
            return logs_service_pb2.ExportLogsServiceResponse()

    class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:
            metric_names.update(m.name for rm in request.resource_metrics for sm in rm.scope_metrics
                                for m in sm.metrics)
            return metrics_service_pb2.ExportMetricsServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    logs_service_pb2_grpc.add_LogsServiceServicer_to_server(Logs(), server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    path = sock_dir / "job.sock"
    agent = Agent(identity=AgentIdentity(node_id="n", host_name="h", cluster="c"),
                  sources=[JobSource(socket_path=path, interval_s=0.05)], gateway=f"127.0.0.1:{port}",
                  export_interval_s=0.2)
    agent.start()
    try:
        reporter = JobReporter(socket_path=path, job="run1", customer="acme", rank=0, world_size=2)
        assert reporter.step(1, T0, T0 + 10**9, tokens=5)
        wait_for(lambda: "ridethrough.job.tokens" in metric_names, timeout_s=20, what="job metrics exported")
    finally:
        agent.stop(timeout_s=5)  # flushes the log records
        server.stop(0)
    (step,) = [r for r in records if r.get("event.name") == "job.step"]
    assert {"job.id": "run1", "job.customer": "acme", "job.rank": "0", "job.tokens": "5"}.items() <= step.items()
    assert {spec.name for spec in metrics_of("job")} - {"ridethrough.job.samples", "ridethrough.job.phase.time"} \
        <= metric_names
    assert not path.exists()
