"""Module DOM decoding (collector/optics.py) against hand-computed values.

The modelled EEPROMs live in tests/fixtures/ethtool/ and are written by
tests/fixtures/ethtool/model_fixtures.py; each value below is worked out from the raw
bytes by hand, in the comment next to it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import struct
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ridethrough.collector.optics import (
    EepromError,
    ModuleEeprom,
    ModuleStandard,
    Quantity,
    Thresholds,
    decode_dom,
)

FIXTURES = Path(__file__).parent / "fixtures" / "ethtool"


def load(fixture: str, ifname: str) -> ModuleEeprom:
    folder = FIXTURES / fixture / ifname
    standard = ModuleStandard((folder / "eeprom_type").read_text().strip())
    return ModuleEeprom(standard, (folder / "eeprom.bin").read_bytes())


def patched(eeprom: ModuleEeprom, offset: int, fmt: str, *values: float) -> ModuleEeprom:
    data = bytearray(eeprom.data)
    struct.pack_into(">" + fmt, data, offset, *values)
    return ModuleEeprom(eeprom.standard, bytes(data))


def limits(thresholds: Thresholds) -> tuple[float, ...]:
    """High alarm, low alarm, high warning, low warning (pytest.approx cannot compare dataclasses)."""
    return tuple(value for _, value in thresholds.items())


def model() -> ModuleType:
    spec = importlib.util.spec_from_file_location("model_fixtures", FIXTURES / "model_fixtures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_modelled_fixtures_are_what_the_model_writes() -> None:
    for name, files in model().fixtures().items():
        for relative, content in files.items():
            path = FIXTURES / name / relative
            expected = content if isinstance(content, bytes) else content.encode()
            assert path.read_bytes() == expected, f"{path} differs; rerun model_fixtures.py"


def test_module_standard_from_the_ioctl_code() -> None:
    assert ModuleStandard.from_ethtool(1) is ModuleStandard.SFF_8079
    assert ModuleStandard.from_ethtool(2) is ModuleStandard.SFF_8472
    assert ModuleStandard.from_ethtool(3) is ModuleStandard.SFF_8636
    assert ModuleStandard.from_ethtool(4) is ModuleStandard.SFF_8436
    with pytest.raises(ValueError, match="0x9"):
        ModuleStandard.from_ethtool(9)


# --- SFF-8636 -----------------------------------------------------------------------------------


def test_sff8636_monitors_by_hand() -> None:
    eeprom = load("mlx5_qsfp28", "ens1f0np0")
    assert len(eeprom.data) == 640  # lower page + upper pages 00h-03h, as mlx5 returns it
    data = eeprom.data
    assert data[22:24] == b"\x26\x80"  # 0x2680 = 9856; 9856 / 256 = 38.5 degC
    assert data[26:28] == b"\x80\xe8"  # 0x80e8 = 33000; x 100 uV = 3.3 V
    assert data[34:36] == b"\x1f\x40"  # Rx lane 1: 8000 x 0.1 uW = 0.8 mW
    assert data[42:44] == b"\x0c\xb2"  # bias lane 1: 3250 x 2 uA = 6.5 mA
    dom = decode_dom(eeprom)
    assert dom is not None and dom.layout == "sff8636"
    assert dom.temperature_c == 38.5
    assert dom.voltage_v == pytest.approx(3.3)
    assert dom.rx_power_mw == pytest.approx((0.8, 0.75, 0.9, 0.08))
    assert dom.tx_bias_ma == pytest.approx((6.5, 6.6, 6.4, 6.5))
    assert dom.tx_power_mw == pytest.approx((0.7, 0.72, 0.68, 0.7))
    assert dom.rx_power_is_average


def test_sff8636_thresholds_come_from_page_03h_at_512() -> None:
    eeprom = load("mlx5_qsfp28", "ens1f0np0")
    # Page 03h byte 128 sits at 3 x 128 + 128 = 512: 0x4b00 = 19200 / 256 = 75 degC.
    assert eeprom.data[512:514] == b"\x4b\x00"
    dom = decode_dom(eeprom)
    assert dom is not None
    assert dom.thresholds[Quantity.TEMPERATURE] == Thresholds(75.0, -5.0, 70.0, 0.0)
    assert limits(dom.thresholds[Quantity.VOLTAGE]) == pytest.approx((3.63, 2.97, 3.465, 3.135))
    assert limits(dom.thresholds[Quantity.RX_POWER]) == pytest.approx((2.0, 0.05, 1.5, 0.1))
    assert limits(dom.thresholds[Quantity.TX_BIAS]) == pytest.approx((12.0, 2.0, 10.0, 3.0))
    assert limits(dom.thresholds[Quantity.TX_POWER]) == pytest.approx((2.0, 0.1, 1.5, 0.2))


def test_sff8636_negative_temperature_is_signed() -> None:
    eeprom = patched(load("mlx5_qsfp28", "ens1f0np0"), 22, "h", -1280)  # 0xfb00
    dom = decode_dom(eeprom)
    assert dom is not None and dom.temperature_c == -5.0


def test_sff8636_without_tx_power_measurement_reports_no_tx_power() -> None:
    eeprom = load("mlx5_qsfp28", "ens1f0np0")
    data = bytearray(eeprom.data)
    data[220] = 0x08  # average Rx power, Tx power not measured
    dom = decode_dom(ModuleEeprom(eeprom.standard, bytes(data)))
    assert dom is not None
    assert dom.tx_power_mw == ()
    assert Quantity.TX_POWER not in dom.thresholds
    assert len(dom.rx_power_mw) == 4


def test_sff8636_without_page_03h_has_no_thresholds() -> None:
    full = load("mlx5_qsfp28", "ens1f0np0")
    short = decode_dom(ModuleEeprom(full.standard, full.data[:256]))
    assert short is not None and short.thresholds == {} and short.temperature_c == 38.5
    flat = bytearray(full.data)
    flat[2] |= 0x04  # Flat_mem: the module has no page 03h, whatever the driver padded
    decoded = decode_dom(ModuleEeprom(full.standard, bytes(flat)))
    assert decoded is not None and decoded.thresholds == {}


def test_sff8636_data_not_ready_and_passive_copper_have_no_dom() -> None:
    eeprom = load("mlx5_qsfp28", "ens1f0np0")
    not_ready = bytearray(eeprom.data)
    not_ready[2] |= 0x01
    assert decode_dom(ModuleEeprom(eeprom.standard, bytes(not_ready))) is None
    assert decode_dom(load("mlx5_qsfp28", "ens1f1np1")) is None  # DAC: technology 0xA


def test_sff8636_active_copper_has_module_monitors_only() -> None:
    eeprom = load("mlx5_qsfp28", "ens1f0np0")
    data = bytearray(eeprom.data)
    data[147] = 0xC0  # copper, near and far end limiting active equalizers
    dom = decode_dom(ModuleEeprom(eeprom.standard, bytes(data)))
    assert dom is not None
    assert dom.temperature_c == 38.5
    assert (dom.tx_bias_ma, dom.tx_power_mw, dom.rx_power_mw) == ((), (), ())
    assert set(dom.thresholds) == {Quantity.TEMPERATURE, Quantity.VOLTAGE}


def test_sff8436_decodes_like_sff8636() -> None:
    eeprom = load("mlx5_qsfp28", "ens1f0np0")
    dom = decode_dom(ModuleEeprom(ModuleStandard.SFF_8436, eeprom.data))
    assert dom is not None and dom.temperature_c == 38.5


# --- CMIS ---------------------------------------------------------------------------------------


def test_cmis_full_image_by_hand() -> None:
    eeprom = load("mlx5_osfp_cmis", "ens2f0np0")
    data = eeprom.data
    assert len(data) == 2432  # flat image up to page 11h: 17 x 128 + 256
    assert data[14:16] == b"\x3d\x40"  # 15680 / 256 = 61.25 degC
    assert data[88] == 0x44  # application 1: 4 host lanes, 4 media lanes
    assert data[128 + 160] == 0x0F  # page 01h byte 160: bias, Tx and Rx power monitored; bias x2
    # Page 11h byte 170 (bias, lane 1) sits at 17 x 128 + 170 = 2346: 2000 x 2 uA x 2 = 8.0 mA.
    assert data[2346:2348] == b"\x07\xd0"
    dom = decode_dom(eeprom)
    assert dom is not None and dom.layout == "cmis"
    assert dom.temperature_c == 61.25
    assert dom.voltage_v == pytest.approx(3.29)
    assert dom.tx_bias_ma == pytest.approx((8.0, 8.2, 7.9, 8.1))
    assert dom.tx_power_mw == pytest.approx((1.2, 1.25, 1.18, 1.22))
    assert dom.rx_power_mw == pytest.approx((0.9, 0.95, 0.12, 0.88))
    assert dom.thresholds[Quantity.TEMPERATURE] == Thresholds(70.0, -5.0, 60.0, 0.0)
    assert limits(dom.thresholds[Quantity.TX_BIAS]) == pytest.approx((15.0, 2.0, 13.0, 3.0))
    assert limits(dom.thresholds[Quantity.RX_POWER]) == pytest.approx((3.0, 0.1, 2.5, 0.15))


def test_cmis_lane_count_defaults_to_a_full_bank() -> None:
    eeprom = patched(load("mlx5_osfp_cmis", "ens2f0np0"), 88, "B", 0x00)
    dom = decode_dom(eeprom)
    assert dom is not None and len(dom.rx_power_mw) == 8 and dom.rx_power_mw[4:] == (0.0,) * 4


def test_cmis_through_the_ioctl_gives_module_monitors_only() -> None:
    dom = decode_dom(load("mlx5_osfp_cmis", "ens2f1np1"))  # 256 bytes, passed through as SFF-8636
    assert dom is not None and dom.layout == "cmis"
    assert (dom.temperature_c, dom.voltage_v) == (61.25, pytest.approx(3.29))
    assert (dom.tx_bias_ma, dom.rx_power_mw, dom.thresholds) == ((), (), {})


def test_cmis_respects_monitor_support_bits_and_flat_memory() -> None:
    eeprom = load("mlx5_osfp_cmis", "ens2f0np0")
    no_tx_power = patched(eeprom, 128 + 160, "B", 0x0D)  # bit 1 (Tx power) clear
    dom = decode_dom(no_tx_power)
    assert dom is not None and dom.tx_power_mw == () and Quantity.TX_POWER not in dom.thresholds
    assert len(dom.tx_bias_ma) == 4
    no_temperature = decode_dom(patched(eeprom, 128 + 159, "B", 0x02))
    assert no_temperature is not None and no_temperature.temperature_c is None
    assert Quantity.TEMPERATURE not in no_temperature.thresholds
    assert decode_dom(patched(eeprom, 2, "B", 0x80)) is None  # flat memory


def test_cmis_standard_with_a_non_cmis_identifier_is_an_error() -> None:
    eeprom = load("mlx5_qsfp28", "ens1f0np0")
    with pytest.raises(EepromError, match="not a CMIS module"):
        decode_dom(ModuleEeprom(ModuleStandard.CMIS, eeprom.data))


# --- SFF-8472 -----------------------------------------------------------------------------------


def test_sff8472_internal_calibration_by_hand() -> None:
    eeprom = load("bnxt_sfp28", "ens3f0np0")
    a2 = eeprom.data[256:]
    assert a2[96:98] == b"\x2a\xc0"  # 10944 / 256 = 42.75 degC
    assert a2[104:106] == b"\x10\xcc"  # 4300 x 0.1 uW = 0.43 mW
    dom = decode_dom(eeprom)
    assert dom is not None and dom.layout == "sff8472"
    assert dom.temperature_c == 42.75
    assert dom.voltage_v == pytest.approx(3.31)
    assert dom.tx_bias_ma == pytest.approx((7.2,))
    assert dom.tx_power_mw == pytest.approx((0.55,))
    assert dom.rx_power_mw == pytest.approx((0.43,))
    assert dom.thresholds[Quantity.TEMPERATURE] == Thresholds(78.0, -13.0, 73.0, -8.0)
    assert limits(dom.thresholds[Quantity.RX_POWER]) == pytest.approx((1.5, 0.02, 1.2, 0.04))


def test_sff8472_external_calibration_by_hand() -> None:
    dom = decode_dom(load("bnxt_sfp28", "ens3f1np1"))
    assert dom is not None
    assert dom.temperature_c == 39.0  # (1.0 x 10240 - 256) / 256
    assert dom.voltage_v == pytest.approx(3.3)  # 1.0 x 33000 + 0
    assert dom.tx_bias_ma == pytest.approx((6.0,))  # 1.5 x 2000 = 3000 x 2 uA
    assert dom.tx_power_mw == pytest.approx((0.51,))  # 1.0 x 5000 + 100 = 5100 x 0.1 uW
    assert dom.rx_power_mw == pytest.approx((0.401,))  # 0.5 x 8000 + 10 = 4010 x 0.1 uW
    assert dom.thresholds[Quantity.TEMPERATURE] == Thresholds(79.0, -5.0, 74.0, -1.0)
    assert limits(dom.thresholds[Quantity.TX_BIAS]) == pytest.approx((18.0, 1.2, 15.0, 2.4))
    assert limits(dom.thresholds[Quantity.RX_POWER]) == pytest.approx((1.5, 0.02, 1.2, 0.04))


def test_sff8472_calibrated_power_never_goes_negative() -> None:
    eeprom = patched(load("bnxt_sfp28", "ens3f1np1"), 256 + 82, "h", -20000)  # Tx power offset
    dom = decode_dom(eeprom)
    assert dom is not None and dom.tx_power_mw == (0.0,)


def test_sff8472_nan_calibration_is_an_error() -> None:
    eeprom = patched(load("bnxt_sfp28", "ens3f1np1"), 256 + 72, "f", math.nan)
    with pytest.raises(EepromError, match="calibration"):
        decode_dom(eeprom)


def test_sfp_without_a2h_or_without_diagnostics_has_no_dom() -> None:
    eeprom = load("bnxt_sfp28", "ens3f0np0")
    assert decode_dom(ModuleEeprom(ModuleStandard.SFF_8472, eeprom.data[:256])) is None  # A0h-only drivers
    assert decode_dom(patched(eeprom, 92, "B", 0x00)) is None
    assert decode_dom(ModuleEeprom(ModuleStandard.SFF_8079, eeprom.data[:256])) is None


# --- malformed images ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("standard", "data", "message"),
    [
        (ModuleStandard.SFF_8636, b"", "empty"),
        (ModuleStandard.SFF_8636, b"\x11" * 100, "need 256"),
        (ModuleStandard.SFF_8636, b"\xff" * 256, "not a QSFP"),
        (ModuleStandard.SFF_8636, b"\x00" * 256, "not a QSFP"),
        (ModuleStandard.SFF_8472, b"\x03" * 200, "needs 256"),
        (ModuleStandard.SFF_8472, b"\x11" + bytes(511), "not an SFP"),
        (ModuleStandard.CMIS, b"\x18" * 64, "needs 128"),
    ],
)
def test_malformed_images_raise_eeprom_error(standard: ModuleStandard, data: bytes, message: str) -> None:
    with pytest.raises(EepromError, match=message):
        decode_dom(ModuleEeprom(standard, data))


@given(st.sampled_from(list(ModuleStandard)), st.binary(max_size=2600))
def test_any_bytes_decode_or_raise_eeprom_error(standard: ModuleStandard, data: bytes) -> None:
    with contextlib.suppress(EepromError):
        decode_dom(ModuleEeprom(standard, data))


@given(st.sampled_from([0x03, 0x11, 0x18, 0x19]), st.binary(min_size=2431, max_size=2431))
def test_plausible_identifiers_with_random_pages_never_crash(identifier: int, rest: bytes) -> None:
    data = bytes([identifier]) + rest
    for standard in ModuleStandard:
        try:
            dom = decode_dom(ModuleEeprom(standard, data))
        except EepromError:
            continue
        if dom is not None:
            assert all(math.isfinite(v) for v in (*dom.tx_bias_ma, *dom.rx_power_mw, *dom.tx_power_mw))


# --- thresholds ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "state"),
    [(76.0, 2), (75.0, 1), (71.0, 1), (70.0, 0), (30.0, 0), (0.0, 0), (-1.0, -1), (-5.0, -1), (-6.0, -2)],
)
def test_threshold_state(value: float, state: int) -> None:
    assert Thresholds(high_alarm=75.0, low_alarm=-5.0, high_warning=70.0, low_warning=0.0).state(value) == state


def test_thresholds_usable_only_when_programmed_and_ordered() -> None:
    assert Thresholds(75.0, -5.0, 70.0, 0.0).usable()
    assert Thresholds(2.0, 0.0, 1.5, 0.0).usable()  # a zero low limit is a real limit
    assert not Thresholds(0.0, 0.0, 0.0, 0.0).usable()
    assert not Thresholds(70.0, -5.0, 75.0, 0.0).usable()  # warning above alarm
    names = [name for name, _ in Thresholds(1.0, 2.0, 3.0, 4.0).items()]
    assert names == ["high_alarm", "low_alarm", "high_warning", "low_warning"]
