"""The NVML seam: the real backend on this machine, error translation, the tables, the protocol."""

from __future__ import annotations

import contextlib
import ctypes
import inspect
from pathlib import Path

import pynvml
import pytest

from ridethrough.collector.nvml import (
    XID_TABLE,
    ClockEventReason,
    EccCounts,
    MemoryInfo,
    NvlinkCounters,
    NvmlBackend,
    NvmlError,
    NvmlGpuLost,
    NvmlNotSupported,
    NvmlUnavailable,
    PynvmlBackend,
    RecoveryAction,
    RemappedRows,
    RetiredPages,
    Utilization,
    XidClass,
    decode_clock_event_reasons,
    nvml_error,
    recovery_action_name,
    xid_info,
)
from ridethrough.lab.fake_gpu import FakeNvmlBackend, create_fake_gpus
from ridethrough.lab.fake_gpu_state import PER_GPU_CALLS


def _nvml_loads() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


HAVE_NVML = _nvml_loads()


@pytest.mark.skipif(HAVE_NVML, reason="this machine has an NVIDIA driver")
def test_real_backend_constructs_and_init_says_unavailable_without_a_driver() -> None:
    backend = PynvmlBackend()  # constructing touches nothing
    with pytest.raises(NvmlUnavailable) as raised:
        backend.init()
    assert raised.value.code in (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    assert raised.value.__cause__ is None, "the pynvml exception is translated, not chained"
    backend.shutdown()  # never started: nothing to stop, no error


def test_real_backend_before_init_is_uninitialised() -> None:
    with pytest.raises(NvmlError) as raised:
        PynvmlBackend().device_count()
    assert raised.value.code == pynvml.NVML_ERROR_UNINITIALIZED and type(raised.value) is NvmlError


@pytest.mark.parametrize(("code", "kind"), [
    (pynvml.NVML_ERROR_NOT_SUPPORTED, NvmlNotSupported),
    (pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, NvmlNotSupported),
    (pynvml.NVML_ERROR_GPU_IS_LOST, NvmlGpuLost),
    (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, NvmlUnavailable),
    (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, NvmlUnavailable),
    (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, NvmlUnavailable),
    (pynvml.NVML_ERROR_INVALID_ARGUMENT, NvmlError),
    (pynvml.NVML_ERROR_UNKNOWN, NvmlError),
])
def test_nvml_codes_map_onto_the_hierarchy(code: int, kind: type[NvmlError], monkeypatch: pytest.MonkeyPatch) -> None:
    assert type(nvml_error(code, "x")) is kind and nvml_error(code, "x").code == code

    def fails() -> int:
        raise pynvml.NVMLError(code)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", fails)
    with pytest.raises(kind) as raised:
        PynvmlBackend().device_count()
    assert type(raised.value) is kind and raised.value.code == code


def test_temperature_falls_back_on_drivers_without_the_v_call(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(*_args: object) -> int:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda index: object())
    monkeypatch.setattr(pynvml, "nvmlDeviceGetTemperatureV", missing)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetTemperature", lambda handle, sensor: 61)
    assert PynvmlBackend().temperature_c(0) == 61


def test_wait_xid_maps_nvml_events_to_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """The event-set path over pynvml's own ctypes types, with the C library replaced at its edge."""
    handles = [ctypes.pointer(pynvml.struct_c_nvmlDevice_t()) for _ in range(3)]
    freed: list[object] = []
    delivered = pynvml.c_nvmlEventData_t()
    delivered.device = handles[2]
    delivered.eventType = pynvml.nvmlEventTypeXidCriticalError
    delivered.eventData = 79
    queue = [delivered]

    def register(handle: object, event_types: int, event_set: object) -> None:
        if handle is handles[1]:  # a GPU without XID events is left out, not fatal
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        assert event_types == pynvml.nvmlEventTypeXidCriticalError and event_set == "set"

    def wait(event_set: object, timeout_ms: int) -> object:
        if not queue:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        return queue.pop()

    for name, fn in {
        "nvmlDeviceGetCount": lambda: 3, "nvmlDeviceGetHandleByIndex": lambda i: handles[i],
        "nvmlDeviceGetUUID": lambda h: f"GPU-{handles.index(h)}", "nvmlEventSetCreate": lambda: "set",
        "nvmlDeviceRegisterEvents": register, "nvmlEventSetWait": wait, "nvmlEventSetFree": freed.append,
        "nvmlShutdown": lambda: None,
    }.items():
        monkeypatch.setattr(pynvml, name, fn)
    backend = PynvmlBackend(clock=lambda: 123)
    event = backend.wait_xid(100)
    assert event is not None and (event.gpu_index, event.uuid, event.xid, event.timestamp_ns) == (2, "GPU-2", 79, 123)
    assert backend.wait_xid(100) is None, "NVML's timeout is no event, not an error"
    backend.shutdown()
    assert freed == ["set"]


def _field_values(monkeypatch: pytest.MonkeyPatch, answers: dict[int, tuple[int, int, object]]) -> list[list[int]]:
    """Replace nvmlDeviceGetFieldValues at its edge: field id -> (nvmlReturn, valueType, value)."""
    asked: list[list[int]] = []

    def get(handle: object, field_ids: list[int]) -> object:
        asked.append(list(field_ids))
        values = (pynvml.c_nvmlFieldValue_t * len(field_ids))()
        for slot, field_id in zip(values, field_ids, strict=True):
            ret, value_type, value = answers[field_id]
            slot.fieldId, slot.nvmlReturn, slot.valueType = field_id, ret, value_type
            member = {pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal", pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
                      pynvml.NVML_VALUE_TYPE_DOUBLE: "dVal"}[value_type]
            setattr(slot.value, member, value)
        return values

    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda index: object())
    monkeypatch.setattr(pynvml, "nvmlDeviceGetFieldValues", get)
    return asked


def test_field_values_are_read_by_their_value_type(monkeypatch: pytest.MonkeyPatch) -> None:
    ok, uint, ull, dbl = (pynvml.NVML_SUCCESS, pynvml.NVML_VALUE_TYPE_UNSIGNED_INT,
                          pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, pynvml.NVML_VALUE_TYPE_DOUBLE)
    asked = _field_values(monkeypatch, {
        pynvml.NVML_FI_DEV_RETIRED_SBE: (ok, ull, 3), pynvml.NVML_FI_DEV_RETIRED_DBE: (ok, uint, 1),
        pynvml.NVML_FI_DEV_RETIRED_PENDING: (ok, dbl, 1.0),
        pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: (ok, uint, RecoveryAction.GPU_RESET),
        pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT: (ok, uint, 18),
    })
    backend = PynvmlBackend()
    assert backend.retired_pages(0) == RetiredPages(single_bit=3, double_bit=1, pending=True)
    assert backend.recovery_action(0) == RecoveryAction.GPU_RESET and backend.nvlink_count(0) == 18
    assert len(asked[0]) == 3, "the three retired-page fields in one call"


def test_a_field_the_gpu_lacks_raises_its_own_error(monkeypatch: pytest.MonkeyPatch) -> None:
    _field_values(monkeypatch, {
        pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: (pynvml.NVML_ERROR_NOT_SUPPORTED, 1, 0),
        pynvml.NVML_FI_DEV_RETIRED_SBE: (pynvml.NVML_SUCCESS, pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, 0),
        pynvml.NVML_FI_DEV_RETIRED_DBE: (pynvml.NVML_ERROR_GPU_IS_LOST, 1, 0),
        pynvml.NVML_FI_DEV_RETIRED_PENDING: (pynvml.NVML_SUCCESS, pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, 0),
    })
    with pytest.raises(NvmlNotSupported):
        PynvmlBackend().recovery_action(0)
    with pytest.raises(NvmlGpuLost):
        PynvmlBackend().retired_pages(0)


def test_recovery_actions_are_nvmls() -> None:
    for action in RecoveryAction:
        assert getattr(pynvml, f"NVML_GPU_RECOVERY_ACTION_{action.name}") == action.value
    assert recovery_action_name(4) == "drain_and_reset" and recovery_action_name(99) == "99"


def test_clock_event_reason_bits_are_pynvmls() -> None:
    expected = {
        "GpuIdle": pynvml.nvmlClocksEventReasonGpuIdle,
        "ApplicationsClocksSetting": pynvml.nvmlClocksEventReasonApplicationsClocksSetting,
        "SwPowerCap": pynvml.nvmlClocksEventReasonSwPowerCap,
        "HwSlowdown": pynvml.nvmlClocksEventReasonHwSlowdown,
        "SyncBoost": pynvml.nvmlClocksEventReasonSyncBoost,
        "SwThermalSlowdown": pynvml.nvmlClocksEventReasonSwThermalSlowdown,
        "HwThermalSlowdown": pynvml.nvmlClocksEventReasonHwThermalSlowdown,
        "HwPowerBrakeSlowdown": pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown,
        "DisplayClockSetting": pynvml.nvmlClocksEventReasonDisplayClockSetting,
    }
    assert {r.name: r.value for r in ClockEventReason} == expected
    for name, bit in expected.items():
        assert decode_clock_event_reasons(bit) == (name,)


def test_decode_clock_event_reasons() -> None:
    assert decode_clock_event_reasons(0) == ()
    assert decode_clock_event_reasons(0x61) == ("GpuIdle", "SwThermalSlowdown", "HwThermalSlowdown")
    assert decode_clock_event_reasons(0x4 | 0x10000) == ("SwPowerCap", "0x10000"), "unknown bits are kept"


def test_xid_table_covers_the_fleet_xids_with_their_classes() -> None:
    wanted = {13, 31, 43, 45, 48, 61, 62, 63, 64, 68, 69, 74, 79, 92, 94, 95, 119, 120, 140}
    assert wanted <= set(XID_TABLE)
    assert all(info.code == code and info.meaning for code, info in XID_TABLE.items())
    classes = {code: xid_info(code).xid_class for code in wanted}
    assert classes[13] is classes[31] is classes[43] is XidClass.APPLICATION_ERROR
    assert classes[48] is classes[74] is classes[95] is classes[119] is XidClass.GPU_RESET
    assert classes[79] is XidClass.NODE_REBOOT
    assert classes[63] is classes[92] is XidClass.PRECURSOR
    assert classes[45] is XidClass.INFORMATIONAL
    assert "fallen off the bus" in xid_info(79).meaning and "Double-bit" in xid_info(48).meaning
    assert set(classes.values()) == set(XidClass) - {XidClass.UNKNOWN}
    assert xid_info(4242).xid_class is XidClass.UNKNOWN and "4242" in xid_info(4242).meaning


def test_both_backends_satisfy_the_protocol(tmp_path: Path) -> None:
    create_fake_gpus(tmp_path / "gpus.json", 2, host="h0", seed=1)
    fake: NvmlBackend = FakeNvmlBackend(tmp_path / "gpus.json")
    real: NvmlBackend = PynvmlBackend()
    assert isinstance(fake, NvmlBackend) and isinstance(real, NvmlBackend)
    members = {name for name, _ in inspect.getmembers(NvmlBackend, inspect.isfunction) if not name.startswith("_")}
    assert "wait_xid" in members and len(members) == 23
    per_gpu = {name for name in members if "index" in inspect.signature(getattr(NvmlBackend, name)).parameters}
    assert per_gpu == PER_GPU_CALLS, "a fake GPU can declare any per-GPU call unsupported, and only those"
    for cls in (FakeNvmlBackend, PynvmlBackend):
        for name in members:
            mine, theirs = inspect.signature(getattr(cls, name)), inspect.signature(getattr(NvmlBackend, name))
            assert mine.parameters.keys() == theirs.parameters.keys(), (cls.__name__, name)
            assert mine.return_annotation == theirs.return_annotation, (cls.__name__, name)


@pytest.mark.skipif(not HAVE_NVML, reason="needs an NVIDIA driver")
def test_real_backend_on_a_real_gpu() -> None:
    """On a machine with GPUs, every call answers with its type or says it is not supported."""
    backend = PynvmlBackend()
    backend.init()
    try:
        assert backend.device_count() >= 1 and backend.driver_version()
        expected: dict[str, type] = {
            "uuid": str, "name": str, "serial": str, "pci_bus_id": str, "utilization": Utilization,
            "memory": MemoryInfo, "temperature_c": int, "power_mw": int, "sm_clock_mhz": int,
            "clock_event_reasons": int, "ecc_errors": EccCounts, "remapped_rows": RemappedRows,
            "pcie_replay_count": int, "nvlink_count": int, "retired_pages": RetiredPages, "recovery_action": int,
        }
        for name, kind in expected.items():
            with contextlib.suppress(NvmlNotSupported):
                assert isinstance(getattr(backend, name)(0), kind), name
        assert backend.uuid(0).startswith("GPU-") and 0 < backend.temperature_c(0) < 120
        try:
            links = backend.nvlink_count(0)
        except NvmlNotSupported:
            links = 0
        for link in range(links):
            assert isinstance(backend.nvlink_active(0, link), bool)
            with contextlib.suppress(NvmlNotSupported):
                assert isinstance(backend.nvlink_errors(0, link), NvlinkCounters)
        try:
            event = backend.wait_xid(10)
            assert event is None or event.gpu_index >= 0
        except NvmlNotSupported:
            pass
    finally:
        backend.shutdown()
