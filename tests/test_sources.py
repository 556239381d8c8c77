"""The netdev and infiniband sources, and the counter tracker behind them.

Fixture trees live in tests/fixtures/sysfs/ (see each tree's capture.txt):
``virtio_vm`` was captured from a real VM with tests/tools/capture_sysfs.py;
``ib_host`` adds a modeled mlx5 InfiniBand port to a captured eth0/lo;
``roce_host`` is a modeled mlx5 RoCE host; ``broken`` holds one malformed
value of each kind.
"""

from __future__ import annotations

import errno
import importlib.util
import itertools
import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ridethrough.collector.counters import CounterTracker, parse_counter
from ridethrough.collector.sample import MetricKind, Sample, Source
from ridethrough.collector.sources import InfinibandSource, NetdevSource
from ridethrough.collector.sources import _sysfs as sysfs_module
from ridethrough.collector.sources.infiniband import parse_numbered_state, parse_rate
from ridethrough.collector.sources.netdev import parse_carrier, parse_speed

FIXTURES = Path(__file__).parent / "fixtures" / "sysfs"
NOW_NS = 1_700_000_000_000_000_000


def _key(name: str, attributes: Mapping[str, str]) -> tuple[str, frozenset[tuple[str, str]]]:
    return (name, frozenset(attributes.items()))


def index(samples: Iterable[Sample]) -> dict[tuple[str, frozenset[tuple[str, str]]], Sample]:
    """Samples by (name, attributes), failing on a duplicate series."""
    indexed: dict[tuple[str, frozenset[tuple[str, str]]], Sample] = {}
    for sample in samples:
        key = _key(sample.name, sample.attributes)
        assert key not in indexed, f"series emitted twice: {key}"
        indexed[key] = sample
    return indexed


def value(samples: Iterable[Sample], name: str, attributes: Mapping[str, str]) -> float | None:
    """The value of one series, None when it was not emitted."""
    sample = index(samples).get(_key(name, attributes))
    return None if sample is None else sample.value


def iface(name: str, **extra: str) -> dict[str, str]:
    """netdev attributes: the interface, plus ``direction`` or ``counter`` when given."""
    attributes = {"network.interface.name": name}
    if "direction" in extra:
        attributes["network.io.direction"] = extra["direction"]
    if "counter" in extra:
        attributes["nic.counter"] = extra["counter"]
    return attributes


def copy_fixture(name: str, tmp_path: Path) -> Path:
    root = tmp_path / name
    shutil.copytree(FIXTURES / name, root)
    return root


def write(path: Path, text: str) -> None:
    path.write_text(text)


# --- CounterTracker ---------------------------------------------------------------------------


def test_first_reading_is_the_baseline_and_deltas_add() -> None:
    tracker = CounterTracker()
    assert tracker.observe("m", {"a": "1"}, 1000) == 1000
    assert tracker.observe("m", {"a": "1"}, 1500) == 1500
    assert tracker.observe("m", {"a": "1"}, 1500) == 1500
    assert tracker.resets_total == 0


def test_a_value_going_down_is_a_reset_and_the_new_value_is_added_whole() -> None:
    tracker = CounterTracker()
    tracker.observe("m", {}, 1000)
    assert tracker.observe("m", {}, 30) == 1030
    assert tracker.observe("m", {}, 50) == 1050
    assert tracker.observe("m", {}, 0) == 1050
    assert tracker.resets_total == 2


def test_series_are_keyed_by_name_and_attributes_in_any_order() -> None:
    tracker = CounterTracker()
    tracker.observe("m", {"a": "1", "b": "2"}, 10)
    assert tracker.observe("m", {"b": "2", "a": "1"}, 15) == 15
    assert tracker.observe("m", {"a": "1", "b": "3"}, 7) == 7
    assert tracker.observe("n", {"a": "1", "b": "2"}, 3) == 3
    assert len(tracker) == 3


def test_series_idle_for_max_idle_collections_are_forgotten() -> None:
    tracker = CounterTracker(max_idle_collections=2)
    tracker.observe("gone", {}, 100)
    tracker.observe("kept", {}, 100)
    assert tracker.end_collection() == 0
    tracker.observe("kept", {}, 110)
    assert tracker.end_collection() == 0  # "gone" idle for 1 collection
    tracker.observe("kept", {}, 120)
    assert tracker.end_collection() == 1  # idle for 2: forgotten
    assert len(tracker) == 1
    # Back after being forgotten: a fresh baseline, not a reset.
    assert tracker.observe("gone", {}, 5) == 5
    assert tracker.resets_total == 0


def test_negative_raw_value_and_bad_idle_limit_are_rejected() -> None:
    with pytest.raises(ValueError, match="negative"):
        CounterTracker().observe("m", {}, -1)
    with pytest.raises(ValueError, match="max_idle_collections"):
        CounterTracker(max_idle_collections=0)


@given(st.lists(st.integers(min_value=0, max_value=2**64 - 1), min_size=1, max_size=50))
def test_totals_never_go_down_and_count_every_increment(readings: list[int]) -> None:
    tracker = CounterTracker()
    totals = [tracker.observe("m", {}, raw) for raw in readings]
    assert all(later >= earlier for earlier, later in itertools.pairwise(totals))
    expected = readings[0] + sum(
        (now - before) if now >= before else now for before, now in itertools.pairwise(readings)
    )
    assert totals[-1] == expected
    assert tracker.resets_total == sum(1 for a, b in itertools.pairwise(readings) if b < a)


@pytest.mark.parametrize("text", ["", "\n", "12x34\n", "-5\n", "1_000\n", "0x10\n", "1.5\n", "\u0661\n"])
def test_parse_counter_rejects_anything_but_an_unsigned_decimal(text: str) -> None:
    with pytest.raises(ValueError):
        parse_counter(text)


def test_parse_counter_reads_kernel_output() -> None:
    assert parse_counter("351884869\n") == 351884869
    assert parse_counter("18446744073709551615\n") == 2**64 - 1


# --- netdev parsers -----------------------------------------------------------------------------


def test_netdev_parsers() -> None:
    assert parse_speed("100000\n") == 100000
    assert parse_speed("-1\n") is None
    with pytest.raises(ValueError):
        parse_speed("fast\n")
    assert parse_carrier("1\n") == 1
    assert parse_carrier("0\n") == 0
    with pytest.raises(ValueError):
        parse_carrier("2\n")


# --- NetdevSource on fixtures --------------------------------------------------------------------


def test_netdev_is_a_source_with_its_name_and_interval() -> None:
    source = NetdevSource(sysfs_root=FIXTURES / "virtio_vm", interval_s=5)
    assert isinstance(source, Source)
    assert (source.name, source.interval_s) == ("netdev", 5.0)
    with pytest.raises(ValueError, match="interval_s"):
        NetdevSource(sysfs_root="/sys", interval_s=0)


def test_netdev_reads_a_captured_virtio_vm_exactly() -> None:
    source = NetdevSource(sysfs_root=FIXTURES / "virtio_vm")
    samples = source.collect(NOW_NS)
    expected = {
        ("system.network.io", "receive"): 356435584,
        ("system.network.io", "transmit"): 422772,
        ("system.network.packet.count", "receive"): 8428,
        ("system.network.packet.count", "transmit"): 4691,
        ("system.network.errors", "receive"): 0,
        ("system.network.errors", "transmit"): 0,
        ("system.network.packet.dropped", "receive"): 0,
        ("system.network.packet.dropped", "transmit"): 0,
    }
    by_series = index(samples)
    for (name, direction), raw in expected.items():
        sample = by_series[_key(name, iface("eth0", direction=direction))]
        assert sample.value == raw
        assert sample.kind is MetricKind.COUNTER
    assert value(samples, "ridethrough.nic.carrier_changes", iface("eth0")) == 2
    assert value(samples, "ridethrough.nic.up", iface("eth0")) == 1
    assert value(samples, "ridethrough.nic.mtu", iface("eth0")) == 1400
    # virtio reports speed -1 (unknown): omitted, not zero.
    assert value(samples, "ridethrough.nic.speed", iface("eth0")) is None
    # ifb0 is admin-down: carrier and speed failed EINVAL at capture (see capture.txt).
    assert value(samples, "ridethrough.nic.up", iface("ifb0")) == 0
    assert value(samples, "ridethrough.nic.mtu", iface("ifb0")) == 1500
    assert source.errors_total == 0


def test_netdev_puts_unmapped_statistics_under_nic_stat() -> None:
    samples = NetdevSource(sysfs_root=FIXTURES / "virtio_vm").collect(NOW_NS)
    stats = {
        s.attributes["nic.counter"]
        for s in samples
        if s.name == "ridethrough.nic.stat" and s.attributes["network.interface.name"] == "eth0"
    }
    files = set(os.listdir(FIXTURES / "virtio_vm/class/net/eth0/statistics"))
    mapped = {f"{d}_{k}" for d in ("rx", "tx") for k in ("bytes", "packets", "errors", "dropped")}
    assert stats == files - mapped
    assert {"rx_crc_errors", "collisions", "tx_carrier_errors"} <= stats


def test_netdev_reads_a_roce_host_and_skips_plain_files_in_class_net() -> None:
    source = NetdevSource(sysfs_root=FIXTURES / "roce_host")
    samples = source.collect(NOW_NS)
    assert value(samples, "ridethrough.nic.speed", iface("ens1f0np0")) == 200000
    assert value(samples, "ridethrough.nic.mtu", iface("ens1f0np0")) == 9000
    crc = value(samples, "ridethrough.nic.stat", iface("ens1f0np0", counter="rx_crc_errors"))
    assert crc == 17
    assert value(samples, "ridethrough.nic.up", iface("docker0")) == 0
    names = {s.attributes["network.interface.name"] for s in samples}
    assert names == {"ens1f0np0", "docker0"}  # lo excluded, bonding_masters is a file
    assert source.errors_total == 0


@pytest.mark.parametrize(
    ("include", "exclude", "expected"),
    [
        (None, ("lo",), {"eth0", "ifb0", "ifb1"}),
        (None, (), {"eth0", "ifb0", "ifb1", "lo"}),
        (["eth*"], ("lo",), {"eth0"}),
        (None, ["ifb*"], {"eth0", "lo"}),
        (["ifb*", "lo"], ["ifb1"], {"ifb0", "lo"}),
        (["lo"], ("lo",), set()),  # exclude wins
    ],
)
def test_netdev_include_and_exclude_globs(
    include: list[str] | None, exclude: tuple[str, ...], expected: set[str]
) -> None:
    source = NetdevSource(sysfs_root=FIXTURES / "virtio_vm", include=include, exclude=exclude)
    names = {s.attributes["network.interface.name"] for s in source.collect(NOW_NS)}
    assert names == expected


def test_netdev_counter_reset_keeps_the_total_rising(tmp_path: Path) -> None:
    root = copy_fixture("virtio_vm", tmp_path)
    rx_bytes = root / "class/net/eth0/statistics/rx_bytes"
    source = NetdevSource(sysfs_root=root)
    series = _key("system.network.io", iface("eth0", direction="receive"))
    assert index(source.collect(NOW_NS))[series].value == 356435584
    write(rx_bytes, "1000\n")  # driver reloaded: counters restart from zero
    assert index(source.collect(NOW_NS))[series].value == 356435584 + 1000
    write(rx_bytes, "1500\n")
    assert index(source.collect(NOW_NS))[series].value == 356435584 + 1500
    assert source.resets_total == 1
    assert source.errors_total == 0


def test_netdev_broken_tree_yields_the_good_values_and_counts_errors() -> None:
    source = NetdevSource(sysfs_root=FIXTURES / "broken")
    samples = source.collect(NOW_NS)
    rx, tx = iface("eth0", direction="receive"), iface("eth0", direction="transmit")
    assert value(samples, "system.network.packet.count", rx) == 100
    assert value(samples, "system.network.packet.count", tx) == 200
    assert value(samples, "system.network.errors", tx) == 0
    assert value(samples, "system.network.io", rx) is None  # "12x34"
    assert value(samples, "system.network.io", tx) is None  # empty file
    assert value(samples, "system.network.errors", rx) is None  # "-5"
    assert value(samples, "ridethrough.nic.speed", iface("eth0")) is None  # "fast"
    assert value(samples, "ridethrough.nic.up", iface("eth0")) == 1
    assert value(samples, "ridethrough.nic.carrier_changes", iface("eth0")) == 3
    # eth1 has no statistics/ at all but its link state still reads.
    assert value(samples, "ridethrough.nic.up", iface("eth1")) == 0
    assert value(samples, "ridethrough.nic.mtu", iface("eth1")) == 1500
    assert source.errors_total == 5
    source.collect(NOW_NS)
    assert source.errors_total == 10


def test_netdev_interface_vanishing_between_collects(tmp_path: Path) -> None:
    root = copy_fixture("virtio_vm", tmp_path)
    eth0 = root / "class/net/eth0"
    saved = tmp_path / "eth0"
    source = NetdevSource(sysfs_root=root, max_idle_collections=2)
    series = _key("system.network.io", iface("eth0", direction="receive"))
    assert series in index(source.collect(NOW_NS))
    shutil.move(eth0, saved)
    samples = source.collect(NOW_NS)
    assert not any(s.attributes["network.interface.name"] == "eth0" for s in samples)
    assert source.errors_total == 0
    # Back after one collection with a smaller counter: remembered, so a reset.
    shutil.move(saved, eth0)
    write(eth0 / "statistics/rx_bytes", "10\n")
    assert index(source.collect(NOW_NS))[series].value == 356435584 + 10
    assert source.resets_total == 1
    # Gone for max_idle_collections collections: forgotten, so back as a fresh baseline.
    shutil.move(eth0, saved)
    source.collect(NOW_NS)
    source.collect(NOW_NS)
    shutil.move(saved, eth0)
    write(eth0 / "statistics/rx_bytes", "4\n")
    assert index(source.collect(NOW_NS))[series].value == 4
    assert source.resets_total == 1


def test_netdev_file_or_interface_vanishing_mid_read_is_skipped_quietly(tmp_path: Path) -> None:
    root = copy_fixture("virtio_vm", tmp_path)
    # Listed, then gone when read: ENOENT, exactly what a dangling link gives.
    rx_bytes = root / "class/net/eth0/statistics/rx_bytes"
    rx_bytes.unlink()
    rx_bytes.symlink_to(tmp_path / "no-such-file")
    (root / "class/net/ghost0").symlink_to(tmp_path / "no-such-device")
    source = NetdevSource(sysfs_root=root)
    samples = source.collect(NOW_NS)
    assert value(samples, "system.network.io", iface("eth0", direction="receive")) is None
    assert value(samples, "system.network.io", iface("eth0", direction="transmit")) == 422772
    assert not any(s.attributes["network.interface.name"] == "ghost0" for s in samples)
    assert source.errors_total == 0


def test_netdev_unreadable_file_is_counted_not_raised(tmp_path: Path) -> None:
    root = copy_fixture("virtio_vm", tmp_path)
    mtu = root / "class/net/eth0/mtu"
    mtu.unlink()
    mtu.mkdir()  # EISDIR: stands in for EACCES/EIO, which root cannot be denied
    source = NetdevSource(sysfs_root=root)
    samples = source.collect(NOW_NS)
    assert value(samples, "ridethrough.nic.mtu", iface("eth0")) is None
    assert value(samples, "ridethrough.nic.up", iface("eth0")) == 1
    assert source.errors_total == 1


def _fail_reads(monkeypatch: pytest.MonkeyPatch, failures: Mapping[str, int]) -> None:
    """Make reads of files named in ``failures`` raise OSError with that errno, as the kernel does."""
    real = sysfs_module.read_sysfs_text

    def read(path: str | Path) -> str:
        name = os.path.basename(path)
        if name in failures:
            code = failures[name]
            raise OSError(code, os.strerror(code), str(path))
        text: str = real(path)
        return text

    monkeypatch.setattr(sysfs_module, "read_sysfs_text", read)


def test_netdev_einval_on_carrier_and_speed_means_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    _fail_reads(monkeypatch, {"carrier": errno.EINVAL, "speed": errno.EINVAL})
    source = NetdevSource(sysfs_root=FIXTURES / "roce_host")
    samples = source.collect(NOW_NS)
    assert value(samples, "ridethrough.nic.up", iface("ens1f0np0")) == 0
    assert value(samples, "ridethrough.nic.speed", iface("ens1f0np0")) is None
    assert source.errors_total == 0


def test_netdev_other_read_errors_are_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    _fail_reads(monkeypatch, {"rx_bytes": errno.EINVAL, "mtu": errno.EACCES})
    source = NetdevSource(sysfs_root=FIXTURES / "roce_host")
    samples = source.collect(NOW_NS)
    assert not any(s.name == "ridethrough.nic.mtu" for s in samples)
    assert value(samples, "ridethrough.nic.speed", iface("ens1f0np0")) == 200000
    assert source.errors_total == 4  # rx_bytes and mtu on ens1f0np0 and docker0


def test_netdev_without_class_net_counts_one_error(tmp_path: Path) -> None:
    source = NetdevSource(sysfs_root=tmp_path)
    assert source.collect(NOW_NS) == []
    assert source.errors_total == 1


# --- infiniband parsers --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "gbits"),
    [
        ("100 Gb/sec (4X EDR)\n", 100.0),
        ("200 Gb/sec (4X HDR)\n", 200.0),
        ("400 Gb/sec (4X NDR)\n", 400.0),
        ("2.5 Gb/sec (1X SDR)\n", 2.5),
        ("56 Gb/sec (4X FDR)\n", 56.0),
    ],
)
def test_parse_rate(text: str, gbits: float) -> None:
    assert parse_rate(text) == gbits


@pytest.mark.parametrize("text", ["", "fast\n", "Gb/sec\n", "100 Mb/sec\n"])
def test_parse_rate_rejects_garbage(text: str) -> None:
    with pytest.raises(ValueError):
        parse_rate(text)


def test_parse_numbered_state() -> None:
    assert parse_numbered_state("4: ACTIVE\n") == 4
    assert parse_numbered_state("5: LinkUp\n") == 5
    assert parse_numbered_state("4: PortConfigurationTraining\n") == 4
    for text in ("LinkUp\n", "", "x: ACTIVE\n", "4:\n"):
        with pytest.raises(ValueError):
            parse_numbered_state(text)


# --- InfinibandSource on fixtures ----------------------------------------------------------------

PORT = {"ib.device": "mlx5_0", "ib.port": "1"}


def port(**extra: str) -> dict[str, str]:
    """Attributes of mlx5_0 port 1 plus ``ib.<key>`` for each keyword (``counter``, ``link_layer``)."""
    return {**PORT, **{f"ib.{k}": v for k, v in extra.items()}}


def test_infiniband_is_a_source_with_its_name_and_interval() -> None:
    source = InfinibandSource(sysfs_root=FIXTURES / "ib_host", interval_s=2.5)
    assert isinstance(source, Source)
    assert (source.name, source.interval_s) == ("infiniband", 2.5)


def test_infiniband_reads_an_mlx5_ib_port_exactly() -> None:
    source = InfinibandSource(sysfs_root=FIXTURES / "ib_host")
    samples = index(source.collect(NOW_NS))

    def get(name: str, **attrs: str) -> float:
        return samples[_key(name, {**PORT, **attrs})].value

    # port_*_data count 4-byte words.
    assert get("ridethrough.ib.port.io", **{"network.io.direction": "transmit"}) == 123456789012 * 4
    assert get("ridethrough.ib.port.io", **{"network.io.direction": "receive"}) == 91857341234 * 4
    assert get("ridethrough.ib.port.packets", **{"network.io.direction": "transmit"}) == 456789012
    assert get("ridethrough.ib.port.packets", **{"network.io.direction": "receive"}) == 345678901
    cast = "ridethrough.ib.port.cast_packets"
    assert get(cast, **{"network.io.direction": "transmit", "ib.cast": "unicast"}) == 456789008
    assert get(cast, **{"network.io.direction": "receive", "ib.cast": "unicast"}) == 345660628
    assert get(cast, **{"network.io.direction": "transmit", "ib.cast": "multicast"}) == 4
    assert get(cast, **{"network.io.direction": "receive", "ib.cast": "multicast"}) == 18273
    assert get("ridethrough.ib.port.xmit_wait") == 7654321
    assert get("ridethrough.ib.port.errors", **{"ib.counter": "symbol_error"}) == 12
    assert get("ridethrough.ib.port.errors", **{"ib.counter": "link_downed"}) == 1
    assert get("ridethrough.ib.port.errors", **{"ib.counter": "port_xmit_discards"}) == 3
    assert get("ridethrough.ib.port.errors", **{"ib.counter": "VL15_dropped"}) == 0
    assert get("ridethrough.ib.port.hw_counter", **{"ib.counter": "out_of_sequence"}) == 5
    assert get("ridethrough.ib.port.hw_counter", **{"ib.counter": "local_ack_timeout_err"}) == 2
    assert get("ridethrough.ib.port.state", **{"ib.link_layer": "InfiniBand"}) == 4
    assert get("ridethrough.ib.port.phys_state") == 5
    assert get("ridethrough.ib.port.rate") == 200.0
    assert source.errors_total == 0


def test_infiniband_sorts_every_counters_file_into_one_metric() -> None:
    samples = InfinibandSource(sysfs_root=FIXTURES / "ib_host").collect(NOW_NS)
    counters = os.listdir(FIXTURES / "ib_host/class/infiniband/mlx5_0/ports/1/counters")
    hw_counters = os.listdir(FIXTURES / "ib_host/class/infiniband/mlx5_0/ports/1/hw_counters")
    errors = {s.attributes["ib.counter"] for s in samples if s.name == "ridethrough.ib.port.errors"}
    hw = {s.attributes["ib.counter"] for s in samples if s.name == "ridethrough.ib.port.hw_counter"}
    from_counters = [
        s for s in samples if s.kind is MetricKind.COUNTER and s.name != "ridethrough.ib.port.hw_counter"
    ]
    assert len(from_counters) == len(counters)  # each file exactly once
    assert errors == set(counters) - {
        "port_xmit_data", "port_rcv_data", "port_xmit_packets", "port_rcv_packets", "port_xmit_wait",
        "unicast_xmit_packets", "unicast_rcv_packets", "multicast_xmit_packets", "multicast_rcv_packets",
    }  # fmt: skip
    assert hw == set(hw_counters) - {"lifespan"}  # the cache period in ms is not a counter


def test_infiniband_reads_a_roce_port() -> None:
    source = InfinibandSource(sysfs_root=FIXTURES / "roce_host")
    samples = index(source.collect(NOW_NS))
    assert samples[_key("ridethrough.ib.port.state", port(link_layer="Ethernet"))].value == 4
    assert samples[_key("ridethrough.ib.port.hw_counter", port(counter="np_cnp_sent"))].value == 1520
    assert samples[_key("ridethrough.ib.port.hw_counter", port(counter="rp_cnp_handled"))].value == 1498
    rx = {**PORT, "network.io.direction": "receive"}
    assert samples[_key("ridethrough.ib.port.io", rx)].value == 2271892018 * 4
    assert source.errors_total == 0


def test_infiniband_broken_tree_yields_the_good_values_and_counts_errors() -> None:
    source = InfinibandSource(sysfs_root=FIXTURES / "broken")
    samples = index(source.collect(NOW_NS))
    assert samples[_key("ridethrough.ib.port.state", port(link_layer="InfiniBand"))].value == 4
    assert samples[_key("ridethrough.ib.port.io", {**PORT, "network.io.direction": "receive"})].value == 4000
    assert samples[_key("ridethrough.ib.port.hw_counter", port(counter="out_of_sequence"))].value == 7
    names = {name for name, _ in samples}
    assert "ridethrough.ib.port.phys_state" not in names  # "LinkUp" without its number
    assert "ridethrough.ib.port.rate" not in names  # "fast"
    assert "ridethrough.ib.port.errors" not in names  # symbol_error is empty
    assert _key("ridethrough.ib.port.io", {**PORT, "network.io.direction": "transmit"}) not in samples
    assert _key("ridethrough.ib.port.hw_counter", port(counter="packet_seq_err")) not in samples
    assert source.errors_total == 5


def test_infiniband_counter_reset_keeps_the_total_rising(tmp_path: Path) -> None:
    root = copy_fixture("ib_host", tmp_path)
    counters = root / "class/infiniband/mlx5_0/ports/1/counters"
    source = InfinibandSource(sysfs_root=root)
    tx = _key("ridethrough.ib.port.io", {**PORT, "network.io.direction": "transmit"})
    symbol = _key("ridethrough.ib.port.errors", port(counter="symbol_error"))
    first = index(source.collect(NOW_NS))
    assert (first[tx].value, first[symbol].value) == (123456789012 * 4, 12)
    write(counters / "port_xmit_data", "100\n")  # perfquery -R, or an HCA reset
    write(counters / "symbol_error", "0\n")
    second = index(source.collect(NOW_NS))
    assert (second[tx].value, second[symbol].value) == (123456789012 * 4 + 400, 12)
    write(counters / "symbol_error", "2\n")
    assert index(source.collect(NOW_NS))[symbol].value == 14
    assert source.resets_total == 2


def test_a_counter_standing_still_hands_out_its_last_sample_and_a_moving_one_a_new_one(tmp_path: Path) -> None:
    root = copy_fixture("ib_host", tmp_path)
    counters = root / "class/infiniband/mlx5_0/ports/1/counters"
    source = InfinibandSource(sysfs_root=root)
    tx = _key("ridethrough.ib.port.io", {**PORT, "network.io.direction": "transmit"})
    symbol = _key("ridethrough.ib.port.errors", port(counter="symbol_error"))
    first = index(source.collect(NOW_NS))
    write(counters / "port_xmit_data", "123456789013\n")
    second = index(source.collect(NOW_NS))
    assert second[symbol] is first[symbol], "unchanged: the same (immutable) sample again"
    assert second[tx] is not first[tx] and second[tx].value == first[tx].value + 4
    assert second[tx].attributes is first[tx].attributes, "a series keeps its attribute dict"
    shutil.rmtree(root / "class/infiniband/mlx5_0")
    assert source.collect(NOW_NS) == []
    shutil.copytree(FIXTURES / "ib_host/class/infiniband/mlx5_0", root / "class/infiniband/mlx5_0")
    back = index(source.collect(NOW_NS))
    assert back[symbol].value == 12 and back[symbol] is not first[symbol], "a port that came back starts afresh"


def test_infiniband_port_vanishing_between_collects(tmp_path: Path) -> None:
    root = copy_fixture("ib_host", tmp_path)
    source = InfinibandSource(sysfs_root=root)
    assert source.collect(NOW_NS)
    shutil.rmtree(root / "class/infiniband/mlx5_0")
    assert source.collect(NOW_NS) == []
    assert source.errors_total == 0


def test_infiniband_einval_on_rate_means_unknown_but_on_a_counter_is_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fail_reads(monkeypatch, {"rate": errno.EINVAL, "symbol_error": errno.EINVAL})
    source = InfinibandSource(sysfs_root=FIXTURES / "ib_host")
    names = {s.name for s in source.collect(NOW_NS)}
    assert "ridethrough.ib.port.rate" not in names
    assert "ridethrough.ib.port.state" in names
    assert source.errors_total == 1


def test_infiniband_without_class_infiniband_is_quietly_empty() -> None:
    source = InfinibandSource(sysfs_root=FIXTURES / "virtio_vm")
    assert source.collect(NOW_NS) == []
    assert source.errors_total == 0


# --- the capture script ----------------------------------------------------------------------------


def _capture_module() -> ModuleType:
    path = Path(__file__).parent / "tools" / "capture_sysfs.py"
    spec = importlib.util.spec_from_file_location("capture_sysfs", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_capture_copies_what_the_sources_read_and_lists_unreadable_files(tmp_path: Path) -> None:
    capture = _capture_module()
    fake_sys = copy_fixture("roce_host", tmp_path)
    carrier = fake_sys / "class/net/docker0/carrier"
    carrier.unlink()
    carrier.mkdir()  # unreadable, as EINVAL would make it on a real /sys
    (fake_sys / "class/net/docker0/address").write_text("02:42:ac:11:00:02\n")
    out = tmp_path / "out"
    assert capture.main(["--sysfs-root", str(fake_sys), "--out", str(out)]) == 0
    manifest = (out / "capture.txt").read_text()
    assert "class/net/docker0/carrier EISDIR" in manifest
    assert not (out / "class/net/docker0/address").exists()  # no MAC addresses in fixtures
    # Same samples from the copy (docker0's `up` is 0 with carrier 0 or unknown alike).
    for source_type in (NetdevSource, InfinibandSource):
        original = source_type(sysfs_root=FIXTURES / "roce_host").collect(NOW_NS)
        captured = source_type(sysfs_root=out).collect(NOW_NS)
        assert sorted(map(repr, original)) == sorted(map(repr, captured))
    with pytest.raises(SystemExit):
        capture.main(["--sysfs-root", str(fake_sys), "--out", str(out)])  # refuses to overwrite
