"""The NVML seam: one small protocol in front of the GPU management library.

The agent's GPU source talks to an `NvmlBackend`, never to ``pynvml`` directly.
`PynvmlBackend` is the real one (nvidia-ml-py over ``libnvidia-ml.so.1``);
``ridethrough.lab.fake_gpu.FakeNvmlBackend`` plays scripted faults through the same
protocol. Devices are addressed by NVML index; every value comes back as a plain
int, str or frozen dataclass, never a ctypes struct.

Failures are exceptions from one small hierarchy rooted at `NvmlError`, keeping the
NVML return codes that a caller acts on apart:

* `NvmlNotSupported`: this GPU (or driver) cannot answer this call; ask once, remember;
* `NvmlGpuLost`: ``NVML_ERROR_GPU_IS_LOST``, the GPU has fallen off the bus;
* `NvmlUnavailable`: no NVML on this machine (library missing, driver not loaded);
* `NvmlError` itself: anything else, with NVML's ``code`` and message.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import pynvml

from ridethrough.collector.nvml_tables import (
    XID_TABLE,
    ClockEventReason,
    RecoveryAction,
    XidClass,
    XidInfo,
    decode_clock_event_reasons,
    recovery_action_name,
    xid_info,
)

__all__ = [
    "XID_TABLE",
    "ClockEventReason",
    "EccCounts",
    "MemoryInfo",
    "NvlinkCounters",
    "NvmlBackend",
    "NvmlError",
    "NvmlGpuLost",
    "NvmlNotSupported",
    "NvmlUnavailable",
    "PynvmlBackend",
    "RecoveryAction",
    "RemappedRows",
    "RetiredPages",
    "Utilization",
    "XidClass",
    "XidEvent",
    "XidInfo",
    "decode_clock_event_reasons",
    "nvml_error",
    "recovery_action_name",
    "xid_info",
]


class NvmlError(Exception):
    """An NVML call failed; ``code`` is NVML's return code (``pynvml.NVML_ERROR_*``)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"NVML error {code}: {message}")
        self.code = code
        self.message = message


class NvmlNotSupported(NvmlError):
    """The call is not supported on this GPU or driver; a caller records it once and stops asking."""


class NvmlGpuLost(NvmlError):
    """The GPU is lost (``NVML_ERROR_GPU_IS_LOST``, XID 79): it has fallen off the bus."""


class NvmlUnavailable(NvmlError):
    """NVML cannot be used on this machine: no library, no driver, or a driver/library mismatch."""


_NOT_SUPPORTED = frozenset({pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND})
_UNAVAILABLE = frozenset({
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND,
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
    pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH,
})


def nvml_error(code: int, message: str) -> NvmlError:
    """Build the `NvmlError` subclass that NVML return code ``code`` maps to."""
    if code in _NOT_SUPPORTED:
        return NvmlNotSupported(code, message)
    if code == pynvml.NVML_ERROR_GPU_IS_LOST:
        return NvmlGpuLost(code, message)
    if code in _UNAVAILABLE:
        return NvmlUnavailable(code, message)
    return NvmlError(code, message)


@dataclass(frozen=True, slots=True)
class Utilization:
    """Percent of the last sample period the GPU was busy, and its memory was read or written."""

    gpu_percent: int
    memory_percent: int


@dataclass(frozen=True, slots=True)
class MemoryInfo:
    """Frame-buffer memory, in bytes."""

    used_bytes: int
    total_bytes: int


@dataclass(frozen=True, slots=True)
class EccCounts:
    """``nvmlDeviceGetTotalEccErrors`` for both error types and both counter types.

    Volatile counts reset at driver load; aggregate counts persist over the GPU's life.
    """

    corrected_volatile: int
    corrected_aggregate: int
    uncorrected_volatile: int
    uncorrected_aggregate: int


@dataclass(frozen=True, slots=True)
class RemappedRows:
    """``nvmlDeviceGetRemappedRows``: rows remapped for correctable and uncorrectable errors.

    ``pending``: a remap waits for the next GPU reset; ``failure``: a remap failed (RMA).
    """

    corrected: int
    uncorrected: int
    pending: bool
    failure: bool


@dataclass(frozen=True, slots=True)
class RetiredPages:
    """Pages retired by dynamic page retirement (before Ampere; Ampere and newer remap rows instead).

    Read through the fields ``NVML_FI_DEV_RETIRED_SBE``, ``_DBE`` and ``_PENDING``;
    ``pending``: a retirement waits for the next reattach of the driver or GPU reset.
    """

    single_bit: int
    double_bit: int
    pending: bool


@dataclass(frozen=True, slots=True)
class NvlinkCounters:
    """``nvmlDeviceGetNvLinkErrorCounter`` for one link: data-link-layer error totals."""

    crc_flit: int
    crc_data: int
    replay: int
    recovery: int


@dataclass(frozen=True, slots=True)
class XidEvent:
    """One critical XID event, as NVML's event set delivers it."""

    gpu_index: int
    uuid: str
    xid: int
    timestamp_ns: int
    """When it happened (the fake) or when NVML delivered it (the real one), ns since the epoch."""


@runtime_checkable
class NvmlBackend(Protocol):
    """The NVML calls the GPU source makes, by device index. Every call may raise `NvmlError`."""

    def init(self) -> None:
        """``nvmlInit``: must succeed before any other call; `NvmlUnavailable` where there is no NVML."""
        ...

    def shutdown(self) -> None:
        """``nvmlShutdown``, and release anything `wait_xid` holds."""
        ...

    def driver_version(self) -> str:
        """``nvmlSystemGetDriverVersion``, e.g. ``"550.90.07"``."""
        ...

    def device_count(self) -> int:
        """``nvmlDeviceGetCount``: GPUs visible, lost ones included."""
        ...

    def uuid(self, index: int) -> str:
        """``nvmlDeviceGetUUID``, e.g. ``"GPU-8c3d…"``."""
        ...

    def name(self, index: int) -> str:
        """``nvmlDeviceGetName``, e.g. ``"NVIDIA H100 80GB HBM3"``."""
        ...

    def serial(self, index: int) -> str:
        """``nvmlDeviceGetSerial``: the board serial number."""
        ...

    def pci_bus_id(self, index: int) -> str:
        """``nvmlDeviceGetPciInfo().busId``, e.g. ``"00000000:18:00.0"``."""
        ...

    def utilization(self, index: int) -> Utilization:
        """``nvmlDeviceGetUtilizationRates``."""
        ...

    def memory(self, index: int) -> MemoryInfo:
        """``nvmlDeviceGetMemoryInfo``."""
        ...

    def temperature_c(self, index: int) -> int:
        """GPU die temperature in °C (``nvmlDeviceGetTemperatureV``, sensor ``NVML_TEMPERATURE_GPU``)."""
        ...

    def power_mw(self, index: int) -> int:
        """``nvmlDeviceGetPowerUsage``: board power draw in milliwatts."""
        ...

    def sm_clock_mhz(self, index: int) -> int:
        """``nvmlDeviceGetClockInfo(NVML_CLOCK_SM)``: current SM clock in MHz."""
        ...

    def clock_event_reasons(self, index: int) -> int:
        """``nvmlDeviceGetCurrentClocksEventReasons``: a `ClockEventReason` bit mask."""
        ...

    def ecc_errors(self, index: int) -> EccCounts:
        """``nvmlDeviceGetTotalEccErrors``, corrected and uncorrected, volatile and aggregate."""
        ...

    def remapped_rows(self, index: int) -> RemappedRows:
        """``nvmlDeviceGetRemappedRows`` (Ampere and newer)."""
        ...

    def retired_pages(self, index: int) -> RetiredPages:
        """Retired pages and whether one is pending (fields ``NVML_FI_DEV_RETIRED_*``; before Ampere)."""
        ...

    def pcie_replay_count(self, index: int) -> int:
        """``nvmlDeviceGetPcieReplayCounter``: PCIe link-level retransmissions since driver load."""
        ...

    def recovery_action(self, index: int) -> int:
        """The driver's recommended `RecoveryAction` (field ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``, R550+)."""
        ...

    def nvlink_count(self, index: int) -> int:
        """NVLink links on this GPU (field ``NVML_FI_DEV_NVLINK_LINK_COUNT``); links are 0 … count-1."""
        ...

    def nvlink_active(self, index: int, link: int) -> bool:
        """``nvmlDeviceGetNvLinkState``: whether the link is up."""
        ...

    def nvlink_errors(self, index: int, link: int) -> NvlinkCounters:
        """``nvmlDeviceGetNvLinkErrorCounter`` for CRC flit, CRC data, replay and recovery."""
        ...

    def wait_xid(self, timeout_ms: int) -> XidEvent | None:
        """Wait up to ``timeout_ms`` for the next critical XID on any GPU; None when none came."""
        ...


_Fn = Callable[..., Any]


class PynvmlBackend(NvmlBackend):
    """`NvmlBackend` over ``pynvml`` (nvidia-ml-py). Constructing it touches nothing; `init` loads NVML."""

    def __init__(self, *, clock: Callable[[], int] = time.time_ns) -> None:
        self._clock = clock
        self._handles: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._event_lock = threading.Lock()  # one event set, even when two threads wait at once
        self._event_set: Any = None
        self._event_gpus: dict[int | None, tuple[int, str]] = {}

    @staticmethod
    def _call(fn: _Fn, *args: Any) -> Any:
        try:
            return fn(*args)
        except pynvml.NVMLError as err:
            raise nvml_error(int(err.value), str(err)) from None

    def _handle(self, index: int) -> Any:
        with self._lock:
            handle = self._handles.get(index)
        if handle is None:
            handle = self._call(pynvml.nvmlDeviceGetHandleByIndex, index)
            with self._lock:
                self._handles[index] = handle
        return handle

    def _on(self, fn: _Fn, index: int, *args: Any) -> Any:
        return self._call(fn, self._handle(index), *args)

    def init(self) -> None:
        """``nvmlInit``; raises `NvmlUnavailable` on a machine without an NVIDIA driver."""
        self._call(pynvml.nvmlInit)

    def shutdown(self) -> None:
        """Free the XID event set and ``nvmlShutdown``; a backend that never started has nothing to stop."""
        with self._event_lock:
            event_set, self._event_set = self._event_set, None
            self._event_gpus = {}
        with self._lock:
            self._handles.clear()
        try:
            if event_set is not None:
                self._call(pynvml.nvmlEventSetFree, event_set)
            self._call(pynvml.nvmlShutdown)
        except NvmlError as err:
            if err.code != pynvml.NVML_ERROR_UNINITIALIZED:
                raise

    def driver_version(self) -> str:
        """See `NvmlBackend.driver_version`."""
        return _text(self._call(pynvml.nvmlSystemGetDriverVersion))

    def device_count(self) -> int:
        """See `NvmlBackend.device_count`."""
        return int(self._call(pynvml.nvmlDeviceGetCount))

    def uuid(self, index: int) -> str:
        """See `NvmlBackend.uuid`."""
        return _text(self._on(pynvml.nvmlDeviceGetUUID, index))

    def name(self, index: int) -> str:
        """See `NvmlBackend.name`."""
        return _text(self._on(pynvml.nvmlDeviceGetName, index))

    def serial(self, index: int) -> str:
        """See `NvmlBackend.serial`."""
        return _text(self._on(pynvml.nvmlDeviceGetSerial, index))

    def pci_bus_id(self, index: int) -> str:
        """See `NvmlBackend.pci_bus_id`."""
        return _text(self._on(pynvml.nvmlDeviceGetPciInfo, index).busId)

    def utilization(self, index: int) -> Utilization:
        """See `NvmlBackend.utilization`."""
        rates = self._on(pynvml.nvmlDeviceGetUtilizationRates, index)
        return Utilization(gpu_percent=int(rates.gpu), memory_percent=int(rates.memory))

    def memory(self, index: int) -> MemoryInfo:
        """See `NvmlBackend.memory`."""
        info = self._on(pynvml.nvmlDeviceGetMemoryInfo, index)
        return MemoryInfo(used_bytes=int(info.used), total_bytes=int(info.total))

    def temperature_c(self, index: int) -> int:
        """See `NvmlBackend.temperature_c`; falls back to the older call where the driver lacks the V one."""
        current = getattr(pynvml, "nvmlDeviceGetTemperatureV", None)  # older nvidia-ml-py releases lack it
        if current is not None:
            try:
                return int(self._on(current, index, pynvml.NVML_TEMPERATURE_GPU))
            except NvmlNotSupported as err:
                if err.code != pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                    raise
        return int(self._on(pynvml.nvmlDeviceGetTemperature, index, pynvml.NVML_TEMPERATURE_GPU))

    def power_mw(self, index: int) -> int:
        """See `NvmlBackend.power_mw`."""
        return int(self._on(pynvml.nvmlDeviceGetPowerUsage, index))

    def sm_clock_mhz(self, index: int) -> int:
        """See `NvmlBackend.sm_clock_mhz`."""
        return int(self._on(pynvml.nvmlDeviceGetClockInfo, index, pynvml.NVML_CLOCK_SM))

    def clock_event_reasons(self, index: int) -> int:
        """See `NvmlBackend.clock_event_reasons`."""
        return int(self._on(pynvml.nvmlDeviceGetCurrentClocksEventReasons, index))

    def ecc_errors(self, index: int) -> EccCounts:
        """See `NvmlBackend.ecc_errors`."""
        def total(error_type: int, counter_type: int) -> int:
            return int(self._on(pynvml.nvmlDeviceGetTotalEccErrors, index, error_type, counter_type))

        corrected, uncorrected = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        return EccCounts(
            corrected_volatile=total(corrected, pynvml.NVML_VOLATILE_ECC),
            corrected_aggregate=total(corrected, pynvml.NVML_AGGREGATE_ECC),
            uncorrected_volatile=total(uncorrected, pynvml.NVML_VOLATILE_ECC),
            uncorrected_aggregate=total(uncorrected, pynvml.NVML_AGGREGATE_ECC),
        )

    def remapped_rows(self, index: int) -> RemappedRows:
        """See `NvmlBackend.remapped_rows`."""
        corrected, uncorrected, pending, failure = self._on(pynvml.nvmlDeviceGetRemappedRows, index)
        return RemappedRows(int(corrected), int(uncorrected), bool(pending), bool(failure))

    def retired_pages(self, index: int) -> RetiredPages:
        """See `NvmlBackend.retired_pages`."""
        sbe, dbe, pending = self._fields(index, _RETIRED_FIELDS)
        return RetiredPages(single_bit=sbe, double_bit=dbe, pending=bool(pending))

    def pcie_replay_count(self, index: int) -> int:
        """See `NvmlBackend.pcie_replay_count`."""
        return int(self._on(pynvml.nvmlDeviceGetPcieReplayCounter, index))

    def recovery_action(self, index: int) -> int:
        """See `NvmlBackend.recovery_action`."""
        (action,) = self._fields(index, (_FI_GPU_RECOVERY_ACTION,))
        return action

    def nvlink_count(self, index: int) -> int:
        """See `NvmlBackend.nvlink_count`."""
        (count,) = self._fields(index, (pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT,))
        return count

    def _fields(self, index: int, field_ids: tuple[int, ...]) -> list[int]:
        """``nvmlDeviceGetFieldValues`` for integer fields; a field the GPU lacks raises its own error."""
        values = self._on(pynvml.nvmlDeviceGetFieldValues, index, list(field_ids))
        out: list[int] = []
        for field_id, value in zip(field_ids, values, strict=True):
            if value.nvmlReturn != pynvml.NVML_SUCCESS:
                raise nvml_error(int(value.nvmlReturn), f"field value {field_id}")
            member = _VALUE_MEMBERS.get(int(value.valueType), "ullVal")
            out.append(int(getattr(value.value, member)))
        return out

    def nvlink_active(self, index: int, link: int) -> bool:
        """See `NvmlBackend.nvlink_active`."""
        return bool(self._on(pynvml.nvmlDeviceGetNvLinkState, index, link) == pynvml.NVML_FEATURE_ENABLED)

    def nvlink_errors(self, index: int, link: int) -> NvlinkCounters:
        """See `NvmlBackend.nvlink_errors`."""
        def counter(kind: int) -> int:
            return int(self._on(pynvml.nvmlDeviceGetNvLinkErrorCounter, index, link, kind))

        return NvlinkCounters(
            crc_flit=counter(pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT),
            crc_data=counter(pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA),
            replay=counter(pynvml.NVML_NVLINK_ERROR_DL_REPLAY),
            recovery=counter(pynvml.NVML_NVLINK_ERROR_DL_RECOVERY),
        )

    def _xid_event_set(self) -> Any:
        """Create the event set on first use, with every GPU that supports critical-XID events."""
        with self._event_lock:
            if self._event_set is None:
                self._event_set = self._new_event_set()
            return self._event_set

    def _new_event_set(self) -> Any:
        event_set = self._call(pynvml.nvmlEventSetCreate)
        gpus: dict[int | None, tuple[int, str]] = {}
        try:
            for index in range(self.device_count()):
                try:
                    handle = self._handle(index)
                    self._call(pynvml.nvmlDeviceRegisterEvents, handle, pynvml.nvmlEventTypeXidCriticalError,
                               event_set)
                    gpus[_address(handle)] = (index, self.uuid(index))
                except (NvmlNotSupported, NvmlGpuLost):
                    continue  # a lost GPU or one without XID events cannot tell us anything here
            if not gpus:
                raise NvmlNotSupported(pynvml.NVML_ERROR_NOT_SUPPORTED, "no GPU supports critical XID events")
        except NvmlError:
            self._call(pynvml.nvmlEventSetFree, event_set)
            raise
        self._event_gpus = gpus
        return event_set

    def wait_xid(self, timeout_ms: int) -> XidEvent | None:
        """``nvmlEventSetWait`` on an event set of critical-XID events from every GPU."""
        event_set = self._xid_event_set()
        try:
            data = pynvml.nvmlEventSetWait(event_set, timeout_ms)
        except pynvml.NVMLError as err:
            if int(err.value) == pynvml.NVML_ERROR_TIMEOUT:
                return None
            raise nvml_error(int(err.value), str(err)) from None
        if not int(data.eventType) & pynvml.nvmlEventTypeXidCriticalError:
            return None
        index, uuid = self._event_gpus.get(_address(data.device), (-1, ""))
        return XidEvent(gpu_index=index, uuid=uuid, xid=int(data.eventData), timestamp_ns=self._clock())


_FI_GPU_RECOVERY_ACTION: int = getattr(pynvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", 230)
"""Field id 230 (R550+); nvidia-ml-py releases before R550 do not name it, drivers before R550 answer NOT_SUPPORTED."""
_RETIRED_FIELDS = (pynvml.NVML_FI_DEV_RETIRED_SBE, pynvml.NVML_FI_DEV_RETIRED_DBE, pynvml.NVML_FI_DEV_RETIRED_PENDING)
_VALUE_MEMBERS: dict[int, str] = {
    pynvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
    getattr(pynvml, "NVML_VALUE_TYPE_UNSIGNED_SHORT", 6): "usVal",
}
"""Which member of ``nvmlValue_t`` holds a field value, by ``valueType``."""


def _address(handle: Any) -> int | None:
    """A device handle's pointer value: the same GPU always has the same handle."""
    return ctypes.cast(handle, ctypes.c_void_p).value


def _text(value: object) -> str:
    """NVML strings arrive as str (pynvml decodes most) or bytes (struct fields such as ``busId``)."""
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return str(value)
