"""The detector contract: a detector reads a window of the store and returns findings.

    class LinkDown:
        name = "link_down"
        def detect(self, window: Window) -> list[Finding]: ...

Detectors push their work down to ClickHouse (aggregate in SQL, not in Python loops over
rows) through ``window.query``; they never write. The controller runs each on its own
schedule, isolates and counts one that raises, and folds findings into incidents.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


class EntityType(enum.Enum):
    """What a finding is about (the thing to repair or route around)."""

    LINK = "link"
    NIC = "nic"
    GPU = "gpu"
    HOST = "host"
    RANK = "rank"
    CLOCK = "clock"
    PATH = "path"


class Severity(enum.IntEnum):
    """How bad: ordered, so incidents escalate with max()."""

    INFO = 1
    WARNING = 2
    ERROR = 3
    CRITICAL = 4


class FindingKind(enum.Enum):
    """Every kind of finding, listed once (a catalogue: tests hold detectors to it)."""

    LINK_DOWN = "link_down"
    LINK_FLAP = "link_flap"
    LINK_DEGRADING = "link_degrading"
    GPU_FAILING = "gpu_failing"
    GPU_FAILED = "gpu_failed"
    STRAGGLER = "straggler"
    CLOCK_JUMP = "clock_jump"
    CLOCK_UNSYNCED = "clock_unsynced"
    CONGESTION = "congestion"
    AGENT_SILENT = "agent_silent"


@dataclass(frozen=True, slots=True)
class Finding:
    """One detector's claim about one entity, with the evidence behind it."""

    detector: str
    kind: FindingKind
    entity_type: EntityType
    entity: str
    """Stable name: ``h3-leaf1r0`` (link), ``h2/mlx5_0`` (NIC), ``h2/gpu3`` (GPU), ``h5`` (host)."""
    severity: Severity
    confidence: float
    """0..1."""
    summary: str
    """One line for a human."""
    observed_at_ns: int
    """When the evidence was seen (the newest point it rests on)."""
    evidence: Mapping[str, Any] = field(default_factory=dict)
    """The query (name) and the values that triggered it."""
    time_to_failure_s: float | None = None
    """For predictions: the estimated time until the hard failure."""
    cluster: str = ""

    @property
    def key(self) -> str:
        """The incident key this finding folds into: kind + entity (stable across restarts)."""
        return f"{self.kind.value}:{self.entity_type.value}:{self.entity}"


Query = Callable[[str, Mapping[str, Any]], tuple[list[str], list[tuple[Any, ...]]]]
"""Run a parameterised read-only SQL statement: (sql, parameters) → (column names, rows)."""


@dataclass(frozen=True, slots=True)
class Window:
    """The time range a detector looks at, and how to read the store."""

    start_ns: int
    end_ns: int
    query: Query
    cluster: str = ""
    """Empty: every cluster in the store."""

    @property
    def seconds(self) -> float:
        """The window's length."""
        return (self.end_ns - self.start_ns) / 1e9


@runtime_checkable
class Detector(Protocol):
    """A plugin: ``name``, ``interval_s`` and ``window_s`` (how often and how far back), ``detect``."""

    @property
    def name(self) -> str:
        """Stable, short: used in logs, counters and findings."""
        ...

    @property
    def interval_s(self) -> float:
        """How often the controller runs it."""
        ...

    @property
    def window_s(self) -> float:
        """How much history each run reads."""
        ...

    def detect(self, window: Window) -> list[Finding]:
        """Findings for the window (an empty list when all is well); read-only."""
        ...
