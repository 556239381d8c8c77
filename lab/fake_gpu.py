"""Fake GPUs: a JSON script the lab writes, and an `NvmlBackend` the agent reads it through.

The lab process scripts faults with `GpuScript`; the agent, a different process inside
the host's network namespace, reads the same ``gpus.json`` through `FakeNvmlBackend`.
What a GPU reports is `ridethrough.lab.fake_gpu_state.gpu_state` of the script and the
backend's clock, so every reader agrees at any instant. Writers replace the file
atomically (a temporary file and ``os.replace``) under an advisory lock, so a reader
never sees half a script and two writers never lose each other's faults.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import secrets
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path

import pynvml

from ridethrough.collector.nvml import (
    EccCounts,
    MemoryInfo,
    NvlinkCounters,
    NvmlBackend,
    NvmlError,
    RemappedRows,
    RetiredPages,
    Utilization,
    XidEvent,
    nvml_error,
)
from ridethrough.lab.control import GpuFault
from ridethrough.lab.fake_gpu_state import (
    DRIVER_VERSION,
    H100_MEMORY_TOTAL_BYTES,
    H100_NAME,
    H100_NVLINKS,
    H100_UNSUPPORTED,
    FakeGpu,
    GpuState,
    Script,
    ScriptedFault,
    ScriptError,
    check_params,
    check_unsupported,
    gpu_state,
    parse_script,
    script_to_json,
    xid_faults,
)

__all__ = ["FakeNvmlBackend", "GpuScript", "ScriptError", "ScriptedFault", "create_fake_gpus"]

_HGX_BUSES = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)
"""PCI buses of the eight GPUs on an HGX H100 board, in NVML index order."""
_POLL_S = 0.2
_STATE_GRAIN_NS = 1_000_000
"""How often `FakeNvmlBackend.wait_xid` looks at the script again while it waits."""


def _fake_gpu(host: str, seed: int, index: int, *, name: str, nvlinks: int, unsupported: tuple[str, ...]) -> FakeGpu:
    digest = hashlib.blake2b(f"{host}:{seed}:{index}".encode(), digest_size=16).digest()
    bus = _HGX_BUSES[index] if index < len(_HGX_BUSES) else 0xE0 + index - len(_HGX_BUSES)
    return FakeGpu(
        index=index,
        uuid=f"GPU-{uuid.UUID(bytes=digest)}",
        serial=f"165{int.from_bytes(digest[:8], 'big') % 10**10:010d}",
        pci_bus_id=f"{(bus >> 8):08X}:{bus & 0xFF:02X}:00.0",
        name=name,
        nvlinks=nvlinks,
        memory_total_bytes=H100_MEMORY_TOTAL_BYTES,
        unsupported=unsupported,
    )


def _write_atomically(path: Path, text: str) -> None:
    """Write next to ``path`` and rename over it: readers see the old file or the new, never half."""
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise


@contextlib.contextmanager
def _writer_lock(path: Path) -> Iterator[None]:
    """Serialise writers (readers need no lock: they only ever see whole files)."""
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _read_script(path: Path) -> Script:
    return parse_script(path.read_text(encoding="utf-8"), source=str(path))


def _file_key(st: os.stat_result) -> tuple[int, ...]:
    """What changes when a file is edited in place or replaced (the old file's link count drops)."""
    return st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_nlink


def create_fake_gpus(path: str | os.PathLike[str], count: int = 8, *, host: str, seed: int | None = None,
                     name: str = H100_NAME, nvlinks: int = H100_NVLINKS,
                     unsupported: Iterable[str] = H100_UNSUPPORTED) -> None:
    """Write a fresh script of ``count`` healthy GPUs for ``host`` (replacing any there).

    UUIDs, serials and the healthy load pattern follow from ``host`` and ``seed``; with no
    seed a random one is drawn and stored, so every reader of the file still agrees.
    ``unsupported`` names the per-GPU calls every GPU answers NOT_SUPPORTED (an H100's by
    default; ``("remapped_rows",)`` plays a pre-Ampere GPU that retires pages instead).
    """
    if count < 0 or nvlinks < 0:
        raise ValueError(f"count and nvlinks must be >= 0, not {count} and {nvlinks}")
    calls = check_unsupported(list(unsupported))
    seed = secrets.randbits(32) if seed is None else seed
    gpus = tuple(_fake_gpu(host, seed, i, name=name, nvlinks=nvlinks, unsupported=calls) for i in range(count))
    target = Path(path)
    with _writer_lock(target):
        _write_atomically(target, script_to_json(Script(host, seed, DRIVER_VERSION, gpus)))


class GpuScript:
    """The lab's handle on one host's ``gpus.json``: add and clear timed faults."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def script(self) -> Script:
        """The whole script as it is now; `ScriptError` if the file is malformed."""
        return _read_script(self.path)

    def faults(self) -> list[ScriptedFault]:
        """Every scripted fault, ended ones included, in the order they were added."""
        return list(self.script().faults)

    def add(self, gpu: int, fault: GpuFault, params: Mapping[str, float], *, start_ns: int,
            end_ns: int | None = None) -> int:
        """Schedule ``fault`` on GPU ``gpu`` from ``start_ns`` (until ``end_ns`` or a `clear`); returns its id.

        Parameters per fault are in ``fake_gpu_state.FAULT_PARAMS``; a wrong GPU, an unknown or
        missing parameter, or a negative value raises `ScriptError` and changes nothing.
        """
        with _writer_lock(self.path):
            script = _read_script(self.path)
            if not 0 <= gpu < len(script.gpus):
                raise ScriptError(f"{self.path}: no GPU {gpu} (the host has {len(script.gpus)})")
            if end_ns is not None and end_ns < start_ns:
                raise ScriptError(f"{fault.value}: end_ns {end_ns} is before start_ns {start_ns}")
            checked = check_params(fault, params, script.gpus[gpu])
            added = ScriptedFault(script.next_id, gpu, fault, checked, start_ns, end_ns)
            _write_atomically(self.path, script_to_json(
                replace(script, faults=(*script.faults, added), next_id=script.next_id + 1)))
        return added.id

    def clear(self, gpu: int, *, at_ns: int) -> int:
        """End every fault on ``gpu`` still in force at ``at_ns``; drop those not started yet.

        Counters keep the totals they reached, as on real hardware; conditions (heat, a
        pending remap, a lost GPU) end. Returns how many faults were ended or dropped.
        """
        with _writer_lock(self.path):
            script = _read_script(self.path)
            kept: list[ScriptedFault] = []
            changed = 0
            for fault in script.faults:
                if fault.gpu != gpu or (fault.end_ns is not None and fault.end_ns <= at_ns):
                    kept.append(fault)
                    continue
                changed += 1
                if fault.start_ns <= at_ns:
                    kept.append(replace(fault, end_ns=at_ns))
            _write_atomically(self.path, script_to_json(replace(script, faults=tuple(kept))))
        return changed


class FakeNvmlBackend(NvmlBackend):
    """`NvmlBackend` over a host's ``gpus.json``: what real NVML would say, had the script happened.

    Like NVML, every call but `init` fails with ``NVML_ERROR_UNINITIALIZED`` before `init`,
    an unknown GPU index is ``NVML_ERROR_INVALID_ARGUMENT``, a GPU that has fallen off
    the bus fails every call with `NvmlGpuLost`, and a call the GPU's ``unsupported`` list
    names fails with `NvmlNotSupported`. The file is re-read when it changes.
    """

    def __init__(self, script_path: str | os.PathLike[str], *, clock: Callable[[], int] = time.time_ns) -> None:
        self._path = Path(script_path)
        self._clock = clock
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._initialized = False
        self._stat_key: tuple[int, ...] | None = None
        self._script: Script | None = None
        self._fd: int | None = None
        """The script file as last read, held open: its fstat is the cheap check that it is still current."""
        self._states: dict[int, tuple[tuple[int, int, int], GpuState]] = {}
        self._returned: set[int] = set()

    def _load(self) -> Script:
        """The script, re-read when its file changed.

        Every call checks, so a fault the lab adds is seen by the next call. The check is an
        ``fstat`` of the file as last read (an agent makes about a hundred calls a second; a
        ``stat`` by path costs several times more): writers replace the file, which unlinks the
        old one (its link count drops, its ctime moves), and an edit in place moves its mtime,
        ctime or size. The file is checked before it is read, so a change during the read is
        seen by the next call; one already unlinked when opened is not kept open at all.
        """
        with self._lock:
            if not self._initialized:
                raise nvml_error(pynvml.NVML_ERROR_UNINITIALIZED, "Uninitialized")
            if self._fd is not None and self._script is not None and _file_key(os.fstat(self._fd)) == self._stat_key:
                return self._script
            self._close()
            try:
                fd = os.open(self._path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                raise nvml_error(pynvml.NVML_ERROR_DRIVER_NOT_LOADED, f"no fake GPU script at {self._path}") from None
            except OSError as err:
                raise NvmlError(pynvml.NVML_ERROR_UNKNOWN, f"fake GPU script unreadable: {err}") from None
            try:
                key = _file_key(os.fstat(fd))
                chunks = []
                while chunk := os.read(fd, 1 << 16):
                    chunks.append(chunk)
                self._script = parse_script(b"".join(chunks).decode("utf-8"), source=str(self._path))
            except (ScriptError, OSError, UnicodeDecodeError) as err:
                os.close(fd)
                raise NvmlError(pynvml.NVML_ERROR_UNKNOWN, f"fake GPU script unreadable: {err}") from None
            if key[3] == 0:  # replaced while we opened it: the next call opens the new file
                os.close(fd)
            else:
                self._fd, self._stat_key = fd, key
            return self._script

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _state(self, script: Script, index: int) -> GpuState:
        # The state is a pure function of (script, GPU, time); calls within 1 ms share it.
        key = (id(script), index, self._clock() // _STATE_GRAIN_NS)
        cached = self._states.get(index)
        if cached is None or cached[0] != key:
            cached = (key, gpu_state(script, index, key[2] * _STATE_GRAIN_NS))
            self._states[index] = cached
        return cached[1]

    def _gpu(self, index: int, call: str) -> tuple[FakeGpu, GpuState]:
        script = self._load()
        if not 0 <= index < len(script.gpus):
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT, f"Invalid Argument: no GPU {index}")
        state = self._state(script, index)
        if state.lost:
            raise nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST, f"GPU is lost: GPU {index} has fallen off the bus")
        gpu = script.gpus[index]
        if call in gpu.unsupported:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED, f"Not Supported: {call} on GPU {index}")
        return gpu, state

    def init(self) -> None:
        """Start reading the script; `NvmlUnavailable` if there is none, `NvmlError` if it is malformed."""
        with self._lock:
            self._initialized = True
            self._stopped.clear()
        try:
            self._load()
        except NvmlError:
            with self._lock:
                self._initialized = False
            raise

    def shutdown(self) -> None:
        """Stop; a `wait_xid` in progress returns early."""
        with self._lock:
            self._initialized = False
            self._close()
        self._stopped.set()

    def driver_version(self) -> str:
        """See `NvmlBackend.driver_version`."""
        return self._load().driver_version

    def device_count(self) -> int:
        """See `NvmlBackend.device_count`."""
        return len(self._load().gpus)

    def uuid(self, index: int) -> str:
        """See `NvmlBackend.uuid`."""
        return self._gpu(index, "uuid")[0].uuid

    def name(self, index: int) -> str:
        """See `NvmlBackend.name`."""
        return self._gpu(index, "name")[0].name

    def serial(self, index: int) -> str:
        """See `NvmlBackend.serial`."""
        return self._gpu(index, "serial")[0].serial

    def pci_bus_id(self, index: int) -> str:
        """See `NvmlBackend.pci_bus_id`."""
        return self._gpu(index, "pci_bus_id")[0].pci_bus_id

    def utilization(self, index: int) -> Utilization:
        """See `NvmlBackend.utilization`."""
        return self._gpu(index, "utilization")[1].utilization

    def memory(self, index: int) -> MemoryInfo:
        """See `NvmlBackend.memory`."""
        return self._gpu(index, "memory")[1].memory

    def temperature_c(self, index: int) -> int:
        """See `NvmlBackend.temperature_c`."""
        return self._gpu(index, "temperature_c")[1].temperature_c

    def power_mw(self, index: int) -> int:
        """See `NvmlBackend.power_mw`."""
        return self._gpu(index, "power_mw")[1].power_mw

    def sm_clock_mhz(self, index: int) -> int:
        """See `NvmlBackend.sm_clock_mhz`."""
        return self._gpu(index, "sm_clock_mhz")[1].sm_clock_mhz

    def clock_event_reasons(self, index: int) -> int:
        """See `NvmlBackend.clock_event_reasons`."""
        return self._gpu(index, "clock_event_reasons")[1].clock_event_reasons

    def ecc_errors(self, index: int) -> EccCounts:
        """See `NvmlBackend.ecc_errors`."""
        return self._gpu(index, "ecc_errors")[1].ecc

    def remapped_rows(self, index: int) -> RemappedRows:
        """See `NvmlBackend.remapped_rows`."""
        return self._gpu(index, "remapped_rows")[1].remapped_rows

    def retired_pages(self, index: int) -> RetiredPages:
        """See `NvmlBackend.retired_pages`."""
        return self._gpu(index, "retired_pages")[1].retired_pages

    def pcie_replay_count(self, index: int) -> int:
        """See `NvmlBackend.pcie_replay_count`."""
        return self._gpu(index, "pcie_replay_count")[1].pcie_replay_count

    def recovery_action(self, index: int) -> int:
        """See `NvmlBackend.recovery_action`."""
        return self._gpu(index, "recovery_action")[1].recovery_action

    def nvlink_count(self, index: int) -> int:
        """See `NvmlBackend.nvlink_count`."""
        return self._gpu(index, "nvlink_count")[0].nvlinks

    def _link(self, index: int, link: int, call: str) -> GpuState:
        gpu, state = self._gpu(index, call)
        if not 0 <= link < gpu.nvlinks:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT, f"Invalid Argument: GPU {index} has no link {link}")
        return state

    def nvlink_active(self, index: int, link: int) -> bool:
        """See `NvmlBackend.nvlink_active`; fake links stay up (CRC storms degrade, they do not cut)."""
        self._link(index, link, "nvlink_active")
        return True

    def nvlink_errors(self, index: int, link: int) -> NvlinkCounters:
        """See `NvmlBackend.nvlink_errors`."""
        return self._link(index, link, "nvlink_errors").nvlink_errors.get(link, NvlinkCounters(0, 0, 0, 0))

    def _next_xid(self) -> XidEvent | None:
        script = self._load()
        for fault in xid_faults(script, self._clock()):
            with self._lock:
                if fault.id in self._returned:
                    continue
                self._returned.add(fault.id)
            xid = fault.xid()
            if xid is None:
                continue
            return XidEvent(fault.gpu, script.gpus[fault.gpu].uuid, xid, fault.start_ns)
        return None

    def wait_xid(self, timeout_ms: int) -> XidEvent | None:
        """The oldest XID whose time has come that this instance has not returned yet.

        Polls the script every 200 ms until ``timeout_ms`` has passed (on the real clock,
        whatever the injected one says) or `shutdown` is called; None when nothing came.
        """
        deadline = time.monotonic() + max(timeout_ms, 0) / 1000
        while True:
            event = self._next_xid()
            remaining = deadline - time.monotonic()
            if event is not None or remaining <= 0:
                return event
            if self._stopped.wait(min(_POLL_S, remaining)):
                return None
