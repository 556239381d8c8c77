"""One GPU's fields: read them through an `NvmlBackend`, turn them into samples.

`GpuReader` is the only part that talks to NVML. It asks each GPU for every field once a
tick and remembers the calls a GPU does not support (``NVML_ERROR_NOT_SUPPORTED``): each is
logged once and never asked again. Any other NVML error skips that one field for that
tick and is counted; `NvmlGpuLost` is left to the caller, which reports the GPU as failed.

`samples_of` and `health_state` are pure: a `GpuReading` in, samples or a state out.
Metric names, units and attributes are catalogued in ``ridethrough/metrics/gpu.yaml``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Final, TypeVar

from ridethrough.collector.counters import CounterTracker
from ridethrough.collector.nvml import (
    ClockEventReason,
    EccCounts,
    MemoryInfo,
    NvlinkCounters,
    NvmlBackend,
    NvmlError,
    NvmlGpuLost,
    NvmlNotSupported,
    RecoveryAction,
    RemappedRows,
    RetiredPages,
    Utilization,
    decode_clock_event_reasons,
    recovery_action_name,
)
from ridethrough.collector.sample import MetricKind, Sample

from ._attrs import Extra, SeriesAttributes

_log = logging.getLogger(__name__)
_T = TypeVar("_T")

UNKNOWN: Final = "unknown"
"""The value of an identity attribute NVML could not tell (a serial on a consumer board, a GPU lost at start)."""
GPU_ATTRIBUTES: Final = ("hw.id", "hw.type", "hw.vendor", "hw.model", "hw.serial_number", "gpu.index",
                         "gpu.pci_bus_id")
"""The attribute keys every GPU sample and event carries."""
HEALTH_STATES: Final = ("ok", "degraded", "predicted_failure", "failed")
"""``hw.state`` values of ``hw.status``, best first (OTel's well-known values for a GPU)."""

_DEGRADING_REASONS: Final = (ClockEventReason.HwSlowdown | ClockEventReason.SwThermalSlowdown
                             | ClockEventReason.HwThermalSlowdown | ClockEventReason.HwPowerBrakeSlowdown)
"""Clock event reasons that mean the GPU runs slower than it should (power capping under load does not)."""
_REASON_LIST: Final = tuple(str(reason.name) for reason in ClockEventReason)
_REASON_NAMES: Final = frozenset(_REASON_LIST)
_RECOVERY_NAMES: Final = tuple(recovery_action_name(a) for a in RecoveryAction)
_LOSS_ACTIONS: Final = frozenset(RecoveryAction) - {RecoveryAction.NONE, RecoveryAction.DRAIN_P2P}
"""Recovery actions after which the GPU runs no work until someone acts (reset, reboot, ...)."""


@dataclass(frozen=True, slots=True)
class GpuIdentity:
    """Who a GPU is: its attributes on every sample and event."""

    index: int
    uuid: str = UNKNOWN
    model: str = UNKNOWN
    serial: str = UNKNOWN
    pci_bus_id: str = UNKNOWN

    def attributes(self) -> dict[str, str]:
        """`GPU_ATTRIBUTES` with their values: OTel's ``hw.*`` where they exist, ``gpu.*`` for the rest."""
        return {"hw.id": self.uuid, "hw.type": "gpu", "hw.vendor": "NVIDIA", "hw.model": self.model,
                "hw.serial_number": self.serial, "gpu.index": str(self.index) if self.index >= 0 else UNKNOWN,
                "gpu.pci_bus_id": self.pci_bus_id}


@dataclass(frozen=True, slots=True)
class LinkReading:
    """One NVLink: whether it is up, and its error counters (None where NVML would not say)."""

    up: bool | None
    errors: NvlinkCounters | None


@dataclass(frozen=True, slots=True)
class GpuReading:
    """Everything read from one GPU in one tick; None for a field that is unsupported or failed."""

    utilization: Utilization | None = None
    memory: MemoryInfo | None = None
    temperature_c: int | None = None
    power_mw: int | None = None
    sm_clock_mhz: int | None = None
    clock_event_reasons: int | None = None
    ecc: EccCounts | None = None
    remapped_rows: RemappedRows | None = None
    retired_pages: RetiredPages | None = None
    pcie_replay_count: int | None = None
    recovery_action: int | None = None
    links: Mapping[int, LinkReading] = field(default_factory=dict)
    links_lost: int = 0
    """Links that were up earlier and are down now."""


class GpuReader:
    """Reads GPUs through a backend, asking each GPU only what it supports."""

    def __init__(self, backend: NvmlBackend, *, nvlink_every: int = 1) -> None:
        self._nvml = backend
        self._nvlink_every = max(1, nvlink_every)
        self._reads: dict[int, int] = {}
        self._last_links: dict[int, dict[int, LinkReading]] = {}
        self._unsupported: set[tuple[int, str]] = set()
        self._links: dict[int, int] = {}
        self._links_seen_up: set[tuple[int, int]] = set()
        self.errors_total = 0
        """NVML errors other than NOT_SUPPORTED and GPU_IS_LOST: each skipped one field once."""

    @property
    def unsupported(self) -> frozenset[tuple[int, str]]:
        """(GPU index, call) pairs NVML answered NOT_SUPPORTED: never asked again."""
        return frozenset(self._unsupported)

    def identity(self, index: int) -> tuple[GpuIdentity, bool]:
        """The GPU's identity, and whether it is complete (no field failed for a reason that may pass)."""
        calls = {"uuid": self._nvml.uuid, "name": self._nvml.name, "serial": self._nvml.serial,
                 "pci_bus_id": self._nvml.pci_bus_id}
        values = {call: self._ask(index, call, read) for call, read in calls.items()}
        complete = all(v is not None or (index, call) in self._unsupported for call, v in values.items())
        uuid, model, serial, bus = (v or UNKNOWN for v in values.values())
        return GpuIdentity(index, uuid, model, serial, bus), complete

    def read(self, index: int) -> GpuReading:
        """Read every field of GPU ``index``; raises `NvmlGpuLost` if it has fallen off the bus."""
        nvml = self._nvml
        reads = self._reads[index] = self._reads.get(index, -1) + 1
        if reads % self._nvlink_every == 0 or index not in self._last_links:
            self._last_links[index] = self._read_links(index)
        links = self._last_links[index]
        return GpuReading(
            utilization=self._ask(index, "utilization", nvml.utilization),
            memory=self._ask(index, "memory", nvml.memory),
            temperature_c=self._ask(index, "temperature_c", nvml.temperature_c),
            power_mw=self._ask(index, "power_mw", nvml.power_mw),
            sm_clock_mhz=self._ask(index, "sm_clock_mhz", nvml.sm_clock_mhz),
            clock_event_reasons=self._ask(index, "clock_event_reasons", nvml.clock_event_reasons),
            ecc=self._ask(index, "ecc_errors", nvml.ecc_errors),
            remapped_rows=self._ask(index, "remapped_rows", nvml.remapped_rows),
            retired_pages=self._ask(index, "retired_pages", nvml.retired_pages),
            pcie_replay_count=self._ask(index, "pcie_replay_count", nvml.pcie_replay_count),
            recovery_action=self._ask(index, "recovery_action", nvml.recovery_action),
            links=links,
            links_lost=sum(1 for link, r in links.items() if r.up is False and (index, link) in self._links_seen_up),
        )

    def _read_links(self, index: int) -> dict[int, LinkReading]:
        count = self._links.get(index)
        if count is None:
            count = self._ask(index, "nvlink_count", self._nvml.nvlink_count)
            if count is None:
                return {}
            self._links[index] = count
        links: dict[int, LinkReading] = {}
        for link in range(count):
            up = self._ask(index, f"nvlink_active[{link}]", self._nvml.nvlink_active, link)
            errors = self._ask(index, f"nvlink_errors[{link}]", self._nvml.nvlink_errors, link)
            if up:
                self._links_seen_up.add((index, link))
            links[link] = LinkReading(up, errors)
        return links

    def _ask(self, index: int, call: str, read: Callable[..., _T], *args: int) -> _T | None:
        if (index, call) in self._unsupported:
            return None
        try:
            return read(index, *args)
        except NvmlGpuLost:
            raise
        except NvmlNotSupported as err:
            self._unsupported.add((index, call))
            _log.info("gpu %d: %s is not supported (%s); not asking again", index, call, err)
        except NvmlError as err:
            self.errors_total += 1
            # debug, not warning: a field that keeps failing would otherwise log every tick
            _log.debug("gpu %d: %s failed this tick: %s", index, call, err)
        return None


def health_state(reading: GpuReading) -> str:
    """The GPU's ``hw.state``: failed, predicted_failure, degraded or ok (a lost GPU is failed, elsewhere).

    failed: the driver asks for a reset or reboot, or a row remap failed; predicted_failure:
    a row remap or page retirement waits for the next reset; degraded: clocks held down by heat
    or a hardware slowdown, an NVLink that was up is down, or the driver asks to drain P2P.
    """
    action = reading.recovery_action or RecoveryAction.NONE
    rows, pages = reading.remapped_rows, reading.retired_pages
    if action in _LOSS_ACTIONS or (rows is not None and rows.failure):
        return "failed"
    if (rows is not None and rows.pending) or (pages is not None and pages.pending):
        return "predicted_failure"
    reasons = reading.clock_event_reasons or 0
    if action != RecoveryAction.NONE or reasons & _DEGRADING_REASONS or reading.links_lost:
        return "degraded"
    return "ok"


def status_samples(attrs: Mapping[str, str] | SeriesAttributes, state: str) -> list[Sample]:
    """``hw.status``: one series per `HEALTH_STATES` value, 1 for the GPU's state and 0 for the others."""
    a = _series(attrs)
    return [_gauge(a, "hw.status", "1", s == state, ("hw.state", s)) for s in HEALTH_STATES]


class LinkSamples:
    """NVLink samples per GPU, rebuilt only when the reader read NVLink again.

    NVLink is most of a GPU's series (18 links x 5); between two reads its values are the same
    objects, so the last samples stand (their counters' totals cannot have moved).
    """

    def __init__(self) -> None:
        self._last: dict[int, tuple[object, list[Sample]]] = {}

    def of(self, index: int, r: GpuReading, attrs: Mapping[str, str] | SeriesAttributes,
           counters: CounterTracker) -> list[Sample]:
        """The NVLink samples of GPU ``index``'s reading."""
        last = self._last.get(index)
        if last is None or last[0] is not r.links:
            last = (r.links, list(_links(r, _series(attrs), counters)))
            self._last[index] = last
        return last[1]


def samples_of(reading: GpuReading, attrs: Mapping[str, str] | SeriesAttributes, counters: CounterTracker,
               links: list[Sample] | None = None) -> list[Sample]:
    """Every sample of one GPU's reading; counters go through ``counters`` so they never go down.

    ``attrs``: the GPU's attributes, or its `SeriesAttributes` where the caller keeps them from
    tick to tick. ``links``: the reading's NVLink samples when the caller keeps them (see `LinkSamples`).
    """
    a = _series(attrs)
    link_samples = links if links is not None else list(_links(reading, a, counters))
    return [*_load(reading, a), *_clocks(reading, a), *_memory_health(reading, a, counters),
            *link_samples, *_recovery(reading, a), *status_samples(a, health_state(reading))]


def _series(attrs: Mapping[str, str] | SeriesAttributes) -> SeriesAttributes:
    return attrs if isinstance(attrs, SeriesAttributes) else SeriesAttributes(attrs)


def _gauge(a: SeriesAttributes, name: str, unit: str, value: float, *extra: Extra) -> Sample:
    return a.sample(name, MetricKind.GAUGE, unit, value, *extra)


def _counter(counters: CounterTracker, a: SeriesAttributes, name: str, unit: str, raw: int, *extra: Extra) -> Sample:
    return a.sample(name, MetricKind.COUNTER, unit, counters.observe_key(a.key(name, *extra), raw), *extra)


def _load(r: GpuReading, a: SeriesAttributes) -> Iterator[Sample]:
    if r.utilization is not None:
        yield _gauge(a, "hw.gpu.utilization", "1", r.utilization.gpu_percent / 100, ("hw.gpu.task", "general"))
        yield _gauge(a, "ridethrough.gpu.memory_controller.utilization", "1", r.utilization.memory_percent / 100)
    if r.memory is not None:
        yield _gauge(a, "hw.gpu.memory.usage", "By", r.memory.used_bytes)
        yield _gauge(a, "hw.gpu.memory.limit", "By", r.memory.total_bytes)
    if r.temperature_c is not None:
        yield _gauge(a, "hw.temperature", "Cel", r.temperature_c)
    if r.power_mw is not None:
        yield _gauge(a, "hw.power", "W", r.power_mw / 1000)


def _clocks(r: GpuReading, a: SeriesAttributes) -> Iterator[Sample]:
    if r.sm_clock_mhz is not None:
        yield _gauge(a, "ridethrough.gpu.clock.sm", "MHz", r.sm_clock_mhz)
    if r.clock_event_reasons is None:
        return
    mask = r.clock_event_reasons
    yield _gauge(a, "ridethrough.gpu.clock_event_reasons", "1", mask)
    active = set(decode_clock_event_reasons(mask))
    # every known reason as 0 or 1, so a reason that ends shows as a drop to 0, not a gap
    for name in [*_REASON_LIST, *sorted(active - _REASON_NAMES)]:
        yield _gauge(a, "ridethrough.gpu.clock_event_reason", "1", name in active, ("gpu.clock_event_reason", name))


def _memory_health(r: GpuReading, a: SeriesAttributes, counters: CounterTracker) -> Iterator[Sample]:
    def by_type(name: str, unit: str, corrected: int, uncorrected: int) -> Iterator[Sample]:
        yield _counter(counters, a, name, unit, corrected, ("error.type", "corrected"))
        yield _counter(counters, a, name, unit, uncorrected, ("error.type", "uncorrected"))

    if r.ecc is not None:
        yield from by_type("hw.errors", "{error}", r.ecc.corrected_volatile, r.ecc.uncorrected_volatile)
        yield from by_type("ridethrough.gpu.ecc.aggregate", "{error}", r.ecc.corrected_aggregate,
                           r.ecc.uncorrected_aggregate)
    if r.remapped_rows is not None:
        rows = r.remapped_rows
        yield from by_type("ridethrough.gpu.memory.remapped_rows", "{row}", rows.corrected, rows.uncorrected)
        yield _gauge(a, "ridethrough.gpu.memory.remap_pending", "1", rows.pending)
        yield _gauge(a, "ridethrough.gpu.memory.remap_failure", "1", rows.failure)
    if r.retired_pages is not None:
        pages = r.retired_pages
        yield from by_type("ridethrough.gpu.memory.retired_pages", "{page}", pages.single_bit, pages.double_bit)
        yield _gauge(a, "ridethrough.gpu.memory.retirement_pending", "1", pages.pending)
    if r.pcie_replay_count is not None:
        yield _counter(counters, a, "ridethrough.gpu.pcie.replays", "{replay}", r.pcie_replay_count)


def _links(r: GpuReading, a: SeriesAttributes, counters: CounterTracker) -> Iterator[Sample]:
    for link, reading in sorted(r.links.items()):
        on_link = ("gpu.nvlink", str(link))
        if reading.up is not None:
            yield _gauge(a, "ridethrough.gpu.nvlink.up", "1", reading.up, on_link)
        if reading.errors is None:
            continue
        e = reading.errors
        for kind, raw in (("crc_flit", e.crc_flit), ("crc_data", e.crc_data), ("replay", e.replay),
                          ("recovery", e.recovery)):
            yield _counter(counters, a, "ridethrough.gpu.nvlink.errors", "{error}", raw, on_link, ("error.type", kind))


def _recovery(r: GpuReading, a: SeriesAttributes) -> Iterator[Sample]:
    if r.recovery_action is None:
        return
    current = recovery_action_name(r.recovery_action)
    names = _RECOVERY_NAMES if current in _RECOVERY_NAMES else (*_RECOVERY_NAMES, current)
    for name in names:
        yield _gauge(a, "ridethrough.gpu.recovery_action", "1", name == current, ("gpu.recovery_action", name))
