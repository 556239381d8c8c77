"""Linux network interface counters and link state from sysfs.

Reads, for each ``<sysfs_root>/class/net/<interface>/``:

* ``statistics/*``: cumulative counters (``rx_bytes``, ``tx_errors``,
  ``rx_crc_errors``, ...), one unsigned integer per file;
* ``carrier_changes``: cumulative link up/down transitions (kernel >= 3.15);
* ``operstate``, ``carrier``, ``mtu``, ``speed``: link state gauges.

How a value that cannot be read is treated (a source never raises for one bad
file; the agent above still catches whatever escapes):

* ``ENOENT``: absent. Kernels and drivers differ in which attributes exist,
  and an interface can vanish between listing and reading; it is simply not
  listed next time. Not an error, except a missing ``statistics/`` directory
  on an interface that is still there.
* ``EINVAL`` from ``carrier`` or ``speed``: unknown. The kernel answers so
  while the link is administratively down or the driver cannot tell.
* any other ``OSError``, or text that does not parse: the value is skipped
  and `NetdevSource.errors_total` grows by one.
"""

from __future__ import annotations

import fnmatch
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from ..counters import parse_counter
from ..sample import MetricKind, Sample
from ._attrs import SeriesAttributes
from ._sysfs import SysfsSource, nonempty

if TYPE_CHECKING:
    from ridethrough.settings import AgentConfig

_log = logging.getLogger(__name__)

_T = TypeVar("_T")

_IFACE = "network.interface.name"
_DIRECTION = "network.io.direction"

# statistics/ files with an OpenTelemetry semantic-convention home:
# file name -> (metric name, unit, direction). Every other file goes to
# ridethrough.nic.stat with the file name as the `nic.counter` attribute.
_MAPPED_STATISTICS: Mapping[str, tuple[str, str, str]] = {
    "rx_bytes": ("system.network.io", "By", "receive"),
    "tx_bytes": ("system.network.io", "By", "transmit"),
    "rx_packets": ("system.network.packet.count", "{packet}", "receive"),
    "tx_packets": ("system.network.packet.count", "{packet}", "transmit"),
    "rx_errors": ("system.network.errors", "{error}", "receive"),
    "tx_errors": ("system.network.errors", "{error}", "transmit"),
    "rx_dropped": ("system.network.packet.dropped", "{packet}", "receive"),
    "tx_dropped": ("system.network.packet.dropped", "{packet}", "transmit"),
}

# Attributes whose read fails with EINVAL while the answer is unknown
# (admin-down link, driver without link settings): see the module docstring.
_EINVAL_MEANS_UNKNOWN = frozenset({"carrier", "speed"})


# Sample input, /sys/class/net/eth0/speed on a 100 GbE port: "100000\n".
# A virtio NIC prints "-1\n" (SPEED_UNKNOWN); an admin-down link fails EINVAL.
def parse_speed(text: str) -> int | None:
    """Parse ``speed`` (Mbit/s); None when the kernel says it is unknown (-1).

    Raises:
        ValueError: the text is not an integer.
    """
    stripped = text.strip()
    if stripped == "-1":
        return None
    return parse_counter(stripped)


# Sample input, /sys/class/net/eth0/carrier: "1\n" (link detected) or "0\n".
def parse_carrier(text: str) -> int:
    """Parse ``carrier``: 1 when the physical link is up, 0 when not.

    Raises:
        ValueError: the text is neither ``0`` nor ``1``.
    """
    stripped = text.strip()
    if stripped not in ("0", "1"):
        raise ValueError(f"carrier is not 0 or 1: {text!r}")
    return int(stripped)


# Sample input, /sys/class/net/eth0/operstate: "up\n"; also "down", "dormant",
# "lowerlayerdown", "notpresent", "testing", and "unknown" (lo, some tunnels).
def parse_operstate(text: str) -> str:
    """Parse ``operstate`` (RFC 2863 operational state, lower case).

    Raises:
        ValueError: the file is empty.
    """
    return nonempty(text, "operstate")


class NetdevSource(SysfsSource):
    """Network interface counters (bytes, packets, errors, drops) and link state.

    Metrics (see `ridethrough.catalogue`): ``system.network.io``,
    ``system.network.packet.count``, ``system.network.errors``,
    ``system.network.packet.dropped``, ``ridethrough.nic.stat``,
    ``ridethrough.nic.carrier_changes``, ``ridethrough.nic.up``,
    ``ridethrough.nic.mtu``, ``ridethrough.nic.speed``.

    Counter samples are totals since the agent started, made monotonic by a
    `CounterTracker`, so a NIC reset never shows up as a negative rate.
    """

    source_name = "netdev"
    einval_means_unknown = _EINVAL_MEANS_UNKNOWN

    def __init__(
        self,
        *,
        sysfs_root: str | Path,
        interval_s: float = 1.0,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] = ("lo",),
        max_idle_collections: int = 60,
    ) -> None:
        """Read interfaces under ``<sysfs_root>/class/net``.

        Args:
            sysfs_root: where sysfs is mounted: ``/sys`` on a host, a captured
                tree in tests.
            interval_s: how often the agent should call `collect`.
            include: shell globs (``eth*``, ``ens1f?np?``); when given, only
                interfaces matching one of them are read.
            exclude: shell globs of interfaces never read, applied after ``include``.
            max_idle_collections: forget an interface's counters after this many
                collections without it.

        Raises:
            ValueError: ``interval_s`` is not positive.
        """
        super().__init__(interval_s=interval_s, max_idle_collections=max_idle_collections)
        self._net = os.path.join(sysfs_root, "class", "net")  # a string: a collection joins a hundred paths
        self._include = tuple(include) if include is not None else None
        self._exclude = tuple(exclude)

    def _read_all(self) -> Iterator[Sample]:
        for interface in self._interfaces():
            yield from self._collect_interface(interface)

    def _selected(self, interface: str) -> bool:
        if self._include is not None and not any(
            fnmatch.fnmatchcase(interface, pattern) for pattern in self._include
        ):
            return False
        return not any(fnmatch.fnmatchcase(interface, pattern) for pattern in self._exclude)

    def _interfaces(self) -> list[str]:
        try:
            entries = sorted(os.listdir(self._net))
        except OSError as exc:
            self._error(self._net, exc)
            return []
        # class/net also holds plain files such as bonding_masters.
        return [e for e in entries if self._selected(e) and os.path.isdir(os.path.join(self._net, e))]

    def _collect_interface(self, interface: str) -> Iterator[Sample]:
        base = os.path.join(self._net, interface, "")
        series = self._series_attributes(base, {_IFACE: interface})
        yield from self._statistics(base, interface)
        changes = self._value(base + "carrier_changes", parse_counter)
        if changes is not None:
            metric = "ridethrough.nic.carrier_changes"
            total = self._tracker.observe_key(series.key(metric), changes)
            yield series.sample(metric, MetricKind.COUNTER, "{change}", total)
        yield from self._link_gauges(base, series)

    def _statistics(self, base: str, interface: str) -> Iterator[Sample]:
        directory = base + "statistics"
        try:
            files = sorted(os.listdir(directory))
        except FileNotFoundError as exc:
            if os.path.isdir(base):  # the interface is there, its counters are not
                self._error(directory, exc)
            return
        except OSError as exc:
            self._error(directory, exc)
            return

        def describe(file: str) -> tuple[str, str, dict[str, str], int]:
            mapped = _MAPPED_STATISTICS.get(file)
            if mapped is None:
                return "ridethrough.nic.stat", "1", {_IFACE: interface, "nic.counter": file}, 1
            metric, unit, direction = mapped
            return metric, unit, {_IFACE: interface, _DIRECTION: direction}, 1

        yield from self._counter_files(directory, files, describe)

    def _link_gauges(self, base: str, series: SeriesAttributes) -> Iterator[Sample]:
        kind = MetricKind.GAUGE
        operstate = self._value(base + "operstate", parse_operstate)
        if operstate is not None:
            carrier = self._value(base + "carrier", parse_carrier)
            # Both must agree: operstate alone stays "up" on some drivers for a
            # moment after the cable is pulled, carrier alone ignores admin state.
            up = 1 if operstate == "up" and carrier == 1 else 0
            yield series.sample("ridethrough.nic.up", kind, "1", up)
        mtu = self._value(base + "mtu", parse_counter)
        if mtu is not None:
            yield series.sample("ridethrough.nic.mtu", kind, "By", mtu)
        speed = self._value(base + "speed", parse_speed)
        if speed is not None:
            yield series.sample("ridethrough.nic.speed", kind, "Mbit/s", speed)


def from_config(cfg: AgentConfig) -> NetdevSource:
    """The netdev source the agent's config asks for."""
    return NetdevSource(sysfs_root=cfg.sysfs_root, interval_s=cfg.interval_s)
