"""Fake GPUs: every scripted fault plays as NVML would show it, through `FakeNvmlBackend`."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from ridethrough.collector.nvml import (
    ClockEventReason,
    NvlinkCounters,
    NvmlError,
    NvmlGpuLost,
    NvmlNotSupported,
    NvmlUnavailable,
    RecoveryAction,
    RetiredPages,
)
from ridethrough.lab.control import GpuFault
from ridethrough.lab.fake_gpu import FakeNvmlBackend, GpuScript, ScriptError, create_fake_gpus

T0 = 1_700_000_000_000_000_000
S = 1_000_000_000
SW = int(ClockEventReason.SwThermalSlowdown)
HW = int(ClockEventReason.HwThermalSlowdown)


class Clock:
    """A settable clock in ns since the epoch."""

    def __init__(self, now_ns: int) -> None:
        self.now_ns = now_ns

    def __call__(self) -> int:
        return self.now_ns

    def at(self, seconds: float) -> Clock:
        self.now_ns = T0 + round(seconds * S)
        return self


@pytest.fixture
def path(tmp_path: Path) -> Path:
    target = tmp_path / "gpus.json"
    create_fake_gpus(target, host="h0", seed=7)
    return target


@pytest.fixture
def clock() -> Clock:
    return Clock(T0)


@pytest.fixture
def nvml(path: Path, clock: Clock) -> Iterator[FakeNvmlBackend]:
    backend = FakeNvmlBackend(path, clock=clock)
    backend.init()
    yield backend
    backend.shutdown()


def per_gpu_calls(nvml: FakeNvmlBackend) -> dict[str, Callable[[int], object]]:
    """Every per-GPU call of the protocol, as a function of the index."""
    return {
        "uuid": nvml.uuid, "name": nvml.name, "serial": nvml.serial, "pci_bus_id": nvml.pci_bus_id,
        "utilization": nvml.utilization, "memory": nvml.memory, "temperature_c": nvml.temperature_c,
        "power_mw": nvml.power_mw, "sm_clock_mhz": nvml.sm_clock_mhz,
        "clock_event_reasons": nvml.clock_event_reasons, "ecc_errors": nvml.ecc_errors,
        "remapped_rows": nvml.remapped_rows, "pcie_replay_count": nvml.pcie_replay_count,
        "recovery_action": nvml.recovery_action,
        "nvlink_count": nvml.nvlink_count, "nvlink_active": lambda i: nvml.nvlink_active(i, 0),
        "nvlink_errors": lambda i: nvml.nvlink_errors(i, 0),
    }


def snapshot(nvml: FakeNvmlBackend, index: int) -> dict[str, object]:
    return {name: call(index) for name, call in per_gpu_calls(nvml).items()}


def drain_xids(nvml: FakeNvmlBackend) -> list[tuple[int, int]]:
    events = []
    while (event := nvml.wait_xid(0)) is not None:
        events.append((event.gpu_index, event.xid))
    return events


# -- inventory and NVML's rules -------------------------------------------------------------------


def test_inventory_looks_like_an_hgx_h100(nvml: FakeNvmlBackend) -> None:
    assert nvml.device_count() == 8
    uuids = [nvml.uuid(i) for i in range(8)]
    assert len(set(uuids)) == 8 and all(u.startswith("GPU-") and len(u) == 40 for u in uuids)
    assert len({nvml.serial(i) for i in range(8)}) == 8
    assert nvml.pci_bus_id(0) == "00000000:18:00.0" and len({nvml.pci_bus_id(i) for i in range(8)}) == 8
    assert nvml.name(3) == "NVIDIA H100 80GB HBM3"
    assert nvml.nvlink_count(0) == 18
    assert nvml.memory(0).total_bytes == 81559 * 2**20
    assert nvml.driver_version().count(".") == 2


def test_count_and_seed_are_respected(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    create_fake_gpus(a, 4, host="h1", seed=3)
    create_fake_gpus(b, 4, host="h1", seed=3)
    create_fake_gpus(c, 4, host="h2", seed=3)
    assert [g.uuid for g in GpuScript(a).script().gpus] == [g.uuid for g in GpuScript(b).script().gpus]
    assert {g.uuid for g in GpuScript(a).script().gpus}.isdisjoint(g.uuid for g in GpuScript(c).script().gpus)
    backend = FakeNvmlBackend(a, clock=Clock(T0))
    backend.init()
    assert backend.device_count() == 4
    with pytest.raises(NvmlError) as raised:
        backend.uuid(4)
    assert raised.value.code == pynvml.NVML_ERROR_INVALID_ARGUMENT and type(raised.value) is NvmlError


def test_unknown_gpu_or_link_is_nvml_invalid_argument(nvml: FakeNvmlBackend) -> None:
    for call in (lambda: nvml.temperature_c(8), lambda: nvml.uuid(-1), lambda: nvml.nvlink_errors(0, 18)):
        with pytest.raises(NvmlError) as raised:
            call()
        assert raised.value.code == pynvml.NVML_ERROR_INVALID_ARGUMENT


def test_calls_before_init_fail_like_nvml(path: Path, tmp_path: Path) -> None:
    backend = FakeNvmlBackend(path, clock=Clock(T0))
    with pytest.raises(NvmlError) as raised:
        backend.device_count()
    assert raised.value.code == pynvml.NVML_ERROR_UNINITIALIZED
    with pytest.raises(NvmlUnavailable):
        FakeNvmlBackend(tmp_path / "absent.json").init()


def test_healthy_gpus_are_plausible_and_vary_slowly(nvml: FakeNvmlBackend, clock: Clock) -> None:
    for index in range(8):
        previous: dict[str, Any] | None = None
        for second in range(0, 1200, 7):
            clock.at(second)
            util, temp, power = nvml.utilization(index), nvml.temperature_c(index), nvml.power_mw(index)
            assert 0 <= util.memory_percent <= util.gpu_percent <= 100
            assert 40 <= temp <= 75 and 100_000 <= power <= 700_000
            assert nvml.sm_clock_mhz(index) == 1980 and nvml.clock_event_reasons(index) == 0
            assert 0 < nvml.memory(index).used_bytes < nvml.memory(index).total_bytes
            assert nvml.ecc_errors(index).corrected_aggregate == 0 and not nvml.remapped_rows(index).pending
            now = {"util": util.gpu_percent, "temp": temp}
            if previous is not None:
                assert abs(now["util"] - previous["util"]) <= 10 and abs(now["temp"] - previous["temp"]) <= 3
            previous = now
    clock.at(0)
    assert len({nvml.utilization(i).gpu_percent for i in range(8)}) > 1, "every GPU would move in lockstep"


# -- each fault follows its script ----------------------------------------------------------------


def test_sbe_counts_rise_with_time_then_keep_their_total(path: Path, nvml: FakeNvmlBackend, clock: Clock) -> None:
    GpuScript(path).add(1, GpuFault.ECC_SBE_RISING, {"rate_per_s": 2.0}, start_ns=T0 + 5 * S)
    assert nvml.ecc_errors(1).corrected_volatile == 0
    clock.at(15)
    counts = nvml.ecc_errors(1)
    assert counts.corrected_volatile == counts.corrected_aggregate == 20
    assert counts.uncorrected_volatile == 0 and nvml.ecc_errors(0).corrected_volatile == 0
    clock.at(25)
    assert nvml.ecc_errors(1).corrected_aggregate == 40
    assert GpuScript(path).clear(1, at_ns=T0 + 25 * S) == 1
    clock.at(500)
    assert nvml.ecc_errors(1).corrected_aggregate == 40, "clear stops growth, keeps the total"


def test_row_remap_becomes_pending_and_clears_on_reset(path: Path, nvml: FakeNvmlBackend, clock: Clock) -> None:
    GpuScript(path).add(2, GpuFault.ROW_REMAP_PENDING, {"rows": 2}, start_ns=T0 + 10 * S)
    clock.at(9)
    assert nvml.remapped_rows(2).pending is False and nvml.remapped_rows(2).corrected == 0
    clock.at(10)
    rows = nvml.remapped_rows(2)
    assert rows.pending is True and rows.corrected == 2 and rows.uncorrected == 0 and not rows.failure
    GpuScript(path).clear(2, at_ns=T0 + 20 * S)
    clock.at(21)
    assert nvml.remapped_rows(2).pending is False and nvml.remapped_rows(2).corrected == 2


def test_dbe_bumps_uncorrected_counts_and_fires_xid_48_once(path: Path, nvml: FakeNvmlBackend, clock: Clock) -> None:
    GpuScript(path).add(3, GpuFault.ECC_DBE, {}, start_ns=T0 + 10 * S)
    assert nvml.wait_xid(0) is None, "not before its time"
    clock.at(10)
    ecc = nvml.ecc_errors(3)
    assert (ecc.uncorrected_volatile, ecc.uncorrected_aggregate, ecc.corrected_volatile) == (1, 1, 0)
    event = nvml.wait_xid(0)
    assert event is not None and (event.gpu_index, event.xid, event.timestamp_ns) == (3, 48, T0 + 10 * S)
    assert event.uuid == nvml.uuid(3)
    clock.at(60)
    assert nvml.wait_xid(0) is None, "one DBE, one XID 48"
    assert nvml.remapped_rows(3).uncorrected == 1 and nvml.remapped_rows(3).pending


@pytest.mark.parametrize("code", [13, 48, 63, 64, 74, 92, 94, 95, 119])
def test_xid_fires_once_and_leaves_the_gpu_readable(path: Path, nvml: FakeNvmlBackend, code: int) -> None:
    GpuScript(path).add(5, GpuFault.XID, {"code": code}, start_ns=T0)
    assert drain_xids(nvml) == [(5, code)]
    assert nvml.temperature_c(5) > 0


def test_xid_79_means_the_gpu_is_lost(path: Path, nvml: FakeNvmlBackend) -> None:
    GpuScript(path).add(4, GpuFault.XID, {"code": 79}, start_ns=T0)
    assert drain_xids(nvml) == [(4, 79)]
    with pytest.raises(NvmlGpuLost):
        nvml.uuid(4)
    assert nvml.uuid(5)


def test_thermal_throttle_reasons_appear_only_above_the_thresholds(
        path: Path, nvml: FakeNvmlBackend, clock: Clock) -> None:
    GpuScript(path).add(0, GpuFault.THERMAL, {"deg_per_s": 1.0}, start_ns=T0)
    temps, seen = [], set()
    for second in range(0, 61):
        clock.at(second)
        temp, reasons, mhz = nvml.temperature_c(0), nvml.clock_event_reasons(0), nvml.sm_clock_mhz(0)
        temps.append(temp)
        assert bool(reasons & SW) == (temp >= 87) and bool(reasons & HW) == (temp >= 90), (temp, reasons)
        assert (mhz < 1980) == (temp >= 87)
        seen.add(reasons)
    assert temps == sorted(temps) and temps[0] < 75 and temps[-1] == 95, temps
    assert {0, SW, SW | HW} <= seen
    assert nvml.clock_event_reasons(1) == 0, "only the scripted GPU heats up"
    GpuScript(path).clear(0, at_ns=T0 + 60 * S)
    clock.at(120)
    assert nvml.temperature_c(0) < 75 and nvml.clock_event_reasons(0) == 0 and nvml.sm_clock_mhz(0) == 1980


def test_pcie_replay_storm_climbs_at_its_rate(path: Path, nvml: FakeNvmlBackend, clock: Clock) -> None:
    GpuScript(path).add(6, GpuFault.PCIE_REPLAY_STORM, {"rate_per_s": 100.0}, start_ns=T0)
    counts = []
    for second in (0, 1, 10):
        clock.at(second)
        counts.append(nvml.pcie_replay_count(6))
    assert counts == [0, 100, 1000]
    assert nvml.pcie_replay_count(7) == 0


def test_nvlink_crc_climbs_on_its_link_only(path: Path, nvml: FakeNvmlBackend, clock: Clock) -> None:
    GpuScript(path).add(7, GpuFault.NVLINK_CRC, {"rate_per_s": 50.0, "link": 3}, start_ns=T0)
    clock.at(10)
    link3 = nvml.nvlink_errors(7, 3)
    assert link3.crc_flit == 500 and 0 < link3.crc_data < link3.crc_flit and link3.replay == 500
    assert nvml.nvlink_errors(7, 2) == NvlinkCounters(0, 0, 0, 0) == nvml.nvlink_errors(6, 3)
    assert all(nvml.nvlink_active(7, link) for link in range(18))


def test_fallen_off_bus_fails_every_call_of_that_gpu_only(path: Path, nvml: FakeNvmlBackend, clock: Clock) -> None:
    GpuScript(path).add(2, GpuFault.FALLEN_OFF_BUS, {}, start_ns=T0 + S)
    healthy_before = snapshot(nvml, 2)
    clock.at(2)
    for name, call in per_gpu_calls(nvml).items():
        with pytest.raises(NvmlGpuLost) as raised:
            call(2)
        assert raised.value.code == pynvml.NVML_ERROR_GPU_IS_LOST, name
        call(1)
    assert nvml.device_count() == 8, "a lost GPU still counts"
    assert drain_xids(nvml) == [(2, 79)]
    GpuScript(path).clear(2, at_ns=T0 + 3 * S)
    clock.at(4)
    assert snapshot(nvml, 2).keys() == healthy_before.keys()


def test_recovery_action_follows_the_faults_and_a_clear_is_the_reset(
        path: Path, nvml: FakeNvmlBackend, clock: Clock) -> None:
    script = GpuScript(path)
    script.add(0, GpuFault.ECC_DBE, {}, start_ns=T0 + S)
    script.add(1, GpuFault.XID, {"code": 95}, start_ns=T0)
    script.add(2, GpuFault.XID, {"code": 13}, start_ns=T0)
    script.add(3, GpuFault.ROW_REMAP_PENDING, {}, start_ns=T0)
    assert nvml.recovery_action(0) == RecoveryAction.NONE, "not before its time"
    clock.at(2)
    assert [nvml.recovery_action(i) for i in range(4)] == [
        RecoveryAction.GPU_RESET, RecoveryAction.GPU_RESET, RecoveryAction.NONE, RecoveryAction.NONE]
    script.clear(0, at_ns=T0 + 3 * S)
    clock.at(4)
    assert nvml.recovery_action(0) == RecoveryAction.NONE and not nvml.remapped_rows(0).pending


def test_an_h100_retires_no_pages_and_an_older_gpu_retires_them(tmp_path: Path, nvml: FakeNvmlBackend) -> None:
    with pytest.raises(NvmlNotSupported) as raised:
        nvml.retired_pages(0)
    assert raised.value.code == pynvml.NVML_ERROR_NOT_SUPPORTED
    old = tmp_path / "v100.json"
    create_fake_gpus(old, 1, host="h0", seed=1, unsupported=("remapped_rows",))
    GpuScript(old).add(0, GpuFault.ROW_REMAP_PENDING, {"rows": 2}, start_ns=T0)
    GpuScript(old).add(0, GpuFault.ECC_DBE, {}, start_ns=T0)
    backend = FakeNvmlBackend(old, clock=Clock(T0))
    backend.init()
    assert backend.retired_pages(0) == RetiredPages(single_bit=2, double_bit=1, pending=True)
    with pytest.raises(NvmlNotSupported):
        backend.remapped_rows(0)


def test_unsupported_calls_are_declared_per_gpu_and_checked(tmp_path: Path, clock: Clock) -> None:
    target = tmp_path / "gpus.json"
    create_fake_gpus(target, 2, host="h0", seed=1, unsupported=("serial", "nvlink_errors"))
    assert [g.unsupported for g in GpuScript(target).script().gpus] == [("serial", "nvlink_errors")] * 2
    GpuScript(target).add(1, GpuFault.FALLEN_OFF_BUS, {}, start_ns=T0)
    backend = FakeNvmlBackend(target, clock=clock)
    backend.init()
    for call in (lambda: backend.serial(0), lambda: backend.nvlink_errors(0, 3)):
        with pytest.raises(NvmlNotSupported):
            call()
    assert backend.nvlink_active(0, 3) and backend.uuid(0)
    with pytest.raises(NvmlGpuLost):
        backend.serial(1)  # a lost GPU is lost before anything else
    with pytest.raises(ScriptError, match=r"unknown call\(s\) \['fan_speed'\]"):
        create_fake_gpus(target, 1, host="h0", unsupported=("fan_speed",))
    raw = json.loads(target.read_text())
    del raw["gpus"][0]["unsupported"]
    target.write_text(json.dumps(raw))
    assert GpuScript(target).script().gpus[0].unsupported == (), "scripts written before the key still load"


def test_clear_drops_faults_not_started_yet(path: Path, nvml: FakeNvmlBackend, clock: Clock) -> None:
    script = GpuScript(path)
    script.add(0, GpuFault.XID, {"code": 94}, start_ns=T0 + 100 * S)
    script.add(1, GpuFault.XID, {"code": 94}, start_ns=T0 + 100 * S)
    assert script.clear(0, at_ns=T0) == 1
    clock.at(200)
    assert drain_xids(nvml) == [(1, 94)]


# -- processes and files --------------------------------------------------------------------------


def test_two_backends_agree_and_each_gets_every_xid(path: Path, clock: Clock) -> None:
    script = GpuScript(path)
    script.add(0, GpuFault.THERMAL, {"deg_per_s": 2.0}, start_ns=T0)
    script.add(1, GpuFault.ECC_SBE_RISING, {"rate_per_s": 3.0}, start_ns=T0)
    script.add(2, GpuFault.NVLINK_CRC, {"rate_per_s": 5.0, "link": 0}, start_ns=T0)
    script.add(3, GpuFault.ECC_DBE, {"count": 2}, start_ns=T0 + 5 * S)
    script.add(4, GpuFault.XID, {"code": 119}, start_ns=T0 + 7 * S)
    a, b = FakeNvmlBackend(path, clock=clock), FakeNvmlBackend(path, clock=clock)
    a.init()
    b.init()
    for second in (0, 3, 6, 9, 30):
        clock.at(second)
        assert [snapshot(a, i) for i in range(8)] == [snapshot(b, i) for i in range(8)]
    assert drain_xids(a) == drain_xids(b) == [(3, 48), (4, 119)]


def test_backend_rereads_the_script_when_it_changes(path: Path, nvml: FakeNvmlBackend) -> None:
    assert nvml.pcie_replay_count(0) == 0
    script = GpuScript(path)
    mtime_ns = path.stat().st_mtime_ns
    for rate in (1.0, 2.0, 3.0):
        script.add(0, GpuFault.PCIE_REPLAY_STORM, {"rate_per_s": rate}, start_ns=T0 - 10 * S)
        os.utime(path, ns=(mtime_ns, mtime_ns))  # as on a file system with coarse timestamps
        assert nvml.pcie_replay_count(0) == 10 * sum(f.params["rate_per_s"] for f in script.faults())


def test_backend_notices_an_edit_in_place_a_removal_and_a_new_file(path: Path, nvml: FakeNvmlBackend) -> None:
    inode = path.stat().st_ino
    raw = json.loads(path.read_text())
    raw["gpus"] = raw["gpus"][:3]
    with open(path, "r+") as script:  # the same file, rewritten: no rename for the backend to see
        script.truncate(0)
        script.write(json.dumps(raw))
    assert path.stat().st_ino == inode and nvml.device_count() == 3
    path.unlink()
    with pytest.raises(NvmlError) as raised:
        nvml.device_count()
    assert raised.value.code == pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    create_fake_gpus(path, 5, host="h0", seed=7)
    assert nvml.device_count() == 5


def test_a_script_replaced_while_the_backend_opens_it_is_read_again(
        path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = FakeNvmlBackend(path, clock=clock)
    real_fstat = os.fstat
    replaced: list[bool] = []

    def fstat_after_a_writer(fd: int) -> os.stat_result:
        if not replaced:  # the lab replaces the file between the backend's open and its fstat
            replaced.append(True)
            GpuScript(path).add(0, GpuFault.PCIE_REPLAY_STORM, {"rate_per_s": 1.0}, start_ns=T0 - 10 * S)
        return real_fstat(fd)

    monkeypatch.setattr(os, "fstat", fstat_after_a_writer)
    backend.init()  # reads the old file, which is already unlinked
    assert replaced and backend.pcie_replay_count(0) == 10, "the next call read the new file"
    backend.shutdown()


def test_backend_keeps_one_file_open_and_closes_it_at_shutdown(path: Path, clock: Clock) -> None:
    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    before = open_fds()
    backend = FakeNvmlBackend(path, clock=clock)
    backend.init()
    for rate in (1.0, 2.0):  # each change replaces the file: the old one is let go
        GpuScript(path).add(0, GpuFault.PCIE_REPLAY_STORM, {"rate_per_s": rate}, start_ns=T0)
        backend.pcie_replay_count(0)
    assert open_fds() == before + 1
    backend.shutdown()
    assert open_fds() == before


def test_script_survives_concurrent_writers_and_a_reader(path: Path, clock: Clock) -> None:
    reader = FakeNvmlBackend(path, clock=clock.at(1000))
    reader.init()
    errors: list[BaseException] = []
    stop = threading.Event()

    def write(gpu: int) -> None:
        try:
            script = GpuScript(path)
            for _ in range(40):
                script.add(gpu, GpuFault.ECC_SBE_RISING, {"rate_per_s": 1.0}, start_ns=T0)
        except BaseException as err:
            errors.append(err)

    def read() -> None:
        last = 0
        try:
            while not stop.is_set():
                total = reader.ecc_errors(0).corrected_aggregate + reader.ecc_errors(1).corrected_aggregate
                assert total >= last, "a reader went back in time: it saw a stale or partial file"
                last = total
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=write, args=(gpu,)) for gpu in (0, 1)]
    watcher = threading.Thread(target=read)
    watcher.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    stop.set()
    watcher.join(timeout=60)
    assert not errors, errors
    faults = GpuScript(path).faults()
    assert len(faults) == 80 and len({f.id for f in faults}) == 80, "a writer lost another's update"
    assert reader.ecc_errors(0).corrected_aggregate == 40 * 1000
    assert not list(path.parent.glob(".gpus.json.*.tmp")), "temporary files are cleaned up"


@pytest.mark.parametrize(("content", "expected"), [
    ("{not json", "not valid JSON (line 1, column 2"),
    ("[]", "script must be a JSON object"),
    (json.dumps({"version": 1}), "missing 'gpus'"),
    ("", "not valid JSON"),
])
def test_malformed_script_is_a_clear_error(path: Path, content: str, expected: str) -> None:
    path.write_text(content)
    with pytest.raises(ScriptError, match=".*".join(map(re.escape, (str(path), expected)))) as raised:
        GpuScript(path).faults()
    assert raised.value.__cause__ is None and raised.value.__suppress_context__, "no json traceback chained on"
    backend = FakeNvmlBackend(path)
    with pytest.raises(NvmlError, match=re.escape(expected)) as nvml_raised:
        backend.init()
    assert nvml_raised.value.code == pynvml.NVML_ERROR_UNKNOWN


def test_malformed_fault_entry_names_the_entry(path: Path) -> None:
    raw = json.loads(path.read_text())
    raw["faults"] = [{"id": 1, "gpu": 0, "fault": "meltdown", "params": {}, "start_ns": T0, "end_ns": None}]
    path.write_text(json.dumps(raw))
    with pytest.raises(ScriptError, match=r"faults\[0\]: unknown fault 'meltdown'"):
        GpuScript(path).faults()
    raw["faults"][0].update(fault="thermal", params={"deg_per_s": "hot"})
    path.write_text(json.dumps(raw))
    with pytest.raises(ScriptError, match=r"faults\[0\]: thermal: parameter 'deg_per_s' must be a finite number"):
        GpuScript(path).faults()


@pytest.mark.parametrize(("gpu", "fault", "params", "expected"), [
    (8, GpuFault.THERMAL, {}, "no GPU 8"),
    (0, GpuFault.XID, {}, "missing parameter"),
    (0, GpuFault.ECC_SBE_RISING, {"rate": 1.0}, "unknown parameter"),
    (0, GpuFault.PCIE_REPLAY_STORM, {"rate_per_s": -1.0}, ">= 0"),
    (0, GpuFault.NVLINK_CRC, {"rate_per_s": 1.0, "link": 18}, "below 18"),
    (0, GpuFault.XID, {"code": 0}, "positive"),
])
def test_bad_faults_are_refused_and_change_nothing(path: Path, gpu: int, fault: GpuFault,
                                                   params: dict[str, float], expected: str) -> None:
    before = path.read_text()
    with pytest.raises(ScriptError, match=expected):
        GpuScript(path).add(gpu, fault, params, start_ns=T0)
    assert path.read_text() == before


def test_wait_xid_waits_for_an_event_and_shutdown_interrupts_it(path: Path, nvml: FakeNvmlBackend) -> None:
    started = time.monotonic()
    assert nvml.wait_xid(150) is None
    assert 0.14 <= time.monotonic() - started < 2

    adder = threading.Timer(0.2, lambda: GpuScript(path).add(1, GpuFault.XID, {"code": 74}, start_ns=T0))
    adder.start()
    event = nvml.wait_xid(10_000)
    adder.join()
    assert event is not None and (event.gpu_index, event.xid) == (1, 74)

    outcomes: list[object] = []

    def wait() -> None:
        try:
            outcomes.append(nvml.wait_xid(30_000))
        except NvmlError as err:  # shut down before it started waiting: NVML says uninitialised
            outcomes.append(err.code)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.1)  # most likely it is blocked by now; either way it must end promptly
    started = time.monotonic()
    nvml.shutdown()
    waiter.join(timeout=5)
    assert not waiter.is_alive() and time.monotonic() - started < 5
    assert outcomes in ([None], [pynvml.NVML_ERROR_UNINITIALIZED])
