"""The agent's view of its sources: the latest samples of each, within a series limit.

The collect thread replaces a source's samples each tick; the exporter, the Prometheus
endpoint and the agent's own metrics read them at any moment.
"""

from __future__ import annotations

import logging
import threading

from ridethrough.collector.sample import Sample

log = logging.getLogger(__name__)

SeriesKey = tuple[str, frozenset[tuple[str, str]]]
"""One series: a metric name and its attribute set."""


def _series(sample: Sample) -> SeriesKey:
    return sample.name, frozenset(sample.attributes.items())


class Snapshot:
    """The latest samples of each source, shared by the collect thread and the readers.

    It holds at most ``max_series`` distinct series (metric name and attribute set) in all.
    A series it already holds keeps updating; a new one beyond the limit is refused and
    counted in `dropped`, by source, on every collection that refuses it.
    """

    def __init__(self, *, max_series: int = 100_000) -> None:
        self._lock = threading.Lock()
        self._max = max_series
        self._by_source: dict[str, dict[str, list[Sample]]] = {}
        self._held: dict[str, int] = {}
        self.dropped: dict[str, int] = {}
        """Series refused for want of room, by source (cumulative)."""

    def replace(self, source: str, samples: list[Sample]) -> None:
        """Make ``samples`` the source's current view (less any series refused for want of room)."""
        with self._lock:
            room = self._max - (sum(self._held.values()) - self._held.get(source, 0))
            held = len(samples)
            if held > room:  # rare: only then is it worth hashing every attribute set
                samples, held = self._admit(source, samples, room)
            self._by_source[source] = group_by_name(samples)
            self._held[source] = held

    def _admit(self, source: str, samples: list[Sample], room: int) -> tuple[list[Sample], int]:
        """The samples of series already held, then of new series while there is room."""
        before = {_series(s) for group in self._by_source.get(source, {}).values() for s in group}
        keys = [_series(s) for s in samples]
        keep = {k for k in keys if k in before}
        for k in keys:
            if len(keep) >= room:
                break
            keep.add(k)
        refused = len(set(keys) - keep)
        if refused:
            if not any(self.dropped.values()):
                log.warning("series limit (%d) reached: new series from %s are dropped and counted in "
                            "ridethrough.agent.series.dropped; raise agent.max_series if they matter",
                            self._max, source)
            self.dropped[source] = self.dropped.get(source, 0) + refused
        return [s for s, k in zip(samples, keys, strict=True) if k in keep], len(keep)

    def samples(self) -> list[Sample]:
        """Every current sample of every source."""
        with self._lock:
            return [s for by_name in self._by_source.values() for v in by_name.values() for s in v]

    def by_name(self) -> dict[str, list[Sample]]:
        """Every current sample by metric name: names in the order `samples` meets them, samples in that order."""
        merged: dict[str, list[Sample]] = {}
        with self._lock:
            for by_name in self._by_source.values():
                for name, group in by_name.items():
                    held = merged.get(name)
                    # the source's own list is shared, never changed: `replace` swaps in new lists
                    merged[name] = group if held is None else held + group
        return merged


def group_by_name(samples: list[Sample]) -> dict[str, list[Sample]]:
    """Samples by metric name, names and samples in the order they come."""
    groups: dict[str, list[Sample]] = {}
    for sample in samples:
        group = groups.get(sample.name)
        if group is None:
            groups[sample.name] = [sample]
        else:
            group.append(sample)
    return groups
