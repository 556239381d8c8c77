"""NIC physical-layer counters, bit error rates and transceiver diagnostics through ethtool.

For each interface an `EthtoolBackend` lists (the real one, `IoctlEthtool`, asks the
kernel through ``SIOCETHTOOL``; `DirectoryEthtool` replays a captured folder):

* **PHY counters** from the driver statistics (``ethtool -S``), those present only:
  mlx5's ``rx_crc_errors_phy``, ``rx_symbol_err_phy``, ``rx_pcs_symbol_err_phy``,
  ``rx_corrected_bits_phy``, ``rx_bits_phy``, ``link_down_events_phy`` and
  ``rx_err_lane_<n>_phy``; and ``rx_fec_{corrected,uncorrectable}_blocks`` (bnxt).
  Counters, made monotonic by a `CounterTracker` (a driver reload or
  ``ethtool --reset`` reads as a reset, not a negative rate).
* **Bit error rates** over each collection interval, from raw deltas, as the mlx5
  documentation defines them (Documentation/networking/device_drivers/ethernet/
  mellanox/mlx5/counters.rst)::

      pre-FEC BER  = Δrx_corrected_bits_phy / Δbits   (bits FEC had to correct)
      post-FEC BER = Δrx_pcs_symbol_err_phy / Δbits   (symbol errors FEC did not correct)

  ``Δbits`` is ``Δrx_bits_phy`` where the driver exposes it. Upstream mlx5 documents
  the counter but (up to Linux 6.18) does not export it, so otherwise ``Δbits`` is
  estimated as link speed x elapsed time: the receiver sees line-rate bits even when
  idle, and the estimate is within the line-coding overhead (a few %), which is
  plenty for an order-of-magnitude quantity. ``nic.phy.bits_source`` says which.
  The pre-FEC figure is a floor: bits in codewords FEC could not correct are not in
  ``rx_corrected_bits_phy``. No BER is emitted on an interface's first collection,
  when ``Δbits`` is 0 (link down), when the speed is unknown or changed, or when any
  counter involved went down (a reset: the interval it covers is unknown).
* **Transceiver DOM** (``ethtool -m``) decoded by `ridethrough.collector.optics`:
  temperature, supply voltage, per-lane Tx bias, Tx power and Rx power (in Cel, V, A
  and W), the module's own alarm/warning thresholds, and an alarm state per quantity computed against them
  (-2 low alarm, -1 low warning, 0 normal, 1 high warning, 2 high alarm).

A missing capability (no stats, no module, a driver without module access) is skipped
quietly (the backend logs it once); a failed read or a malformed value is skipped and
counted in `EthtoolSource.errors_total`. A source never raises for one bad interface.
"""

from __future__ import annotations

import fnmatch
import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ..counters import parse_counter
from ..ethtool_ioctl import IoctlEthtool
from ..optics import Dom, ModuleEeprom, ModuleStandard, Quantity, decode_dom
from ..sample import Sample
from ._sysfs import SysfsSource, gauge
from .netdev import parse_speed

if TYPE_CHECKING:
    from ridethrough.settings import AgentConfig

__all__ = [
    "DirectoryEthtool",
    "EthtoolBackend",
    "EthtoolSource",
    "PhyReading",
    "bit_error_rates",
    "dom_samples",
    "from_config",
    "parse_ethtool_stats",
]

_log = logging.getLogger(__name__)

_IFACE = "network.interface.name"
_COUNTER = "ethtool.counter"
_LANE = "lane"
_BITS_SOURCE = "nic.phy.bits_source"

_CORRECTED_BITS = "rx_corrected_bits_phy"
_UNCORRECTED_SYMBOLS = "rx_pcs_symbol_err_phy"
_RECEIVED_BITS = "rx_bits_phy"

# ethtool stat -> (metric, unit, whether the stat name goes into ethtool.counter).
_PHY_COUNTERS: Mapping[str, tuple[str, str, bool]] = {
    "rx_crc_errors_phy": ("ridethrough.nic.phy.errors", "{error}", True),
    "rx_symbol_err_phy": ("ridethrough.nic.phy.errors", "{error}", True),
    _UNCORRECTED_SYMBOLS: ("ridethrough.nic.phy.errors", "{error}", True),
    "rx_fec_corrected_blocks": ("ridethrough.nic.phy.fec_blocks", "{block}", True),
    "rx_fec_uncorrectable_blocks": ("ridethrough.nic.phy.fec_blocks", "{block}", True),
    _CORRECTED_BITS: ("ridethrough.nic.phy.corrected_bits", "{bit}", False),
    _RECEIVED_BITS: ("ridethrough.nic.phy.received_bits", "{bit}", False),
    "link_down_events_phy": ("ridethrough.nic.phy.link_down_events", "{event}", False),
}
_LANE_ERRORS = re.compile(r"rx_err_lane_([0-9]+)_phy")

# Quantity -> (value metric, unit, factor from the decoder's unit); thresholds go to
# "<value metric>_threshold". The decoder speaks mA and mW, as the standards and
# `ethtool -m` do; metrics carry base units, which OTel and Prometheus name cleanly
# (`_amperes`, `_watts`) where `mA` would come out as a `_mA` suffix.
_OPTICS: Mapping[Quantity, tuple[str, str, float]] = {
    Quantity.TEMPERATURE: ("ridethrough.nic.optics.temperature", "Cel", 1.0),
    Quantity.VOLTAGE: ("ridethrough.nic.optics.voltage", "V", 1.0),
    Quantity.TX_BIAS: ("ridethrough.nic.optics.tx_bias", "A", 1e-3),
    Quantity.TX_POWER: ("ridethrough.nic.optics.tx_power", "W", 1e-3),
    Quantity.RX_POWER: ("ridethrough.nic.optics.rx_power", "W", 1e-3),
}


@runtime_checkable
class EthtoolBackend(Protocol):
    """The seam between the ethtool source and the machine."""

    def interfaces(self) -> list[str]:
        """Interfaces to read, sorted. Raises OSError when they cannot be listed."""
        ...

    def stats(self, ifname: str) -> Mapping[str, int]:
        """Driver statistics (``ETH_SS_STATS``) by name; empty when the driver has none."""
        ...

    def module_eeprom(self, ifname: str) -> ModuleEeprom | None:
        """The plugged module's EEPROM; None when there is no module or no way to read it."""
        ...

    def speed_mbps(self, ifname: str) -> int | None:
        """Link speed in Mbit/s; None while unknown."""
        ...


# Sample input, `ethtool -S eth0` (and a fixture's stats.txt):
#   NIC statistics:
#        rx_crc_errors_phy: 17
#        rx_corrected_bits_phy: 123456
def parse_ethtool_stats(text: str) -> dict[str, int]:
    """Parse ``ethtool -S`` output into ``{name: value}``; lines without a value are headers.

    Raises:
        ValueError: a line whose value is not an unsigned integer, or has no name.
    """
    stats: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        name, sep, value = line.rpartition(":")
        if not line.strip() or (sep and not value.strip()):
            continue
        if not sep or not name.strip():
            raise ValueError(f"line {number}: expected 'name: value', got {line!r}")
        try:
            stats[name.strip()] = parse_counter(value)
        except ValueError as exc:
            raise ValueError(f"line {number}: {exc}") from None
    return stats


class DirectoryEthtool:
    """Replays a folder written by tests/tools/capture_ethtool.py (or modelled by hand).

    One sub-folder per interface, holding any of: ``stats.txt`` (``ethtool -S``
    text), ``speed`` (as sysfs prints it), ``eeprom.bin`` with ``eeprom_type`` (a
    `ModuleStandard` value such as ``sff8636``). A missing file is a missing
    capability. Honours the `EthtoolBackend` protocol.
    """

    def __init__(self, root: str | Path) -> None:
        """Replay the captured interfaces under ``root``."""
        self._root = Path(root)

    def interfaces(self) -> list[str]:
        """The interface folders, sorted."""
        return sorted(p.name for p in self._root.iterdir() if p.is_dir())

    def stats(self, ifname: str) -> dict[str, int]:
        """``stats.txt``, parsed; empty when absent."""
        path = self._root / ifname / "stats.txt"
        return parse_ethtool_stats(path.read_text(encoding="ascii")) if path.exists() else {}

    def module_eeprom(self, ifname: str) -> ModuleEeprom | None:
        """``eeprom.bin`` as the standard ``eeprom_type`` names; None when absent."""
        folder = self._root / ifname
        if not (folder / "eeprom.bin").exists():
            return None
        standard = ModuleStandard((folder / "eeprom_type").read_text(encoding="ascii").strip())
        return ModuleEeprom(standard, (folder / "eeprom.bin").read_bytes())

    def speed_mbps(self, ifname: str) -> int | None:
        """``speed``, parsed as sysfs prints it; None when absent or -1."""
        path = self._root / ifname / "speed"
        return parse_speed(path.read_text(encoding="ascii")) if path.exists() else None


@dataclass(frozen=True, slots=True)
class PhyReading:
    """The raw counters one BER computation needs, at one collection."""

    time_ns: int
    corrected_bits: int | None
    uncorrected_symbols: int | None
    received_bits: int | None
    speed_mbps: int | None


def bit_error_rates(before: PhyReading, after: PhyReading) -> tuple[dict[str, float], str] | None:
    """Pre- and post-FEC BER between two readings, and where the bit count came from.

    Returns ``({"pre_fec": ..., "post_fec": ...}, bits_source)`` with only the rates
    whose error counter both readings hold, or None when no rate can be computed (see
    the module docstring: no time passed, no bits, unknown or changed speed, a reset).
    """
    elapsed_ns = after.time_ns - before.time_ns
    if elapsed_ns <= 0:
        return None
    if before.received_bits is not None and after.received_bits is not None:
        bits: float = after.received_bits - before.received_bits
        source = _RECEIVED_BITS
    elif after.speed_mbps and after.speed_mbps == before.speed_mbps:
        bits = after.speed_mbps * 1e6 * elapsed_ns / 1e9
        source = "link_speed"
    else:
        return None
    errors = {"pre_fec": (before.corrected_bits, after.corrected_bits),
              "post_fec": (before.uncorrected_symbols, after.uncorrected_symbols)}
    deltas = {k: b - a for k, (a, b) in errors.items() if a is not None and b is not None}
    if bits <= 0 or not deltas or any(d < 0 for d in deltas.values()):
        return None
    return {k: d / bits for k, d in deltas.items()}, source


def dom_samples(ifname: str, dom: Dom) -> Iterator[Sample]:
    """Gauges for one module's decoded diagnostics (values, thresholds, alarm states)."""
    base = {_IFACE: ifname}
    module = {Quantity.TEMPERATURE: dom.temperature_c, Quantity.VOLTAGE: dom.voltage_v}
    lanes = {Quantity.TX_BIAS: dom.tx_bias_ma, Quantity.TX_POWER: dom.tx_power_mw,
             Quantity.RX_POWER: dom.rx_power_mw}
    for quantity, value in module.items():
        if value is not None:
            metric, unit, factor = _OPTICS[quantity]
            yield gauge(metric, unit, base, value * factor)
    for quantity, values in lanes.items():
        metric, unit, factor = _OPTICS[quantity]
        for lane, value in enumerate(values, 1):
            yield gauge(metric, unit, {**base, _LANE: str(lane)}, value * factor)
    for quantity, limits in dom.thresholds.items():
        if not limits.usable():
            continue  # unprogrammed (all zero) or out of order: nothing to compare against
        metric, unit, factor = _OPTICS[quantity]
        for name, limit in limits.items():
            yield gauge(f"{metric}_threshold", unit, {**base, "optics.threshold": name}, limit * factor)
        state = {_IFACE: ifname, "optics.quantity": str(quantity)}
        value = module.get(quantity)
        if value is not None:
            yield gauge("ridethrough.nic.optics.module_alarm", "1", state, limits.state(value))
        for lane, lane_value in enumerate(lanes.get(quantity, ()), 1):
            yield gauge("ridethrough.nic.optics.lane_alarm", "1", {**state, _LANE: str(lane)},
                        limits.state(lane_value))


class EthtoolSource(SysfsSource):
    """PHY error counters, pre/post-FEC bit error rates and transceiver DOM of each NIC.

    Metrics (see `ridethrough.catalogue`): ``ridethrough.nic.phy.*`` and
    ``ridethrough.nic.optics.*``.
    """

    source_name = "ethtool"

    def __init__(
        self,
        *,
        backend: EthtoolBackend,
        interval_s: float = 1.0,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] = (),
        optics_every: int = 1,
        max_idle_collections: int = 60,
    ) -> None:
        """Read the interfaces ``backend`` lists.

        Args:
            backend: the machine's edge: `IoctlEthtool` on a host, `DirectoryEthtool` on a capture.
            interval_s: how often the agent should call `collect`.
            include: shell globs; when given, only interfaces matching one are read.
            exclude: shell globs of interfaces never read, applied after ``include``.
            optics_every: read module EEPROMs every this many collections. A read goes
                over the module's I2C bus (through NIC firmware on mlx5), and DOM moves
                slowly, so a busy host may not want it every interval.
            max_idle_collections: forget an interface's counters after this many
                collections without it.

        Raises:
            ValueError: ``interval_s`` is not positive or ``optics_every`` is below 1.
        """
        super().__init__(interval_s=interval_s, max_idle_collections=max_idle_collections)
        if optics_every < 1:
            raise ValueError(f"optics_every must be >= 1, got {optics_every}")
        self._backend = backend
        self._include = tuple(include) if include is not None else None
        self._exclude = tuple(exclude)
        self._optics_every = optics_every
        self._collections = 0
        self._now_ns = 0
        self._readings: dict[str, PhyReading] = {}

    def collect(self, now_ns: int) -> list[Sample]:
        """Read every interface once; unreadable values are skipped and counted."""
        self._now_ns = now_ns
        try:
            return super().collect(now_ns)
        finally:
            self._collections += 1

    def _read_all(self) -> Iterator[Sample]:
        try:
            names = [n for n in self._backend.interfaces() if self._selected(n)]
        except OSError as exc:
            self._fail("listing interfaces", exc)
            return
        readings: dict[str, PhyReading] = {}
        read_optics = self._collections % self._optics_every == 0
        for ifname in names:
            yield from self._phy(ifname, readings)
            if read_optics:
                yield from self._optics(ifname)
        # Only interfaces seen this time are kept, which bounds the state and makes an
        # interface that comes back start a fresh BER window.
        self._readings = readings

    def _selected(self, ifname: str) -> bool:
        if self._include is not None and not any(fnmatch.fnmatchcase(ifname, p) for p in self._include):
            return False
        return not any(fnmatch.fnmatchcase(ifname, p) for p in self._exclude)

    def _phy(self, ifname: str, readings: dict[str, PhyReading]) -> Iterator[Sample]:
        try:
            stats = self._backend.stats(ifname)
        except (OSError, ValueError) as exc:
            self._fail(f"{ifname}: stats", exc)
            return
        for name, raw in stats.items():
            mapped = _phy_metric(ifname, name)
            if mapped is not None:
                metric, unit, attributes = mapped
                yield self._counter(metric, unit, attributes, raw)
        if _CORRECTED_BITS not in stats and _UNCORRECTED_SYMBOLS not in stats:
            return  # no FEC counters: no BER to compute
        reading = PhyReading(self._now_ns, stats.get(_CORRECTED_BITS), stats.get(_UNCORRECTED_SYMBOLS),
                             stats.get(_RECEIVED_BITS), self._speed(ifname, stats))
        readings[ifname] = reading
        previous = self._readings.get(ifname)
        rates = bit_error_rates(previous, reading) if previous is not None else None
        if rates is not None:
            values, source = rates
            attributes = {_IFACE: ifname, _BITS_SOURCE: source}
            for kind, rate in values.items():
                yield gauge(f"ridethrough.nic.phy.{kind}_ber", "1", attributes, rate)

    def _speed(self, ifname: str, stats: Mapping[str, int]) -> int | None:
        if _RECEIVED_BITS in stats:
            return None  # not needed: the driver counts the bits itself
        try:
            return self._backend.speed_mbps(ifname)
        except (OSError, ValueError) as exc:
            self._fail(f"{ifname}: speed", exc)
            return None

    def _optics(self, ifname: str) -> Iterator[Sample]:
        try:
            eeprom = self._backend.module_eeprom(ifname)
            dom = decode_dom(eeprom) if eeprom is not None else None
        except (OSError, ValueError) as exc:  # EepromError is a ValueError
            self._fail(f"{ifname}: module EEPROM", exc)
            return
        if dom is not None:
            yield from dom_samples(ifname, dom)

    def _fail(self, what: str, exc: Exception) -> None:
        self._errors_total += 1
        # Debug, not warning: a broken module or driver would otherwise log every interval.
        _log.debug("ethtool: skipping %s: %s", what, exc)


def _phy_metric(ifname: str, stat: str) -> tuple[str, str, dict[str, str]] | None:
    """The (metric, unit, attributes) an ethtool stat goes to; None for stats not read here."""
    mapped = _PHY_COUNTERS.get(stat)
    if mapped is not None:
        metric, unit, named = mapped
        return metric, unit, ({_IFACE: ifname, _COUNTER: stat} if named else {_IFACE: ifname})
    lane = _LANE_ERRORS.fullmatch(stat)
    if lane is not None:
        return "ridethrough.nic.phy.lane_errors", "{error}", {_IFACE: ifname, _LANE: str(int(lane.group(1)))}
    return None


def from_config(cfg: AgentConfig) -> EthtoolSource:
    """The ethtool source the agent's config asks for: ioctls on the interfaces under ``sysfs_root``."""
    return EthtoolSource(backend=IoctlEthtool(sysfs_root=cfg.sysfs_root), interval_s=cfg.interval_s)

