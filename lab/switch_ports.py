"""The lab switches' own ports, as their kernels report them: link state, MTU, frames dropped on receipt.

A real switch reports each port's operational state and MTU (gNMI ``oper-status`` and ``mtu``, an IB
subnet manager's PortInfo), and counts the frames a port had to drop as they arrived: a frame
longer than the port's MTU is one (IB ``PortRcvErrors`` counts it as a malformed packet). The lab's
switch ports are veths, whose kernel keeps the same three facts: ``IFLA_OPERSTATE``, ``IFLA_MTU`` and
``rx_dropped`` (a veth drops a frame longer than its MTU on receipt and counts it there).

`KernelPorts` reads every port of a switch with one netlink dump of its namespace, at most every
``max_age_s`` whoever asks. `meter_providers` exports state and MTU per port every second with the
netdev contract the agents' netdev source uses (``ridethrough.nic.up``, ``ridethrough.nic.mtu``,
attribute ``network.interface.name`` = the port's interface on the switch), and `watch` exports a
switch's at once when one of its ports changes state (as a switch sends a trap, rather than wait
for the next poll), so the link detectors see a switch port go down as soon as a host NIC, and can
compare the MTUs of a cable's two ends. The receive drops join the port's ``port_rcv_errors``
(`ridethrough.lab.switch_counters`).
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider

from ridethrough.lab import rtnl_links
from ridethrough.lab.control import LabError
from ridethrough.lab.switch_counters import switch_provider
from ridethrough.lab.topology import Kind, Topology

log = logging.getLogger(__name__)
UP = "ridethrough.nic.up"
MTU = "ridethrough.nic.mtu"
INTERFACE = "network.interface.name"
STATE_INTERVAL_S = 1.0
"""How often state and MTU leave without a change (an agent's export interval)."""
WATCH_S = 0.2
"""How often `watch` looks for a port that changed state."""


@dataclass(frozen=True, slots=True)
class Port:
    """One switch port as its kernel last reported it."""

    up: bool
    mtu: int
    rx_dropped: float
    """Frames the port dropped as they arrived (too long for its MTU), since the interface was made."""


Reader = Callable[[str], Mapping[str, Port]]
"""A switch's namespace → its ports by interface name (LabError if the namespace cannot be read)."""


def port_of(message: Mapping[str, Any]) -> tuple[str, Port] | None:
    """One RTM_NEWLINK message (`rtnl_links.dump`'s dict, pyroute2's shape) as (interface, `Port`); None for
    ``lo``."""
    name = str(message.get("ifname") or "")
    if not name or name == "lo":
        return None
    stats = message.get("stats64") or {}
    return name, Port(up=message.get("operstate") == "UP", mtu=int(message.get("mtu") or 0),
                      rx_dropped=float(stats.get("rx_dropped", 0)))


class NetlinkReader:
    """Reads a namespace's ports over one raw netlink socket per namespace (`ridethrough.lab.rtnl_links`)."""

    def __init__(self, namespaces: Iterable[str]) -> None:
        self._names = list(namespaces)
        self._socks: dict[str, tuple[socket.socket, threading.Lock]] = {}  # one request at a time on a socket
        self._seq = itertools.count(1)

    def open(self) -> None:
        """One socket per namespace; LabError if one is missing (the ones opened are closed)."""
        from ridethrough.lab.netns import ns_path

        try:
            for ns in self._names:
                if not ns_path(ns).exists():
                    raise LabError(f"namespace {ns} does not exist (is the lab up?)")
                self._socks[ns] = (rtnl_links.open_in(str(ns_path(ns))), threading.Lock())
        except BaseException:
            self.close()
            raise

    def __call__(self, ns: str) -> dict[str, Port]:
        if ns not in self._socks:
            raise LabError(f"no netlink socket open in namespace {ns}")
        sock, lock = self._socks[ns]
        with lock:
            messages = rtnl_links.dump(sock, next(self._seq))
        return dict(p for m in messages if (p := port_of(m)) is not None)

    def close(self) -> None:
        """Close every socket."""
        for sock, _ in self._socks.values():
            sock.close()
        self._socks.clear()


class KernelPorts:
    """Per switch, its ports as its kernel last reported them (see the module docstring)."""

    def __init__(self, topology: Topology, read: Reader, *, max_age_s: float = WATCH_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.topology = topology
        self._read = read
        self._max_age_s = max_age_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, dict[str, Port]] = {}
        self._read_at: dict[str, float] = {}
        self.switches = [n for n in topology.nodes if topology.kind(n) is not Kind.HOST]
        self._cabled = {sw: {link.ifname(sw) for link in topology.node_links(sw)} for sw in self.switches}

    def ports(self, switch: str) -> dict[str, Port]:
        """``switch``'s cabled ports, read again when the last reading is ``max_age_s`` old; the last reading if
        the kernel cannot be read now (none before the first good one)."""
        with self._lock:
            if self._clock() - self._read_at.get(switch, -1e18) >= self._max_age_s:
                self._read_at[switch] = self._clock()
                try:
                    self._last[switch] = dict(self._read(self.topology.namespace(switch)))
                except LabError as exc:
                    log.warning("switch ports: %s", exc)
            return {name: port for name, port in self._last.get(switch, {}).items() if name in self._cabled[switch]}

    def rx_dropped(self, switch: str) -> dict[str, float]:
        """``switch``'s ports' receive drops (for ``port_rcv_errors``)."""
        return {name: port.rx_dropped for name, port in self.ports(switch).items()}


def meter_providers(ports: KernelPorts, *, gateway: str, cluster: str,
                    interval_s: float = STATE_INTERVAL_S) -> dict[str, MeterProvider]:
    """Per switch, a meter provider exporting its ports' state and MTU (shut them down to flush)."""
    out: dict[str, MeterProvider] = {}
    for switch in ports.switches:
        provider = switch_provider(switch, gateway=gateway, cluster=cluster, interval_s=interval_s)
        meter = provider.get_meter("ridethrough.lab.switch")
        meter.create_observable_gauge(UP, callbacks=[_observe(ports, switch, lambda p: 1.0 if p.up else 0.0)],
                                      unit="1", description="1 while a switch port is operationally up")
        meter.create_observable_gauge(MTU, callbacks=[_observe(ports, switch, lambda p: float(p.mtu))],
                                      unit="By", description="A switch port's MTU")
        out[switch] = provider
    return out


def watch(ports: KernelPorts, providers: Mapping[str, MeterProvider], stopping: threading.Event, *,
          every_s: float = WATCH_S) -> None:
    """Until ``stopping`` is set: every ``every_s``, read each switch's ports, and flush its provider at once
    when a port's state changed since the last look (the first look only learns the states).

    One thread per switch, as each switch sends its own traps: a flush waits for the gateway to make its batch
    durable (up to a second on a loaded machine), and the far end of a cut cable must not wait for the near
    end's flush to be read at all."""
    threads = [threading.Thread(target=_watch_one, args=(ports, switch, provider, stopping, every_s),
                                name=f"port-watch-{switch}", daemon=True) for switch, provider in providers.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _watch_one(ports: KernelPorts, switch: str, provider: MeterProvider, stopping: threading.Event,
               every_s: float) -> None:
    seen: dict[str, bool] | None = None
    while not stopping.wait(every_s):
        try:
            now = {name: port.up for name, port in ports.ports(switch).items()}
        except Exception:  # the watcher must outlive one bad reading: the next look may be good
            log.exception("%s: reading its ports failed", switch)
            continue
        before, seen = seen, now
        if before is not None and now != before:
            changed = sorted(n for n in now if before.get(n) != now[n])
            log.info("%s: port(s) %s changed state; exporting now", switch, ", ".join(changed))
            try:
                provider.force_flush(timeout_millis=5_000)
            except Exception:  # the next periodic export carries it anyway
                log.warning("%s: exporting its port states failed", switch, exc_info=True)


def _observe(ports: KernelPorts, switch: str,
             value: Callable[[Port], float]) -> Callable[[CallbackOptions], Iterable[Observation]]:
    def callback(options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(value(port), {INTERFACE: name}) for name, port in ports.ports(switch).items()]
    return callback
