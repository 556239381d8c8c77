"""The lab switches' port counters, exported over OTLP as an InfiniBand fabric's switch ports would be.

Two counters of a real switch port, made from what the lab's faults leave in the kernel:

* **receive errors** (``port_rcv_errors``): a failing optic or a dirty fibre corrupts frames on the
  cable and the port at the receiving end counts and drops them. The lab makes such a cable with
  nftables (`ridethrough.lab.nft`): a rule at the *sending* end drops a share of the packets
  leaving on that interface, and counts them. So switch ``X``'s port towards ``N`` on link ``L``
  counts the packets ``N``'s rule dropped leaving on ``L``'s interface in ``N`` (`nft_drops`).
* **transmit wait** (``port_xmit_wait``: the ticks a port had data to send and could not): a
  congested egress. The lab congests a link with a ``tbf`` rate cap at the sending end
  (``degrade_link``); the qdisc's ``overlimits`` (packets held for want of tokens) is the wait of
  that very port (`tbf_overlimits`).

A port's own kernel adds to its receive errors the frames it dropped on arrival (a veth drops a
frame longer than its MTU: an MTU mismatch on the cable), read by `ridethrough.lab.switch_ports`.

`PortCounters` keeps one of them per (switch, port), monotonic as hardware counters are: a rule or
qdisc that is replaced or removed (``restore_link``) restarts its count, so what it had counted is
kept as a base. Only the links with the matching fault in the lab's state are read (``link:*/loss``,
``link:*/degrade``), so an unfaulted lab runs no ``nft`` or ``tc`` at all. `meter_providers`
exports them per switch every few seconds with the contract the agents use for host ports
(``ridethrough.ib.port.errors`` with ``ib.counter`` ``port_rcv_errors``, and
``ridethrough.ib.port.xmit_wait``; attributes ``ib.device`` = the port's interface on the switch,
``ib.port`` ``1``; resource ``ridethrough.node.id`` = the switch), so the detectors read switch
ports as they read NICs: a subnet manager's ``perfquery`` in an IB fabric, a gNMI subscription on
an Ethernet one.
"""

from __future__ import annotations

import json
import logging
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource

from ridethrough.lab import nft
from ridethrough.lab.control import LabError
from ridethrough.lab.netns import enter_fn
from ridethrough.lab.state import StateFile
from ridethrough.lab.topology import Kind, Topology

log = logging.getLogger(__name__)
METRIC = "ridethrough.ib.port.errors"
COUNTER = "port_rcv_errors"
XMIT_WAIT = "ridethrough.ib.port.xmit_wait"
EXPORT_INTERVAL_S = 5.0
TC_TIMEOUT_S = 30.0
_CACHE_S = 1.0

Reader = Callable[[str], Mapping[str, float]]
"""A namespace → per interface with a fault's rule or qdisc, its count so far (`nft_drops`, `tbf_overlimits`)."""


def nft_drops(ns: str) -> dict[str, float]:
    """Per lossy interface in ``ns``, the packets its loss rule dropped (LabError if nft fails)."""
    return {ifname: float(rule.get("dropped", 0.0)) for ifname, rule in nft.losses(ns).items()}


def tbf_overlimits(ns: str) -> dict[str, float]:
    """Per interface in ``ns`` with a root ``tbf``, the packets it held for want of tokens (LabError if tc fails)."""
    try:
        done = subprocess.run([_tc_binary(), "-s", "-j", "qdisc", "show"], capture_output=True, text=True,
                              timeout=TC_TIMEOUT_S, preexec_fn=enter_fn(ns, None))  # enters the namespace, then exec
        qdiscs = json.loads(done.stdout or "[]") if done.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError) as exc:  # SubprocessError: no such namespace
        raise LabError(f"tc in {ns}: {exc}") from exc
    if not isinstance(qdiscs, list):
        raise LabError(f"tc in {ns}: {' '.join(done.stderr.split()) or f'exit status {done.returncode}'}")
    return {str(q["dev"]): float(q.get("overlimits", 0)) for q in qdiscs
            if isinstance(q, dict) and q.get("kind") == "tbf" and q.get("root") and "dev" in q}


def _tc_binary() -> str:
    """``tc`` (iproute2), looked for in the sbin directories too (LabError if it is not installed)."""
    found = nft.which("tc")
    if found is None:
        raise LabError("reading a tbf cap needs tc: install the iproute2 Debian package")
    return found


class PortCounters:
    """Per switch port, one counter made from the lab's faults, monotonic (see the module docstring)."""

    def __init__(self, topology: Topology, faulted_links: Callable[[], Iterable[str]], *, read: Reader = nft_drops,
                 at_receiver: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        """``faulted_links``: the links whose ends ``read`` may count now, asked every refresh; ``at_receiver``:
        what the sending end counts is the receiving port's (lost frames), else the sending port's own (its wait)."""
        self.topology = topology
        self._faulted = faulted_links
        self._read = read
        self._at_receiver = at_receiver
        self._clock = clock
        self._lock = threading.Lock()
        self._base: dict[tuple[str, str], float] = {}  # (switch, port) -> counted by rules since replaced
        self._last: dict[tuple[str, str], float] = {}  # (switch, port) -> the current rule's count, last read
        self._read_at = -1e18
        self.switches = [n for n in topology.nodes if topology.kind(n) is not Kind.HOST]

    def ports(self, switch: str) -> dict[str, float]:
        """``switch``'s ports (interface name → its count so far), every port listed, refreshed at most once a
        second whoever asks."""
        with self._lock:
            if self._clock() - self._read_at >= _CACHE_S:
                self._refresh()
                self._read_at = self._clock()
            return {link.ifname(switch): self._base.get((switch, link.ifname(switch)), 0.0)
                    + self._last.get((switch, link.ifname(switch)), 0.0) for link in self.topology.node_links(switch)}

    def _refresh(self) -> None:
        seen: set[tuple[str, str]] = set()
        by_ns: dict[str, Mapping[str, float] | None] = {}
        for name in sorted(set(self._faulted())):
            try:
                link = self.topology.link(name)
            except (KeyError, ValueError):
                continue
            for sender in (link.lower, link.upper):
                counter = link.peer(sender) if self._at_receiver else sender
                if self.topology.kind(counter) is Kind.HOST:
                    continue  # host ports are the agents' (their fake IB tree)
                ns, key = self.topology.namespace(sender), (counter, link.ifname(counter))
                if ns not in by_ns:
                    try:
                        by_ns[ns] = self._read(ns)
                    except LabError as exc:  # a namespace going away, nft or tc busy: keep the last count as it is
                        log.warning("switch counters: %s", exc)
                        by_ns[ns] = None
                counts = by_ns[ns]
                if counts is None:
                    seen.add(key)
                    continue
                count = counts.get(link.ifname(sender))
                if count is not None:
                    self._count(key, count)
                    seen.add(key)
        for key in [k for k in self._last if k not in seen]:  # the rule is gone: what it counted stays counted
            self._count(key, 0.0)

    def _count(self, key: tuple[str, str], now: float) -> None:
        last = self._last.get(key, 0.0)
        if now < last:  # a new rule counts from zero
            self._base[key] = self._base.get(key, 0.0) + last
        self._last[key] = now


def faulted_links(state: StateFile, fault: str = "loss") -> Callable[[], list[str]]:
    """The lab's links with a ``fault`` now (``loss``, ``degrade``), from its state file's ``link:NAME/FAULT``
    entries; none if it is unreadable."""
    suffix = f"/{fault}"

    def read() -> list[str]:
        try:
            faults = state.read().get("faults", {})
        except LabError as exc:  # the lab going down: nothing faulted is left to read either
            log.warning("switch counters: lab state %s: %s", state.path, exc)
            return []
        return [k.removeprefix("link:").removesuffix(suffix) for k in faults
                if k.startswith("link:") and k.endswith(suffix)]
    return read


def lab_counters(topology: Topology, state: StateFile) -> tuple[PortCounters, PortCounters]:
    """The lab's (receive errors, transmit wait) counters (see the module docstring)."""
    return (PortCounters(topology, faulted_links(state, "loss"), read=nft_drops, at_receiver=True),
            PortCounters(topology, faulted_links(state, "degrade"), read=tbf_overlimits, at_receiver=False))


def switch_provider(switch: str, *, gateway: str, cluster: str, interval_s: float) -> MeterProvider:
    """A meter provider whose resource is ``switch`` (as an agent's is its host), exporting to ``gateway`` every
    ``interval_s``."""
    resource = Resource.create({"service.name": "ridethrough-switch", "host.name": switch,
                                "ridethrough.node.id": switch, "ridethrough.cluster": cluster})
    reader = PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=gateway, insecure=True, timeout=10),
                                           export_interval_millis=interval_s * 1000)
    return MeterProvider(resource=resource, metric_readers=[reader])


def meter_providers(errors: PortCounters, *, gateway: str, cluster: str, xmit_wait: PortCounters | None = None,
                    dropped: Callable[[str], Mapping[str, float]] | None = None,
                    interval_s: float = EXPORT_INTERVAL_S) -> list[MeterProvider]:
    """One meter provider per switch exporting its ports' counters to ``gateway`` (shut them down to flush).

    ``dropped``: per switch, what each port's kernel dropped on receipt (`ridethrough.lab.switch_ports`:
    frames over its MTU), counted as receive errors too, as an IB port counts a malformed packet."""
    out: list[MeterProvider] = []
    for switch in errors.switches:
        provider = switch_provider(switch, gateway=gateway, cluster=cluster, interval_s=interval_s)
        meter = provider.get_meter("ridethrough.lab.switch")
        meter.create_observable_counter(
            METRIC, callbacks=[_observe(errors, switch, {"ib.counter": COUNTER}, dropped)], unit="{error}",
            description="Frames received with errors on a switch port (lost on its cable)")
        if xmit_wait is not None:
            meter.create_observable_counter(
                XMIT_WAIT, callbacks=[_observe(xmit_wait, switch, {})], unit="{tick}",
                description="Times a switch port had data to send and could not (a congested egress)")
        out.append(provider)
    return out


def _observe(counters: PortCounters, switch: str, extra: Mapping[str, str],
             plus: Callable[[str], Mapping[str, float]] | None = None,
             ) -> Callable[[CallbackOptions], Iterable[Observation]]:
    def callback(options: CallbackOptions) -> Iterable[Observation]:
        attrs: dict[str, Any] = {"ib.port": "1", **extra}
        more = plus(switch) if plus is not None else {}
        return [Observation(value + more.get(port, 0.0), {**attrs, "ib.device": port})
                for port, value in counters.ports(switch).items()]
    return callback
