"""InfiniBand and RoCE port counters and state from sysfs.

Reads, for each ``<sysfs_root>/class/infiniband/<device>/ports/<port>/``:

* ``counters/*``: the IB PMA PortCounters (``symbol_error``, ``port_rcv_data``,
  ...), extended to 64 bits where the HCA supports PortCountersExtended;
  ``port_xmit_data``/``port_rcv_data`` count 4-byte words, so they are
  multiplied by 4 into bytes. Legacy 32-bit (and the 4/8/16-bit error)
  counters saturate at their maximum instead of wrapping: a flat line there
  means "at least", not "no new errors";
* ``hw_counters/*``: driver counters (mlx5: ``out_of_sequence``,
  ``packet_seq_err``, ``local_ack_timeout_err``, ``np_cnp_sent``,
  ``rp_cnp_handled``, ...), except ``lifespan``, which is the driver's cache
  period in ms, not a counter;
* ``state``, ``phys_state``, ``rate``, ``link_layer``.

Where each counters/ file goes:

* ``port_{xmit,rcv}_data`` -> ``ridethrough.ib.port.io`` (bytes, by direction);
* ``port_{xmit,rcv}_packets`` -> ``ridethrough.ib.port.packets``;
* ``{unicast,multicast}_{xmit,rcv}_packets`` -> ``ridethrough.ib.port.cast_packets``
  with ``ib.cast``. They are a breakdown of the packet totals, so they get a
  metric of their own: in ``ridethrough.ib.port.packets`` a sum over all
  series would count every packet twice, and the metric would have two
  attribute shapes;
* ``port_xmit_wait`` -> ``ridethrough.ib.port.xmit_wait`` (ticks with data to
  send and no credit to send it: congestion, not an error);
* every other file -> ``ridethrough.ib.port.errors`` with ``ib.counter``.

Unreadable values follow the same rules as `ridethrough.collector.sources.netdev`:
``ENOENT`` is absent, ``EINVAL`` from ``rate`` is unknown, anything else
(including ``EINVAL`` from a counter, which is a failed PMA query) is skipped
and counted in `InfinibandSource.errors_total`.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from ..sample import MetricKind, Sample
from ._attrs import SeriesAttributes
from ._sysfs import SysfsSource, nonempty

if TYPE_CHECKING:
    from ridethrough.settings import AgentConfig

_log = logging.getLogger(__name__)

_T = TypeVar("_T")

_DEVICE = "ib.device"
_PORT = "ib.port"
_DIRECTION = "network.io.direction"
_COUNTER = "ib.counter"

_GAUGE = MetricKind.GAUGE
_IB_DATA_WORD_BYTES = 4
"""PortXmitData/PortRcvData count octets divided by 4 (IBA vol. 1, 16.1.3.5)."""

# counters/ file -> (metric, unit, extra attributes, multiplier to the unit).
_MAPPED_COUNTERS: Mapping[str, tuple[str, str, Mapping[str, str], int]] = {
    "port_xmit_data": ("ridethrough.ib.port.io", "By", {_DIRECTION: "transmit"}, _IB_DATA_WORD_BYTES),
    "port_rcv_data": ("ridethrough.ib.port.io", "By", {_DIRECTION: "receive"}, _IB_DATA_WORD_BYTES),
    "port_xmit_packets": ("ridethrough.ib.port.packets", "{packet}", {_DIRECTION: "transmit"}, 1),
    "port_rcv_packets": ("ridethrough.ib.port.packets", "{packet}", {_DIRECTION: "receive"}, 1),
    "unicast_xmit_packets": (
        "ridethrough.ib.port.cast_packets",
        "{packet}",
        {_DIRECTION: "transmit", "ib.cast": "unicast"},
        1,
    ),
    "unicast_rcv_packets": (
        "ridethrough.ib.port.cast_packets",
        "{packet}",
        {_DIRECTION: "receive", "ib.cast": "unicast"},
        1,
    ),
    "multicast_xmit_packets": (
        "ridethrough.ib.port.cast_packets",
        "{packet}",
        {_DIRECTION: "transmit", "ib.cast": "multicast"},
        1,
    ),
    "multicast_rcv_packets": (
        "ridethrough.ib.port.cast_packets",
        "{packet}",
        {_DIRECTION: "receive", "ib.cast": "multicast"},
        1,
    ),
    "port_xmit_wait": ("ridethrough.ib.port.xmit_wait", "{tick}", {}, 1),
}

_NOT_HW_COUNTERS = frozenset({"lifespan"})

# Attributes whose read fails with EINVAL while the answer is unknown
# (rate_show() returns -EINVAL for an unknown link width).
_EINVAL_MEANS_UNKNOWN = frozenset({"rate"})

_NUMBERED_STATE = re.compile(r"([0-9]+):\s*\S.*")
_RATE = re.compile(r"([0-9]+(?:\.[0-9]+)?) Gb/sec(?: \(.*\))?")


# Sample input, ports/1/state: "4: ACTIVE\n" (1: DOWN, 2: INIT, 3: ARMED,
# 5: ACTIVE_DEFER); ports/1/phys_state: "5: LinkUp\n" (2: Polling, 3: Disabled).
def parse_numbered_state(text: str) -> int:
    """Parse ``state``/``phys_state`` (``"<number>: <name>"``) into the number.

    Raises:
        ValueError: the text is not in that form.
    """
    match = _NUMBERED_STATE.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"not '<number>: <name>': {text!r}")
    return int(match.group(1))


# Sample input, ports/1/rate: "100 Gb/sec (4X EDR)\n", "200 Gb/sec (4X HDR)\n",
# "2.5 Gb/sec (1X SDR)\n" (the kernel prints deci-Gb/s as "%d%s" with ".5").
def parse_rate(text: str) -> float:
    """Parse ``rate`` into Gbit/s.

    Raises:
        ValueError: the text does not start with ``<number> Gb/sec``.
    """
    match = _RATE.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"not '<number> Gb/sec (<width> <speed>)': {text!r}")
    return float(match.group(1))


# Sample input, ports/1/link_layer: "InfiniBand\n" or "Ethernet\n" (RoCE).
def parse_link_layer(text: str) -> str:
    """Parse ``link_layer``.

    Raises:
        ValueError: the file is empty.
    """
    return nonempty(text, "link_layer")


class InfinibandSource(SysfsSource):
    """InfiniBand/RoCE port counters (data, packets, errors, congestion) and state.

    Metrics (see `ridethrough.catalogue`): ``ridethrough.ib.port.io``,
    ``ridethrough.ib.port.packets``, ``ridethrough.ib.port.cast_packets``,
    ``ridethrough.ib.port.errors``, ``ridethrough.ib.port.xmit_wait``,
    ``ridethrough.ib.port.hw_counter``, ``ridethrough.ib.port.state``,
    ``ridethrough.ib.port.phys_state``, ``ridethrough.ib.port.rate``.

    Counter samples are totals since the agent started, made monotonic by a
    `CounterTracker`. A host without ``class/infiniband`` yields nothing and
    counts no error.
    """

    source_name = "infiniband"
    einval_means_unknown = _EINVAL_MEANS_UNKNOWN

    def __init__(
        self,
        *,
        sysfs_root: str | Path,
        interval_s: float = 1.0,
        max_idle_collections: int = 60,
    ) -> None:
        """Read ports under ``<sysfs_root>/class/infiniband``.

        Args:
            sysfs_root: where sysfs is mounted: ``/sys`` on a host, a captured
                tree in tests.
            interval_s: how often the agent should call `collect`.
            max_idle_collections: forget a port's counters after this many
                collections without it.

        Raises:
            ValueError: ``interval_s`` is not positive.
        """
        super().__init__(interval_s=interval_s, max_idle_collections=max_idle_collections)
        # plain strings, not Paths: a collection joins a few hundred of them
        self._ib = os.path.join(sysfs_root, "class", "infiniband")

    def _read_all(self) -> Iterator[Sample]:
        for device in self._list(self._ib, missing_is_error=False):
            device_dir = os.path.join(self._ib, device)
            ports_dir = os.path.join(device_dir, "ports")
            for port in self._list(ports_dir, missing_is_error=os.path.isdir(device_dir)):
                yield from self._collect_port(device, port, os.path.join(ports_dir, port))

    def _list(self, directory: str, *, missing_is_error: bool) -> list[str]:
        try:
            return sorted(e for e in os.listdir(directory) if os.path.isdir(os.path.join(directory, e)))
        except FileNotFoundError as exc:
            if missing_is_error:
                self._error(directory, exc)
            return []
        except OSError as exc:
            self._error(directory, exc)
            return []

    def _collect_port(self, device: str, port: str, base: str) -> Iterator[Sample]:
        series = self._series_attributes(base, {_DEVICE: device, _PORT: port})
        yield from self._port_gauges(base + "/", series)
        yield from self._counters(os.path.join(base, "counters"), series.base)
        yield from self._hw_counters(os.path.join(base, "hw_counters"), series.base)

    def _port_gauges(self, base: str, series: SeriesAttributes) -> Iterator[Sample]:
        state = self._value(base + "state", parse_numbered_state)
        if state is not None:
            link_layer = self._value(base + "link_layer", parse_link_layer) or "unknown"
            yield series.sample("ridethrough.ib.port.state", _GAUGE, "1", state, ("ib.link_layer", link_layer))
        phys_state = self._value(base + "phys_state", parse_numbered_state)
        if phys_state is not None:
            yield series.sample("ridethrough.ib.port.phys_state", _GAUGE, "1", phys_state)
        rate = self._value(base + "rate", parse_rate)
        if rate is not None:
            yield series.sample("ridethrough.ib.port.rate", _GAUGE, "Gbit/s", rate)

    def _counters(self, directory: str, attributes: Mapping[str, str]) -> Iterator[Sample]:
        # A port without counters/ is normal: the driver has no PMA (no process_mad).
        def describe(file: str) -> tuple[str, str, dict[str, str], int]:
            mapped = _MAPPED_COUNTERS.get(file)
            if mapped is None:
                return "ridethrough.ib.port.errors", "{error}", {**attributes, _COUNTER: file}, 1
            metric, unit, extra, multiplier = mapped
            return metric, unit, {**attributes, **extra}, multiplier

        yield from self._counter_files(directory, self._files(directory), describe)

    def _hw_counters(self, directory: str, attributes: Mapping[str, str]) -> Iterator[Sample]:
        # A port without hw_counters/ is normal: the driver has no alloc_hw_stats.
        def describe(file: str) -> tuple[str, str, dict[str, str], int]:
            return "ridethrough.ib.port.hw_counter", "1", {**attributes, _COUNTER: file}, 1

        files = [f for f in self._files(directory) if f not in _NOT_HW_COUNTERS]
        yield from self._counter_files(directory, files, describe)

    def _files(self, directory: str) -> list[str]:
        try:
            return sorted(os.listdir(directory))
        except FileNotFoundError:
            return []
        except OSError as exc:
            self._error(directory, exc)
            return []


def from_config(cfg: AgentConfig) -> InfinibandSource:
    """The InfiniBand source the agent's config asks for."""
    return InfinibandSource(sysfs_root=cfg.sysfs_root, interval_s=cfg.interval_s)
