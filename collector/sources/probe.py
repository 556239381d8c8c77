"""Source ``probe``: answer peers' probes, probe peers over every NIC, report delay, loss and purity per path.

`ProbeSource` is a background source: `start` runs a `Responder` (answering on each local
NIC at the probe port) and a `Prober` (coded pairs to ``k`` random peers plus pinned ones,
over each NIC). Each sample goes to ``on_sample`` (the pairwise clock estimator) and into
the path's window; `collect` turns the windows and counters into metrics, per (source node,
source NIC, destination node, destination NIC) and where it applies per direction
(``forward``: from this node to the peer; ``reverse``: back):

* one-way delay and RTT: min, p50, p99, max over the interval (``probe.quantile``); a one-way
  delay is clock-corrected when ``corrections`` knows both ends, else half the RTT with
  ``probe.clock.corrected=false``;
* loss ratio per direction, pure-pair ratio per direction, probes sent, received, lost, late
  (answered after the timeout by a stalled responder: also received) and unknown (could not be
  judged: neither); the loss ratio is of the probes judged; per node, probes unreached
  (unanswered before their path's first reply: a peer still starting; one series, not one a
  path: it stops growing 30 s into a path's life);
* whether the path is suspended (its peer stopped answering), packets dropped by reason, and
  the seconds the prober's and the responder's threads were stalled (``probe.role``);
* from ``clocks`` (`PairwiseClocks`), each peer's latest finished clock window:
  ``ridethrough.clock.pair.*`` (offset, drift, uncertainty, step, reference time).

Corrections come from ``corrections``, or from a ``feed`` polling the clock service
(``clock_corrections_url``): the loop closes there, the service solving the graph of every
node's pair estimates and this source using its per-node answer for one-way delays.

Defaults, and why. A round of pairs every 0.5 s, one pair per path: with 10 peers over 2 NICs
(20 paths) that is 80 probes/s out and, as many peers probe us, about 80 replies/s out; at 192
bytes of payload (258 on the wire) ~0.17 Mbit/s per NIC, 1.7e-5 of a 10 Gbit/s link, and about
1 % of one core measured (``bench/probe_overhead.py``; budgets 0.1 % and 2 %). A 20 µs pair gap
is a few MTU-sized packets at 10-100 Gbit/s, so a queue building between the two shows; a 1 s
timeout is far above any fabric RTT; 10 losses in a row (5 s) suspend a path, retried after
5 s, then 10, 20, ... up to 300 s. 10 µs of pure-pair tolerance sits above the jitter of
software stamps and below a queue of a few packets.

The peer table (``probe_peers_file``, see `ridethrough.collector.probe_paths`) is re-read
when it changes; this node's own entry gives the NIC addresses unless ``local`` is given.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar, cast

from ..clock import ScriptedClock
from ..clock_feed import CorrectionsFeed
from ..clock_pairs import PairwiseClocks
from ..huygens import HuygensConfig
from ..probe_paths import PeerTable, load_peers
from ..probe_responder import Responder
from ..probe_sample import ProbeSample
from ..probe_stats import Correction, PathWindow, SampleAggregator, quantiles
from ..probe_wire import DropReason
from ..prober import PathStatus, Prober, ProberSettings
from ..sample import EventSink, MetricKind, Sample
from ..timestamps import HostTime

if TYPE_CHECKING:
    from ridethrough.settings import AgentConfig

_log = logging.getLogger(__name__)

DEFAULT_PORT = 7447
DEFAULT_PURE_TOLERANCE_NS = 10_000
P = "ridethrough.probe."
_NS_PER_S = 1e9
CLOCK_WINDOW_S = 2.0
"""Pairwise clock windows, and how often corrections are polled: the clock service's window."""
CorrectionsProvider = Callable[[], Mapping[str, Correction]]
PathTuple = tuple[str, str, str, str]
T = TypeVar("T")


class ProbeSource:
    """Source ``probe`` (see the module docstring)."""

    def __init__(self, *, node: str, local: Mapping[str, str] | None = None, peers: PeerTable | None = None,
                 peers_file: str | os.PathLike[str] = "", port: int = DEFAULT_PORT, interval_s: float = 1.0,
                 settings: ProberSettings | None = None, host_time: HostTime | None = None,
                 corrections: CorrectionsProvider | None = None,
                 on_sample: Callable[[ProbeSample], None] | None = None,
                 pure_tolerance_ns: int = DEFAULT_PURE_TOLERANCE_NS, clocks: PairwiseClocks | None = None,
                 feed: CorrectionsFeed | None = None) -> None:
        """Peers come from ``peers`` or ``peers_file``; ``local`` (NIC → address) from this node's entry if None.

        ``clocks`` gets every sample too and its window estimates are collected as
        ``ridethrough.clock.pair.*``; ``feed`` (started and stopped with the source) becomes
        ``corrections`` unless those are given.
        """
        if interval_s <= 0 or pure_tolerance_ns < 0:
            raise ValueError("interval_s must be positive and pure_tolerance_ns non-negative")
        self.node = node
        self.local = dict(local or {})
        """This node's NICs and their addresses, as given (empty: from the peer table)."""
        self.port = port
        self._peers_file = Path(peers_file) if peers_file else None
        self._peers: PeerTable = dict(peers or {})
        self._peers_mtime = -1
        self._interval_s = interval_s
        self.settings = settings or ProberSettings()
        self._time = host_time or HostTime()
        self.clocks = clocks
        """The pairwise clock estimators (None: no clock estimates from this node)."""
        self._feed = feed
        self.corrections = corrections if corrections is not None or feed is None else feed
        """Where clock corrections come from, read at each `collect` (None: one-way delays are RTT/2)."""
        self.on_sample = on_sample
        """Gets every sample, in the prober's thread (the pairwise clock estimator); set it before `start`."""
        self._aggregator = SampleAggregator(pure_tolerance_ns=pure_tolerance_ns)
        self._last: dict[PathTuple, PathStatus] = {}
        self._responder: Responder | None = None
        self._prober: Prober | None = None
        self._start_error = ""

    @property
    def name(self) -> str:
        """``probe``."""
        return "probe"

    @property
    def interval_s(self) -> float:
        """How often the agent calls `collect`."""
        return self._interval_s

    @property
    def addresses(self) -> dict[str, tuple[str, int]]:
        """Where the responder answers, per NIC (once started)."""
        return self._responder.addresses if self._responder else {}

    def start(self, *, emit: EventSink) -> None:
        """Start answering and probing; a peers file that is not there yet is retried at each `collect`."""
        if self._feed is not None:
            self._feed.start()
        self._try_start()

    def stop(self, *, timeout_s: float) -> None:
        """Stop probing and answering (and polling for corrections)."""
        if self._feed is not None:
            self._feed.stop(timeout_s=timeout_s)
        for part in (self._prober, self._responder):
            if part is not None:
                part.stop(timeout_s=timeout_s)

    def set_peers(self, peers: PeerTable) -> None:
        """Replace the peer table (instead of a file)."""
        self._peers = dict(peers)
        if self._prober is not None:
            self._prober.set_peers(self._peers)

    def take(self, sample: ProbeSample) -> None:
        """One sample from the prober (its thread): into the path's window, then to ``on_sample``."""
        self._aggregator.add(sample)
        if self.clocks is not None:
            self.clocks.add(sample)
        if self.on_sample is not None:
            try:
                self.on_sample(sample)
            except Exception:  # the estimator's bug must not stop the prober
                _log.exception("probe: on_sample consumer failed")

    def collect(self, now_ns: int) -> list[Sample]:
        """The interval's per-path metrics, and the drop counters."""
        self._refresh()
        if self.corrections is not None:
            self._aggregator.corrections = dict(self.corrections())
        windows = self._aggregator.take()
        out: list[Sample] = []
        statuses = self._prober.paths() if self._prober else []
        for status in statuses:
            key = (status.path.local.node, status.path.local.nic, status.path.peer.node, status.path.peer.nic)
            attrs = dict(zip(("probe.src.node", "probe.src.nic", "probe.dst.node", "probe.dst.nic"), key, strict=True))
            out += _counters(status, self._last.get(key), attrs)
            if (window := windows.get(key)) is not None:
                out += _delays(window, attrs)
        self._last = {(s.path.local.node, s.path.local.nic, s.path.peer.node, s.path.peer.nic): s for s in statuses}
        out += self._own_counters()
        if self.clocks is not None:
            out += self.clocks.samples()
        return out

    def _own_counters(self) -> list[Sample]:
        out: list[Sample] = []
        for role, part in (("prober", self._prober), ("responder", self._responder)):
            dropped = part.dropped() if part is not None else dict.fromkeys(DropReason, 0)
            out += [Sample(P + "dropped", n, MetricKind.COUNTER, "{packet}", {"probe.role": role, "reason": str(r)})
                    for r, n in dropped.items()]
            if part is not None:
                out.append(Sample(P + "stalled", part.stalls.stalled_s, MetricKind.COUNTER, "s", {"probe.role": role}))
        if self._prober is not None:
            out.append(Sample(P + "unreached", self._prober.unreached(), MetricKind.COUNTER, "{probe}", {}))
        if self._responder is not None:
            out += [Sample(P + "answered", n, MetricKind.COUNTER, "{probe}", {"probe.dst.nic": nic})
                    for nic, n in self._responder.answered().items()]
        return out

    def _refresh(self) -> None:
        """Re-read the peers file if it changed; start if a first attempt could not."""
        if self._peers_file is not None:
            try:
                mtime = self._peers_file.stat().st_mtime_ns
            except OSError:
                mtime = -1
            if mtime != self._peers_mtime and mtime != -1:
                try:
                    self.set_peers(load_peers(self._peers_file, default_port=self.port))
                    self._peers_mtime = mtime
                except ValueError as exc:  # half-written or wrong: keep the table we have
                    _log.warning("probe: %s", exc)
        if self._prober is None:
            self._try_start()

    def _try_start(self) -> None:
        if self._peers_file is not None and self._peers_mtime == -1 and not self._peers:
            try:
                self._peers = load_peers(self._peers_file, default_port=self.port)
                self._peers_mtime = self._peers_file.stat().st_mtime_ns
            except (ValueError, OSError) as exc:
                self._not_started(str(exc))
                return
        own = self._peers.get(self.node, {})
        local = self.local or {nic: addr for nic, (addr, _) in own.items()}
        if not local:
            self._not_started(f"no local NICs: give probe_bind or list node {self.node!r} in the peer table")
            return
        listen = {nic: (addr, own[nic][1] if nic in own else self.port) for nic, addr in local.items()}
        prober = Prober(node=self.node, local=local, peers=self._peers, on_sample=self.take,
                        settings=self.settings, host_time=self._time)
        responder = Responder(node=self.node, listen=listen, host_time=self._time,
                              known_nodes=lambda: self._peers.keys(), max_skew_s=self.settings.max_skew_s,
                              on_probe=prober.heard_from)
        try:
            responder.start()
            prober.start()
        except OSError as exc:
            responder.stop(timeout_s=1.0)
            prober.close()
            self._not_started(f"cannot bind probe sockets {listen}: {exc}")
            return
        self._responder, self._prober = responder, prober

    def _not_started(self, why: str) -> None:
        if why != self._start_error:  # log each new reason once, not every tick
            _log.warning("probe: not probing yet: %s", why)
            self._start_error = why


def _counters(status: PathStatus, last: PathStatus | None, attrs: dict[str, str]) -> list[Sample]:
    counter = MetricKind.COUNTER
    out = [Sample(P + "sent", status.sent, counter, "{probe}", attrs),
           Sample(P + "received", status.received, counter, "{probe}", attrs),
           Sample(P + "late", status.late, counter, "{probe}", attrs),
           Sample(P + "unknown", status.unknown, counter, "{probe}", attrs),
           Sample(P + "path.suspended", float(status.suspended), MetricKind.GAUGE, "1", attrs)]
    lost = {"forward": status.lost_forward, "reverse": status.lost_reverse}
    out += [Sample(P + "lost", n, counter, "{probe}", {**attrs, "probe.direction": d}) for d, n in lost.items()]
    if last is not None:
        resolved = (status.received + status.lost) - (last.received + last.lost)
        before = {"forward": last.lost_forward, "reverse": last.lost_reverse}
        if resolved > 0:
            out += [Sample(P + "loss.ratio", min(1.0, max(0.0, (lost[d] - before[d]) / resolved)), MetricKind.GAUGE,
                           "1", {**attrs, "probe.direction": d}) for d in lost]
    return out


def _delays(w: PathWindow, attrs: dict[str, str]) -> list[Sample]:
    gauge, kind = MetricKind.GAUGE, w.rx_kind.value
    out = [Sample(P + "rtt", v / _NS_PER_S, gauge, "s", {**attrs, "probe.quantile": q, "probe.timestamp.kind": kind})
           for q, v in quantiles(w.rtt_ns)]
    corrected = "true" if w.corrected else "false"
    for direction, values in (("forward", w.forward_ns), ("reverse", w.reverse_ns)):
        out += [Sample(P + "owd", v / _NS_PER_S, gauge, "s",
                       {**attrs, "probe.direction": direction, "probe.quantile": q, "probe.clock.corrected": corrected,
                        "probe.timestamp.kind": kind}) for q, v in quantiles(values)]
    if w.pairs:
        out += [Sample(P + "pure.ratio", n / w.pairs, gauge, "1", {**attrs, "probe.direction": d})
                for d, n in (("forward", w.pure_forward), ("reverse", w.pure_reverse))]
    return out


def _get(cfg: object, name: str, default: T) -> T:
    """``cfg.probe_<name>``, or ``default`` where the config has no such field."""
    return cast(T, getattr(cfg, f"probe_{name}", default))


def from_config(cfg: AgentConfig) -> ProbeSource:
    """The probe source the agent's config asks for (``probe_*`` fields; defaults where absent)."""
    settings = ProberSettings(
        k=_get(cfg, "k", 10), pinned=tuple(_get(cfg, "pinned", ())), redraw_s=_get(cfg, "redraw_s", 600.0),
        interval_s=_get(cfg, "interval_s", 0.5), pair_gap_ns=round(_get(cfg, "pair_gap_us", 20.0) * 1000),
        timeout_s=_get(cfg, "timeout_s", 1.0), late_s=_get(cfg, "late_s", 10.0),
        max_skew_s=_get(cfg, "max_skew_s", 1.0),
        losses_to_suspend=_get(cfg, "losses_to_suspend", 10),
        want_hardware=_get(cfg, "hardware_timestamps", False))
    clock = ScriptedClock(cfg.clock_script) if cfg.clock_script else None
    # The composition root fills node_id with the host name; a bare config probes as "localhost".
    node = cfg.node_id or "localhost"
    url: str = getattr(cfg, "clock_corrections_url", "")
    window_s = CLOCK_WINDOW_S
    return ProbeSource(node=node, local=dict(_get(cfg, "bind", {})),
                       peers_file=_get(cfg, "peers_file", ""), port=_get(cfg, "port", DEFAULT_PORT),
                       interval_s=cfg.interval_s, settings=settings, host_time=HostTime(clock) if clock else None,
                       pure_tolerance_ns=round(_get(cfg, "pure_tolerance_us", 10.0) * 1000),
                       clocks=PairwiseClocks(node=node, config=HuygensConfig(window_ns=round(window_s * 1e9))),
                       feed=CorrectionsFeed(url, interval_s=window_s) if url else None)
