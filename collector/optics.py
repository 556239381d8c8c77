"""Decode a pluggable module's digital diagnostics (DOM) from its EEPROM image: pure code, no I/O.

Three memory layouts are understood, picked by the module's identifier byte (SFF-8024)
and the standard the driver reported:

* **SFF-8472** (SFP, SFP+, SFP28): page A0h at 0-255, diagnostics page A2h at 256-511.
  Monitors at A2h 96-105, thresholds at A2h 0-39; an externally calibrated module
  (A0h byte 92 bit 4) has slope/offset and Rx power polynomial constants at A2h 56-91.
* **SFF-8636 / SFF-8436** (QSFP+, QSFP28): monitors in the lower page (temperature
  22-23, Vcc 26-27, per lane Rx power 34-41, Tx bias 42-49, Tx power 50-57);
  thresholds in upper page 03h (128-199).
* **CMIS 4/5** (QSFP-DD, OSFP, QSFP112): module monitors in the lower page (14-17),
  support bits and the Tx bias multiplier in page 01h, thresholds in page 02h,
  per-lane monitors in page 11h (bank 0: lanes 1-8).

The image is *flat*: bytes 0-127 are the lower page, and byte ``b`` (128-255) of upper
page ``N`` sits at ``128 * N + b``. That is exactly what ``ETHTOOL_GMODULEEEPROM``
returns for SFF-8636 (640 bytes: upper pages 00h-03h), so SFF-8636 page 03h starts
at 512; a CMIS image with page 11h is 2432 bytes (pages nobody read are zeros, and a
page past the end of the image is absent).

Units, as the standards define them: temperature signed 1/256 degC; voltage 100 uV;
Tx bias 2 uA (CMIS: times the page 01h multiplier); optical power 0.1 uW. Decoded
values are degC, V, mA and mW. Lanes are numbered from 1, as in the standards and in
``ethtool -m``.

`decode_dom` returns None when the module has no diagnostics to give (SFF-8079, an
SFP dump without A2h, passive copper, flat-memory CMIS, data not ready) and raises
`EepromError` when the image is malformed (too short, an identifier that does not fit).
"""

from __future__ import annotations

import enum
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "Dom",
    "EepromError",
    "ModuleEeprom",
    "ModuleStandard",
    "Quantity",
    "Thresholds",
    "decode_dom",
]


class EepromError(ValueError):
    """The EEPROM image cannot be decoded (too short, or not the layout it claims)."""


class ModuleStandard(enum.Enum):
    """The management interface a module's EEPROM follows (``ETH_MODULE_SFF_*`` in ethtool.h)."""

    SFF_8079 = "sff8079"
    """SFP, page A0h only (256 bytes): no diagnostics."""
    SFF_8472 = "sff8472"
    """SFP with diagnostics: A0h and A2h (512 bytes)."""
    SFF_8636 = "sff8636"
    """QSFP28 (256 bytes, or 640 with upper pages 01h-03h)."""
    SFF_8436 = "sff8436"
    """QSFP+ (same sizes as SFF-8636)."""
    CMIS = "cmis"
    """QSFP-DD/OSFP read page by page (no ioctl code: the netlink ethtool API reads these)."""

    @classmethod
    def from_ethtool(cls, code: int) -> ModuleStandard:
        """The standard for an ``ETH_MODULE_SFF_*`` code from ``ETHTOOL_GMODULEINFO``.

        Raises:
            ValueError: an unknown code.
        """
        try:
            return _ETHTOOL_CODES[code]
        except KeyError:
            raise ValueError(f"unknown ETH_MODULE_SFF type {code:#x}") from None


_ETHTOOL_CODES = {
    1: ModuleStandard.SFF_8079,
    2: ModuleStandard.SFF_8472,
    3: ModuleStandard.SFF_8636,
    4: ModuleStandard.SFF_8436,
}


@dataclass(frozen=True, slots=True)
class ModuleEeprom:
    """A module's EEPROM as a driver returned it: the standard it reported, and the flat image."""

    standard: ModuleStandard
    data: bytes


class Quantity(enum.StrEnum):
    """A monitored quantity; the value is the ``optics.quantity`` attribute."""

    TEMPERATURE = "temperature"
    VOLTAGE = "voltage"
    TX_BIAS = "tx_bias"
    TX_POWER = "tx_power"
    RX_POWER = "rx_power"


@dataclass(frozen=True, slots=True)
class Thresholds:
    """A module's own alarm and warning limits for one quantity, in the quantity's unit."""

    high_alarm: float
    low_alarm: float
    high_warning: float
    low_warning: float

    def items(self) -> tuple[tuple[str, float], ...]:
        """``(name, limit)`` pairs; the names are the ``optics.threshold`` attribute values."""
        return (("high_alarm", self.high_alarm), ("low_alarm", self.low_alarm),
                ("high_warning", self.high_warning), ("low_warning", self.low_warning))

    def usable(self) -> bool:
        """Whether the limits mean anything: not all zero (unprogrammed) and in order."""
        if not any((self.high_alarm, self.low_alarm, self.high_warning, self.low_warning)):
            return False
        return self.low_alarm <= self.low_warning <= self.high_warning <= self.high_alarm

    def state(self, value: float) -> int:
        """-2 below the low alarm, -1 below the low warning, 0 within, 1 above the high warning, 2 above the alarm."""
        if value > self.high_alarm:
            return 2
        if value < self.low_alarm:
            return -2
        if value > self.high_warning:
            return 1
        if value < self.low_warning:
            return -1
        return 0


@dataclass(frozen=True, slots=True)
class Dom:
    """Decoded diagnostics. Lane tuples hold lane 1 first; an empty tuple: not monitored."""

    layout: str
    """Which layout decoded it: ``sff8472``, ``sff8636`` or ``cmis``."""
    temperature_c: float | None = None
    voltage_v: float | None = None
    tx_bias_ma: tuple[float, ...] = ()
    tx_power_mw: tuple[float, ...] = ()
    rx_power_mw: tuple[float, ...] = ()
    thresholds: Mapping[Quantity, Thresholds] = field(default_factory=dict)
    """Only the quantities whose thresholds the module provides."""
    rx_power_is_average: bool = True
    """False when the module reports Rx power as OMA rather than average power."""


# --- shared helpers -----------------------------------------------------------------------------

_A2 = 256
"""Where SFF-8472 page A2h starts in the image."""
_SFP_IDS = frozenset({0x01, 0x02, 0x03, 0x0B})  # GBIC, soldered, SFP/SFP+/SFP28, DWDM-SFP
_QSFP_IDS = frozenset({0x0C, 0x0D, 0x11})  # QSFP, QSFP+, QSFP28
_CMIS_IDS = frozenset({0x18, 0x19, 0x1B, 0x1E, 0x1F, 0x20})  # QSFP-DD, OSFP, DSFP, QSFP+/SFP-DD/SFP+ CMIS
_QUANTITY_SCALE = {
    Quantity.TEMPERATURE: 1 / 256,  # degC per LSB (signed)
    Quantity.VOLTAGE: 1e-4,  # V per LSB
    Quantity.TX_BIAS: 2e-3,  # mA per LSB
    Quantity.TX_POWER: 1e-4,  # mW per LSB
    Quantity.RX_POWER: 1e-4,
}


def _u16(data: bytes, offset: int) -> int:
    return int(struct.unpack_from(">H", data, offset)[0])


def _s16(data: bytes, offset: int) -> int:
    return int(struct.unpack_from(">h", data, offset)[0])


def _page(n: int, byte: int) -> int:
    """Image offset of ``byte`` (128-255) of upper page ``n``."""
    return 128 * n + byte


def _has_page(data: bytes, n: int) -> bool:
    return len(data) >= _page(n, 256)


def _raw_thresholds(data: bytes, offset: int, *, signed: bool = False) -> tuple[int, int, int, int]:
    """Four limits stored high alarm, low alarm, high warning, low warning (every standard's order)."""
    read = _s16 if signed else _u16
    return (read(data, offset), read(data, offset + 2), read(data, offset + 4), read(data, offset + 6))


def _scaled(raw: tuple[int, ...], scale: float) -> Thresholds:
    return Thresholds(raw[0] * scale, raw[1] * scale, raw[2] * scale, raw[3] * scale)


def _lanes(data: bytes, offset: int, count: int, scale: float) -> tuple[float, ...]:
    return tuple(_u16(data, offset + 2 * i) * scale for i in range(count))


# --- SFF-8472 -----------------------------------------------------------------------------------

# A2h byte offsets of each quantity's monitor and first threshold.
_SFP_FIELDS = {
    Quantity.TEMPERATURE: (96, 0),
    Quantity.VOLTAGE: (98, 8),
    Quantity.TX_BIAS: (100, 16),
    Quantity.TX_POWER: (102, 24),
    Quantity.RX_POWER: (104, 32),
}
# A2h offsets of the (slope, offset) calibration pairs for externally calibrated modules.
_SFP_CALIBRATION = {
    Quantity.TX_BIAS: 76,
    Quantity.TX_POWER: 80,
    Quantity.TEMPERATURE: 84,
    Quantity.VOLTAGE: 88,
}
_SFP_RX_POLYNOMIAL = 56
"""Rx_PWR(4) .. Rx_PWR(0), big-endian IEEE 754 floats, highest order first."""


def _sfp_calibrate(data: bytes, quantity: Quantity, raw: int) -> float:
    """An externally calibrated raw reading in the standard's LSB units (SFF-8472 section 9.3)."""
    a2 = data[_A2:]
    if quantity is Quantity.RX_POWER:
        coefficients = struct.unpack_from(">5f", a2, _SFP_RX_POLYNOMIAL)
        value = float(sum(c * raw ** (4 - i) for i, c in enumerate(coefficients)))
    else:
        at = _SFP_CALIBRATION[quantity]
        slope = _u16(a2, at) / 256  # unsigned fixed point, 8.8
        value = slope * raw + _s16(a2, at + 2)
    if not math.isfinite(value):  # NaN or infinite polynomial constants: garbage, not a reading
        raise EepromError(f"SFF-8472 calibration of {quantity} gives {value}")
    # A calibration offset can push a reading just below zero; a current or power cannot be.
    return value if quantity is Quantity.TEMPERATURE else max(value, 0.0)


def _decode_sff8472(data: bytes) -> Dom | None:
    if len(data) < _A2:
        raise EepromError(f"SFF-8472 image is {len(data)} bytes; page A0h alone needs 256")
    if data[0] not in _SFP_IDS:
        raise EepromError(f"identifier {data[0]:#04x} is not an SFP module")
    diagnostics = data[92]
    # A driver that reads A0h only gives 256 bytes (older mlx5); bit 6 clear: no diagnostics.
    if len(data) < 2 * _A2 or not diagnostics & 0x40:
        return None
    external = bool(diagnostics & 0x10)
    values: dict[Quantity, float] = {}
    thresholds: dict[Quantity, Thresholds] = {}
    for quantity, (monitor, limits) in _SFP_FIELDS.items():
        signed = quantity is Quantity.TEMPERATURE
        read = _s16 if signed else _u16
        raws = (read(data, _A2 + monitor), *_raw_thresholds(data, _A2 + limits, signed=signed))
        if external:
            lsbs = [_sfp_calibrate(data, quantity, r) for r in raws]
        else:
            lsbs = [float(r) for r in raws]
        scale = _QUANTITY_SCALE[quantity]
        values[quantity] = lsbs[0] * scale
        thresholds[quantity] = Thresholds(*(v * scale for v in lsbs[1:]))
    return Dom(
        layout="sff8472",
        temperature_c=values[Quantity.TEMPERATURE],
        voltage_v=values[Quantity.VOLTAGE],
        tx_bias_ma=(values[Quantity.TX_BIAS],),
        tx_power_mw=(values[Quantity.TX_POWER],),
        rx_power_mw=(values[Quantity.RX_POWER],),
        thresholds=thresholds,
        rx_power_is_average=bool(diagnostics & 0x08),
    )


# --- SFF-8636 / SFF-8436 ------------------------------------------------------------------------

_QSFP_LANES = 4
_QSFP_THRESHOLDS = {  # page 03h byte of the first (high alarm) limit
    Quantity.TEMPERATURE: 128,
    Quantity.VOLTAGE: 144,
    Quantity.RX_POWER: 176,
    Quantity.TX_BIAS: 184,
    Quantity.TX_POWER: 192,
}


def _decode_sff8636(data: bytes) -> Dom | None:
    if len(data) < 256:
        raise EepromError(f"SFF-8636 image is {len(data)} bytes; lower page and page 00h need 256")
    status = data[2]
    if status & 0x01:  # Data_Not_Ready: monitors are not valid yet (module still initialising)
        return None
    technology = data[147] >> 4
    if technology in (0xA, 0xB):  # passive copper: nothing to monitor, every field reads 0
        return None
    dom_type = data[220]
    optical = technology < 0xA  # active copper has electronics (temperature, Vcc) but no lasers
    thresholds: dict[Quantity, Thresholds] = {}
    # Page 03h exists only on paged modules (Flat_mem clear) and only if the driver read it.
    if not status & 0x04 and _has_page(data, 3):
        for quantity, byte in _QSFP_THRESHOLDS.items():
            if optical or quantity in (Quantity.TEMPERATURE, Quantity.VOLTAGE):
                raw = _raw_thresholds(data, _page(3, byte), signed=quantity is Quantity.TEMPERATURE)
                thresholds[quantity] = _scaled(raw, _QUANTITY_SCALE[quantity])
        if not dom_type & 0x04:
            thresholds.pop(Quantity.TX_POWER, None)
    return Dom(
        layout="sff8636",
        temperature_c=_s16(data, 22) / 256,
        voltage_v=_u16(data, 26) * 1e-4,
        rx_power_mw=_lanes(data, 34, _QSFP_LANES, 1e-4) if optical else (),
        tx_bias_ma=_lanes(data, 42, _QSFP_LANES, 2e-3) if optical else (),
        # Byte 220 bit 2: Tx power measured at all (many SR4 modules do not).
        tx_power_mw=_lanes(data, 50, _QSFP_LANES, 1e-4) if optical and dom_type & 0x04 else (),
        thresholds=thresholds,
        rx_power_is_average=bool(dom_type & 0x08),
    )


# --- CMIS ---------------------------------------------------------------------------------------

_CMIS_BANK_LANES = 8
_CMIS_THRESHOLDS = {  # page 02h byte of the first (high alarm) limit
    Quantity.TEMPERATURE: 128,
    Quantity.VOLTAGE: 136,
    Quantity.TX_POWER: 176,
    Quantity.TX_BIAS: 184,
    Quantity.RX_POWER: 192,
}
_CMIS_LANE_MONITORS = {  # page 11h byte of lane 1; (page 01h byte 160 support bit)
    Quantity.TX_POWER: (154, 0x02),
    Quantity.TX_BIAS: (170, 0x01),
    Quantity.RX_POWER: (186, 0x04),
}
_CMIS_BIAS_MULTIPLIER = {0: 1, 1: 2, 2: 4}


def _cmis_lane_count(data: bytes) -> int:
    """Media lanes of the first advertised application (byte 88, bits 3-0); 8 when unset."""
    count = data[88] & 0x0F
    return count if 1 <= count <= _CMIS_BANK_LANES else _CMIS_BANK_LANES


def _decode_cmis(data: bytes) -> Dom | None:
    if len(data) < 128:
        raise EepromError(f"CMIS image is {len(data)} bytes; the lower page needs 128")
    if data[2] & 0x80:  # flat memory: no pages, hence no diagnostics (passive copper)
        return None
    module_monitors = data[_page(1, 159)] if _has_page(data, 1) else 0x03
    lane_monitors = data[_page(1, 160)] if _has_page(data, 1) else 0
    # CMIS: Tx bias LSB is 2 uA times the multiplier advertised in page 01h byte 160 bits 4-3.
    bias_scale = 2e-3 * _CMIS_BIAS_MULTIPLIER.get((lane_monitors >> 3) & 0x03, 1)
    scales = {**_QUANTITY_SCALE, Quantity.TX_BIAS: bias_scale}
    supported = {
        Quantity.TEMPERATURE: bool(module_monitors & 0x01),
        Quantity.VOLTAGE: bool(module_monitors & 0x02),
        **{q: bool(lane_monitors & bit) for q, (_, bit) in _CMIS_LANE_MONITORS.items()},
    }
    lanes: dict[Quantity, tuple[float, ...]] = {}
    if _has_page(data, 0x11):
        count = _cmis_lane_count(data)
        for quantity, (byte, _) in _CMIS_LANE_MONITORS.items():
            if supported[quantity]:
                lanes[quantity] = _lanes(data, _page(0x11, byte), count, scales[quantity])
    thresholds: dict[Quantity, Thresholds] = {}
    if _has_page(data, 2):
        for quantity, byte in _CMIS_THRESHOLDS.items():
            if supported[quantity]:
                raw = _raw_thresholds(data, _page(2, byte), signed=quantity is Quantity.TEMPERATURE)
                thresholds[quantity] = _scaled(raw, scales[quantity])
    return Dom(
        layout="cmis",
        temperature_c=_s16(data, 14) / 256 if supported[Quantity.TEMPERATURE] else None,
        voltage_v=_u16(data, 16) * 1e-4 if supported[Quantity.VOLTAGE] else None,
        tx_bias_ma=lanes.get(Quantity.TX_BIAS, ()),
        tx_power_mw=lanes.get(Quantity.TX_POWER, ()),
        rx_power_mw=lanes.get(Quantity.RX_POWER, ()),
        thresholds=thresholds,
        rx_power_is_average=not _has_page(data, 1) or bool(data[_page(1, 151)] & 0x10),
    )


# --- dispatch -----------------------------------------------------------------------------------


def decode_dom(eeprom: ModuleEeprom) -> Dom | None:
    """Decode the diagnostics in ``eeprom``; None when the module has none to give.

    The driver's standard picks SFP or QSFP; for QSFP-class images the identifier byte
    then tells SFF-8636 from CMIS, because drivers that pass CMIS modules through the
    ioctl report them as SFF-8636 (the same rule ``ethtool -m`` follows).

    Raises:
        EepromError: the image is empty, too short for its layout, or its identifier
            does not belong to the layout.
    """
    data = eeprom.data
    if not data:
        raise EepromError("empty EEPROM image")
    if eeprom.standard is ModuleStandard.SFF_8079:
        return None
    if eeprom.standard is ModuleStandard.SFF_8472:
        return _decode_sff8472(data)
    if data[0] in _CMIS_IDS:
        return _decode_cmis(data)
    if eeprom.standard is ModuleStandard.CMIS:
        raise EepromError(f"identifier {data[0]:#04x} is not a CMIS module")
    if data[0] not in _QSFP_IDS:
        raise EepromError(f"identifier {data[0]:#04x} is not a QSFP module")
    return _decode_sff8636(data)
