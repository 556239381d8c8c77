"""Job step events (source ``job``): training processes report step boundaries over a Unix socket.

Any process on the node (the job shim, or anything using `ridethrough.collector.job_client`)
sends one JSON message per Unix *datagram* to ``agent.job_socket`` (schema and checks in
`ridethrough.collector.job_protocol`). Datagrams rather than a stream: one message is one
datagram, so there is no framing to get wrong and no half-message to resynchronise after, and a
sender using non-blocking sends is never held up by a slow or absent agent (it drops and counts).

A receiver thread validates each message. A valid one updates bounded per-rank aggregates,
which `JobSource.collect` turns into metrics, and becomes an `Event` (``job.step``,
``job.started``, ``job.ended``) exported as an OTel log record. A malformed one is dropped and
counted by `DropReason`; nothing a sender writes can raise in the thread or grow memory without
bound: at most `DEFAULT_MAX_SERIES` (job, rank) series are kept (a new one beyond is dropped as
``too_many_series``), a series idle for ``idle_forget_s`` is forgotten (its counters restart from
zero if it returns), and events are rate-limited per rank and in total (the step still counts;
the event is counted in ``ridethrough.job.events.suppressed``).

The sender's pid and uid come from the kernel (``SO_PASSCRED``), not from the message, so a
later step can map a rank to its process (`JobSource.ranks`). Binding the socket safely (stale
files, permissions, not deleting what is not ours) is `ridethrough.collector.job_socket`.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..job_protocol import MAX_DATAGRAM_BYTES, DropReason, Lifecycle, Message, ProtocolError, StepReport, decode
from ..job_socket import ANCILLARY_BYTES, DEFAULT_SOCKET_MODE, bind_job_socket, credentials, file_id, unlink_if_ours
from ..sample import Event, EventSink, MetricKind, Sample

if TYPE_CHECKING:
    from ridethrough.settings import AgentConfig

_log = logging.getLogger(__name__)

DEFAULT_MAX_SERIES = 4096
"""Most (customer, job, rank) series kept at once."""
DEFAULT_IDLE_FORGET_S = 600.0
"""A series with no message for this long is forgotten."""
EVENTS_PER_S = 2.0
"""Events a rank may cause per second, on average: one per step up to a couple of steps a second."""
EVENT_BURST = 10.0
"""Events a rank may cause at once (a burst of short steps, a restart's start and first steps)."""
TOTAL_EVENTS_PER_S = 500.0
"""Events the whole source may emit per second, so that many ranks together cannot flood the logs."""
TOTAL_EVENT_BURST = 1000.0
"""Events the whole source may emit at once."""

_DRAIN_BATCH = 256  # datagrams per wake-up, so that a flood cannot keep stop() waiting
_TYPES = ("step", "start", "end")
# one attribute dict per reason and type, shared by every collection's samples (nobody changes them)
_REASON_ATTRS = {reason: {"reason": str(reason)} for reason in DropReason}
_TYPE_ATTRS = {kind: {"type": kind} for kind in _TYPES}
_SERIES_METRICS = "ridethrough.job."


@dataclass(frozen=True, slots=True)
class RankState:
    """What the agent knows of one rank, for mapping a rank to its process."""

    job: str
    customer: str
    rank: int
    world_size: int
    pid: int
    """The sender's pid as this agent sees it (0 if the kernel could not map it into our namespace)."""
    uid: int
    last_step: int
    """-1 before the first step."""
    running: bool


class _TokenBucket:
    """At most ``burst`` at once, refilled at ``rate`` per second."""

    __slots__ = ("_at", "_burst", "_rate", "_tokens")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self._rate, self._burst, self._tokens, self._at = rate, burst, burst, now

    def take(self, now: float) -> bool:
        self._tokens = min(self._burst, self._tokens + max(0.0, now - self._at) * self._rate)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False


@dataclass(slots=True)
class _Series:
    """Aggregates of one (customer, job, rank): fixed size whatever the traffic."""

    world_size: int
    bucket: _TokenBucket
    last_seen: float
    pid: int = 0
    uid: int = 0
    running: bool = True
    steps: int = 0
    tokens: int | None = None
    samples: int | None = None
    last_step: int = -1
    last_duration_s: float = 0.0
    phase_s: dict[str, float] = field(default_factory=dict)  # keys from PHASES only
    attrs: dict[str, str] = field(default_factory=dict)
    """The series' attributes, made at its first collection and reused: samples share them."""
    phase_attrs: dict[str, dict[str, str]] = field(default_factory=dict)

    def record(self, report: StepReport) -> None:
        self.running = True
        self.steps += 1
        self.last_step = report.step
        self.last_duration_s = report.duration_s
        if report.tokens is not None:
            self.tokens = (self.tokens or 0) + report.tokens
        if report.samples is not None:
            self.samples = (self.samples or 0) + report.samples
        for phase, seconds in report.phases_s.items():
            self.phase_s[phase] = self.phase_s.get(phase, 0.0) + seconds

    def to_samples(self, attrs: dict[str, str]) -> list[Sample]:
        counter, gauge, p = MetricKind.COUNTER, MetricKind.GAUGE, _SERIES_METRICS
        out = [Sample(p + "steps", self.steps, counter, "{step}", attrs),
               Sample(p + "rank.running", float(self.running), gauge, "1", attrs)]
        if self.tokens is not None:
            out.append(Sample(p + "tokens", self.tokens, counter, "{token}", attrs))
        if self.samples is not None:
            out.append(Sample(p + "samples", self.samples, counter, "{sample}", attrs))
        if self.steps:
            out.append(Sample(p + "step.last", self.last_step, gauge, "{step}", attrs))
            out.append(Sample(p + "step.duration", self.last_duration_s, gauge, "s", attrs))
        for phase, seconds in self.phase_s.items():
            on_phase = self.phase_attrs.get(phase)
            if on_phase is None:
                on_phase = self.phase_attrs[phase] = {**attrs, "job.phase": phase}
            out.append(Sample(p + "phase.time", seconds, counter, "s", on_phase))
        return out


class JobSource:
    """Source ``job``: a Unix datagram endpoint for step reports, and the metrics they add up to."""

    def __init__(self, *, socket_path: str | os.PathLike[str], interval_s: float = 1.0,
                 socket_mode: int = DEFAULT_SOCKET_MODE, max_series: int = DEFAULT_MAX_SERIES,
                 idle_forget_s: float = DEFAULT_IDLE_FORGET_S, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], int] = time.time_ns) -> None:
        """``clock`` (monotonic seconds) paces rate limits and idle expiry; ``wall_clock`` stamps events."""
        if interval_s <= 0 or max_series < 1 or idle_forget_s <= 0:
            raise ValueError("interval_s and idle_forget_s must be positive and max_series at least 1")
        self.socket_path = Path(socket_path)
        self._interval_s = float(interval_s)
        self._mode, self._max_series, self._idle_forget_s = socket_mode, max_series, idle_forget_s
        self._clock, self._wall_clock = clock, wall_clock
        self._lock = threading.Lock()
        self._series: dict[tuple[str, str, int], _Series] = {}
        self._dropped = dict.fromkeys(DropReason, 0)
        self._received = dict.fromkeys(_TYPES, 0)
        self._suppressed = 0
        self._all_events = _TokenBucket(TOTAL_EVENTS_PER_S, TOTAL_EVENT_BURST, clock())
        self._emit: EventSink | None = None
        self._sock: socket.socket | None = None
        self._bound: tuple[int, int] | None = None  # (st_dev, st_ino) of our socket file
        self._wake: tuple[socket.socket, socket.socket] | None = None  # wakes the thread's poll() at stop
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def name(self) -> str:
        """``job``."""
        return "job"

    @property
    def interval_s(self) -> float:
        """How often the agent calls `collect`."""
        return self._interval_s

    @property
    def handled(self) -> int:
        """Messages received so far, accepted or dropped."""
        with self._lock:
            return sum(self._received.values()) + sum(self._dropped.values())

    def start(self, *, emit: EventSink) -> None:
        """Bind the socket and start the receiver thread (see `bind_job_socket` for what raises)."""
        if self._thread is not None:
            raise RuntimeError("JobSource.start called twice")
        self._sock = bind_job_socket(self.socket_path, self._mode)
        self._bound = file_id(self.socket_path)
        self._emit = emit
        self._wake = socket.socketpair()
        self._thread = threading.Thread(target=self._run, name="rt-job-socket", daemon=True)
        self._thread.start()

    def stop(self, *, timeout_s: float) -> None:
        """Stop the thread, close the socket and remove its file (if it is still ours)."""
        self._stopping.set()
        if self._wake is not None:
            self._wake[1].send(b"x")
        if self._thread is not None:
            self._thread.join(timeout_s)
        for sock in (self._sock, *(self._wake or ())):
            if sock is not None:
                sock.close()
        if self._bound is not None:
            unlink_if_ours(self.socket_path, self._bound)

    def collect(self, now_ns: int) -> list[Sample]:
        """Per-rank totals and last-step gauges, plus the endpoint's own counters; forgets idle ranks."""
        counter, p = MetricKind.COUNTER, _SERIES_METRICS
        with self._lock:
            # idleness is measured on the monotonic clock messages are stamped with, not on now_ns,
            # which a lab clock script may step
            self._forget_idle(self._clock())
            out: list[Sample] = []
            for (customer, job, rank), series in self._series.items():
                if not series.attrs:
                    series.attrs = {"job.id": job, "job.customer": customer, "job.rank": str(rank)}
                out += series.to_samples(series.attrs)
            out += [Sample(p + "messages.dropped", n, counter, "{message}", _REASON_ATTRS[reason])
                    for reason, n in self._dropped.items()]
            out += [Sample(p + "messages.received", n, counter, "{message}", _TYPE_ATTRS[kind])
                    for kind, n in self._received.items()]
            out.append(Sample(p + "events.suppressed", self._suppressed, counter, "{event}"))
            out.append(Sample(p + "series", len(self._series), MetricKind.GAUGE, "{series}"))
        return out

    def ranks(self) -> list[RankState]:
        """Every rank currently known, with the pid that last reported for it."""
        with self._lock:
            return [RankState(job, customer, rank, s.world_size, s.pid, s.uid, s.last_step, s.running)
                    for (customer, job, rank), s in self._series.items()]

    def _forget_idle(self, now: float) -> None:
        idle = [key for key, s in self._series.items() if now - s.last_seen > self._idle_forget_s]
        for key in idle:
            del self._series[key]

    def _run(self) -> None:
        assert self._sock is not None and self._wake is not None
        poller = select.poll()
        poller.register(self._sock, select.POLLIN)
        poller.register(self._wake[0], select.POLLIN)
        while not self._stopping.is_set():
            poller.poll()
            if not self._drain(self._sock):
                self._stopping.wait(0.1)  # a socket error: do not spin on it

    def _drain(self, sock: socket.socket) -> bool:
        for _ in range(_DRAIN_BATCH):
            try:
                # one byte more than allowed, so that a message of exactly the limit is not "truncated"
                data, ancillary, flags, _ = sock.recvmsg(MAX_DATAGRAM_BYTES + 1, ANCILLARY_BYTES)
            except BlockingIOError:
                return True
            except OSError as exc:
                if not self._stopping.is_set():
                    _log.warning("job socket %s: receive failed: %s", self.socket_path, exc)
                return False
            self._handle(data, ancillary, flags)
        return True

    def _handle(self, data: bytes, ancillary: list[tuple[int, int, bytes]], flags: int) -> None:
        pid, uid = credentials(ancillary)
        try:
            if flags & socket.MSG_TRUNC:
                raise ProtocolError(DropReason.OVERSIZED, f"datagram longer than {MAX_DATAGRAM_BYTES} bytes")
            event = self._accept(decode(data), pid, uid)
        except ProtocolError as exc:
            self._drop(exc.reason, str(exc), pid)
            return
        except Exception as exc:  # a bug here must cost one message, not the receiver thread
            _log.exception("job socket: failed handling a message from pid %d", pid)
            self._drop(DropReason.INTERNAL, repr(exc), pid)
            return
        if event is not None and self._emit is not None:
            try:
                self._emit(event)
            except Exception:  # the sink promises not to raise; the thread outlives one that does
                _log.exception("job socket: event sink failed for %s", event.name)

    def _drop(self, reason: DropReason, why: str, pid: int) -> None:
        with self._lock:
            self._dropped[reason] += 1
            count = self._dropped[reason]
        if str(count).strip("0") == "1":  # log the 1st, 10th, 100th, ... of each reason
            _log.warning("job socket: dropped message from pid %d (%d so far for %s): %s", pid, count, reason, why)

    def _accept(self, message: Message, pid: int, uid: int) -> Event | None:
        who, now = message.who, self._clock()
        key = (who.customer, who.job, who.rank)
        with self._lock:
            series = self._series.get(key)
            if series is None:
                if len(self._series) >= self._max_series:
                    raise ProtocolError(DropReason.TOO_MANY_SERIES, f"already {self._max_series} ranks")
                series = self._series[key] = _Series(who.world_size, _TokenBucket(EVENTS_PER_S, EVENT_BURST, now), now)
            series.world_size, series.last_seen, series.pid, series.uid = who.world_size, now, pid, uid
            if isinstance(message, StepReport):
                series.record(message)
                self._received["step"] += 1
            else:
                series.running = message.kind == "start"
                self._received[message.kind] += 1
            if not (series.bucket.take(now) and self._all_events.take(now)):
                self._suppressed += 1
                return None
        return self._event(message, pid)

    def _event(self, message: Message, pid: int) -> Event:
        who = message.who
        attrs = {"job.id": who.job, "job.customer": who.customer, "job.rank": str(who.rank),
                 "job.world_size": str(who.world_size)}
        if pid > 0:
            attrs["process.pid"] = str(pid)
        rank = f"job {who.job} rank {who.rank}/{who.world_size}"
        if isinstance(message, Lifecycle) and message.kind == "start":
            attrs["job.time_ns"] = str(message.time_ns)
            return Event("job.started", f"{rank} started", self._wall_clock(), "INFO", attrs)
        if isinstance(message, Lifecycle):
            attrs.update({"job.time_ns": str(message.time_ns), "job.end.reason": message.reason})
            if message.detail:
                attrs["job.end.detail"] = message.detail
            severity = "INFO" if message.reason == "completed" else "WARN"
            return Event("job.ended", f"{rank} ended: {message.reason}", self._wall_clock(), severity, attrs)
        attrs.update({"job.step": str(message.step), "job.step.start_ns": str(message.start_ns),
                      "job.step.end_ns": str(message.end_ns), "job.step.duration_s": repr(message.duration_s)})
        if message.tokens is not None:
            attrs["job.tokens"] = str(message.tokens)
        if message.samples is not None:
            attrs["job.samples"] = str(message.samples)
        attrs.update({f"job.phase.{phase}_s": repr(s) for phase, s in message.phases_s.items()})
        body = f"{rank} step {message.step}: {message.duration_s:.3f} s"
        return Event("job.step", body, self._wall_clock(), "INFO", attrs)


def from_config(cfg: AgentConfig) -> JobSource:
    """The job source the agent's config asks for, listening at ``cfg.job_socket``."""
    return JobSource(socket_path=cfg.job_socket, interval_s=cfg.interval_s)

