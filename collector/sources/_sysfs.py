"""Plumbing shared by the sources that read sysfs: intervals, counters, skip-and-count reads.

A value that cannot be read is treated the same way by every such source:

* ``ENOENT``: absent (kernels and drivers differ; an interface can vanish mid-read);
* ``EINVAL`` from a file the source names in ``einval_means_unknown``: unknown;
* any other ``OSError``, or text that does not parse: skipped, and ``errors_total``
  grows by one. A source never raises for one bad file.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import ClassVar, TypeVar

from ..counters import CounterTracker
from ..sample import MetricKind, Sample

_log = logging.getLogger(__name__)
_T = TypeVar("_T")


def read_sysfs_text(path: Path) -> str:
    """Read one sysfs attribute whole (the seam between these sources and the kernel).

    Raises:
        OSError: as the kernel reports it (``ENOENT``, ``EINVAL``, ``EACCES``, ...).
    """
    # os.open/os.read, not Path.read_bytes: no buffered file object for a 20-byte file, which
    # halves the cost of the hundreds of reads a collection makes.
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 65536).decode("ascii", errors="replace")
    finally:
        os.close(fd)


def gauge(metric: str, unit: str, attributes: Mapping[str, str], value: float) -> Sample:
    """A gauge sample (attributes copied)."""
    return Sample(metric, float(value), MetricKind.GAUGE, unit, dict(attributes))


class SysfsSource:
    """Base of sysfs sources: subclasses name themselves and implement `_read_all`."""

    source_name: ClassVar[str] = ""
    einval_means_unknown: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, *, interval_s: float, max_idle_collections: int) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self._interval_s = float(interval_s)
        self._tracker = CounterTracker(max_idle_collections=max_idle_collections)
        self._errors_total = 0

    @property
    def name(self) -> str:
        """The source's short, stable name."""
        return self.source_name

    @property
    def interval_s(self) -> float:
        """How often the agent calls `collect`."""
        return self._interval_s

    @property
    def errors_total(self) -> int:
        """Values skipped because they could not be read or parsed, since construction."""
        return self._errors_total

    @property
    def resets_total(self) -> int:
        """Counter resets (a raw value going down) seen since construction."""
        return self._tracker.resets_total

    def collect(self, now_ns: int) -> list[Sample]:
        """Read everything once; unreadable values are skipped and counted."""
        samples: list[Sample] = []
        try:
            samples.extend(self._read_all())
        finally:
            self._tracker.end_collection()
        return samples

    def _read_all(self) -> Iterable[Sample]:
        raise NotImplementedError

    def _counter(self, metric: str, unit: str, attributes: Mapping[str, str], raw: int) -> Sample:
        total = self._tracker.observe(metric, attributes, raw)
        return Sample(metric, float(total), MetricKind.COUNTER, unit, dict(attributes))

    def _value(self, path: Path, parse: Callable[[str], _T]) -> _T | None:
        try:
            text = read_sysfs_text(path)
        except OSError as exc:
            unknown = exc.errno == errno.EINVAL and path.name in self.einval_means_unknown
            if exc.errno != errno.ENOENT and not unknown:
                self._error(path, exc)
            return None
        try:
            return parse(text)
        except ValueError as exc:
            self._error(path, exc)
            return None

    def _error(self, path: Path, exc: Exception) -> None:
        self._errors_total += 1
        # Debug, not warning: a broken file would otherwise log every interval.
        _log.debug("%s: skipping %s: %s", self.source_name, path, exc)
