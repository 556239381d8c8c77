"""The contract between sources and the agent: a source yields `Sample`s.

A source is any object with a ``name``, an ``interval_s`` and a ``collect(now_ns)``
method. The agent calls it on its interval; a source that raises is logged,
counted and skipped for that tick, so telemetry never takes down its host.

A source that also watches for events in its own thread (NVML XIDs, job step
reports) implements `BackgroundSource`: the agent calls ``start(emit=...)`` once and
``stop(timeout_s=...)`` at shutdown, and each `Event` it emits becomes an OTel log
record.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


class MetricKind(enum.Enum):
    """How a sample's value is to be read."""

    GAUGE = "gauge"
    """A value at a point in time (a temperature, a rate, a state)."""
    COUNTER = "counter"
    """A monotonic cumulative total since the agent started (bytes, errors)."""


@dataclass(frozen=True, slots=True)
class Sample:
    """One observation of one metric series."""

    name: str
    value: float
    kind: MetricKind
    unit: str = ""
    attributes: Mapping[str, str] = field(default_factory=dict)


@runtime_checkable
class Source(Protocol):
    """A plugin that turns one corner of the machine into samples."""

    @property
    def name(self) -> str:
        """A short, stable name (``netdev``, ``infiniband``) used in logs and counters."""
        ...

    @property
    def interval_s(self) -> float:
        """How often the agent calls `collect`."""
        ...

    def collect(self, now_ns: int) -> Iterable[Sample]:
        """Read the source once. ``now_ns`` is the agent clock's time in ns since the epoch."""
        ...


@dataclass(frozen=True, slots=True)
class Event:
    """Something that happened at one instant: exported as an OTel log record."""

    name: str
    """Stable event name, e.g. ``gpu.xid``, ``job.step``; stored as ``event.name``."""
    body: str
    """One human-readable line."""
    time_ns: int
    """When it happened, ns since the epoch (the agent's clock)."""
    severity: str = "INFO"
    """An OTel severity text: TRACE, DEBUG, INFO, WARN, ERROR or FATAL."""
    attributes: Mapping[str, str] = field(default_factory=dict)


EventSink = Callable[[Event], None]
"""Where a background source sends its events; never raises into the caller."""


@runtime_checkable
class BackgroundSource(Source, Protocol):
    """A source with a thread of its own."""

    def start(self, *, emit: EventSink) -> None:
        """Start watching; events go to ``emit``. Called once, before the first `collect`."""
        ...

    def stop(self, *, timeout_s: float) -> None:
        """Stop watching and join the thread within ``timeout_s``."""
        ...
