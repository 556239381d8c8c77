"""One device's attribute sets and samples, made once per series and handed out again every collection."""

from __future__ import annotations

from collections.abc import Mapping

from ..counters import SeriesKey
from ..sample import MetricKind, Sample

Extra = tuple[str, str]
"""One attribute a series adds to its device's: (key, value)."""


class SeriesAttributes:
    """A device's attributes (``base``) and, made on first use, each of its series' attribute dicts.

    The same series gets the same dict object every collection. That spares making it again,
    and what keeps per-series state downstream (the agent's OTLP encoder, a `CounterTracker`
    through `key`) finds it without hashing its contents. Samples share these dicts, as
    samples may: nobody changes a sample's attributes. `sample` goes one step further and
    hands out the last sample of a series again while its value stands still (samples are
    immutable), which the encoder also notices.

    Memory is bounded by the series a device has: extras come from small fixed sets (reasons,
    error types, link numbers).
    """

    def __init__(self, base: Mapping[str, str]) -> None:
        self.base: dict[str, str] = dict(base)
        self._sets: dict[tuple[Extra, ...], dict[str, str]] = {(): self.base}
        self._keys: dict[tuple[str, tuple[Extra, ...]], SeriesKey] = {}
        self._samples: dict[tuple[str, tuple[Extra, ...]], Sample] = {}

    def with_(self, *extra: Extra) -> dict[str, str]:
        """``base`` plus ``extra``: the attributes of one series."""
        found = self._sets.get(extra)
        if found is None:
            found = self._sets[extra] = {**self.base, **dict(extra)}
        return found

    def key(self, metric: str, *extra: Extra) -> SeriesKey:
        """The `CounterTracker` key of ``metric``'s series with ``extra``."""
        found = self._keys.get((metric, extra))
        if found is None:
            found = self._keys[(metric, extra)] = (metric, frozenset(self.with_(*extra).items()))
        return found

    def sample(self, metric: str, kind: MetricKind, unit: str, value: float, *extra: Extra) -> Sample:
        """A sample of ``metric``'s series with ``extra``: its last one again if ``value`` is the same."""
        last = self._samples.get((metric, extra))
        value = float(value)
        if last is None or last.value != value or last.unit != unit or last.kind is not kind:
            last = self._samples[(metric, extra)] = Sample(metric, value, kind, unit, self.with_(*extra))
        return last
