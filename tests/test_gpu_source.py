"""The GPU source over the fake NVML backend: every field, unsupported calls, no driver, lost GPUs, XIDs."""

from __future__ import annotations

import collections
import ctypes
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest

from ridethrough.catalogue import metric, metrics_of
from ridethrough.collector.counters import CounterTracker
from ridethrough.collector.nvml import (
    NvlinkCounters,
    NvmlError,
    NvmlNotSupported,
    PynvmlBackend,
    RecoveryAction,
    RemappedRows,
    XidEvent,
)
from ridethrough.collector.registry import build_sources
from ridethrough.collector.sample import BackgroundSource, Event, MetricKind, Sample
from ridethrough.collector.sources.gpu import GPU_ATTRIBUTES, GpuSource, from_config
from ridethrough.collector.sources.gpu_fields import GpuReading, LinkReading, health_state, samples_of
from ridethrough.collector.sources.gpu_xid import XidWatcher, xid_event
from ridethrough.lab.control import GpuFault
from ridethrough.lab.fake_gpu import FakeNvmlBackend, GpuScript, create_fake_gpus
from ridethrough.settings import AgentConfig
from tests.conftest import wait_for

T0 = 1_700_000_000_000_000_000
S = 1_000_000_000


class Clock:
    """A settable clock in ns since the epoch."""

    def __init__(self) -> None:
        self.now_ns = T0

    def __call__(self) -> int:
        return self.now_ns

    def at(self, seconds: float) -> int:
        self.now_ns = T0 + round(seconds * S)
        return self.now_ns


class Events:
    """An event sink that keeps what it gets (called from the watcher thread too)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.items: list[Event] = []

    def __call__(self, event: Event) -> None:
        with self._lock:
            self.items.append(event)

    def named(self, name: str) -> list[Event]:
        with self._lock:
            return [e for e in self.items if e.name == name]


class CountingFake(FakeNvmlBackend):
    """The fake backend, counting the calls made to it (to prove a call is not made again)."""

    def __init__(self, path: Path, *, clock: Clock) -> None:
        super().__init__(path, clock=clock)
        self.calls: collections.Counter[str] = collections.Counter()

    def init(self) -> None:
        self.calls["init"] += 1
        super().init()

    def serial(self, index: int) -> str:
        self.calls["serial"] += 1
        return super().serial(index)

    def pcie_replay_count(self, index: int) -> int:
        self.calls["pcie_replay_count"] += 1
        return super().pcie_replay_count(index)

    def nvlink_errors(self, index: int, link: int) -> NvlinkCounters:
        self.calls["nvlink_errors"] += 1
        return super().nvlink_errors(index, link)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def path(tmp_path: Path) -> Path:
    target = tmp_path / "gpus.json"
    create_fake_gpus(target, 2, host="h0", seed=7, nvlinks=4)
    return target


def make_source(path: Path, clock: Clock) -> GpuSource:
    return GpuSource(FakeNvmlBackend(path, clock=clock), clock=clock, xid_wait_ms=50,
                     xid_backoff_initial_s=0.01, xid_backoff_max_s=0.05)


@pytest.fixture
def source(path: Path, clock: Clock) -> Iterator[GpuSource]:
    src = make_source(path, clock)
    yield src
    src.stop(timeout_s=5)


def of_gpu(samples: list[Sample], index: int) -> dict[str, list[Sample]]:
    by_name: dict[str, list[Sample]] = collections.defaultdict(list)
    for s in samples:
        if s.attributes.get("gpu.index") == str(index):
            by_name[s.name].append(s)
    return by_name


def value(samples: list[Sample], name: str, index: int, **attrs: str) -> float:
    (match,) = [s for s in of_gpu(samples, index)[name] if all(s.attributes[k] == v for k, v in attrs.items())]
    return match.value


# -- every field ------------------------------------------------------------------------------------


def test_every_field_of_every_gpu_is_read_with_the_gpus_identity(path: Path, clock: Clock, source: GpuSource) -> None:
    nvml = FakeNvmlBackend(path, clock=clock)
    nvml.init()
    samples = source.collect(clock.at(30))
    assert source.available is True
    expected = {m.name for m in metrics_of("gpu")} - {
        "ridethrough.gpu.memory.retired_pages", "ridethrough.gpu.memory.retirement_pending",  # an H100 remaps rows
        "ridethrough.gpu.xid"}  # none happened
    for index in range(2):
        mine = of_gpu(samples, index)
        assert set(mine) == expected
        attrs = mine["hw.power"][0].attributes
        assert attrs == {"hw.id": nvml.uuid(index), "hw.type": "gpu", "hw.vendor": "NVIDIA",
                         "hw.model": "NVIDIA H100 80GB HBM3", "hw.serial_number": nvml.serial(index),
                         "gpu.index": str(index), "gpu.pci_bus_id": nvml.pci_bus_id(index)}
        assert value(samples, "hw.temperature", index) == nvml.temperature_c(index)
        assert value(samples, "hw.power", index) == nvml.power_mw(index) / 1000
        assert value(samples, "hw.gpu.utilization", index) == nvml.utilization(index).gpu_percent / 100
        assert value(samples, "hw.gpu.memory.usage", index) == nvml.memory(index).used_bytes
        assert value(samples, "hw.gpu.memory.limit", index) == 81559 * 2**20
        assert value(samples, "ridethrough.gpu.clock.sm", index) == 1980
        assert len(mine["ridethrough.gpu.nvlink.up"]) == 4 and len(mine["ridethrough.gpu.nvlink.errors"]) == 16
        assert value(samples, "hw.status", index, **{"hw.state": "ok"}) == 1
        assert value(samples, "ridethrough.gpu.recovery_action", index, **{"gpu.recovery_action": "none"}) == 1
    assert source.unsupported == {(0, "retired_pages"), (1, "retired_pages")}


def test_faults_show_in_their_fields(path: Path, clock: Clock, source: GpuSource) -> None:
    script = GpuScript(path)
    script.add(0, GpuFault.THERMAL, {"deg_per_s": 5.0}, start_ns=T0)
    script.add(0, GpuFault.ECC_SBE_RISING, {"rate_per_s": 2.0}, start_ns=T0)
    script.add(0, GpuFault.PCIE_REPLAY_STORM, {"rate_per_s": 10.0}, start_ns=T0)
    script.add(1, GpuFault.NVLINK_CRC, {"rate_per_s": 4.0, "link": 2}, start_ns=T0)
    script.add(1, GpuFault.ECC_DBE, {"count": 2}, start_ns=T0 + 5 * S)
    samples = source.collect(clock.at(10))
    reason = "gpu.clock_event_reason"
    assert value(samples, "ridethrough.gpu.clock_event_reason", 0, **{reason: "HwThermalSlowdown"}) == 1
    assert value(samples, "ridethrough.gpu.clock_event_reason", 0, **{reason: "SwThermalSlowdown"}) == 1
    assert value(samples, "ridethrough.gpu.clock_event_reason", 0, **{reason: "SwPowerCap"}) == 0
    assert value(samples, "ridethrough.gpu.clock_event_reasons", 0) == 0x60
    assert value(samples, "ridethrough.gpu.clock.sm", 0) < 1980
    assert value(samples, "hw.status", 0, **{"hw.state": "degraded"}) == 1
    assert value(samples, "hw.errors", 0, **{"error.type": "corrected"}) == 20
    assert value(samples, "ridethrough.gpu.ecc.aggregate", 0, **{"error.type": "corrected"}) == 20
    assert value(samples, "ridethrough.gpu.pcie.replays", 0) == 100
    assert value(samples, "ridethrough.gpu.nvlink.errors", 1, **{"gpu.nvlink": "2", "error.type": "crc_flit"}) == 40
    assert value(samples, "ridethrough.gpu.nvlink.errors", 1, **{"gpu.nvlink": "1", "error.type": "crc_flit"}) == 0
    assert value(samples, "hw.errors", 1, **{"error.type": "uncorrected"}) == 2
    assert value(samples, "ridethrough.gpu.memory.remap_pending", 1) == 1
    assert value(samples, "ridethrough.gpu.recovery_action", 1, **{"gpu.recovery_action": "gpu_reset"}) == 1
    assert value(samples, "hw.status", 1, **{"hw.state": "failed"}) == 1
    script.clear(1, at_ns=T0 + 20 * S)  # a GPU reset: the recommended action and the pending remap end
    samples = source.collect(clock.at(21))
    assert value(samples, "ridethrough.gpu.recovery_action", 1, **{"gpu.recovery_action": "none"}) == 1
    assert value(samples, "hw.status", 1, **{"hw.state": "ok"}) == 1
    assert value(samples, "hw.errors", 1, **{"error.type": "uncorrected"}) == 2, "counters keep their totals"


def test_a_series_keeps_its_attribute_dict_from_tick_to_tick_while_values_move(
        path: Path, clock: Clock, source: GpuSource) -> None:
    GpuScript(path).add(0, GpuFault.ECC_SBE_RISING, {"rate_per_s": 2.0}, start_ns=T0)

    def series(samples: list[Sample]) -> dict[tuple[str, frozenset[tuple[str, str]]], Sample]:
        return {(s.name, frozenset(s.attributes.items())): s for s in samples}

    first_samples, second_samples = source.collect(clock.at(10)), source.collect(clock.at(20))
    first, second = series(first_samples), series(second_samples)
    assert first.keys() == second.keys() and len(second) == len(second_samples), "no series twice"
    assert all(second[k].attributes is first[k].attributes for k in first), "the same dict, not an equal one"
    corrected = {"error.type": "corrected"}
    assert value(first_samples, "hw.errors", 0, **corrected) == 20
    assert value(second_samples, "hw.errors", 0, **corrected) == 40, "the counter moves on through its cached key"


def test_a_gpu_that_retires_pages_reports_them_instead_of_remapped_rows(tmp_path: Path, clock: Clock) -> None:
    path = tmp_path / "v100.json"
    create_fake_gpus(path, 1, host="h0", seed=1, name="Tesla V100-SXM2-32GB", nvlinks=6,
                     unsupported=("remapped_rows",))
    GpuScript(path).add(0, GpuFault.ROW_REMAP_PENDING, {"rows": 3}, start_ns=T0)
    src = make_source(path, clock)
    samples = src.collect(clock.at(1))
    assert value(samples, "ridethrough.gpu.memory.retired_pages", 0, **{"error.type": "corrected"}) == 3
    assert value(samples, "ridethrough.gpu.memory.retirement_pending", 0) == 1
    assert value(samples, "hw.status", 0, **{"hw.state": "predicted_failure"}) == 1
    assert "ridethrough.gpu.memory.remapped_rows" not in of_gpu(samples, 0)


def test_unsupported_calls_are_logged_once_and_never_made_again(tmp_path: Path, clock: Clock,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "gpus.json"
    create_fake_gpus(path, 2, host="h0", seed=1, nvlinks=2,
                     unsupported=("serial", "pcie_replay_count", "nvlink_errors", "retired_pages"))
    backend = CountingFake(path, clock=clock)
    src = GpuSource(backend, clock=clock)
    with caplog.at_level(logging.INFO, logger="ridethrough.collector.sources.gpu_fields"):
        for second in range(5):
            samples = src.collect(clock.at(second))
    assert backend.calls["pcie_replay_count"] == 2 and backend.calls["nvlink_errors"] == 4
    assert backend.calls["serial"] == 2, "identity is read once, an unsupported serial included"
    assert {s.attributes["hw.serial_number"] for s in samples} == {"unknown"}
    names = {s.name for s in samples}
    assert "ridethrough.gpu.pcie.replays" not in names and "ridethrough.gpu.nvlink.errors" not in names
    assert "ridethrough.gpu.nvlink.up" in names and "hw.temperature" in names
    assert (1, "nvlink_errors[1]") in src.unsupported and (0, "pcie_replay_count") in src.unsupported
    logged = [r.getMessage() for r in caplog.records if "not supported" in r.getMessage()]
    assert len(logged) == len(src.unsupported) == 2 * (1 + 1 + 2 + 1)
    assert src.errors_total == 0


def test_other_nvml_errors_skip_the_field_for_one_tick(path: Path, clock: Clock) -> None:
    class Flaky(FakeNvmlBackend):
        fail = True

        def power_mw(self, index: int) -> int:
            if self.fail:
                raise NvmlError(pynvml.NVML_ERROR_UNKNOWN, "Unknown Error")
            return super().power_mw(index)

    backend = Flaky(path, clock=clock)
    src = GpuSource(backend, clock=clock)
    assert "hw.power" not in {s.name for s in src.collect(clock.at(0))}
    assert src.errors_total == 2 and not any(call == "power_mw" for _, call in src.unsupported)
    backend.fail = False
    assert "hw.power" in {s.name for s in src.collect(clock.at(1))}, "asked again next tick"


# -- no driver, lost GPUs ---------------------------------------------------------------------------


def test_no_nvml_warns_once_then_stays_idle(tmp_path: Path, clock: Clock) -> None:
    backend = CountingFake(tmp_path / "absent.json", clock=clock)
    src = GpuSource(backend, clock=clock)
    events = Events()
    src.start(emit=events)
    assert [src.collect(clock.at(s)) for s in range(3)] == [[], [], []]
    (warning,) = events.items
    assert (warning.name, warning.severity) == ("gpu.nvml_unavailable", "WARN") and "no NVML" in warning.body
    assert backend.calls["init"] == 1 and src.available is False and not src.watcher.running
    src.stop(timeout_s=1)


def _nvml_loads() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(_nvml_loads(), reason="this machine has an NVIDIA driver")
def test_the_real_backend_on_a_host_without_a_driver_is_idle() -> None:
    events = Events()
    src = GpuSource(PynvmlBackend())
    src.start(emit=events)
    assert src.collect(0) == [] and [e.name for e in events.items] == ["gpu.nvml_unavailable"]
    src.stop(timeout_s=1)


def test_a_lost_gpu_reports_failed_status_only_and_one_event(path: Path, clock: Clock, source: GpuSource) -> None:
    events = Events()
    source.start(emit=events)
    uuid = of_gpu(source.collect(clock.at(0)), 1)["hw.power"][0].attributes["hw.id"]
    GpuScript(path).add(1, GpuFault.FALLEN_OFF_BUS, {}, start_ns=T0 + S)
    for second in (2, 3):
        samples = source.collect(clock.at(second))
        lost = of_gpu(samples, 1)
        assert "hw.status" in lost and set(lost) <= {"hw.status", "ridethrough.gpu.xid"}, "XID 79 may be counted"
        assert {s.attributes["hw.state"]: s.value for s in lost["hw.status"]} == {
            "ok": 0, "degraded": 0, "predicted_failure": 0, "failed": 1}
        assert lost["hw.status"][0].attributes["hw.id"] == uuid, "the identity read before it fell off"
        assert "hw.power" in of_gpu(samples, 0)
    (event,) = events.named("gpu.lost")
    assert event.severity == "ERROR" and event.attributes["gpu.index"] == "1" and event.time_ns == T0 + 2 * S
    GpuScript(path).clear(1, at_ns=T0 + 4 * S)
    samples = source.collect(clock.at(5))
    assert "hw.power" in of_gpu(samples, 1) and len(events.named("gpu.recovered")) == 1


def test_a_gpu_lost_before_the_agent_started_is_reported_with_an_unknown_identity(
        path: Path, clock: Clock, source: GpuSource) -> None:
    GpuScript(path).add(0, GpuFault.FALLEN_OFF_BUS, {}, start_ns=T0)
    status = of_gpu(source.collect(clock.at(1)), 0)["hw.status"]
    assert {s.attributes["hw.id"] for s in status} == {"unknown"}
    assert sorted(status[0].attributes) == sorted([*GPU_ATTRIBUTES, "hw.state"])


# -- XIDs -------------------------------------------------------------------------------------------


def test_xids_become_events_and_counters_and_the_thread_stops_promptly(
        path: Path, clock: Clock, source: GpuSource) -> None:
    clock.at(100)
    events = Events()
    source.start(emit=events)
    assert source.watcher.running
    script = GpuScript(path)
    script.add(0, GpuFault.ECC_DBE, {}, start_ns=T0 + 10 * S)
    script.add(1, GpuFault.XID, {"code": 92}, start_ns=T0 + 20 * S)
    script.add(1, GpuFault.XID, {"code": 92}, start_ns=T0 + 30 * S)
    wait_for(lambda: len(events.named("gpu.xid")) == 3, timeout_s=10, what="three XID events")
    dbe, sbe_rate, _ = sorted(events.named("gpu.xid"), key=lambda e: e.time_ns)
    assert (dbe.severity, dbe.time_ns, dbe.attributes["gpu.xid"], dbe.attributes["gpu.xid.class"]) == (
        "ERROR", T0 + 10 * S, "48", "gpu_reset")
    assert "Double-bit" in dbe.attributes["gpu.xid.meaning"] and dbe.attributes["gpu.index"] == "0"
    assert (sbe_rate.severity, sbe_rate.attributes["gpu.xid.class"]) == ("WARN", "precursor")
    counts = {(s.attributes["gpu.index"], s.attributes["gpu.xid"]): s.value
              for s in source.collect(clock.now_ns) if s.name == "ridethrough.gpu.xid"}
    assert counts == {("0", "48"): 1, ("1", "92"): 2}
    started = time.monotonic()
    source.stop(timeout_s=5)
    assert not source.watcher.running and time.monotonic() - started < 2
    assert source.collect(clock.now_ns) == []


def test_watcher_survives_backend_errors_and_a_failing_consumer() -> None:
    script: list[object] = [NvmlError(999, "boom"), NvmlError(999, "boom"), XidEvent(0, "GPU-a", 13, 1),
                            XidEvent(0, "GPU-a", 31, 2)]
    got: list[int] = []

    def wait_xid(timeout_ms: int) -> XidEvent | None:
        if not script:
            time.sleep(timeout_ms / 1000)
            return None
        item = script.pop(0)
        if isinstance(item, Exception):
            raise item
        return item  # type: ignore[return-value]

    def on_xid(xid: XidEvent) -> None:
        got.append(xid.xid)
        if xid.xid == 13:
            raise RuntimeError("consumer failed")

    watcher = XidWatcher(wait_xid, on_xid, wait_ms=20, backoff_initial_s=0.01, backoff_max_s=0.02)
    watcher.start()
    wait_for(lambda: got == [13, 31], timeout_s=10, what="both XIDs after two failures")
    assert watcher.errors_total == 2 and watcher.running
    assert watcher.stop(timeout_s=2) and not watcher.running


def test_watcher_stop_interrupts_a_long_backoff_and_not_supported_ends_it() -> None:
    def broken(timeout_ms: int) -> XidEvent | None:
        raise NvmlError(pynvml.NVML_ERROR_UNKNOWN, "Unknown Error")

    watcher = XidWatcher(broken, lambda xid: None, wait_ms=10, backoff_initial_s=30, backoff_max_s=60)
    watcher.start()
    wait_for(lambda: watcher.errors_total >= 1, timeout_s=10, what="first failure")
    started = time.monotonic()
    assert watcher.stop(timeout_s=5) and time.monotonic() - started < 2

    def unsupported(timeout_ms: int) -> XidEvent | None:
        raise NvmlNotSupported(pynvml.NVML_ERROR_NOT_SUPPORTED, "no GPU supports critical XID events")

    quitter = XidWatcher(unsupported, lambda xid: None)
    quitter.start()
    wait_for(lambda: not quitter.running, timeout_s=10, what="the watcher to give up")
    assert quitter.unsupported and quitter.errors_total == 0


def test_an_xid_outside_the_table_is_a_warning_of_unknown_class() -> None:
    event = xid_event(XidEvent(3, "GPU-x", 4242, 5), {"gpu.index": "3", "hw.id": "GPU-x"})
    assert (event.severity, event.attributes["gpu.xid.class"], event.time_ns) == ("WARN", "unknown", 5)
    assert "4242" in event.body and "GPU 3 (GPU-x)" in event.body


# -- pure parts -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("reading", "state"), [
    (GpuReading(), "ok"),
    (GpuReading(clock_event_reasons=int(pynvml.nvmlClocksEventReasonSwPowerCap)), "ok"),
    (GpuReading(clock_event_reasons=int(pynvml.nvmlClocksEventReasonHwSlowdown)), "degraded"),
    (GpuReading(links={0: LinkReading(False, None)}, links_lost=1), "degraded"),
    (GpuReading(recovery_action=RecoveryAction.DRAIN_P2P), "degraded"),
    (GpuReading(remapped_rows=RemappedRows(1, 0, True, False)), "predicted_failure"),
    (GpuReading(remapped_rows=RemappedRows(1, 0, False, True)), "failed"),
    (GpuReading(recovery_action=RecoveryAction.NODE_REBOOT), "failed"),
])
def test_health_state(reading: GpuReading, state: str) -> None:
    assert health_state(reading) == state


def test_unknown_reason_bits_and_recovery_codes_are_kept() -> None:
    reading = GpuReading(clock_event_reasons=0x10000 | 0x1, recovery_action=42)
    samples = samples_of(reading, {"gpu.index": "0"}, CounterTracker())
    reasons = {s.attributes["gpu.clock_event_reason"]: s.value for s in samples
               if s.name == "ridethrough.gpu.clock_event_reason"}
    assert reasons["0x10000"] == 1 and reasons["GpuIdle"] == 1 and reasons["SwPowerCap"] == 0
    actions = {s.attributes["gpu.recovery_action"]: s.value for s in samples
               if s.name == "ridethrough.gpu.recovery_action"}
    assert actions["42"] == 1 and actions["none"] == 0 and len(actions) == len(RecoveryAction) + 1


# -- wiring and the catalogue -----------------------------------------------------------------------


def test_from_config_reads_the_labs_script_or_real_nvml(path: Path) -> None:
    lab = from_config(AgentConfig(gpu_script=str(path), interval_s=2.5, sources=("gpu",)))
    assert isinstance(lab, BackgroundSource) and lab.name == "gpu" and lab.interval_s == 2.5
    assert {s.attributes["gpu.index"] for s in lab.collect(time.time_ns())} == {"0", "1"}
    (real,) = build_sources(AgentConfig(sources=("gpu",)))
    assert isinstance(real, GpuSource) and isinstance(real.backend, PynvmlBackend)


def faulty_samples(tmp_path: Path, clock: Clock) -> list[Sample]:
    """Samples of every GPU state the catalogue describes: healthy, hot, erring, lost, old, with XIDs."""
    h100, v100 = tmp_path / "h100.json", tmp_path / "v100.json"
    create_fake_gpus(h100, 4, host="h0", seed=3, nvlinks=2)
    create_fake_gpus(v100, 1, host="h1", seed=3, nvlinks=2, unsupported=("remapped_rows",))
    script = GpuScript(h100)
    script.add(0, GpuFault.THERMAL, {"deg_per_s": 10.0}, start_ns=T0)
    script.add(1, GpuFault.ECC_DBE, {}, start_ns=T0)
    script.add(1, GpuFault.NVLINK_CRC, {"rate_per_s": 3.0, "link": 1}, start_ns=T0)
    script.add(2, GpuFault.XID, {"code": 63}, start_ns=T0)
    script.add(3, GpuFault.FALLEN_OFF_BUS, {}, start_ns=T0 + 5 * S)
    GpuScript(v100).add(0, GpuFault.ECC_SBE_RISING, {"rate_per_s": 1.0}, start_ns=T0)
    samples: list[Sample] = []
    for target, xids in ((h100, 2), (v100, 0)):
        src = make_source(target, clock)
        src.start(emit=Events())
        samples += src.collect(clock.at(1))
        wait_for(lambda src=src, xids=xids: src.watcher.xids_total >= xids, timeout_s=10, what="XIDs")
        samples += src.collect(clock.at(10))
        src.stop(timeout_s=5)
    return samples


def test_the_source_emits_exactly_what_the_catalogue_lists(tmp_path: Path, clock: Clock) -> None:
    samples = faulty_samples(tmp_path, clock)
    for sample in samples:
        spec = metric(sample.name)
        where = f"{sample.name} {dict(sample.attributes)}"
        assert spec.source == "gpu", where
        assert (sample.unit, sample.kind) == (spec.unit, spec.kind), where
        assert sorted(sample.attributes) == sorted(spec.attributes), where
        assert all(isinstance(v, str) and v for v in sample.attributes.values()), where
        assert set(GPU_ATTRIBUTES) <= set(spec.attributes), where
        if spec.kind is MetricKind.GAUGE and spec.unit == "1" and "utilization" not in spec.name:
            assert sample.value in (0, 1) or spec.name.endswith("clock_event_reasons"), where
    assert {m.name for m in metrics_of("gpu")} - {s.name for s in samples} == set()
