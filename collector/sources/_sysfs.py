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
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, TypeVar

from ..counters import CounterTracker, SeriesKey, parse_counter
from ..sample import MetricKind, Sample
from ._attrs import SeriesAttributes

_log = logging.getLogger(__name__)
_T = TypeVar("_T")


def read_sysfs_text(path: str | Path) -> str:
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


def nonempty(text: str, what: str) -> str:
    """The attribute's text without surrounding white space; ValueError naming ``what`` if empty."""
    stripped = text.strip()
    if not stripped:
        raise ValueError(f"{what} is empty")
    return stripped


def gauge(metric: str, unit: str, attributes: Mapping[str, str], value: float) -> Sample:
    """A gauge sample. ``attributes`` is shared, not copied: the caller must not change it afterwards."""
    return Sample(metric, float(value), MetricKind.GAUGE, unit, attributes)


@dataclass(slots=True)
class CounterFile:
    """One counter file and the series it feeds, worked out once and reused every collection."""

    path: str
    metric: str
    unit: str
    attributes: dict[str, str]
    """Shared by every sample of the series: readers must not change it."""
    key: SeriesKey
    multiplier: int = 1
    last: Sample | None = None
    """The sample last made from this file: handed out again while the total stands still (most error
    counters, most of the time), which spares making one (samples are immutable, so sharing is safe)."""


Describe = Callable[[str], tuple[str, str, dict[str, str], int]]
"""A counter file's name → (metric, unit, attributes, multiplier to the unit)."""


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
        # directory → file → entry; rebuilt by each collection from the files it read
        self._file_entries: dict[str, dict[str, CounterFile]] = {}
        self._file_entries_seen: dict[str, dict[str, CounterFile]] = {}
        # device directory → its attribute sets, likewise kept only while the device is read
        self._attributes: dict[str, SeriesAttributes] = {}
        self._attributes_seen: dict[str, SeriesAttributes] = {}

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
            # keep only the files (and devices) this collection read: a vanished port's entries go with it
            self._file_entries, self._file_entries_seen = self._file_entries_seen, {}
            self._attributes, self._attributes_seen = self._attributes_seen, {}
        return samples

    def _read_all(self) -> Iterable[Sample]:
        raise NotImplementedError

    def _counter(self, metric: str, unit: str, attributes: Mapping[str, str], raw: int) -> Sample:
        """A counter sample (``attributes`` shared, as by `gauge`)."""
        total = self._tracker.observe(metric, attributes, raw)
        return Sample(metric, float(total), MetricKind.COUNTER, unit, attributes)

    def _series_attributes(self, device: str, base: dict[str, str]) -> SeriesAttributes:
        """The attribute sets of one device (a port, an interface; ``device`` names it, e.g. its
        directory), the same objects every collection while ``base`` stays the same."""
        found = self._attributes.get(device)
        if found is None or found.base != base:
            found = SeriesAttributes(base)
        self._attributes_seen[device] = found
        return found

    def _counter_files(self, directory: str, files: Iterable[str], describe: Describe) -> Iterator[Sample]:
        """A counter sample for each of ``files`` in ``directory`` that reads and parses."""
        known = self._file_entries.get(directory, {})
        seen = self._file_entries_seen[directory] = {}
        observe = self._tracker.observe_key
        for file in files:
            entry = known.get(file)
            if entry is None:
                metric, unit, attributes, multiplier = describe(file)
                entry = CounterFile(os.path.join(directory, file), metric, unit, attributes,
                                    (metric, frozenset(attributes.items())), multiplier)
            seen[file] = entry
            raw = self._value(entry.path, parse_counter)
            if raw is not None:
                total = observe(entry.key, raw * entry.multiplier)
                last = entry.last
                if last is None or last.value != total:
                    last = entry.last = Sample(entry.metric, float(total), MetricKind.COUNTER, entry.unit,
                                               entry.attributes)
                yield last

    def _value(self, path: str | Path, parse: Callable[[str], _T]) -> _T | None:
        try:
            text = read_sysfs_text(path)
        except OSError as exc:
            unknown = exc.errno == errno.EINVAL and os.path.basename(path) in self.einval_means_unknown
            if exc.errno != errno.ENOENT and not unknown:
                self._error(path, exc)
            return None
        try:
            return parse(text)
        except ValueError as exc:
            self._error(path, exc)
            return None

    def _error(self, path: str | Path, exc: Exception) -> None:
        self._errors_total += 1
        # Debug, not warning: a broken file would otherwise log every interval.
        _log.debug("%s: skipping %s: %s", self.source_name, path, exc)
