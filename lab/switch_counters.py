"""The lab switches' port error counters, exported over OTLP as an InfiniBand fabric's switch ports would be.

A failing optic or a dirty fibre corrupts frames on the cable; the port at the receiving end
counts them (``port_rcv_errors`` on an InfiniBand port, CRC/FCS errors on Ethernet) and drops
them. The lab makes such a cable with nftables (`ridethrough.lab.nft`): a rule at the *sending*
end drops a share of the packets leaving on that interface, and counts them. So the receiving
port's error counter is the peer end's drop counter: for switch ``X``'s port towards ``N`` on link
``L``, the packets ``N``'s rule dropped leaving on ``L``'s interface in ``N``.

`PortCounters` keeps those counts per (switch, port) and monotonic, as hardware counters are: a
rule that is replaced or removed (``restore_link``) restarts its count, so what it had counted is
kept as a base. Only the lab's lossy links (its state's ``link:*/loss`` faults) are read, so an
unfaulted lab runs no ``nft`` at all. `meter_providers` exports them per switch every few seconds
with the contract the agents use for host ports (metric ``ridethrough.ib.port.errors``, attributes
``ib.device`` = the port's interface on the switch, ``ib.port`` ``1``, ``ib.counter``
``port_rcv_errors``; resource ``ridethrough.node.id`` = the switch), so the link detectors and the
tomography read switch ports as they read NICs: a subnet manager's ``perfquery`` in an IB fabric, a
gNMI subscription on an Ethernet one.
"""

from __future__ import annotations

import logging
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
from ridethrough.lab.state import StateFile
from ridethrough.lab.topology import Kind, Topology

log = logging.getLogger(__name__)
METRIC = "ridethrough.ib.port.errors"
COUNTER = "port_rcv_errors"
EXPORT_INTERVAL_S = 5.0
_CACHE_S = 1.0

Losses = Callable[[str], Mapping[str, Mapping[str, float]]]
"""A namespace → per lossy interface, ``dropped`` so far (`nft.losses`)."""


class PortCounters:
    """Per switch port, the frames its cable lost on their way in, monotonic (see the module docstring)."""

    def __init__(self, topology: Topology, lossy_links: Callable[[], Iterable[str]], *,
                 losses: Losses = nft.losses, clock: Callable[[], float] = time.monotonic) -> None:
        """``lossy_links``: the names of the links that have (or had) a loss rule now; read every refresh."""
        self.topology = topology
        self._lossy = lossy_links
        self._losses = losses
        self._clock = clock
        self._lock = threading.Lock()
        self._base: dict[tuple[str, str], float] = {}  # (switch, port) -> counted by rules since replaced
        self._last: dict[tuple[str, str], float] = {}  # (switch, port) -> the current rule's count, last read
        self._read_at = -1e18
        self.switches = [n for n in topology.nodes if topology.kind(n) is not Kind.HOST]

    def ports(self, switch: str) -> dict[str, float]:
        """``switch``'s ports (interface name → receive errors so far), every port listed, refreshed at most once
        a second whoever asks."""
        with self._lock:
            if self._clock() - self._read_at >= _CACHE_S:
                self._refresh()
                self._read_at = self._clock()
            return {link.ifname(switch): self._base.get((switch, link.ifname(switch)), 0.0)
                    + self._last.get((switch, link.ifname(switch)), 0.0) for link in self.topology.node_links(switch)}

    def _refresh(self) -> None:
        seen: set[tuple[str, str]] = set()
        by_ns: dict[str, Mapping[str, Mapping[str, float]] | None] = {}
        for name in sorted(set(self._lossy())):
            try:
                link = self.topology.link(name)
            except (KeyError, ValueError):
                continue
            for sender in (link.lower, link.upper):
                receiver = link.peer(sender)
                if self.topology.kind(receiver) is Kind.HOST:
                    continue  # host ports are the agents' (their fake IB tree)
                ns, key = self.topology.namespace(sender), (receiver, link.ifname(receiver))
                if ns not in by_ns:
                    try:
                        by_ns[ns] = self._losses(ns)
                    except LabError as exc:  # a namespace going away, nft busy: keep the last count as it is
                        log.warning("switch counters: %s", exc)
                        by_ns[ns] = None
                rules = by_ns[ns]
                if rules is None:
                    seen.add(key)
                    continue
                rule = rules.get(link.ifname(sender))
                if rule is not None:
                    self._count(key, float(rule.get("dropped", 0.0)))
                    seen.add(key)
        for key in [k for k in self._last if k not in seen]:  # the rule is gone: what it counted stays counted
            self._count(key, 0.0)

    def _count(self, key: tuple[str, str], now: float) -> None:
        last = self._last.get(key, 0.0)
        if now < last:  # a new rule counts from zero
            self._base[key] = self._base.get(key, 0.0) + last
        self._last[key] = now


def lossy_links(state: StateFile) -> Callable[[], list[str]]:
    """The lab's lossy links now, from its state file (its ``link:NAME/loss`` faults); none if it is unreadable."""
    def read() -> list[str]:
        try:
            faults = state.read().get("faults", {})
        except LabError as exc:  # the lab going down: nothing lossy is left to read either
            log.warning("switch counters: lab state %s: %s", state.path, exc)
            return []
        return [k.removeprefix("link:").removesuffix("/loss") for k in faults
                if k.startswith("link:") and k.endswith("/loss")]
    return read


def meter_providers(counters: PortCounters, *, gateway: str, cluster: str,
                    interval_s: float = EXPORT_INTERVAL_S) -> list[MeterProvider]:
    """One meter provider per switch exporting its ports' counters to ``gateway`` (shut them down to flush)."""
    out: list[MeterProvider] = []
    for switch in counters.switches:
        resource = Resource.create({"service.name": "ridethrough-switch", "host.name": switch,
                                    "ridethrough.node.id": switch, "ridethrough.cluster": cluster})
        reader = PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=gateway, insecure=True, timeout=10),
                                               export_interval_millis=interval_s * 1000)
        provider = MeterProvider(resource=resource, metric_readers=[reader])
        provider.get_meter("ridethrough.lab.switch").create_observable_counter(
            METRIC, callbacks=[_observe(counters, switch)], unit="{error}",
            description="Frames received with errors on a switch port (lost on its cable)")
        out.append(provider)
    return out


def _observe(counters: PortCounters, switch: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
    def callback(options: CallbackOptions) -> Iterable[Observation]:
        attrs: dict[str, Any] = {"ib.port": "1", "ib.counter": COUNTER}
        return [Observation(value, {**attrs, "ib.device": port}) for port, value in counters.ports(switch).items()]
    return callback
