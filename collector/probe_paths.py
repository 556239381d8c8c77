"""Which paths a prober probes, and what it knows of each: pure bookkeeping, no sockets, no clocks.

A *path* is (this node's NIC, a peer node's NIC): probes go from the local NIC's address to
the peer NIC's address, so routing (the rail) follows the NIC. The peer table says where
everyone's NICs are::

    {"h0": {"nic0": "10.64.0.1", "nic1": "10.65.0.1"},
     "h1": {"nic0": "10.64.0.3:7447", "nic1": "10.65.0.3"}}

(``host`` or ``host:port``, ``[v6]:port`` for IPv6; without a port, the default probe port).
A local NIC pairs with the peer's NIC of the same name (rail-optimised fabrics route a rail to
itself); a peer sharing no name with us is paired NIC by NIC in sorted order.
"""

from __future__ import annotations

import collections
import ipaddress
import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path as FilePath

from ridethrough.collector.probe_wire import NIC_MAX_BYTES, NODE_MAX_BYTES, Endpoint, check_name

Address = tuple[str, int]
PeerTable = dict[str, dict[str, Address]]
"""node → NIC → (IP address, UDP port)."""


@dataclass(frozen=True, slots=True)
class Path:
    """One probed path: from a local NIC to a peer's NIC at ``peer_addr``."""

    local: Endpoint
    peer: Endpoint
    peer_addr: Address


def parse_address(text: str, default_port: int) -> Address:
    """``host``, ``host:port`` or ``[v6]:port`` → (IP, port); ValueError for anything else."""
    host, port = text, default_port
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket:
            raise ValueError(f"address {text!r}: no closing ]")
        if rest:
            port = int(rest.removeprefix(":"))
    elif text.count(":") == 1:
        host, port_text = text.split(":")
        port = int(port_text)
    ip = ipaddress.ip_address(host)
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} out of range")
    return str(ip), port


def parse_peers(data: object, *, default_port: int) -> PeerTable:
    """Check a peer table (see the module docstring); ValueError naming the bad entry."""
    if not isinstance(data, Mapping):
        raise ValueError("peer table: expected {node: {nic: address}}")
    table: PeerTable = {}
    for node, nics in data.items():
        try:
            check_name(str(node), NODE_MAX_BYTES, "node id")
            if not isinstance(nics, Mapping) or not nics:
                raise ValueError("expected a non-empty {nic: address}")
            table[str(node)] = {check_name(str(nic), NIC_MAX_BYTES, "NIC name"): parse_address(str(addr), default_port)
                                for nic, addr in nics.items()}
        except ValueError as exc:
            raise ValueError(f"peer table: node {node!r}: {exc}") from None
    return table


def load_peers(path: str | FilePath, *, default_port: int) -> PeerTable:
    """Read and check a JSON peer table; ValueError naming the file."""
    try:
        return parse_peers(json.loads(FilePath(path).read_text()), default_port=default_port)
    except (OSError, ValueError) as exc:
        raise ValueError(f"probe peers file {path}: {exc}") from None


def plan_paths(node: str, local_nics: Sequence[str], peers: PeerTable, chosen: Sequence[str]) -> list[Path]:
    """The paths from ``node``'s NICs to each chosen peer's NICs (see the module docstring)."""
    out: list[Path] = []
    for peer in chosen:
        their = peers.get(peer, {})
        names = sorted(their)
        if not names:
            continue
        shared = any(nic in their for nic in local_nics)
        for i, nic in enumerate(sorted(local_nics)):
            if shared and nic not in their:
                continue
            peer_nic = nic if shared else names[i % len(names)]
            out.append(Path(Endpoint(node, nic), Endpoint(peer, peer_nic), their[peer_nic]))
    return out


class PeerPicker:
    """The peers to probe: every pinned one, plus ``k`` drawn at random, re-drawn every ``redraw_s``.

    A drawn peer that leaves the candidates is replaced at once; the rest keep their place
    until the next redraw, so that a path's history is not cut short more often than needed.
    """

    def __init__(self, *, k: int, pinned: Sequence[str] = (), redraw_s: float = 600.0,
                 rng: random.Random | None = None) -> None:
        if k < 0 or redraw_s <= 0:
            raise ValueError("k must be >= 0 and redraw_s positive")
        self.k, self.pinned, self.redraw_s = k, tuple(pinned), redraw_s
        self._rng = rng or random.Random()
        self._drawn: list[str] = []
        self._next_redraw = float("-inf")

    def pick(self, candidates: Sequence[str], now_s: float) -> list[str]:
        """Pinned peers that are candidates, then the drawn ones, in a stable order."""
        pinned = [p for p in self.pinned if p in candidates]
        pool = sorted(set(candidates) - set(pinned))
        if now_s >= self._next_redraw:
            self._drawn = self._rng.sample(pool, min(self.k, len(pool)))
            self._next_redraw = now_s + self.redraw_s
        else:
            kept = [p for p in self._drawn if p in pool]
            rest = [p for p in pool if p not in kept]
            self._drawn = kept + self._rng.sample(rest, min(self.k - len(kept), len(rest)))
        return pinned + sorted(self._drawn)


class TokenBucket:
    """At most ``burst`` at once, refilled at ``rate`` per second."""

    __slots__ = ("_at", "_burst", "_rate", "_tokens")

    def __init__(self, rate: float, burst: float, now_s: float) -> None:
        self._rate, self._burst, self._tokens, self._at = rate, burst, burst, now_s

    def take(self, now_s: float) -> bool:
        """Take one token if there is one."""
        self._tokens = min(self._burst, self._tokens + max(0.0, now_s - self._at) * self._rate)
        self._at = max(self._at, now_s)  # a datagram read out of arrival order refills nothing twice
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False


class ReplayWindow:
    """Sequence numbers seen: the highest, and which of the 64 below it (IPsec's anti-replay window)."""

    __slots__ = ("_mask", "_top")
    SIZE = 64

    def __init__(self) -> None:
        self._top = -1
        self._mask = 0

    def accept(self, seq: int) -> bool:
        """Record ``seq``; False if it was seen already or is too old to tell."""
        if seq > self._top:
            shift = seq - self._top
            self._mask = ((self._mask << shift) | 1) & ((1 << self.SIZE) - 1) if shift < self.SIZE else 1
            self._top = seq
            return True
        back = self._top - seq
        if back >= self.SIZE or self._mask >> back & 1:
            return False
        self._mask |= 1 << back
        return True


@dataclass(slots=True)
class PathHealth:
    """Whether a path is probed: suspended after ``losses_to_suspend`` losses in a row, retried later.

    The first suspension lasts ``backoff_min_s``, each one after a failed retry twice the last,
    up to ``backoff_max_s``, with ±20 % jitter so that paths do not retry in step. A retry is
    one pair: losing both suspends the path again; any reply makes it healthy.
    """

    losses_to_suspend: int = 10
    backoff_min_s: float = 5.0
    backoff_max_s: float = 300.0
    consecutive_losses: int = 0
    suspended_until_s: float = float("-inf")
    backoff_s: float = 0.0
    suspensions: int = 0
    heard: bool = False
    """Some reply ever came: the path was up once (before that, an unanswered probe may be a peer still starting)."""
    _retrying: bool = False

    def active(self, now_s: float) -> bool:
        """Whether the path should be probed now."""
        return now_s >= self.suspended_until_s

    @property
    def retrying(self) -> bool:
        """Back from a suspension with no reply yet: send one pair and wait for its fate."""
        return self._retrying

    def on_reply(self) -> None:
        """A reply came: the peer is there."""
        self.consecutive_losses, self.backoff_s, self._retrying, self.heard = 0, 0.0, False, True
        self.suspended_until_s = float("-inf")

    def wake(self, now_s: float) -> None:
        """End a suspension now (the peer showed it is up); the retry and the backoff stay as they were."""
        self.suspended_until_s = min(self.suspended_until_s, now_s)

    def on_loss(self, now_s: float, rng: random.Random) -> bool:
        """A probe was lost; True if that suspends the path."""
        if not self.active(now_s):
            return False  # probes sent before the suspension are still timing out
        self.consecutive_losses += 1
        if self.consecutive_losses < (2 if self._retrying else self.losses_to_suspend):
            return False
        self.backoff_s = min(self.backoff_max_s, self.backoff_s * 2 if self.backoff_s else self.backoff_min_s)
        self.suspended_until_s = now_s + self.backoff_s * rng.uniform(0.8, 1.2)
        self.consecutive_losses, self._retrying = 0, True
        self.suspensions += 1
        return True


@dataclass(slots=True)
class PathCounters:
    """Cumulative counts of one path, with losses split into forward and reverse.

    Each reply carries the responder's count of probes it received on this path
    (``rx_count``, restarting with its ``epoch``). Between two replies of one epoch, probes
    sent minus probes the responder counted were lost on the way there; probes it counted
    minus replies that came back were lost on the way back. A lost probe is held
    unattributed until a reply settles it; one that no reply settles within ``grace_s`` (the
    peer is gone) counts as forward loss. Every counter only grows.
    """

    sent: int = 0
    received: int = 0
    lost: int = 0
    lost_forward: int = 0
    lost_reverse: int = 0
    unreached: int = 0
    """Probes unanswered before the path's first reply, within the prober's ``first_contact_s``: not lost."""
    late: int = 0
    """Replies that came after the timeout because the responder held them (also in ``received``)."""
    unknown: int = 0
    """Probes that could not be judged: in neither ``received`` nor ``lost``."""
    _unsettled: collections.deque[float] = field(default_factory=collections.deque)
    _epoch: int | None = None
    _base: tuple[int, int, int] = (0, 0, 0)  # (probe index, rx_count, received) at the epoch's first reply
    _last: tuple[int, int] = (0, 0)  # (probe index, rx_count) of the latest reply
    _banked: tuple[int, int] = (0, 0)  # (forward, reverse) settled in earlier epochs
    _settled: tuple[int, int] = (0, 0)  # (forward, reverse) settled in this epoch

    def on_lost(self, now_s: float) -> None:
        """A probe timed out at ``now_s``."""
        self.lost += 1
        self._unsettled.append(now_s)
        self._attribute()  # replies to later probes may have settled it before it timed out

    def on_reply(self, index: int, rx_count: int, epoch: int) -> None:
        """A reply to the path's ``index``-th probe (1-based) came, with the responder's counters."""
        self.received += 1
        if epoch != self._epoch or rx_count < self._last[1] or index < self._last[0]:
            # a new responder (or it forgot us): bank what this epoch settled, count afresh from here
            self._banked = (self._banked[0] + self._settled[0], self._banked[1] + self._settled[1])
            self._settled, self._epoch = (0, 0), epoch
            self._base = (index, rx_count, self.received)
        else:
            i0, c0, r0 = self._base
            forward = (index - i0) - (rx_count - c0)
            reverse = (rx_count - c0) - (self.received - r0)
            self._settled = (max(self._settled[0], forward), max(self._settled[1], reverse))
        self._last = (index, rx_count)
        self._attribute()

    def on_late(self) -> None:
        """A reply came late: received, but out of order, so it leaves the direction split alone."""
        self.received += 1
        self.late += 1

    def settle(self, now_s: float, grace_s: float) -> None:
        """Count losses that no reply settled within ``grace_s`` as forward."""
        while self._unsettled and now_s - self._unsettled[0] >= grace_s:
            self._unsettled.popleft()
            self.lost_forward += 1

    def _attribute(self) -> None:
        for direction in (1, 0):  # reverse first: a loss no reply explains stays forward
            owed = self._banked[direction] + self._settled[direction] - (self.lost_reverse if direction
                                                                          else self.lost_forward)
            take = max(0, min(owed, len(self._unsettled)))
            for _ in range(take):
                self._unsettled.popleft()
            if direction:
                self.lost_reverse += take
            else:
                self.lost_forward += take
