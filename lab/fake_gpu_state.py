"""The fake GPUs' script, and their health as a pure function of the script and the time.

A host's ``gpus.json`` holds its inventory and a list of timed faults::

    {"version": 1, "host": "h0", "seed": 7, "driver_version": "550.90.07",
     "gpus": [{"index": 0, "uuid": "GPU-…", "serial": "1654…", "pci_bus_id": "00000000:18:00.0",
               "name": "NVIDIA H100 80GB HBM3", "nvlinks": 18, "memory_total_bytes": 85520809984,
               "unsupported": ["retired_pages"]}],
     "faults": [{"id": 1, "gpu": 0, "fault": "ecc_sbe_rising", "params": {"rate_per_s": 2.0},
                 "start_ns": 1700000000000000000, "end_ns": null}],
     "next_id": 2}

`gpu_state` reads nothing but that script and ``now_ns``, so the lab (which writes
the file) and the agent (which reads it through ``FakeNvmlBackend``, in another process)
always agree on what a GPU shows. Counters keep their totals after a fault ends, as
real hardware does; conditions (a pending remap, heat, a lost GPU, the driver's
recommended recovery action) end with the fault: clearing a GPU's faults stands for
resetting it. ``unsupported`` (optional) names the `NvmlBackend` calls the GPU answers
with ``NVML_ERROR_NOT_SUPPORTED``, as a GPU of another generation or a consumer board would.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ridethrough.collector.nvml import (
    ClockEventReason,
    EccCounts,
    MemoryInfo,
    NvlinkCounters,
    RecoveryAction,
    RemappedRows,
    RetiredPages,
    Utilization,
    XidClass,
    xid_info,
)
from ridethrough.lab.control import GpuFault

SCRIPT_VERSION = 1
H100_NAME = "NVIDIA H100 80GB HBM3"
H100_NVLINKS = 18
H100_MEMORY_TOTAL_BYTES = 81559 * 2**20
"""What ``nvidia-smi`` shows as 81559 MiB on an H100 SXM5 80GB."""
DRIVER_VERSION = "550.90.07"
H100_UNSUPPORTED = ("retired_pages",)
"""What an H100 answers NOT_SUPPORTED: it remaps rows instead of retiring pages."""
PER_GPU_CALLS = frozenset({
    "uuid", "name", "serial", "pci_bus_id", "utilization", "memory", "temperature_c", "power_mw",
    "sm_clock_mhz", "clock_event_reasons", "ecc_errors", "remapped_rows", "retired_pages",
    "pcie_replay_count", "recovery_action", "nvlink_count", "nvlink_active", "nvlink_errors",
})
"""The `NvmlBackend` calls about one GPU: those a fake GPU may list as unsupported."""

MAX_SM_CLOCK_MHZ = 1980
SW_THERMAL_SLOWDOWN_C = 87
HW_THERMAL_SLOWDOWN_C = 90
_THROTTLE_MHZ_PER_C = 75
_MIN_THROTTLED_MHZ = 1005
_COOL_DEG_PER_S = 2.0
"""How fast a GPU cools back towards its baseline once a THERMAL fault ends."""

# fault -> (required params, optional params with their defaults)
FAULT_PARAMS: Mapping[GpuFault, tuple[frozenset[str], Mapping[str, float]]] = {
    GpuFault.ECC_SBE_RISING: (frozenset(), {"rate_per_s": 1.0}),
    GpuFault.ROW_REMAP_PENDING: (frozenset(), {"rows": 1, "rate_per_s": 0.0}),
    GpuFault.ECC_DBE: (frozenset(), {"count": 1}),
    GpuFault.XID: (frozenset({"code"}), {}),
    GpuFault.THERMAL: (frozenset(), {"deg_per_s": 1.0, "cap_c": 95}),
    GpuFault.PCIE_REPLAY_STORM: (frozenset(), {"rate_per_s": 1.0}),
    GpuFault.NVLINK_CRC: (frozenset(), {"rate_per_s": 1.0, "link": 0}),
    GpuFault.FALLEN_OFF_BUS: (frozenset(), {}),
}
"""Parameters of each fault. ROW_REMAP_PENDING remaps ``rows`` rows at its start, then
``rate_per_s`` more each second; ECC_DBE is ``count`` uncorrectable errors at its start."""

XID_DOUBLE_BIT_ECC = 48
XID_FALLEN_OFF_BUS = 79


class ScriptError(ValueError):
    """The fake GPU script (or a fault to add to it) is malformed; the message says where and what."""


@dataclass(frozen=True, slots=True)
class FakeGpu:
    """One fake GPU's inventory entry."""

    index: int
    uuid: str
    serial: str
    pci_bus_id: str
    name: str
    nvlinks: int
    memory_total_bytes: int
    unsupported: tuple[str, ...] = ()
    """`PER_GPU_CALLS` this GPU answers with NVML_ERROR_NOT_SUPPORTED."""


@dataclass(frozen=True, slots=True)
class ScriptedFault:
    """One timed fault on one GPU; ``end_ns`` None means until cleared."""

    id: int
    gpu: int
    fault: GpuFault
    params: Mapping[str, float]
    start_ns: int
    end_ns: int | None = None

    def active(self, now_ns: int) -> bool:
        """Whether the fault is in force at ``now_ns``."""
        return self.start_ns <= now_ns and (self.end_ns is None or now_ns < self.end_ns)

    def elapsed_s(self, now_ns: int) -> float:
        """Seconds the fault has been in force by ``now_ns`` (it stops counting at its end)."""
        until = now_ns if self.end_ns is None else min(now_ns, self.end_ns)
        return max(0, until - self.start_ns) / 1e9

    def xid(self) -> int | None:
        """The XID this fault raises when it starts, if any."""
        if self.fault is GpuFault.XID:
            return int(self.params["code"])
        return {GpuFault.ECC_DBE: XID_DOUBLE_BIT_ECC, GpuFault.FALLEN_OFF_BUS: XID_FALLEN_OFF_BUS}.get(self.fault)


@dataclass(frozen=True, slots=True)
class Script:
    """A host's fake GPUs and their faults: the whole content of ``gpus.json``."""

    host: str
    seed: int
    driver_version: str
    gpus: tuple[FakeGpu, ...]
    faults: tuple[ScriptedFault, ...] = ()
    next_id: int = 1


def check_params(fault: GpuFault, params: Mapping[str, Any], gpu: FakeGpu) -> dict[str, float]:
    """Validate a fault's parameters against `FAULT_PARAMS` and fill in defaults."""
    required, optional = FAULT_PARAMS[fault]
    unknown = sorted(set(params) - required - set(optional))
    if unknown:
        allowed = sorted(required | set(optional)) or ["none"]
        raise ScriptError(f"{fault.value}: unknown parameter(s) {unknown}; allowed: {allowed}")
    missing = sorted(required - set(params))
    if missing:
        raise ScriptError(f"{fault.value}: missing parameter(s) {missing}")
    checked = {**optional, **params}
    for key, value in checked.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise ScriptError(f"{fault.value}: parameter {key!r} must be a finite number >= 0, not {value!r}")
    if "link" in checked and not (checked["link"] == int(checked["link"]) and checked["link"] < gpu.nvlinks):
        raise ScriptError(f"{fault.value}: link must be a whole number below {gpu.nvlinks}, not {checked['link']!r}")
    if "code" in checked and not (checked["code"] == int(checked["code"]) and checked["code"] > 0):
        raise ScriptError(f"{fault.value}: code must be a positive whole number, not {checked['code']!r}")
    return {key: float(value) for key, value in checked.items()}


def script_to_json(script: Script) -> str:
    """Serialise a script (the inverse of `parse_script`)."""
    raw = {
        "version": SCRIPT_VERSION,
        "host": script.host,
        "seed": script.seed,
        "driver_version": script.driver_version,
        "gpus": [
            {"index": g.index, "uuid": g.uuid, "serial": g.serial, "pci_bus_id": g.pci_bus_id, "name": g.name,
             "nvlinks": g.nvlinks, "memory_total_bytes": g.memory_total_bytes, "unsupported": list(g.unsupported)}
            for g in script.gpus
        ],
        "faults": [
            {"id": f.id, "gpu": f.gpu, "fault": f.fault.value, "params": dict(f.params), "start_ns": f.start_ns,
             "end_ns": f.end_ns}
            for f in script.faults
        ],
        "next_id": script.next_id,
    }
    return json.dumps(raw, indent=1) + "\n"


def parse_script(text: str, *, source: str) -> Script:
    """Parse and validate ``gpus.json``; a `ScriptError` names ``source`` and what is wrong."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        raise ScriptError(f"{source}: not valid JSON (line {err.lineno}, column {err.colno}: {err.msg})") from None
    try:
        return _script(raw)
    except ScriptError as err:
        raise ScriptError(f"{source}: {err}") from None


def _get(obj: Any, key: str, kind: type, where: str, *, optional: bool = False) -> Any:
    if not isinstance(obj, dict):
        raise ScriptError(f"{where} must be a JSON object")
    if key not in obj or (optional and obj[key] is None):
        if optional:
            return None
        raise ScriptError(f"{where}: missing {key!r}")
    value = obj[key]
    if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
        raise ScriptError(f"{where}: {key!r} must be {kind.__name__}, not {value!r}")
    return value


def _script(raw: Any) -> Script:
    version = _get(raw, "version", int, "script")
    if version != SCRIPT_VERSION:
        raise ScriptError(f"script version {version} is not {SCRIPT_VERSION}")
    gpus = tuple(_gpu(item, i) for i, item in enumerate(_get(raw, "gpus", list, "script")))
    faults = tuple(_fault(item, i, gpus) for i, item in enumerate(_get(raw, "faults", list, "script")))
    return Script(
        host=_get(raw, "host", str, "script"),
        seed=_get(raw, "seed", int, "script"),
        driver_version=_get(raw, "driver_version", str, "script"),
        gpus=gpus,
        faults=faults,
        next_id=_get(raw, "next_id", int, "script"),
    )


def _gpu(raw: Any, position: int) -> FakeGpu:
    where = f"gpus[{position}]"
    gpu = FakeGpu(
        index=_get(raw, "index", int, where),
        uuid=_get(raw, "uuid", str, where),
        serial=_get(raw, "serial", str, where),
        pci_bus_id=_get(raw, "pci_bus_id", str, where),
        name=_get(raw, "name", str, where),
        nvlinks=_get(raw, "nvlinks", int, where),
        memory_total_bytes=_get(raw, "memory_total_bytes", int, where),
        unsupported=check_unsupported(_get(raw, "unsupported", list, where, optional=True) or (), where),
    )
    if gpu.index != position:
        raise ScriptError(f"{where}: index {gpu.index} is out of order (expected {position})")
    return gpu


def check_unsupported(calls: Any, where: str = "unsupported") -> tuple[str, ...]:
    """Validate a GPU's list of unsupported calls against `PER_GPU_CALLS`."""
    if isinstance(calls, str) or not all(isinstance(c, str) for c in calls):
        raise ScriptError(f"{where}: 'unsupported' must be a list of call names, not {calls!r}")
    unknown = sorted(set(calls) - PER_GPU_CALLS)
    if unknown:
        raise ScriptError(f"{where}: unknown call(s) {unknown} in 'unsupported'; known: {sorted(PER_GPU_CALLS)}")
    return tuple(dict.fromkeys(calls))


def _fault(raw: Any, position: int, gpus: tuple[FakeGpu, ...]) -> ScriptedFault:
    where = f"faults[{position}]"
    gpu = _get(raw, "gpu", int, where)
    if not 0 <= gpu < len(gpus):
        raise ScriptError(f"{where}: gpu {gpu} does not exist ({len(gpus)} GPUs)")
    name = _get(raw, "fault", str, where)
    try:
        fault = GpuFault(name)
    except ValueError:
        raise ScriptError(f"{where}: unknown fault {name!r}; known: {[f.value for f in GpuFault]}") from None
    try:
        params = check_params(fault, _get(raw, "params", dict, where), gpus[gpu])
    except ScriptError as err:
        raise ScriptError(f"{where}: {err}") from None
    start_ns = _get(raw, "start_ns", int, where)
    end_ns = _get(raw, "end_ns", int, where, optional=True)
    return ScriptedFault(_get(raw, "id", int, where), gpu, fault, params, start_ns, end_ns)


@dataclass(frozen=True, slots=True)
class GpuState:
    """Everything a fake GPU reports at one instant."""

    lost: bool
    utilization: Utilization
    memory: MemoryInfo
    temperature_c: int
    power_mw: int
    sm_clock_mhz: int
    clock_event_reasons: int
    ecc: EccCounts
    remapped_rows: RemappedRows
    retired_pages: RetiredPages
    """What a GPU that retires pages instead of remapping rows would show for the same faults."""
    pcie_replay_count: int
    recovery_action: int
    nvlink_errors: Mapping[int, NvlinkCounters]
    """Error counters of links that have any; every other link reads all zeros."""


@dataclass(frozen=True, slots=True)
class _Baseline:
    util: float
    memory_util: float
    memory_fraction: float
    temperature_c: float
    power_w: float


def _baseline(seed: int, gpu: int, now_ns: int) -> _Baseline:
    """A healthy GPU under a training load: slow, deterministic waves, different on each GPU."""
    digest = hashlib.blake2b(f"{seed}:{gpu}".encode(), digest_size=8).digest()
    phase = [b / 256 for b in digest]
    t = now_ns / 1e9

    def wave(period_s: float, k: int) -> float:
        return math.sin(2 * math.pi * (t / period_s + phase[k]))

    util = 72 + 14 * wave(420, 0) + 6 * wave(53, 1)
    return _Baseline(
        util=util,
        memory_util=0.6 * util + 4 * wave(97, 2),
        memory_fraction=0.80 + 0.05 * wave(900, 3),
        temperature_c=45 + 0.25 * util + 1.5 * wave(180, 4),  # ~45 °C idle, ~65 °C under load
        power_w=100 + 5.5 * util + 10 * wave(31, 5),
    )


def _thermal_c(fault: ScriptedFault, base_c: float, now_ns: int) -> float:
    """Heat rises ``deg_per_s`` to ``cap_c``; once the fault ends it cools back to the baseline."""
    peak = min(fault.params["cap_c"], base_c + fault.params["deg_per_s"] * fault.elapsed_s(now_ns))
    if fault.end_ns is None or now_ns < fault.end_ns:
        return max(base_c, peak)
    return max(base_c, peak - _COOL_DEG_PER_S * (now_ns - fault.end_ns) / 1e9)


def _count(fault: ScriptedFault, now_ns: int, key: str = "rate_per_s") -> int:
    return math.floor(fault.params[key] * fault.elapsed_s(now_ns))


_ACTION_OF_CLASS: Mapping[XidClass, RecoveryAction] = {
    XidClass.GPU_RESET: RecoveryAction.GPU_RESET,
    XidClass.NODE_REBOOT: RecoveryAction.NODE_REBOOT,
}


def _recovery_action(active: list[ScriptedFault]) -> int:
    """The driver's advice while faults are in force: a DBE or a reset-class XID asks for a GPU reset,
    a reboot-class XID for a node reboot (the stronger advice wins); clearing the faults is the reset."""
    actions = [RecoveryAction.NONE]
    for fault in active:
        xid = fault.xid()
        if xid is not None:
            actions.append(_ACTION_OF_CLASS.get(xid_info(xid).xid_class, RecoveryAction.NONE))
    strength = (RecoveryAction.NONE, RecoveryAction.GPU_RESET, RecoveryAction.NODE_REBOOT)
    return int(max(actions, key=strength.index))


def gpu_state(script: Script, index: int, now_ns: int) -> GpuState:
    """What GPU ``index`` reports at ``now_ns``: a pure function of the script and the time."""
    gpu = script.gpus[index]
    base = _baseline(script.seed, index, now_ns)
    started = [f for f in script.faults if f.gpu == index and f.start_ns <= now_ns]

    def of(kind: GpuFault) -> list[ScriptedFault]:
        return [f for f in started if f.fault is kind]

    sbe = sum(_count(f, now_ns) for f in of(GpuFault.ECC_SBE_RISING))
    dbe = sum(int(f.params["count"]) for f in of(GpuFault.ECC_DBE))
    remaps = of(GpuFault.ROW_REMAP_PENDING) + of(GpuFault.ECC_DBE)  # Ampere+ remaps a row after a DBE
    temperature = max([base.temperature_c, *(_thermal_c(f, base.temperature_c, now_ns) for f in of(GpuFault.THERMAL))])
    temperature_c = int(temperature)
    reasons, clock = 0, MAX_SM_CLOCK_MHZ
    if temperature_c >= SW_THERMAL_SLOWDOWN_C:
        reasons |= ClockEventReason.SwThermalSlowdown
        over_c = temperature_c - SW_THERMAL_SLOWDOWN_C + 1
        clock = max(_MIN_THROTTLED_MHZ, MAX_SM_CLOCK_MHZ - _THROTTLE_MHZ_PER_C * over_c)
    if temperature_c >= HW_THERMAL_SLOWDOWN_C:
        reasons |= ClockEventReason.HwThermalSlowdown
    nvlink: dict[int, NvlinkCounters] = {}
    for fault in of(GpuFault.NVLINK_CRC):
        link, flits = int(fault.params["link"]), _count(fault, now_ns)
        old = nvlink.get(link, NvlinkCounters(0, 0, 0, 0))
        # every flit that fails its CRC is replayed; data CRC errors are a fraction of them
        nvlink[link] = NvlinkCounters(old.crc_flit + flits, old.crc_data + flits // 8, old.replay + flits, 0)
    lost = any(f.active(now_ns) and f.xid() == XID_FALLEN_OFF_BUS for f in started)
    remapped = sum(int(f.params["rows"]) + _count(f, now_ns) for f in of(GpuFault.ROW_REMAP_PENDING))
    pending = any(f.active(now_ns) for f in remaps)
    return GpuState(
        lost=lost,
        utilization=Utilization(round(base.util), round(base.memory_util)),
        memory=MemoryInfo(int(gpu.memory_total_bytes * base.memory_fraction), gpu.memory_total_bytes),
        temperature_c=temperature_c,
        power_mw=round(base.power_w * 1000),
        sm_clock_mhz=clock,
        clock_event_reasons=int(reasons),
        ecc=EccCounts(sbe, sbe, dbe, dbe),
        remapped_rows=RemappedRows(corrected=remapped, uncorrected=dbe, pending=pending, failure=False),
        retired_pages=RetiredPages(single_bit=remapped, double_bit=dbe, pending=pending),
        pcie_replay_count=sum(_count(f, now_ns) for f in of(GpuFault.PCIE_REPLAY_STORM)),
        recovery_action=_recovery_action([f for f in started if f.active(now_ns)]),
        nvlink_errors=nvlink,
    )


def xid_faults(script: Script, now_ns: int) -> list[ScriptedFault]:
    """Faults that have raised an XID by ``now_ns``, oldest first."""
    fired = [f for f in script.faults if f.start_ns <= now_ns and f.xid() is not None]
    return sorted(fired, key=lambda f: (f.start_ns, f.id))
