"""What NVML's numbers mean: clock event reason bits, recovery actions and XID codes.

The clock event reason bits are pynvml's own constants (``nvmlClocksEventReason*``), so
they cannot drift from the library. The recovery actions are NVML's
``nvmlDeviceGpuRecoveryAction_t`` (read through the field ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``);
they are spelled out here because nvidia-ml-py releases before R550 do not define them. The
XID table follows NVIDIA's Xid catalogue (docs.nvidia.com/deploy/xid-errors); each code's
class is the action it calls for on an Ampere-or-newer data-centre GPU, which is what a
detector needs to decide.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

import pynvml


class ClockEventReason(enum.IntFlag):
    """Why the clocks are below their maximum (``nvmlDeviceGetCurrentClocksEventReasons``)."""

    GpuIdle = int(pynvml.nvmlClocksEventReasonGpuIdle)
    ApplicationsClocksSetting = int(pynvml.nvmlClocksEventReasonApplicationsClocksSetting)
    SwPowerCap = int(pynvml.nvmlClocksEventReasonSwPowerCap)
    HwSlowdown = int(pynvml.nvmlClocksEventReasonHwSlowdown)
    SyncBoost = int(pynvml.nvmlClocksEventReasonSyncBoost)
    SwThermalSlowdown = int(pynvml.nvmlClocksEventReasonSwThermalSlowdown)
    HwThermalSlowdown = int(pynvml.nvmlClocksEventReasonHwThermalSlowdown)
    HwPowerBrakeSlowdown = int(pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown)
    DisplayClockSetting = int(pynvml.nvmlClocksEventReasonDisplayClockSetting)


def decode_clock_event_reasons(mask: int) -> tuple[str, ...]:
    """Name each bit set in a clock event reason mask, lowest bit first.

    Bits this table does not know (newer drivers add some) come back as ``"0x…"`` so
    nothing is silently dropped: ``decode_clock_event_reasons(0x61)`` is
    ``("GpuIdle", "SwThermalSlowdown", "HwThermalSlowdown")``.
    """
    names: list[str] = []
    for bit in range(mask.bit_length()):
        value = 1 << bit
        if not mask & value:
            continue
        try:
            names.append(ClockEventReason(value).name or hex(value))
        except ValueError:
            names.append(hex(value))
    return tuple(names)


class RecoveryAction(enum.IntEnum):
    """What the driver recommends doing to a GPU (``nvmlDeviceGpuRecoveryAction_t``, R550 and newer)."""

    NONE = 0
    GPU_RESET = 1
    NODE_REBOOT = 2
    DRAIN_P2P = 3
    """Stop peer-to-peer traffic to this GPU (an NVLink problem), then act."""
    DRAIN_AND_RESET = 4
    RECOVER_IMEX_DOMAIN = 5
    BUS_RESET = 6
    SYSTEM_REBOOT = 7


def recovery_action_name(code: int) -> str:
    """``RecoveryAction`` name in lower case (``gpu_reset``); a code newer than this table as its number."""
    try:
        return RecoveryAction(code).name.lower()
    except ValueError:
        return str(code)


class XidClass(enum.Enum):
    """What an XID asks of the operator, coarsest first."""

    APPLICATION_ERROR = "application error"
    """The application (or its input) faulted; the GPU is fine, restart the job."""
    GPU_RESET = "needs GPU reset"
    """The GPU must be drained and reset before it runs work again."""
    NODE_REBOOT = "needs node reboot"
    """The GPU is gone from the host; only a reboot (or a field service) brings it back."""
    PRECURSOR = "precursor"
    """Nothing failed yet, but the GPU is trending towards a failure: plan a drain."""
    INFORMATIONAL = "informational"
    """A consequence of another event, or a notice; no action on its own."""
    UNKNOWN = "unknown"
    """A code not in this table: look it up in NVIDIA's catalogue for the driver branch."""


@dataclass(frozen=True, slots=True)
class XidInfo:
    """One XID code, what it means, and what it asks for."""

    code: int
    meaning: str
    xid_class: XidClass


_A, _R, _B = XidClass.APPLICATION_ERROR, XidClass.GPU_RESET, XidClass.NODE_REBOOT
_P, _I = XidClass.PRECURSOR, XidClass.INFORMATIONAL

XID_TABLE: Mapping[int, XidInfo] = {
    info.code: info
    for info in (
        XidInfo(13, "Graphics engine exception (for example an out-of-range access in a kernel)", _A),
        XidInfo(31, "GPU memory page fault (an illegal address in an application)", _A),
        XidInfo(43, "GPU stopped processing: the channel was reset after a fault in user code", _A),
        XidInfo(45, "Preemptive cleanup of a channel, following an earlier error or a killed process", _I),
        XidInfo(48, "Double-bit (uncorrectable) ECC error in GPU memory", _R),
        XidInfo(61, "Internal micro-controller breakpoint or warning", _R),
        XidInfo(62, "Internal micro-controller halt", _R),
        XidInfo(63, "ECC page retirement or row-remapping event recorded; applied at the next GPU reset", _P),
        XidInfo(64, "ECC page retirement or row-remapper recording failure", _R),
        XidInfo(68, "Video processor (NVDEC) exception", _A),
        XidInfo(69, "Graphics engine class error", _A),
        XidInfo(74, "NVLink error (a link failed or saw fatal errors)", _R),
        XidInfo(79, "GPU has fallen off the bus", _B),
        XidInfo(92, "High single-bit ECC error rate", _P),
        XidInfo(94, "Contained ECC error: only the applications that touched the memory are affected", _A),
        XidInfo(95, "Uncontained ECC error: every application on the GPU is affected", _R),
        XidInfo(119, "GSP RPC timeout: the GPU System Processor stopped answering the driver", _R),
        XidInfo(120, "GSP error: the firmware on the GPU System Processor faulted", _R),
        XidInfo(140, "Unrecovered ECC error: the driver could not retire or remap the failing memory", _R),
    )
}
"""The XIDs a fleet operator meets most, by code."""


def xid_info(code: int) -> XidInfo:
    """Look up an XID; codes outside `XID_TABLE` come back with class `XidClass.UNKNOWN`."""
    known = XID_TABLE.get(code)
    if known is not None:
        return known
    return XidInfo(code, f"XID {code}: not in ridethrough's table, see NVIDIA's Xid catalogue", XidClass.UNKNOWN)
