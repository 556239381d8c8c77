"""The contract between sources and the agent: a source yields `Sample`s.

A source is any object with a ``name``, an ``interval_s`` and a ``collect(now_ns)``
method. The agent calls it on its interval; a source that raises is logged,
counted and skipped for that tick, so telemetry never takes down its host.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
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
