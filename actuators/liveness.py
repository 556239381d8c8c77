"""Fast per-path liveness for the reflex: UDP echoes every few ms per (rail, peer), and what they say.

A *target* is one rail to one peer: from a local NIC's address to the same-named NIC of the
peer, answered by the peer agent's probe responder (`ridethrough.collector.probe_responder`;
same packets, so the same checks, rate limits and anti-replay apply). The host picks the rail;
the leaf hashes each flow onto a spine, so one source port would watch one spine only. Each
NIC therefore has a pool of ``flows`` sockets on random ports and every probe to a target uses
the next one: over a few probes every spine behind the rail is exercised (with 16 ports and 2
spines the chance that a spine is never hashed to is 2 x 2^-16). A probe that fails is re-sent
at once on the *same* port (same 5-tuple, same spine), so a dead spine is confirmed within two
timeouts instead of waiting for the rotation to come back to it. The timeout follows the round
trips seen, as TCP's RTO does (`RoundTrips`), from ``timeout_s`` up to `MAX_TIMEOUT_S`.

Probes come from their own endpoint name (``~nic0``), so the responder keeps their anti-replay
window apart from the mesh prober's. Replies carry the responder's receive and send times: the
network RTT is the probe's round trip less that turnaround, measured with the kernel's receive
stamp, so neither the responder's scheduling nor ours counts as network delay. Replies are read
before losses are declared, so a reflex thread that ran late does not invent losses.

`PathHealth` turns outcomes into a verdict: a path is *failing* while one port has ``losses`` bad
probes in a row (lost, or a network RTT above ``delay_s``) unbroken by a good one, and goes down
the first time it is; it comes back after ``holddown_s`` with no bad probe; a path that fails
again soon after coming back waits twice as long (up to ``holddown_max_s``), so a flapping link
is damped rather than followed.
"""

from __future__ import annotations

import collections
import contextlib
import math
import random
import secrets
import select
import struct
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from ridethrough.collector.probe_paths import Address
from ridethrough.collector.probe_sample import TimestampKind
from ridethrough.collector.probe_wire import NIC_MAX_BYTES, Endpoint, Probe, Reply, WireError, decode, encode
from ridethrough.collector.timestamps import HostTime, ProbeSocket, Received, open_probe_socket

_DRAIN = 256  # datagrams per socket per wake-up
_LATE = 1024  # expired probes remembered, so that a late reply still teaches the timeout
MAX_TIMEOUT_S = 0.25
"""The longest a probe waits for its reply, however slow the round trips have been: beyond this the
reflex would be too slow to help, and `ridethrough.actuators.reflex.decide`'s proof rule, not a longer
wait, is what keeps a host too busy to answer in time from moving traffic."""


@dataclass(frozen=True, slots=True)
class Target:
    """One rail to one peer: from local NIC ``nic`` to the peer's ``peer_nic`` at ``address``."""

    peer: str
    nic: str
    peer_nic: str
    address: Address


@dataclass(frozen=True, slots=True)
class Outcome:
    """One probe's fate: ``rtt_ns`` is the network round trip, None if no reply came in time."""

    target: Target
    flow: int
    sent_s: float
    """Monotonic send time."""
    rtt_ns: int | None
    seen_s: float = math.nan
    """Monotonic time it became known (the reply read, the timeout passed); nan: when it was sent."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HealthSettings:
    """When a path is down and when it is back (see the module docstring)."""

    losses: int = 2
    delay_s: float = 0.010
    holddown_s: float = 2.0
    holddown_max_s: float = 60.0

    def __post_init__(self) -> None:
        if self.losses < 1 or min(self.delay_s, self.holddown_s) <= 0 or self.holddown_max_s < self.holddown_s:
            raise ValueError("losses >= 1, delay and hold-down > 0, and holddown_max_s >= holddown_s")


@dataclass(slots=True)
class _Run:
    bad: int
    first_s: float
    last_s: float


@dataclass(slots=True)
class PathHealth:
    """The verdict on one target from its outcomes (pure: times are the outcomes' and the caller's)."""

    settings: HealthSettings
    up: bool = True
    reason: str = ""
    """Why it went down: ``loss`` or ``delay``."""
    down_since_s: float = math.nan
    """Send time of the first bad probe of the run that took it down."""
    last_good_s: float = -math.inf
    """Send time of the latest good probe."""
    last_bad_s: float = -math.inf
    last_bad_seen_s: float = -math.inf
    """When the latest bad probe was known to be bad: the hold-down counts from there, not from its send
    (a loss is known only a timeout later, and a timeout can be long on a busy host)."""
    clean_since_s: float = math.nan
    """Send time of the first good probe after the latest bad one (nan while there is none)."""
    holddown_s: float = 0.0
    _up_at_s: float = -math.inf
    _runs: dict[int, _Run] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.holddown_s = self.settings.holddown_s

    def observe(self, o: Outcome) -> bool:
        """Take one outcome; True if it made the path failing (a port's run of bad probes reached ``losses``).

        The first time that happens while the path is up, the path goes down.
        """
        s = self.settings
        if o.rtt_ns is not None and o.rtt_ns <= s.delay_s * 1e9:
            self.last_good_s = max(self.last_good_s, o.sent_s)
            run = self._runs.get(o.flow)
            if run is not None and o.sent_s > run.first_s:  # a later probe on that port came through
                del self._runs[o.flow]
            if o.sent_s > self.last_bad_s:
                self.clean_since_s = o.sent_s if math.isnan(self.clean_since_s) else min(self.clean_since_s, o.sent_s)
            return False
        self.last_bad_s, self.clean_since_s = max(self.last_bad_s, o.sent_s), math.nan
        self.last_bad_seen_s = max(self.last_bad_seen_s, o.sent_s if math.isnan(o.seen_s) else o.seen_s)
        run = self._runs.setdefault(o.flow, _Run(0, o.sent_s, o.sent_s))
        run.bad, run.last_s = run.bad + 1, max(run.last_s, o.sent_s)
        if run.bad != s.losses:
            return False
        if self.up:
            self.up, self.down_since_s = False, run.first_s
            self.reason = "loss" if o.rtt_ns is None else "delay"
            recent = o.sent_s - self._up_at_s < s.holddown_max_s
            self.holddown_s = min(s.holddown_max_s, 2 * self.holddown_s) if recent else s.holddown_s
        return True

    def hold(self, now_s: float, reason: str) -> None:
        """Take the path down without evidence of our own (an override adopted from an earlier run):
        it comes back after a hold-down of good probes, like any other."""
        self.up, self.reason, self.down_since_s = False, reason, now_s
        self.last_bad_s, self.clean_since_s = max(self.last_bad_s, now_s), math.nan
        self.last_bad_seen_s = max(self.last_bad_seen_s, now_s)

    @property
    def failing(self) -> bool:
        """Whether a port's run of bad probes is long enough to take the path down, and unbroken so far."""
        return any(run.bad >= self.settings.losses for run in self._runs.values())

    @property
    def failing_since_s(self) -> float:
        """Send time of the first bad probe of the oldest run that makes it `failing` (nan if it is not)."""
        return min((r.first_s for r in self._runs.values() if r.bad >= self.settings.losses), default=math.nan)

    @property
    def failing_last_s(self) -> float:
        """Send time of the latest bad probe of the runs that make it `failing` (nan if it is not)."""
        return max((r.last_s for r in self._runs.values() if r.bad >= self.settings.losses), default=math.nan)

    @property
    def clean(self) -> bool:
        """Whether no port is in a run of bad probes (the latest probe from every port came through)."""
        return not self._runs

    def suspect(self, flow: int) -> bool:
        """Whether to probe ``flow``'s port again at once: it is in a run of bad probes short enough that one
        more decides something (confirms a failure, or shows it was a blip: a stalled peer agent, say)."""
        run = self._runs.get(flow)
        return run is not None and run.bad <= self.settings.losses

    def tick(self, now_s: float) -> bool:
        """True if the path comes back up now: no bad probe for its hold-down, and a good one since."""
        if self.up or now_s - self.last_bad_seen_s < self.holddown_s or self.last_good_s <= self.last_bad_s:
            return False
        self.up, self._up_at_s, self.reason = True, now_s, ""
        self._runs.clear()
        return True


_IDS = struct.Struct("!QQQq")
_IDS_OFFSET = 8  # seq, pair_id, cookie, t1_ns: consecutive in the probe layout (`ridethrough.collector.probe_wire`)


@dataclass(slots=True)
class RoundTrips:
    """RFC 6298's smoothed round trip and its variation, for a timeout that follows what is seen.

    Over the whole round trip as this host sees it, the peer agent's turnaround included: on a
    busy host replies come later, and the timeout must wait for them rather than call them lost.
    """

    srtt_s: float = math.nan
    rttvar_s: float = math.nan

    def sample(self, rtt_s: float) -> None:
        """One round trip (replies that came too late count too: they are what the timeout must cover)."""
        if math.isnan(self.srtt_s):
            self.srtt_s, self.rttvar_s = rtt_s, rtt_s / 2
        else:
            self.rttvar_s = 0.75 * self.rttvar_s + 0.25 * abs(self.srtt_s - rtt_s)
            self.srtt_s = 0.875 * self.srtt_s + 0.125 * rtt_s

    def timeout_s(self, floor_s: float) -> float:
        """How long to wait for a reply: srtt + 4 rttvar, within [``floor_s``, `MAX_TIMEOUT_S`]."""
        estimate = self.srtt_s + 4 * self.rttvar_s
        return floor_s if math.isnan(estimate) else min(MAX_TIMEOUT_S, max(floor_s, estimate))


class _Slot:
    """A target's encoded probe (patched per send), its turn in the rotation of source ports, its round trips."""

    __slots__ = ("dst", "packet", "rtt", "target", "turn")

    def __init__(self, target: Target, src: Endpoint, first_flow: int) -> None:
        self.target, self.dst, self.turn = target, Endpoint(target.peer, target.peer_nic), first_flow
        self.packet = bytearray(encode(Probe(0, 0, 0, 0, 1, TimestampKind.USER, src, self.dst)))
        self.rtt = RoundTrips()

    def next_flow(self, flows: int) -> int:
        """The next source port's index."""
        self.turn = (self.turn + 1) % flows
        return self.turn


@dataclass(slots=True)
class _Pending:
    target: Target
    flow: int
    cookie: int
    t1_ns: int
    sent_s: float
    deadline_s: float


def probe_name(nic: str) -> str:
    """The endpoint name the reflex probes from on ``nic`` (not the mesh prober's, so their replay windows differ)."""
    return ("~" + nic)[:NIC_MAX_BYTES]


class Liveness:
    """Sends the probes and matches the replies; the caller's thread drives it (`tick`, `wait`)."""

    def __init__(self, *, node: str, local: Mapping[str, str], flows: int = 16, interval_s: float = 0.01,
                 timeout_s: float = 0.03, max_rate: float = 500.0, host_time: HostTime | None = None,
                 monotonic: Callable[[], float] = time.monotonic, rng: random.Random | None = None) -> None:
        """``local`` maps this node's NICs to their addresses; ``flows`` source ports per NIC.

        A round (one probe per target) goes every ``interval_s``, or less often when there are so
        many targets that rounds would exceed ``max_rate`` probes a second: the cost stays bounded.
        """
        if flows < 1 or min(interval_s, timeout_s, max_rate) <= 0:
            raise ValueError("flows >= 1; interval_s, timeout_s and max_rate > 0")
        self.node, self.local = node, dict(local)
        self.flows, self.timeout_s, self.max_rate = flows, timeout_s, max_rate
        self.interval_s = self._base_interval_s = interval_s
        self._time, self._mono = host_time or HostTime(), monotonic
        self._rng = rng or random.Random()
        self._src = {nic: Endpoint(node, probe_name(nic)) for nic in local}
        self._socks: dict[str, list[ProbeSocket]] = {}
        self._poll: select.poll | None = None
        self._by_fd: dict[int, tuple[str, ProbeSocket]] = {}
        self._seq = dict.fromkeys(local, time.time_ns() // 1000)  # a restart never reuses a sequence number
        self._pending: dict[tuple[str, int], _Pending] = {}
        self._expired: collections.OrderedDict[tuple[str, int], _Pending] = collections.OrderedDict()
        self._slots: dict[Target, _Slot] = {}
        self._next_round_s = -math.inf
        self.sent = self.received = self.lost = self.late = self.dropped = 0

    # -- sockets ---------------------------------------------------------------------------

    def open(self) -> None:
        """Bind ``flows`` sockets per NIC (OSError if one cannot be bound; then none stays open)."""
        try:
            for nic, addr in self.local.items():
                self._socks[nic] = [open_probe_socket(addr, 0, want_tx_timestamps=False) for _ in range(self.flows)]
        except OSError:
            self.close()
            raise
        self._poll = select.poll()
        self._by_fd = {s.fileno(): (nic, s) for nic, socks in self._socks.items() for s in socks}
        for fd in self._by_fd:
            self._poll.register(fd, select.POLLIN)

    def close(self) -> None:
        """Close every socket."""
        for socks in self._socks.values():
            for s in socks:
                s.close()
        self._socks.clear()
        self._poll, self._by_fd = None, {}

    # -- targets and sending ---------------------------------------------------------------

    def set_targets(self, targets: Iterable[Target]) -> None:
        """Probe these targets from now on (a kept target keeps its place in the rotation of ports)."""
        slots: dict[Target, _Slot] = {}
        for t in targets:
            if t.nic in self.local:
                slots[t] = self._slots.get(t) or _Slot(t, self._src[t.nic], self._rng.randrange(self.flows))
        self._slots = slots
        self.interval_s = max(self._base_interval_s, len(slots) / self.max_rate)

    @property
    def targets(self) -> list[Target]:
        """The targets being probed."""
        return list(self._slots)

    def next_due_s(self) -> float:
        """When the next round of probes or the next loss is due (monotonic); inf if nothing is."""
        due = self._next_round_s if self._slots else math.inf
        return min(due, *(p.deadline_s for p in self._pending.values())) if self._pending else due

    def timeout_s_of(self, target: Target) -> float:
        """How long a probe to ``target`` waits for its reply now (adapts to the round trips seen)."""
        slot = self._slots.get(target)
        return self.timeout_s if slot is None else slot.rtt.timeout_s(self.timeout_s)

    def tick(self, now_s: float) -> list[Outcome]:
        """Read waiting replies, declare probes past their timeout lost, send a round if one is due.

        The outcomes of the replies and the losses. Replies are read first: one that arrived in
        time is not lost because this thread ran late. A round is one probe to every target, so
        the thread wakes once per interval to send, however many targets there are.
        """
        out = self.drain() + self._expire(now_s)
        if now_s >= self._next_round_s:
            for slot in self._slots.values():
                self.probe(slot.target, slot.next_flow(self.flows), now_s)
            late = now_s - self._next_round_s >= self.interval_s
            self._next_round_s = now_s + self.interval_s if late else self._next_round_s + self.interval_s
        return out

    def probe(self, target: Target, flow: int, now_s: float) -> None:
        """Send one probe to ``target`` from ``flow``'s port now (a failed send is a loss at timeout)."""
        socks, slot = self._socks.get(target.nic), self._slots.get(target)
        if not socks or slot is None:
            return
        seq, self._seq[target.nic] = self._seq[target.nic], self._seq[target.nic] + 1
        cookie = secrets.randbits(64)
        t1_ns = self._time.now()
        _IDS.pack_into(slot.packet, _IDS_OFFSET, seq, seq, cookie, t1_ns)
        self._pending[(target.nic, seq)] = _Pending(target, flow, cookie, t1_ns, now_s,
                                                    now_s + slot.rtt.timeout_s(self.timeout_s))
        self.sent += 1
        with contextlib.suppress(OSError):  # no route (the NIC is down): the probe times out like a lost one
            socks[flow].send(bytes(slot.packet), target.address)

    def _expire(self, now_s: float) -> list[Outcome]:
        out: list[Outcome] = []
        for key in [k for k, p in self._pending.items() if p.deadline_s <= now_s]:  # a few dozen at most
            p = self._expired[key] = self._pending.pop(key)
            if len(self._expired) > _LATE:
                self._expired.popitem(last=False)
            self.lost += 1
            if p.target in self._slots:  # a target no longer probed has no verdict to feed
                out.append(Outcome(p.target, p.flow, p.sent_s, None, now_s))
        return out

    # -- receiving -------------------------------------------------------------------------

    def wait(self, timeout_s: float) -> list[Outcome]:
        """Wait up to ``timeout_s`` for replies; the outcomes of those that came."""
        if self._poll is None:
            time.sleep(max(0.0, min(timeout_s, 0.1)))
            return []
        out: list[Outcome] = []
        for fd, _ in self._poll.poll(max(0, math.ceil(timeout_s * 1000))):
            if fd in self._by_fd:
                out += self._drain(*self._by_fd[fd])
        return out

    def drain(self) -> list[Outcome]:
        """Read every reply already waiting, without blocking."""
        return self.wait(0.0)

    def _drain(self, nic: str, sock: ProbeSocket) -> list[Outcome]:
        out: list[Outcome] = []
        for _ in range(_DRAIN):
            try:
                received = sock.recv()
            except OSError:  # an ICMP error for an earlier probe: that probe will time out
                continue
            if received is None:
                break
            outcome = self._match(nic, received)
            if outcome is not None:
                out.append(outcome)
        return out

    def _match(self, nic: str, received: Received) -> Outcome | None:
        """The outcome a reply completes; None (counted in `dropped` or `late`) if it completes none."""
        try:
            reply = decode(received.payload)
        except WireError:
            reply = None
        key = (nic, reply.seq) if isinstance(reply, Reply) else (nic, -1)
        p = self._pending.get(key) or self._expired.get(key)
        slot = None if p is None else self._slots.get(p.target)
        if not isinstance(reply, Reply) or p is None or slot is None or reply.cookie != p.cookie \
                or received.addr != p.target.address or reply.dst != slot.dst or reply.src != self._src[nic]:
            self.dropped += 1  # not the reply to anything we sent (or to a target no longer probed)
            return None
        round_trip_ns = self._time.to_local(received.rx_true_ns) - p.t1_ns
        slot.rtt.sample(max(0, round_trip_ns) / 1e9)
        if self._expired.pop(key, None) is not None:  # came after its probe was counted lost
            self.late += 1
            return None
        del self._pending[key]
        self.received += 1
        return Outcome(p.target, p.flow, p.sent_s, max(0, round_trip_ns - max(0, reply.t3_ns - reply.t2_ns)),
                       self._mono())
