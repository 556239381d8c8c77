"""The prober: coded probe pairs over every path, replies matched into `ProbeSample`s, losses counted.

Every ``interval_s`` (jittered ±10 %, from a random phase so that hosts are out of step)
the prober sends a round: a *coded pair* down each path, two probes at least ``pair_gap_ns``
apart (busy-waiting the gap: a sleep would overshoot it by tens of µs). One round per wake-up
rather than one wake-up per path is what keeps the CPU cost low. One socket per local NIC,
bound to the NIC's address: routing takes the NIC's rail, and the source port, hence the ECMP
hash, stays fixed for the prober's life. Send times come from the kernel's transmit stamps
where the driver gives them (replacing the user-space time written into the packet), receive
times from the kernel's receive stamps; every stamp is mapped onto the host's clock (`HostTime`).

A reply is matched to its probe by (NIC, sequence number) and must echo the probe's random
cookie, come from the address the probe went to, name the right endpoints, and carry
times that make one exchange; otherwise it is dropped and counted by `DropReason` (the probe
still waits for its real reply).

Each probe is judged by what the network did to it, not by when a thread got to run:

* *received*: its reply arrived (kernel stamp) within ``timeout_s``, however late this thread
  read it (replies waiting in the sockets are read before any probe is judged);
* *late*: the reply arrived after the timeout, but the exchange less the responder's turnaround
  (t3 - t2: how long the peer held the probe) fits in it: the peer's responder was stalled
  (a starved agent), not the path. Counted as received, and as ``late``;
* *lost*: no reply, while the peer's responder was running: it answered in time a probe of a
  later round (over any rail: one thread answers them all, in the order they arrived), so this
  one was lost on the way; or a reply whose network time alone exceeds the timeout. A probe
  unanswered at its timeout whose peer has answered no later round since is *overdue*: judged
  when such an answer comes, or when its own (late) reply does, or ``late_s`` after the timeout;
* *unknown*: overdue to the end (the peer silent throughout: starved, frozen, or cut off on
  every rail, which this prober cannot tell apart), or unanswered while our own socket dropped
  datagrams for want of buffer (``SO_RXQ_OVFL``). Neither lost nor received. The controller,
  which also has the peer's own account of its stalls (``ridethrough.probe.stalled``), counts
  a path's unknown probes as lost unless one of its ends stalled.

Stalls of this thread (`StallMeter`: late wake-ups, replies read long after they arrived) are
counted in ``stalls``. `PathCounters` splits losses by direction; a path that loses
``losses_to_suspend`` in a row is suspended and retried later with exponential backoff
(`PathHealth`), or at once when the peer's own probes reach our responder over that path
(`heard_from`: the path is back, and a backoff grown over a long outage would otherwise keep
it suspended, and looking dead, minutes after; a probe over another rail says nothing of this
one). Only lost probes count towards a suspension: a peer silent on every rail is not a path's
fault, and its probes go on at the usual pace.

As BFD declares no session down that never came up, a path that has never been answered is
not losing probes but not reached yet: for its first ``first_contact_s`` its unanswered probes
count as ``unreached``, not lost (a peer's agent starts seconds after ours in any rollout, and
its probes lost meanwhile would blame its links). Past that, a path never answered loses like
any other while its peer answers over another: a black hole there from the start is still
reported. Peers are every pinned one plus ``k`` drawn at random and re-drawn every
``redraw_s`` (`PeerPicker`).

`Responder` (answering probes) lives in `ridethrough.collector.probe_responder`.
"""

from __future__ import annotations

import collections
import logging
import math
import random
import secrets
import select
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ridethrough.collector.probe_paths import (
    Path,
    PathCounters,
    PathHealth,
    PeerPicker,
    PeerTable,
    plan_paths,
)
from ridethrough.collector.probe_responder import Responder
from ridethrough.collector.probe_sample import ProbeSample, TimestampKind
from ridethrough.collector.probe_stall import StallMeter
from ridethrough.collector.probe_wire import T1_OFFSET, DropReason, Probe, Reply, WireError, decode, encode, patch_time
from ridethrough.collector.probe_worker import SocketWorker
from ridethrough.collector.timestamps import HostTime, Received

__all__ = ["PathStatus", "Prober", "ProberSettings", "Responder", "worst_kind"]

_log = logging.getLogger(__name__)
_RECENT = 4096  # sequence numbers remembered per NIC after their fate, to tell a replay from a stranger
_TX_STAMP_WINDOW_NS = 100_000_000  # a send stamp this long after the send() call belongs to another packet
_PLAN_EVERY_S = 1.0
_SETTLE_EVERY_S = 0.25
_RATE_SLACK = 500e-6  # how far two hosts' clock rates may differ (quartz: tens of ppm; NTP slews at 500 ppm)
_STAMP_SLACK_NS = 100_000  # and their stamps, taken in user space on one side
_DRAIN_ROUNDS = 64  # batches per socket read before probes are judged: a stalled prober's whole backlog
_RANK = {TimestampKind.HARDWARE: 0, TimestampKind.KERNEL: 1, TimestampKind.USER: 2}
PathKey = tuple[str, str, str]
"""(local NIC, peer node, peer NIC)."""


def worst_kind(*kinds: TimestampKind) -> TimestampKind:
    """The least precise of some timestamp kinds."""
    return max(kinds, key=_RANK.__getitem__)


@dataclass(frozen=True, slots=True, kw_only=True)
class ProberSettings:
    """How a prober probes (defaults: see `ridethrough.collector.sources.probe` for why)."""

    k: int = 10
    pinned: tuple[str, ...] = ()
    redraw_s: float = 600.0
    interval_s: float = 0.5
    pair_gap_ns: int = 20_000
    timeout_s: float = 1.0
    max_skew_s: float = 1.0
    losses_to_suspend: int = 10
    backoff_min_s: float = 5.0
    backoff_max_s: float = 300.0
    first_contact_s: float = 30.0
    late_s: float = 10.0
    """How long past its timeout an overdue probe's reply may still come (late), before the probe is judged."""
    want_tx_timestamps: bool = True
    want_hardware: bool = False

    def __post_init__(self) -> None:
        if min(self.interval_s, self.timeout_s, self.max_skew_s, self.backoff_min_s, self.redraw_s) <= 0:
            raise ValueError("probe interval, timeout, skew, backoff and redraw times must be positive")
        if not 0 <= self.pair_gap_ns <= 10_000_000 or self.k < 0 or self.losses_to_suspend < 1:
            raise ValueError("pair gap must be 0-10 ms, k >= 0 and losses_to_suspend >= 1")
        if self.backoff_max_s < self.backoff_min_s:
            raise ValueError("backoff_max_s must be at least backoff_min_s")
        if self.first_contact_s < 0 or self.late_s < 0:
            raise ValueError("first_contact_s and late_s must be >= 0")


@dataclass(frozen=True, slots=True)
class PathStatus:
    """One path's cumulative counters, read at one moment."""

    path: Path
    sent: int
    received: int
    lost: int
    lost_forward: int
    lost_reverse: int
    suspended: bool
    unreached: int = 0
    """Probes unanswered before the path was first answered (see the module docstring): not in ``lost``."""
    late: int = 0
    """Probes answered late because the peer's responder was stalled (also in ``received``)."""
    unknown: int = 0
    """Probes that could not be judged (see the module docstring): in neither ``received`` nor ``lost``."""


@dataclass(slots=True)
class _Pending:
    path: PathKey
    index: int
    pair_id: int
    pair_index: int
    cookie: int
    t1_ns: int
    t1_kind: TimestampKind
    sent_s: float
    before_true_ns: int
    overflowed: int = 0
    """Our socket's drop count when the probe was sent: a rise before its reply means it may have been ours."""


@dataclass(slots=True)
class _PathState:
    path: Path
    health: PathHealth
    counters: PathCounters = field(default_factory=PathCounters)
    next_index: int = 1
    outstanding: int = 0
    """Probes sent and neither answered nor lost yet."""
    created_s: float = 0.0
    """When the path joined the plan (monotonic s): its first-contact grace runs from here."""

    @property
    def path_key(self) -> PathKey:
        """(local NIC, peer node, peer NIC)."""
        return self.path.local.nic, self.path.peer.node, self.path.peer.nic


class Prober(SocketWorker):
    """Probes paths from this node's NICs (see the module docstring)."""

    thread_name = "rt-prober"

    def __init__(self, *, node: str, local: Mapping[str, str], peers: PeerTable,
                 on_sample: Callable[[ProbeSample], None], settings: ProberSettings | None = None,
                 host_time: HostTime | None = None, monotonic: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None) -> None:
        """``local`` maps this node's NICs to their addresses; ``on_sample`` runs in the prober thread."""
        s = settings or ProberSettings()
        super().__init__({nic: (addr, 0) for nic, addr in local.items()}, want_tx_timestamps=s.want_tx_timestamps,
                         want_hardware=s.want_hardware)
        self.node, self._local, self.settings = node, dict(local), s
        self.tx_stamped = 0
        """Probes whose t1 is the kernel's (or NIC's) send stamp rather than the user-space time."""
        self._peers, self._on_sample = dict(peers), on_sample
        self._time, self._monotonic = host_time or HostTime(), monotonic
        self._rng = rng or random.Random()
        self._picker = PeerPicker(k=s.k, pinned=s.pinned, redraw_s=s.redraw_s, rng=self._rng)
        self._lock = threading.Lock()
        self._states: dict[PathKey, _PathState] = {}
        self._unreached = 0  # over the prober's life: paths leaving the plan take their own counts with them
        self._suspended: set[PathKey] = set()
        """Paths suspended since their last wake-up (a hint read without the lock by `heard_from`)."""
        self._pending: dict[tuple[str, int], _Pending] = {}  # (NIC, seq), in send order
        self._overdue: dict[tuple[str, int], _Pending] = {}  # past their timeout, not yet judged; in send order
        self._answered_upto: dict[str, float] = {}  # peer node → newest send time of a probe it answered in time
        self.stalls = StallMeter()
        """When this prober's thread was held off (late wake-ups, replies read long after they came)."""
        self._tx_keys: dict[tuple[str, int], int] = {}  # (NIC, OPT_ID key) → seq
        self._recent: dict[str, collections.OrderedDict[int, bool]] = {nic: collections.OrderedDict() for nic in local}
        start = time.time_ns() // 1000  # a restarted prober does not reuse the sequence numbers it sent before
        self._next_seq = dict.fromkeys(local, start)
        self._next_pair = start
        self._dropped = dict.fromkeys(DropReason, 0)
        self._next_plan_s = self._next_settle_s = self._quiet_until_s = float("-inf")
        self._next_round_s = monotonic() + self._rng.uniform(0, self.settings.interval_s)  # hosts out of step
        self._quiescing = False
        self._poller: select.poll | None = None
        self._by_fd: dict[int, str] = {}

    def start(self) -> None:
        """Open the sockets (unless open) and probe in a thread until `stop`."""
        self._poller = None  # the thread's first poll registers the wake-up socket too
        super().start()

    def close(self) -> None:
        """Close every socket."""
        super().close()
        self._poller = None

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                wait_s = min(self.tick(self._monotonic()), 0.1)
                started_ns = time.time_ns()
                self.poll(wait_s)
                self.stalls.note_wake(wait_s, started_ns, time.time_ns())
            except Exception:  # one bad turn must not end probing; pace the retries
                _log.exception("prober %s: loop failed", self.node)
                self._stopping.wait(0.5)

    # -- reading ---------------------------------------------------------------------------

    def set_peers(self, peers: PeerTable) -> None:
        """Replace the peer table; the paths follow at the next tick."""
        with self._lock:
            self._peers = dict(peers)
            self._next_plan_s = self._quiet_until_s = float("-inf")

    def paths(self) -> list[PathStatus]:
        """Every current path's counters."""
        with self._lock:
            return [PathStatus(st.path, st.counters.sent, st.counters.received, st.counters.lost,
                               st.counters.lost_forward, st.counters.lost_reverse,
                               not st.health.active(self._monotonic()), st.counters.unreached, st.counters.late,
                               st.counters.unknown)
                    for st in self._states.values()]

    def unreached(self) -> int:
        """Probes unanswered before their path's first reply, within ``first_contact_s`` (not lost), so far."""
        with self._lock:
            return self._unreached

    def heard_from(self, nic: str, node: str, peer_nic: str) -> None:
        """A probe from ``node``'s ``peer_nic`` reached our ``nic``: that path is up, so end its suspension now.

        Called by the responder for every probe it answers: costs a set lookup unless that path is suspended.
        The retry is the usual one pair; losing it suspends the path again.
        """
        key = (nic, node, peer_nic)
        if key not in self._suspended:
            return
        with self._lock:
            self._suspended.discard(key)
            st = self._states.get(key)
            if st is not None:
                st.health.wake(self._monotonic())

    def settle(self, timeout_s: float) -> bool:
        """Send no more pairs and wait (up to ``timeout_s``) until every probe in flight is judged.

        For a run that ends: its counts then add up (sent = received + lost + unknown), where a plain `stop`
        leaves the probes of the last timeout window neither. Once nothing else is in flight, overdue probes
        are judged at once, by what their peer's answers say so far. True when nothing is left in flight.
        """
        with self._lock:
            self._quiescing = True
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                if not self._pending:
                    self._judge_overdue(self._monotonic(), final=True)
                    return True
            if time.monotonic() >= deadline or self._stopping.wait(0.02):
                return False

    def dropped(self) -> dict[DropReason, int]:
        """Replies dropped (and probes that could not be sent) so far, by reason (with those the kernel dropped
        for want of socket buffer)."""
        with self._lock:
            out = dict(self._dropped)
        out[DropReason.SOCKET_OVERFLOW] += sum(sock.overflowed for sock in list(self._sockets.values()))
        return out

    # -- sending and expiry ----------------------------------------------------------------

    def tick(self, now_s: float) -> float:
        """Plan paths, send a round of pairs if one is due, count lost probes; seconds until the next thing due."""
        if now_s < self._quiet_until_s:
            return self._quiet_until_s - now_s  # woken by a reply: nothing is due yet
        # Take the replies already waiting before anything expires: on a loaded host this thread may not
        # run for seconds, and a probe answered in time is not lost because its answer was read late.
        self._drain_all()
        sent_on: set[str] = set()
        with self._lock:
            if now_s >= self._next_plan_s:
                self._plan(now_s)
            if now_s >= self._next_round_s and not self._quiescing:
                for st in self._states.values():
                    if st.health.active(now_s) and not (st.health.retrying and st.outstanding):
                        self._send_pair(st, now_s)
                        sent_on.add(st.path.local.nic)
                interval = self.settings.interval_s * self._rng.uniform(0.9, 1.1)
                self._next_round_s = max(self._next_round_s + interval, now_s)
            self._expire(now_s)
            due = min(self._next_plan_s, self._next_settle_s)
            if not self._quiescing:  # a settling prober sends no rounds: one due in the past would spin it
                due = min(due, self._next_round_s)
            if self._pending:
                due = min(due, next(iter(self._pending.values())).sent_s + self.settings.timeout_s)
            if self._overdue:
                due = min(due, next(iter(self._overdue.values())).sent_s + self.settings.timeout_s
                          + self.settings.late_s)
            self._quiet_until_s = due
        for nic in sent_on:  # loopback and veth stamp within the send: take them now rather than on another wake-up
            self._take_tx_stamps(nic)
        return max(0.0, due - now_s)

    def _plan(self, now_s: float) -> None:
        chosen = self._picker.pick([n for n in self._peers if n != self.node], now_s)
        paths = {(p.local.nic, p.peer.node, p.peer.nic): p for p in plan_paths(self.node, list(self._local),
                                                                                self._peers, chosen)}
        for key in self._states.keys() - paths.keys():
            del self._states[key]
        s = self.settings
        for key, path in paths.items():
            st = self._states.get(key)
            if st is None or st.path != path:
                self._states[key] = _PathState(path, PathHealth(s.losses_to_suspend, s.backoff_min_s, s.backoff_max_s),
                                               created_s=now_s)
        self._next_plan_s = now_s + _PLAN_EVERY_S

    def _send_pair(self, st: _PathState, now_s: float) -> None:
        nic = st.path.local.nic
        sock = self._sockets.get(nic)
        if sock is None:
            return
        pair_id, self._next_pair = self._next_pair, self._next_pair + 1
        probes = []
        for pair_index in (0, 1):  # encode both first, so that only the sends sit between the two t1s
            seq, self._next_seq[nic] = self._next_seq[nic], self._next_seq[nic] + 1
            probe = Probe(seq, pair_id, pair_index, secrets.randbits(64), 1, TimestampKind.USER, st.path.local,
                          st.path.peer)
            probes.append((probe, bytearray(encode(probe))))
        first_ns = 0
        for probe, packet in probes:
            if first_ns:
                while time.perf_counter_ns() - first_ns < self.settings.pair_gap_ns:
                    pass  # busy-wait: a sleep would overshoot a 20 µs gap by tens of µs
            else:
                first_ns = time.perf_counter_ns()
            t1_ns = self._time.now()
            patch_time(packet, T1_OFFSET, t1_ns)
            try:
                key, before_ns = sock.send(bytes(packet), st.path.peer_addr)
            except OSError:  # no route, link down: the probe is lost like any other, and counted as such
                key, before_ns = -1, 0
                self._dropped[DropReason.SEND_ERROR] += 1
            self._sent(st, probe, t1_ns, now_s, before_ns, key)

    def _sent(self, st: _PathState, probe: Probe, t1_ns: int, now_s: float, before_ns: int, key: int) -> None:
        nic = st.path.local.nic
        st.counters.sent += 1
        st.outstanding += 1
        sock = self._sockets.get(nic)
        self._pending[(nic, probe.seq)] = _Pending((nic, st.path.peer.node, st.path.peer.nic), st.next_index,
                                                   probe.pair_id, probe.pair_index, probe.cookie, t1_ns,
                                                   TimestampKind.USER, now_s, before_ns,
                                                   sock.overflowed if sock is not None else 0)
        st.next_index += 1
        if key >= 0:
            self._tx_keys[(nic, key)] = probe.seq

    def _expire(self, now_s: float) -> None:
        timeout = self.settings.timeout_s
        while self._pending:
            key, p = next(iter(self._pending.items()))
            if now_s - p.sent_s < timeout:
                break
            del self._pending[key]
            st = self._states.get(p.path)
            if st is None:
                self._remember(*key, done=False)
            elif not st.health.heard and now_s - st.created_s < self.settings.first_contact_s:
                self._settled(key, st)
                st.counters.unreached += 1  # no reply yet, ever: a peer still starting, not a path losing
                self._unreached += 1
            elif self._answered_later(p):  # the peer answered a later probe in time: this one went missing
                self._judge(key, p, st, now_s)
            else:
                self._overdue[key] = p  # the peer has said nothing since: it may be stalled, not the path
        self._judge_overdue(now_s)
        if self._tx_keys and len(self._tx_keys) > 2 * len(self._pending) + 64:
            live = {(nic, seq) for nic, seq in self._pending}
            self._tx_keys = {k: seq for k, seq in self._tx_keys.items() if (k[0], seq) in live}
        if now_s >= self._next_settle_s:
            grace = timeout + 2 * self.settings.interval_s
            for st in self._states.values():
                st.counters.settle(now_s, grace)
            self._next_settle_s = now_s + _SETTLE_EVERY_S

    def _judge_overdue(self, now_s: float, *, final: bool = False) -> None:
        """Judge the overdue probes whose peer has since answered a later round in time, or whose ``late_s`` ran
        out (all, when ``final``)."""
        horizon = self.settings.timeout_s + self.settings.late_s
        for key, p in list(self._overdue.items()):
            if not (final or now_s - p.sent_s >= horizon or self._answered_later(p)):
                continue
            del self._overdue[key]
            st = self._states.get(p.path)
            if st is None:
                self._remember(*key, done=False)
            else:
                self._judge(key, p, st, now_s)

    def _judge(self, key: tuple[str, int], p: _Pending, st: _PathState, now_s: float) -> None:
        """An unanswered probe's verdict: lost when its peer was answering and our socket dropped nothing since it
        was sent; else unknown (the peer silent throughout: starved, frozen or cut off, this prober cannot tell)."""
        sock = self._sockets.get(key[0])
        if self._answered_later(p) and (sock is None or sock.overflowed <= p.overflowed):
            self._lost(key, st, now_s)
        else:
            self._settled(key, st)
            st.counters.unknown += 1

    def _answered_later(self, p: _Pending) -> bool:
        """Whether the peer answered in time a probe of a later round (over any rail): its responder answers in
        the order probes arrive, so it was running, and ``p`` never reached it or its reply was lost."""
        return self._answered_upto.get(p.path[1], -math.inf) > p.sent_s

    def _lost(self, key: tuple[str, int], st: _PathState, now_s: float) -> None:
        self._settled(key, st)
        st.counters.on_lost(now_s)
        if st.health.on_loss(now_s, self._rng):
            self._suspended.add(st.path_key)
            _log.info("prober %s: path %s → %s suspended for %.0f s after repeated losses", self.node,
                      st.path.local, st.path.peer, st.health.suspended_until_s - now_s)

    def _settled(self, key: tuple[str, int], st: _PathState) -> None:
        """A probe whose fate is decided without its reply: no longer outstanding, a reply to it is late."""
        self._remember(*key, done=False)
        st.outstanding = max(0, st.outstanding - 1)

    def _unpend(self, key: tuple[str, int]) -> None:
        """A probe no longer waited for, in flight or overdue."""
        self._pending.pop(key, None)
        self._overdue.pop(key, None)

    def _remember(self, nic: str, seq: int, *, done: bool) -> None:
        recent = self._recent[nic]
        recent[seq] = done
        if len(recent) > _RECENT:
            recent.popitem(last=False)

    # -- receiving -------------------------------------------------------------------------

    def poll(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for replies and send stamps, and handle what came."""
        if self._poller is None:
            self._poller = select.poll()
            for sock in (*self._sockets.values(), *(self._wake or ())[:1]):
                self._poller.register(sock.fileno(), select.POLLIN)
            self._by_fd = {sock.fileno(): nic for nic, sock in self._sockets.items()}
        for fd, events in self._poller.poll(math.ceil(max(0.0, timeout_s) * 1000)):
            nic = self._by_fd.get(fd)
            if nic is None:
                continue
            if events & select.POLLERR:
                self._take_tx_stamps(nic)  # before the replies: a reply's sample wants its probe's send stamp
            if events & select.POLLIN:
                self._drain(nic)

    def _drain_all(self) -> None:
        """Read every socket until it is empty (bounded): what waits there is judged before any probe expires."""
        for nic in list(self._sockets):
            for _ in range(_DRAIN_ROUNDS):
                if not self._drain(nic):
                    break

    def _take_tx_stamps(self, nic: str) -> None:
        try:
            stamps = self._sockets[nic].tx_stamps()
        except OSError as exc:
            _log.debug("prober %s: error queue of %s: %s", self.node, nic, exc)
            return
        with self._lock:
            for stamp in stamps:
                seq = self._tx_keys.pop((nic, stamp.key), None)
                p = None if seq is None else self._pending.get((nic, seq))
                if p is not None and 0 <= stamp.true_ns - p.before_true_ns <= _TX_STAMP_WINDOW_NS:
                    p.t1_ns, p.t1_kind = self._time.to_local(stamp.true_ns), stamp.kind
                    self.tx_stamped += 1

    def _drain(self, nic: str) -> bool:
        """Read up to one batch from ``nic``'s socket; True when the batch was full (more may wait)."""
        sock = self._sockets.get(nic)
        if sock is None:
            return False
        for _ in range(256):  # bounded, so that a flood cannot keep the prober from sending
            try:
                received = sock.recv()
            except OSError as exc:  # an ICMP error for an earlier probe: that probe will time out
                _log.debug("prober %s: receive on %s failed: %s", self.node, nic, exc)
                continue
            if received is None:
                return False
            self.stalls.note_read(received.rx_true_ns, received.read_ns)
            try:
                sample = self.handle_reply(nic, received)
            except Exception:  # a bug here must cost one packet, not the prober
                _log.exception("prober %s: failed on a packet from %s", self.node, received.addr)
                sample = DropReason.INTERNAL
            if isinstance(sample, DropReason):
                with self._lock:
                    self._dropped[sample] += 1
            elif sample is not None:
                self._emit(sample)
        return True

    def _emit(self, sample: ProbeSample) -> None:
        try:
            self._on_sample(sample)
        except Exception:  # the consumer's bug must not stop probing
            _log.exception("prober %s: sample consumer failed", self.node)

    def handle_reply(self, nic: str, received: Received) -> ProbeSample | DropReason | None:
        """Match one datagram that reached ``nic``'s socket: the sample it completes, None for a reply that
        judges its probe without a sample (late, or too slow on the network), or why it was dropped."""
        try:
            reply = decode(received.payload)
        except WireError as exc:
            return exc.reason
        if not isinstance(reply, Reply):
            return DropReason.UNEXPECTED_TYPE
        with self._lock:
            key = (nic, reply.seq)
            p = self._pending.get(key) or self._overdue.get(key)
            if p is None:
                fate = self._recent[nic].get(reply.seq)
                return DropReason.UNKNOWN_SEQ if fate is None else DropReason.REPLAYED if fate else DropReason.LATE
            if reply.cookie != p.cookie:
                return DropReason.BAD_COOKIE
            st = self._states.get(p.path)
            if st is None:
                self._unpend(key)
                return DropReason.UNKNOWN_SEQ  # the path was dropped from the plan meanwhile
            t4_ns = self._time.to_local(received.rx_true_ns)
            reason = self._check(st.path, p, reply, received, t4_ns)
            if reason is not None:
                return reason
            self._unpend(key)
            timeout_ns = self.settings.timeout_s * 1e9
            if t4_ns - p.t1_ns > timeout_ns:  # came after the timeout: the peer's stall, or the network's delay
                if t4_ns - p.t1_ns - (reply.t3_ns - reply.t2_ns) > timeout_ns:
                    self._lost(key, st, self._monotonic())
                    return None
                self._remember(nic, reply.seq, done=True)
                st.outstanding = max(0, st.outstanding - 1)
                st.counters.on_late()
                st.health.on_reply()
                return None
            self._answered_upto[p.path[1]] = max(self._answered_upto.get(p.path[1], -math.inf), p.sent_s)
            if self._overdue:
                self._quiet_until_s = float("-inf")  # overdue probes this answer judges: at the next tick
            self._remember(nic, reply.seq, done=True)
            st.outstanding = max(0, st.outstanding - 1)
            st.counters.on_reply(p.index, reply.rx_count, reply.epoch)
            st.health.on_reply()
        return ProbeSample(self.node, nic, st.path.peer.node, st.path.peer.nic, reply.seq, p.pair_id, p.pair_index,
                           p.t1_ns, reply.t2_ns, reply.t3_ns, t4_ns, worst_kind(reply.rx_kind, received.kind),
                           worst_kind(p.t1_kind, reply.tx_kind))

    def _check(self, path: Path, p: _Pending, reply: Reply, received: Received, t4_ns: int) -> DropReason | None:
        if received.addr != path.peer_addr or reply.dst != path.peer or reply.src != path.local \
                or (reply.pair_id, reply.pair_index) != (p.pair_id, p.pair_index):
            return DropReason.WRONG_PEER
        skew_ns = round(self.settings.max_skew_s * 1e9)
        if reply.t2_ns > p.t1_ns + skew_ns:
            return DropReason.FUTURE
        if reply.t2_ns < p.t1_ns - skew_ns:
            return DropReason.PAST
        turnaround_ns = reply.t3_ns - reply.t2_ns
        # The turnaround is on the peer's clock, the round trip on ours: over a responder's stall of seconds the
        # two clocks' rates (tens of ppm apart) make a turnaround read longer than the round trip around it.
        if t4_ns - p.t1_ns < turnaround_ns - _RATE_SLACK * turnaround_ns - _STAMP_SLACK_NS:
            return DropReason.INCONSISTENT
        return None
