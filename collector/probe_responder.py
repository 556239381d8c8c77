"""The probe responder: answer valid probes with their receive and send times; drop and count the rest.

One socket per local NIC, bound to the NIC's address and the probe port. Each probe that
passes the checks gets a reply of the same size carrying t2 (the kernel's receive stamp,
on this host's clock), t3 (read just before the reply is sent) and the count of probes this
responder has received on that path, so the prober can tell forward loss from reverse loss.

Checks, cheapest first, each a `DropReason`: a per-source and a total rate limit (a flood
costs a token-bucket lookup per packet and is never answered beyond the limit), the wire
format, the packet type, the destination (this node and this NIC), the prober's node (when
a peer table is known), the probe's send time against this clock (``max_skew_s`` either
way), and an anti-replay window per prober NIC. Per-path and per-source state is bounded
(`MAX_TRACKED`, least recently seen forgotten first). Nothing a sender writes can raise in
the thread.

The rate limits and the send-time check go by when each datagram arrived (its kernel stamp),
not when the thread got to it: a responder starved for a second or two drains that time's
probes at once, and judged on reading they were a flood and from the past, so its peers
counted probes that had arrived in time as lost. The same stamps measure the responder's stalls
(`StallMeter`: a datagram read long after it arrived), and the replies carry them to the prober as
the turnaround t3 - t2, which tells a late reply from a slow network.
"""

from __future__ import annotations

import collections
import logging
import random
import select
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from ridethrough.collector.probe_paths import Address, ReplayWindow, TokenBucket
from ridethrough.collector.probe_stall import StallMeter
from ridethrough.collector.probe_wire import (
    T3_OFFSET,
    DropReason,
    Endpoint,
    Probe,
    WireError,
    decode,
    patch_time,
    reply_bytes,
)
from ridethrough.collector.probe_worker import SocketWorker
from ridethrough.collector.timestamps import HostTime, ProbeSocket, Received

_log = logging.getLogger(__name__)

MAX_TRACKED = 4096
"""Most prober NICs (and, separately, source addresses) the responder keeps state for."""
_DRAIN_BATCH = 256  # datagrams per socket per wake-up, so that one flooded NIC cannot starve the others


@dataclass(slots=True)
class _PathState:
    window: ReplayWindow = field(default_factory=ReplayWindow)
    received: int = 0


class Responder(SocketWorker):
    """Answers probes on each local NIC (see the module docstring)."""

    thread_name = "rt-probe-responder"

    def __init__(self, *, node: str, listen: Mapping[str, Address], host_time: HostTime | None = None,
                 known_nodes: Callable[[], Collection[str]] | None = None, max_skew_s: float = 1.0,
                 per_source_rate: float = 200.0, per_source_burst: float = 50.0, total_rate: float = 20_000.0,
                 total_burst: float = 2_000.0, monotonic: Callable[[], float] = time.monotonic,
                 epoch: int | None = None, on_probe: Callable[[str, str, str], None] | None = None) -> None:
        """``listen`` maps each local NIC to the (address, port) to answer on (port 0: any).

        ``known_nodes`` lists the nodes whose probes are answered (None or empty: any node);
        ``on_probe`` hears every probe answered as (our NIC, its node, its NIC), in the responder's thread
        (the prober's `Prober.heard_from`: the path between those two NICs is up).
        """
        super().__init__(dict(listen), want_tx_timestamps=False)  # t3 goes out in the reply: no stamp to wait for
        self.node = node
        self._endpoints = {nic: Endpoint(node, nic) for nic in listen}
        self._time = host_time or HostTime()
        self._known = known_nodes or tuple
        self._max_skew_ns = round(max_skew_s * 1e9)
        self._source_limit = (per_source_rate, per_source_burst)
        self._monotonic = monotonic
        self._total = TokenBucket(total_rate, total_burst, monotonic())
        self._sources: collections.OrderedDict[str, TokenBucket] = collections.OrderedDict()
        self._paths: collections.OrderedDict[tuple[Endpoint, str], _PathState] = collections.OrderedDict()
        self.epoch = epoch if epoch is not None else random.getrandbits(32) or 1
        """Random per start: a prober seeing it change knows ``rx_count`` restarted."""
        self._lock = threading.Lock()
        self._dropped = dict.fromkeys(DropReason, 0)
        self._answered = dict.fromkeys(listen, 0)
        self._on_probe = on_probe
        self.stalls = StallMeter()
        """When this responder's thread was held off (probes read long after they arrived)."""

    def dropped(self) -> dict[DropReason, int]:
        """Packets dropped so far, by reason (with those the kernel dropped for want of socket buffer)."""
        with self._lock:
            out = dict(self._dropped)
        out[DropReason.SOCKET_OVERFLOW] += sum(sock.overflowed for sock in list(self._sockets.values()))
        return out

    def answered(self) -> dict[str, int]:
        """Probes answered so far, by local NIC."""
        with self._lock:
            return dict(self._answered)

    def _run(self) -> None:
        assert self._wake is not None
        poller = select.poll()
        by_fd = {sock.fileno(): nic for nic, sock in self._sockets.items()}
        for fd in (*by_fd, self._wake[0].fileno()):
            poller.register(fd, select.POLLIN)
        while not self._stopping.is_set():
            ready = [by_fd[fd] for fd, _ in poller.poll() if fd in by_fd]
            if ready:
                self._answer(ready)

    def _answer(self, nics: Collection[str]) -> None:
        """Read what waits on ``nics`` (a batch each) and answer it in the order it arrived, whichever NIC it came
        to: a responder that ran late then answers its backlog oldest first, so a prober that sees a later probe
        answered in time knows an earlier one unanswered was lost on the way, not still queued here."""
        batch: list[tuple[int, str, Received]] = []
        for nic in nics:
            batch += [(received.rx_true_ns, nic, received) for received in self._read(nic)]
        batch.sort(key=lambda item: item[0])
        for _, nic, received in batch:
            try:
                self.handle(nic, self._sockets[nic], received)
            except Exception:  # a bug here must cost one packet, not the responder
                _log.exception("probe responder: failed on a packet from %s", received.addr)
                self._drop(DropReason.INTERNAL)

    def _read(self, nic: str) -> list[Received]:
        sock, out = self._sockets[nic], []
        for _ in range(_DRAIN_BATCH):
            try:
                received = sock.recv()
            except OSError as exc:  # e.g. an ICMP error surfacing: one packet's problem, not the thread's
                _log.debug("probe responder %s: receive failed: %s", nic, exc)
                continue
            if received is None:
                break
            self.stalls.note_read(received.rx_true_ns, received.read_ns)
            out.append(received)
        return out

    def handle(self, nic: str, sock: ProbeSocket, received: Received) -> None:
        """Check one datagram that reached ``nic``; answer it on ``sock`` or count why not."""
        reason = self._rate_limit(received.addr[0], self._arrival_s(received))
        probe: Probe | None = None
        if reason is None:
            probe, reason = self._check(nic, received)
        if probe is None:
            self._drop(reason or DropReason.INTERNAL)
            return
        with self._lock:
            state = self._path(probe.src, received.addr[0])
            if not state.window.accept(probe.seq):
                self._dropped[DropReason.REPLAYED] += 1
                return
            state.received = (state.received + 1) & 0xFFFFFFFF
            count = state.received
        t2_ns = self._time.to_local(received.rx_true_ns)
        packet = reply_bytes(received.payload, t2_ns=t2_ns, rx_kind=received.kind, rx_count=count, epoch=self.epoch)
        patch_time(packet, T3_OFFSET, max(t2_ns, self._time.now()))  # as late as possible before the send
        try:
            sock.send(bytes(packet), received.addr)
        except OSError:
            self._drop(DropReason.SEND_ERROR)
            return
        with self._lock:
            self._answered[nic] += 1
        if self._on_probe is not None:
            self._on_probe(nic, probe.src.node, probe.src.nic)

    def _check(self, nic: str, received: Received) -> tuple[Probe | None, DropReason | None]:
        try:
            packet = decode(received.payload)
        except WireError as exc:
            return None, exc.reason
        if not isinstance(packet, Probe):
            return None, DropReason.UNEXPECTED_TYPE
        if packet.dst != self._endpoints[nic]:
            return None, DropReason.WRONG_DESTINATION
        known = self._known()
        if known and packet.src.node not in known:
            return None, DropReason.UNKNOWN_NODE
        arrived_ns = self._time.to_local(received.rx_true_ns)  # on this host's clock, as t1 is on the prober's
        if packet.t1_ns > arrived_ns + self._max_skew_ns:
            return None, DropReason.FUTURE
        if packet.t1_ns < arrived_ns - self._max_skew_ns:
            return None, DropReason.PAST
        return packet, None

    def _arrival_s(self, received: Received) -> float:
        """When the datagram arrived, on the rate limits' monotonic clock (now, less its age by its stamp)."""
        return self._monotonic() - max(0.0, (time.time_ns() - received.rx_true_ns) / 1e9)

    def _rate_limit(self, source: str, now: float) -> DropReason | None:
        with self._lock:
            bucket = self._sources.get(source)
            if bucket is None:
                bucket = self._sources[source] = TokenBucket(*self._source_limit, now)
                if len(self._sources) > MAX_TRACKED:
                    self._sources.popitem(last=False)
            else:
                self._sources.move_to_end(source)
            ok = bucket.take(now) and self._total.take(now)
        return None if ok else DropReason.RATE_LIMITED

    def _path(self, prober: Endpoint, source: str) -> _PathState:
        """State of one prober NIC (at one address), least recently seen forgotten first."""
        key = (prober, source)
        state = self._paths.get(key)
        if state is None:
            state = self._paths[key] = _PathState()
            if len(self._paths) > MAX_TRACKED:
                self._paths.popitem(last=False)
        else:
            self._paths.move_to_end(key)
        return state

    def _drop(self, reason: DropReason) -> None:
        with self._lock:
            self._dropped[reason] += 1
            count = self._dropped[reason]
        if str(count).strip("0") == "1":  # log the 1st, 10th, 100th, ... of each reason
            _log.info("probe responder %s: dropped a packet (%d so far for %s)", self.node, count, reason)
