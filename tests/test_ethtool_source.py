"""The ethtool source: PHY counters, bit error rates, module DOM, and its two backends.

Fixtures live in tests/fixtures/ethtool/ (see each folder's capture.txt): ``virtio_vm``
was captured on this VM with tests/tools/capture_ethtool.py; ``mlx5_qsfp28``,
``mlx5_osfp_cmis`` and ``bnxt_sfp28`` are modelled by model_fixtures.py; ``broken``
holds one malformed input of each kind. The real `IoctlEthtool` is exercised against
this machine's own interfaces.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from ridethrough.catalogue import metric, metrics_of
from ridethrough.collector import ethtool_ioctl
from ridethrough.collector.ethtool_ioctl import IoctlEthtool
from ridethrough.collector.optics import ModuleEeprom, ModuleStandard
from ridethrough.collector.registry import build_sources
from ridethrough.collector.sample import MetricKind, Sample, Source
from ridethrough.collector.sources.ethtool import (
    DirectoryEthtool,
    EthtoolBackend,
    EthtoolSource,
    PhyReading,
    bit_error_rates,
    parse_ethtool_stats,
)
from ridethrough.settings import AgentConfig
from tests.tools import capture_ethtool

FIXTURES = Path(__file__).parent / "fixtures" / "ethtool"
TREES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())
T0 = 1_700_000_000_000_000_000
SECOND = 1_000_000_000
IFACE = "network.interface.name"

Key = tuple[str, frozenset[tuple[str, str]]]


def index(samples: Iterable[Sample]) -> dict[Key, Sample]:
    """Samples by (name, attributes), failing on a duplicate series."""
    indexed: dict[Key, Sample] = {}
    for sample in samples:
        key = (sample.name, frozenset(sample.attributes.items()))
        assert key not in indexed, f"series emitted twice: {key}"
        indexed[key] = sample
    return indexed


ALIASES = {"counter": "ethtool.counter", "lane": "lane", "threshold": "optics.threshold",
           "quantity": "optics.quantity", "bits": "nic.phy.bits_source"}


def at(ifname: str, **extra: str) -> dict[str, str]:
    """Attributes of one series: the interface, plus ``counter=``, ``lane=``, ... (see ALIASES)."""
    return {IFACE: ifname, **{ALIASES[k]: v for k, v in extra.items()}}


def value(samples: Iterable[Sample], name: str, attributes: Mapping[str, str]) -> float | None:
    """One series' value; None when it was not emitted."""
    sample = index(samples).get((name, frozenset(attributes.items())))
    return None if sample is None else sample.value


def source(tree: str | Path, **kwargs: Any) -> EthtoolSource:
    """An ethtool source replaying a fixture tree (by name) or a folder."""
    root = tree if isinstance(tree, Path) else FIXTURES / tree
    return EthtoolSource(backend=DirectoryEthtool(root), **kwargs)


def copy_tree(name: str, tmp_path: Path) -> Path:
    root = tmp_path / name
    shutil.copytree(FIXTURES / name, root)
    return root


def write_stats(path: Path, stats: Mapping[str, int]) -> None:
    path.write_text(capture_ethtool.format_stats(dict(stats)))


def advance(root: Path, *, by: int = 1000) -> None:
    """Make every counter of every interface grow, as a second collection would see."""
    for stats_file in root.glob("*/stats.txt"):
        try:
            stats = parse_ethtool_stats(stats_file.read_text())
        except ValueError:
            continue
        write_stats(stats_file, {k: v + by * (1 + i) for i, (k, v) in enumerate(stats.items())})


# --- the catalogue contract, both ways -----------------------------------------------------------


def emitted(tmp_path: Path) -> Iterator[tuple[str, Sample]]:
    """(tree, sample) over two collections of every fixture tree, counters advancing between them."""
    for tree in TREES:
        root = copy_tree(tree, tmp_path)
        ethtool = source(root)
        yield from ((tree, s) for s in ethtool.collect(T0))
        advance(root)
        yield from ((tree, s) for s in ethtool.collect(T0 + SECOND))


def test_every_emitted_sample_is_catalogued_exactly(tmp_path: Path) -> None:
    for tree, sample in emitted(tmp_path):
        where = f"{sample.name} on {tree}"
        spec = metric(sample.name)
        assert spec.source == "ethtool", where
        assert (sample.unit, sample.kind) == (spec.unit, spec.kind), where
        assert sorted(sample.attributes) == sorted(spec.attributes), where
        assert all(isinstance(v, str) and v for v in sample.attributes.values()), where


def test_every_catalogued_metric_is_emitted_by_some_fixture(tmp_path: Path) -> None:
    seen = {sample.name for _, sample in emitted(tmp_path)}
    catalogued = {spec.name for spec in metrics_of("ethtool")}
    assert catalogued
    assert catalogued - seen == set()


def test_there_are_fixture_trees() -> None:
    assert {"virtio_vm", "mlx5_qsfp28", "mlx5_osfp_cmis", "bnxt_sfp28", "broken"} <= set(TREES)


# --- PHY counters --------------------------------------------------------------------------------


def test_is_a_source_with_its_name_and_interval() -> None:
    ethtool = source("virtio_vm", interval_s=5)
    assert isinstance(ethtool, Source)
    assert isinstance(DirectoryEthtool(FIXTURES / "virtio_vm"), EthtoolBackend)
    assert isinstance(IoctlEthtool(), EthtoolBackend)
    assert (ethtool.name, ethtool.interval_s) == ("ethtool", 5.0)
    with pytest.raises(ValueError, match="interval_s"):
        source("virtio_vm", interval_s=0)
    with pytest.raises(ValueError, match="optics_every"):
        source("virtio_vm", optics_every=0)


def test_captured_virtio_vm_has_no_phy_counters_and_no_module() -> None:
    ethtool = source("virtio_vm")
    assert DirectoryEthtool(FIXTURES / "virtio_vm").stats("eth0")["tx_kicks"] > 0
    assert ethtool.collect(T0) == []
    assert ethtool.errors_total == 0


def test_mlx5_phy_counters_as_read() -> None:
    samples = source("mlx5_qsfp28").collect(T0)
    port = "ens1f0np0"
    errors = "ridethrough.nic.phy.errors"
    assert value(samples, errors, at(port, counter="rx_crc_errors_phy")) == 17
    assert value(samples, errors, at(port, counter="rx_symbol_err_phy")) == 3
    assert value(samples, errors, at(port, counter="rx_pcs_symbol_err_phy")) == 5
    assert value(samples, "ridethrough.nic.phy.corrected_bits", at(port)) == 12_000_000
    assert value(samples, "ridethrough.nic.phy.received_bits", at(port)) == 8_640_000_000_000_000
    assert value(samples, "ridethrough.nic.phy.link_down_events", at(port)) == 2
    assert value(samples, "ridethrough.nic.phy.lane_errors", at(port, lane="0")) == 4_000_000
    assert value(samples, "ridethrough.nic.phy.lane_errors", at(port, lane="3")) == 2_500_000
    # Other stats (rx_discards_phy, rx_packets, ...) belong to no ethtool metric.
    assert not any(s.attributes.get("ethtool.counter") == "rx_discards_phy" for s in samples)
    # No rx_bits_phy on the second port: the counter is simply not there.
    assert value(samples, "ridethrough.nic.phy.received_bits", at("ens1f1np1")) is None
    assert all(s.kind is MetricKind.COUNTER for s in samples if s.name.startswith("ridethrough.nic.phy."))


def test_bnxt_fec_block_counters() -> None:
    samples = source("bnxt_sfp28").collect(T0)
    blocks = "ridethrough.nic.phy.fec_blocks"
    assert value(samples, blocks, at("ens3f0np0", counter="rx_fec_corrected_blocks")) == 8123
    assert value(samples, blocks, at("ens3f0np0", counter="rx_fec_uncorrectable_blocks")) == 1


def test_counter_reset_keeps_the_total_rising_and_counts_it(tmp_path: Path) -> None:
    root = copy_tree("mlx5_qsfp28", tmp_path)
    stats_file = root / "ens1f0np0" / "stats.txt"
    stats = parse_ethtool_stats(stats_file.read_text())
    ethtool = source(root)
    crc = at("ens1f0np0", counter="rx_crc_errors_phy")
    assert value(ethtool.collect(T0), "ridethrough.nic.phy.errors", crc) == 17
    write_stats(stats_file, {**stats, "rx_crc_errors_phy": 4})  # ethtool --reset, or a driver reload
    assert value(ethtool.collect(T0 + SECOND), "ridethrough.nic.phy.errors", crc) == 17 + 4
    write_stats(stats_file, {**stats, "rx_crc_errors_phy": 10})
    assert value(ethtool.collect(T0 + 2 * SECOND), "ridethrough.nic.phy.errors", crc) == 17 + 10
    assert ethtool.resets_total == 1
    assert ethtool.errors_total == 0


# --- bit error rates -----------------------------------------------------------------------------


def reading(t_s: float, corrected: int | None, uncorrected: int | None, bits: int | None,
            speed: int | None = None) -> PhyReading:
    return PhyReading(int(t_s * SECOND), corrected, uncorrected, bits, speed)


def test_ber_from_rx_bits_phy_deltas() -> None:
    rates = bit_error_rates(reading(0, 1000, 7, 10**15), reading(1, 3000, 8, 10**15 + 10**12))
    assert rates == ({"pre_fec": 2e-9, "post_fec": 1e-12}, "rx_bits_phy")


def test_ber_from_link_speed_when_the_driver_does_not_count_bits() -> None:
    # 100 Gbit/s for 2 s = 2e11 bits; 400 corrected bits -> 2e-9.
    rates = bit_error_rates(reading(0, 0, 0, None, 100_000), reading(2, 400, 0, None, 100_000))
    assert rates == ({"pre_fec": 2e-9, "post_fec": 0.0}, "link_speed")


@pytest.mark.parametrize(
    ("before", "after"),
    [
        (reading(0, 10, 1, 100), reading(0, 20, 1, 200)),  # no time passed
        (reading(0, 10, 1, 100), reading(1, 20, 1, 100)),  # no bits: link down
        (reading(0, 10, 1, 100), reading(1, 5, 1, 200)),  # corrected bits went down: a reset
        (reading(0, 10, 1, 100), reading(1, 20, 0, 200)),  # uncorrected went down
        (reading(0, 10, 1, 500), reading(1, 20, 1, 200)),  # bits went down
        (reading(0, 10, 1, None, None), reading(1, 20, 1, None, None)),  # speed unknown
        (reading(0, 10, 1, None, 25_000), reading(1, 20, 1, None, 100_000)),  # speed changed
        (reading(0, None, None, 100), reading(1, None, None, 200)),  # no error counters
    ],
)
def test_no_ber_without_a_clean_interval(before: PhyReading, after: PhyReading) -> None:
    assert bit_error_rates(before, after) is None


def test_ber_only_for_the_counters_present() -> None:
    rates = bit_error_rates(reading(0, 10, None, 100), reading(1, 30, None, 200))
    assert rates == ({"pre_fec": 0.2}, "rx_bits_phy")


def test_source_emits_ber_over_two_collections_with_known_deltas(tmp_path: Path) -> None:
    root = copy_tree("mlx5_qsfp28", tmp_path)
    ethtool = source(root)
    first = ethtool.collect(T0)
    assert not any(s.name.endswith("_ber") for s in first)  # first collection: no interval yet
    for port in ("ens1f0np0", "ens1f1np1"):
        stats_file = root / port / "stats.txt"
        stats = parse_ethtool_stats(stats_file.read_text())
        grown = {"rx_corrected_bits_phy": stats["rx_corrected_bits_phy"] + 500,
                 "rx_pcs_symbol_err_phy": stats["rx_pcs_symbol_err_phy"] + 1}
        if "rx_bits_phy" in stats:
            grown["rx_bits_phy"] = stats["rx_bits_phy"] + 10**11
        write_stats(stats_file, {**stats, **grown})
    second = ethtool.collect(T0 + 5 * SECOND)
    by_bits = [s for s in second if s.name.endswith("_ber") and s.attributes[IFACE] == "ens1f0np0"]
    assert {s.attributes["nic.phy.bits_source"] for s in by_bits} == {"rx_bits_phy"}
    rates = {s.name: s.value for s in by_bits}
    assert rates["ridethrough.nic.phy.pre_fec_ber"] == pytest.approx(500 / 1e11)
    assert rates["ridethrough.nic.phy.post_fec_ber"] == pytest.approx(1 / 1e11)
    # ens1f1np1 has no rx_bits_phy: 100 Gbit/s x 5 s = 5e11 bits.
    by_speed = {s.name: s for s in second if s.name.endswith("_ber") and s.attributes[IFACE] == "ens1f1np1"}
    assert by_speed["ridethrough.nic.phy.pre_fec_ber"].value == pytest.approx(500 / 5e11)
    assert by_speed["ridethrough.nic.phy.pre_fec_ber"].attributes["nic.phy.bits_source"] == "link_speed"
    assert by_speed["ridethrough.nic.phy.post_fec_ber"].value == pytest.approx(1 / 5e11)
    assert all(s.kind is MetricKind.GAUGE and s.unit == "1" for s in by_bits)


def test_no_ber_across_a_reset_then_it_resumes(tmp_path: Path) -> None:
    root = copy_tree("mlx5_qsfp28", tmp_path)
    stats_file = root / "ens1f0np0" / "stats.txt"
    stats = parse_ethtool_stats(stats_file.read_text())
    ethtool = source(root, include=["ens1f0np0"])
    ethtool.collect(T0)
    write_stats(stats_file, {**stats, "rx_corrected_bits_phy": 100, "rx_bits_phy": 10**9})  # reset
    assert not any(s.name.endswith("_ber") for s in ethtool.collect(T0 + SECOND))
    write_stats(stats_file, {**stats, "rx_corrected_bits_phy": 101, "rx_bits_phy": 2 * 10**9})
    pre = value(ethtool.collect(T0 + 2 * SECOND), "ridethrough.nic.phy.pre_fec_ber",
                at("ens1f0np0", bits="rx_bits_phy"))
    assert pre == pytest.approx(1e-9)


# --- module DOM ----------------------------------------------------------------------------------


def test_sff8636_dom_gauges_thresholds_and_alarms() -> None:
    samples = source("mlx5_qsfp28").collect(T0)
    port = "ens1f0np0"
    assert value(samples, "ridethrough.nic.optics.temperature", at(port)) == 38.5
    assert value(samples, "ridethrough.nic.optics.voltage", at(port)) == pytest.approx(3.3)
    assert value(samples, "ridethrough.nic.optics.rx_power", at(port, lane="1")) == pytest.approx(0.8e-3)  # W
    assert value(samples, "ridethrough.nic.optics.tx_bias", at(port, lane="2")) == pytest.approx(6.6e-3)  # A
    assert value(samples, "ridethrough.nic.optics.tx_power", at(port, lane="4")) == pytest.approx(0.7e-3)
    threshold = "ridethrough.nic.optics.rx_power_threshold"
    assert value(samples, threshold, at(port, threshold="low_warning")) == pytest.approx(0.1e-3)
    assert value(samples, threshold, at(port, threshold="high_alarm")) == pytest.approx(2.0e-3)
    assert value(samples, "ridethrough.nic.optics.module_alarm", at(port, quantity="temperature")) == 0
    lane_alarm = "ridethrough.nic.optics.lane_alarm"
    assert value(samples, lane_alarm, at(port, quantity="rx_power", lane="4")) == -1  # 0.08 < 0.1 mW
    assert value(samples, lane_alarm, at(port, quantity="rx_power", lane="1")) == 0
    # The passive DAC on the other port has no diagnostics at all.
    assert not any(s.name.startswith("ridethrough.nic.optics.") and s.attributes[IFACE] == "ens1f1np1"
                   for s in samples)


def test_cmis_dom_and_the_ioctl_shaped_image() -> None:
    samples = source("mlx5_osfp_cmis").collect(T0)
    full, ioctl = "ens2f0np0", "ens2f1np1"
    assert value(samples, "ridethrough.nic.optics.module_alarm", at(full, quantity="temperature")) == 1
    assert value(samples, "ridethrough.nic.optics.lane_alarm", at(full, quantity="rx_power", lane="3")) == -1
    assert value(samples, "ridethrough.nic.optics.tx_bias", at(full, lane="1")) == pytest.approx(8.0e-3)
    assert value(samples, "ridethrough.nic.optics.tx_bias", at(full, lane="5")) is None  # 4 media lanes
    assert value(samples, "ridethrough.nic.optics.temperature", at(ioctl)) == 61.25
    assert not any(s.attributes.get(IFACE) == "ens2f1np1" and ("lane" in s.attributes or "alarm" in s.name)
                   and s.name.startswith("ridethrough.nic.optics.") for s in samples)


def test_sff8472_dom_from_both_calibrations() -> None:
    samples = source("bnxt_sfp28").collect(T0)
    assert value(samples, "ridethrough.nic.optics.rx_power", at("ens3f0np0", lane="1")) == pytest.approx(0.43e-3)
    assert value(samples, "ridethrough.nic.optics.rx_power", at("ens3f1np1", lane="1")) == pytest.approx(0.401e-3)
    assert value(samples, "ridethrough.nic.optics.temperature", at("ens3f1np1")) == 39.0


def test_unprogrammed_thresholds_give_no_threshold_or_alarm(tmp_path: Path) -> None:
    root = copy_tree("bnxt_sfp28", tmp_path)
    eeprom = bytearray((root / "ens3f0np0" / "eeprom.bin").read_bytes())
    eeprom[256:296] = bytes(40)  # all A2h thresholds zero
    (root / "ens3f0np0" / "eeprom.bin").write_bytes(bytes(eeprom))
    samples = source(root, include=["ens3f0np0"]).collect(T0)
    assert value(samples, "ridethrough.nic.optics.temperature", at("ens3f0np0")) == 42.75
    assert not any(s.name.endswith(("_threshold", "_alarm")) for s in samples)


def test_optics_are_read_every_nth_collection() -> None:
    ethtool = source("mlx5_qsfp28", optics_every=3)

    def has_optics(samples: list[Sample]) -> bool:
        return any(s.name.startswith("ridethrough.nic.optics.") for s in samples)

    assert [has_optics(ethtool.collect(T0 + i * SECOND)) for i in range(4)] == [True, False, False, True]


# --- failures: skipped and counted, never raised ---------------------------------------------------


def test_broken_inputs_are_counted_and_the_rest_still_reported() -> None:
    ethtool = source("broken")
    samples = ethtool.collect(T0)
    # eth0 bad stats line, eth1 short EEPROM, eth2 identifier 0xff, eth3 no eeprom_type,
    # eth4 unknown eeprom_type, eth5 garbage speed.
    assert ethtool.errors_total == 6
    assert value(samples, "ridethrough.nic.phy.errors", at("eth6", counter="rx_crc_errors_phy")) == 1
    assert value(samples, "ridethrough.nic.phy.corrected_bits", at("eth5")) == 10
    ethtool.collect(T0 + SECOND)
    assert ethtool.errors_total == 12


def test_an_unlistable_backend_counts_one_error(tmp_path: Path) -> None:
    ethtool = source(tmp_path / "missing")
    assert ethtool.collect(T0) == []
    assert ethtool.errors_total == 1


def test_include_and_exclude_globs() -> None:
    names = {s.attributes[IFACE] for s in source("mlx5_qsfp28", include=["*f0*"]).collect(T0)}
    assert names == {"ens1f0np0"}
    names = {s.attributes[IFACE] for s in source("mlx5_qsfp28", exclude=["*f0*"]).collect(T0)}
    assert names == {"ens1f1np1"}


def test_parse_ethtool_stats() -> None:
    text = "NIC statistics:\n     rx_crc_errors_phy: 17\n\n     [0]: rx_ucast_packets: 5\n"
    assert parse_ethtool_stats(text) == {"rx_crc_errors_phy": 17, "[0]: rx_ucast_packets": 5}
    for bad in ("     rx_bits_phy: -3\n", "     rx_bits_phy: 1.5\n", "no colon here\n", "   : 5\n"):
        with pytest.raises(ValueError, match="line 1"):
            parse_ethtool_stats(bad)


# --- the real ioctl backend on this machine --------------------------------------------------------


def physical_interface() -> str:
    names = IoctlEthtool().interfaces()
    if not names:
        pytest.skip("no physical network interface on this machine")
    return str(names[0])


def test_ioctl_backend_reads_this_machines_stats() -> None:
    ifname = physical_interface()
    backend = IoctlEthtool()
    stats = backend.stats(ifname)
    assert stats, f"{ifname}: ethtool -S gave nothing"
    assert all(re.fullmatch(r"[\x20-\x7e]+", name) for name in stats)
    assert all(isinstance(v, int) and v >= 0 for v in stats.values())
    again = backend.stats(ifname)
    assert list(again) == list(stats)  # same names, same order
    backend.close()
    assert backend.stats(ifname).keys() == stats.keys()  # reopens its socket


def test_ioctl_backend_lists_physical_interfaces_only() -> None:
    everything = IoctlEthtool(physical_only=False).interfaces()
    physical = IoctlEthtool().interfaces()
    assert set(physical) <= set(everything)
    assert "lo" in everything and "lo" not in physical


def test_ioctl_backend_answers_quietly_where_there_is_nothing() -> None:
    backend = IoctlEthtool(physical_only=False)
    assert backend.stats("lo") == {}  # no ETH_SS_STATS set
    assert backend.module_eeprom("lo") is None
    assert backend.stats("ridethrough-nx0") == {}  # ENODEV: gone since it was listed
    assert backend.module_eeprom("ridethrough-nx0") is None
    assert backend.speed_mbps("ridethrough-nx0") is None


def test_ioctl_backend_backs_off_after_no_module(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real_ioctl = ethtool_ioctl.fcntl.ioctl

    def counting_ioctl(fd: int, request: int, arg: bytes) -> bytes:
        calls.append(request)
        result: bytes = real_ioctl(fd, request, arg)
        return result

    monkeypatch.setattr(ethtool_ioctl.fcntl, "ioctl", counting_ioctl)
    now = [1000.0]
    backend = IoctlEthtool(physical_only=False, module_retry_s=60.0, clock=lambda: now[0])
    assert backend.module_eeprom("lo") is None  # EOPNOTSUPP
    assert len(calls) == 1
    now[0] += 59.0
    assert backend.module_eeprom("lo") is None
    assert len(calls) == 1  # not asked again: mlx5 would log "cable type not recognized" each time
    now[0] += 1.0
    assert backend.module_eeprom("lo") is None
    assert len(calls) == 2


def test_ioctl_backend_module_eeprom_on_this_machine() -> None:
    ifname = physical_interface()
    eeprom = IoctlEthtool().module_eeprom(ifname)
    if Path(f"/sys/class/net/{ifname}/device/driver").resolve().name == "virtio_net":
        assert eeprom is None  # EOPNOTSUPP: no module to read on a virtual NIC
    else:
        assert eeprom is None or isinstance(eeprom, ModuleEeprom)


def test_source_with_the_real_backend_on_this_machine() -> None:
    physical_interface()
    (ethtool,) = build_sources(AgentConfig(sources=("ethtool",), interval_s=2))
    assert isinstance(ethtool, EthtoolSource) and ethtool.interval_s == 2.0
    for sample in ethtool.collect(T0):
        assert metric(sample.name).source == "ethtool"
    assert ethtool.errors_total == 0


# --- the capture tool ------------------------------------------------------------------------------


def test_capture_tool_records_what_the_backend_reads(tmp_path: Path) -> None:
    ifname = physical_interface()
    out = tmp_path / "capture"
    assert capture_ethtool.main(["--out", str(out), "--interface", ifname]) == 0
    replay = DirectoryEthtool(out)
    assert replay.interfaces() == [ifname]
    assert replay.stats(ifname).keys() == IoctlEthtool().stats(ifname).keys()
    manifest = (out / "capture.txt").read_text()
    assert "# kernel:" in manifest and ifname in manifest
    with pytest.raises(SystemExit):
        capture_ethtool.main(["--out", str(out)])  # exists, no --force


def test_capture_blanks_module_serial_numbers() -> None:
    for tree, ifname, start in (("mlx5_qsfp28", "ens1f0np0", 196), ("bnxt_sfp28", "ens3f0np0", 68),
                                ("mlx5_osfp_cmis", "ens2f1np1", 166)):
        folder = FIXTURES / tree / ifname
        data = bytearray((folder / "eeprom.bin").read_bytes())
        data[start:start + 16] = b"SN1234567890ABCD"
        standard = ModuleStandard((folder / "eeprom_type").read_text().strip())
        blanked = capture_ethtool.blank_serial(ModuleEeprom(standard, bytes(data)))
        assert blanked[start:start + 16] == b" " * 16, tree
        assert blanked[:start] == bytes(data[:start]) and blanked[start + 16:] == bytes(data[start + 16:])
