"""The GPU source: health and load of every NVIDIA GPU through NVML, and XID events.

Each tick reads, per GPU: utilisation, memory used and total, temperature, power, SM
clock, clock event (throttle) reasons, volatile and aggregate ECC counts, remapped rows
(Ampere and newer) or retired pages (older GPUs), the PCIe replay counter, NVLink state
and error counters per link, and the driver's recommended recovery action. Every sample
carries the GPU's identity (`GPU_ATTRIBUTES`: UUID as ``hw.id``, index, PCI bus id,
serial, model); the catalogue is ``ridethrough/metrics/gpu.yaml``.

XIDs arrive on NVML's event set in a thread of their own (`XidWatcher`): each becomes a
``gpu.xid`` event (an OTel log record) with its meaning and class, and counts towards
``ridethrough.gpu.xid`` per GPU and code.

How it fails:

* no NVML (no driver, no library): one ``gpu.nvml_unavailable`` warning, then `collect`
  returns nothing, cheaply, for good;
* a call a GPU does not support: logged once, never made again (`GpuReader`);
* a GPU that has fallen off the bus: one ``gpu.lost`` event, and while it is gone only
  ``hw.status`` (``failed``) and its XID counts; ``gpu.recovered`` when it answers again;
* any other NVML error: that field is skipped for the tick and counted in `errors_total`.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ridethrough.collector.counters import CounterTracker
from ridethrough.collector.nvml import (
    NvmlBackend,
    NvmlError,
    NvmlGpuLost,
    NvmlUnavailable,
    PynvmlBackend,
    XidEvent,
    xid_info,
)
from ridethrough.collector.sample import Event, EventSink, MetricKind, Sample

from ._attrs import SeriesAttributes
from .gpu_fields import GPU_ATTRIBUTES, UNKNOWN, GpuIdentity, GpuReader, LinkSamples, samples_of, status_samples
from .gpu_xid import XidWatcher, xid_class_name, xid_event

if TYPE_CHECKING:
    from ridethrough.settings import AgentConfig

__all__ = ["GPU_ATTRIBUTES", "GpuSource", "from_config"]

_log = logging.getLogger(__name__)


class _State(enum.Enum):
    NEW = "new"
    READY = "ready"
    UNAVAILABLE = "unavailable"
    STOPPED = "stopped"


def _log_event(event: Event) -> None:
    """Where events go before the agent hands the source a sink."""
    _log.log(logging.WARNING if event.severity in ("WARN", "ERROR", "FATAL") else logging.INFO,
             "%s: %s", event.name, event.body)


NVLINK_PERIOD_S = 5.0
"""How often the agent reads NVLink (18 links x 2 calls per GPU): often enough for error trends."""


class GpuSource:
    """Every NVML field of every GPU each tick, and XID events from a watcher thread."""

    def __init__(self, backend: NvmlBackend, *, interval_s: float = 1.0, clock: Callable[[], int] = time.time_ns,
                 xid_wait_ms: int = 500, xid_backoff_initial_s: float = 0.5, xid_backoff_max_s: float = 30.0,
                 max_idle_collections: int = 60, nvlink_every: int = 1) -> None:
        """Read GPUs through ``backend``; nothing is touched until `start` or the first `collect`.

        ``clock`` stamps the events that `collect` does not (NVML missing); ``xid_wait_ms`` is
        the longest one wait for XIDs blocks, and so about the longest `stop` takes.
        ``nvlink_every``: read NVLink state and counters on every n-th collection only (they are
        most of the NVML calls, and NVLink errors are trends, not instants).
        """
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self._nvml = backend
        self._interval_s = float(interval_s)
        self._clock = clock
        self._reader = GpuReader(backend, nvlink_every=nvlink_every)
        self._link_samples = LinkSamples()
        self._counters = CounterTracker(max_idle_collections=max_idle_collections)
        self._watcher = XidWatcher(backend.wait_xid, self._on_xid, wait_ms=xid_wait_ms,
                                   backoff_initial_s=xid_backoff_initial_s, backoff_max_s=xid_backoff_max_s)
        self._emit: EventSink = _log_event
        self._state = _State.NEW
        self._watch = False
        self._state_lock = threading.Lock()  # start, stop and the first collect may race
        self._lock = threading.Lock()  # identities and XID counts, shared with the watcher thread
        self._gpu_count = 0
        self._identities: dict[int, GpuIdentity] = {}
        self._series: dict[int, SeriesAttributes] = {}  # used by the collecting thread only
        self._xid_counts: dict[tuple[int, int], int] = {}
        self._xid_uuids: dict[int, str] = {}
        self._lost: set[int] = set()

    @property
    def name(self) -> str:
        """``gpu``."""
        return "gpu"

    @property
    def interval_s(self) -> float:
        """How often the agent calls `collect`."""
        return self._interval_s

    @property
    def backend(self) -> NvmlBackend:
        """The NVML backend this source reads through."""
        return self._nvml

    @property
    def available(self) -> bool | None:
        """True once NVML started, False if this host has none, None before the first try."""
        return {_State.READY: True, _State.UNAVAILABLE: False}.get(self._state)

    @property
    def errors_total(self) -> int:
        """NVML errors that skipped a field for one tick (NOT_SUPPORTED and a lost GPU excluded)."""
        return self._reader.errors_total

    @property
    def unsupported(self) -> frozenset[tuple[int, str]]:
        """(GPU index, call) pairs this host's GPUs do not support: never asked again."""
        return self._reader.unsupported

    @property
    def watcher(self) -> XidWatcher:
        """The XID watcher (for its counts and whether it runs)."""
        return self._watcher

    def start(self, *, emit: EventSink) -> None:
        """Start NVML and the XID watcher; events go to ``emit``. Raises `NvmlError` if NVML fails to start
        for a reason other than its absence (the next `collect` tries again)."""
        self._emit = emit
        with self._state_lock:
            self._watch = True
            self._start_nvml()

    def stop(self, *, timeout_s: float) -> None:
        """Stop the XID watcher within ``timeout_s`` and shut NVML down; `collect` returns nothing afterwards."""
        stopped = self._watcher.stop(timeout_s=timeout_s)
        with self._state_lock:
            was, self._state = self._state, _State.STOPPED
        if was is not _State.READY:
            return
        if not stopped:  # freeing NVML's event set under a thread still waiting on it is not safe
            _log.warning("gpu: XID watcher did not stop within %.1f s; leaving NVML to process exit", timeout_s)
            return
        try:
            self._nvml.shutdown()
        except NvmlError as err:
            _log.warning("gpu: NVML shutdown failed: %s", err)

    def collect(self, now_ns: int) -> list[Sample]:
        """Read every GPU once; nothing at all on a host without NVML."""
        with self._state_lock:
            if self._state is _State.NEW:
                self._start_nvml()
            if self._state is not _State.READY:
                return []
        samples: list[Sample] = []
        try:
            for index in range(self._gpu_count):
                samples += self._collect_gpu(index, now_ns)
        finally:
            self._counters.end_collection()
        return samples + self._xid_samples()

    def _start_nvml(self) -> None:
        """NEW → READY (watcher started if asked) or UNAVAILABLE; other NVML errors leave it NEW."""
        if self._state is _State.NEW:
            try:
                self._nvml.init()
            except NvmlUnavailable as err:
                self._state = _State.UNAVAILABLE
                self._send(Event("gpu.nvml_unavailable", f"no NVML: {err.message}; GPU metrics are off on this host",
                                 self._clock(), "WARN"))
                return
            try:
                self._gpu_count = self._nvml.device_count()
            except NvmlError:
                with contextlib.suppress(NvmlError):
                    self._nvml.shutdown()  # balance this init; the next try inits again
                raise
            self._state = _State.READY
            self._announce()
        if self._state is _State.READY and self._watch:
            self._watcher.start()

    def _announce(self) -> None:
        try:
            driver = self._nvml.driver_version()
        except NvmlError:
            driver = UNKNOWN
        self._send(Event("gpu.nvml_ready", f"NVML ready: driver {driver}, {self._gpu_count} GPU(s)", self._clock(),
                         "INFO", {"hw.driver_version": driver, "gpu.count": str(self._gpu_count)}))

    def _collect_gpu(self, index: int, now_ns: int) -> list[Sample]:
        try:
            identity = self._identity(index)
            reading = self._reader.read(index)
        except NvmlGpuLost as err:
            return self._on_lost(index, now_ns, err)
        attrs = identity.attributes()
        if index in self._lost:
            self._lost.discard(index)
            self._send(Event("gpu.recovered", f"GPU {index} ({identity.uuid}) answers NVML again", now_ns,
                             "INFO", attrs))
        series = self._series.get(index)
        if series is None or series.base != attrs:  # first read, or the identity filled in
            series = self._series[index] = SeriesAttributes(attrs)
        return samples_of(reading, series, self._counters,
                          self._link_samples.of(index, reading, series, self._counters))

    def _identity(self, index: int) -> GpuIdentity:
        with self._lock:
            known = self._identities.get(index)
        if known is not None:
            return known
        identity, complete = self._reader.identity(index)
        if complete:
            with self._lock:
                self._identities[index] = identity
        return identity

    def _on_lost(self, index: int, now_ns: int, err: NvmlGpuLost) -> list[Sample]:
        attrs = self._attributes(index)
        if index not in self._lost:
            self._lost.add(index)
            self._send(Event("gpu.lost", f"GPU {index} ({attrs['hw.id']}) has fallen off the bus: {err.message}",
                             now_ns, "ERROR", attrs))
        return status_samples(attrs, "failed")

    def _attributes(self, index: int) -> dict[str, str]:
        """The best identity known for ``index``: full once read, else the UUID an XID named, else unknown."""
        with self._lock:
            known = self._identities.get(index)
            uuid = self._xid_uuids.get(index, UNKNOWN)
        return (known or GpuIdentity(index, uuid=uuid)).attributes()

    def _on_xid(self, xid: XidEvent) -> None:
        """On the watcher thread: count the XID and send its event."""
        with self._lock:
            key = (xid.gpu_index, xid.xid)
            self._xid_counts[key] = self._xid_counts.get(key, 0) + 1
            if xid.uuid:
                self._xid_uuids.setdefault(xid.gpu_index, xid.uuid)
        self._send(xid_event(xid, self._attributes(xid.gpu_index)))

    def _xid_samples(self) -> list[Sample]:
        with self._lock:
            counts = sorted(self._xid_counts.items())
        samples = []
        for (index, code), count in counts:
            attrs = {**self._attributes(index), "gpu.xid": str(code),
                     "gpu.xid.class": xid_class_name(xid_info(code).xid_class)}
            samples.append(Sample("ridethrough.gpu.xid", float(count), MetricKind.COUNTER, "{event}", attrs))
        return samples

    def _send(self, event: Event) -> None:
        try:
            self._emit(event)
        except Exception:  # a sink is not supposed to raise; if one does, the source carries on
            _log.exception("gpu: could not emit %s", event.name)


def from_config(cfg: AgentConfig) -> GpuSource:
    """The GPU source the agent's config asks for: the lab's fake GPUs when ``gpu_script`` is set, else NVML."""
    backend: NvmlBackend
    if cfg.gpu_script:
        # imported here so that an agent on real GPUs never loads the lab
        from ridethrough.lab.fake_gpu import FakeNvmlBackend

        backend = FakeNvmlBackend(cfg.gpu_script)  # the lab's fake GPUs run on true time, as does this default
    else:
        backend = PynvmlBackend()
    return GpuSource(backend, interval_s=cfg.interval_s, nvlink_every=max(1, round(NVLINK_PERIOD_S / cfg.interval_s)))
