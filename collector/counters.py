"""Turn raw cumulative hardware counters into totals that never go down.

A NIC's ``rx_bytes`` or an HCA's ``port_xmit_data`` is cumulative since the
driver loaded, not since the agent started, and it can go *down*: a driver
reload, a firmware reset, ``ethtool``/``perfquery -R`` clearing it, a 32-bit
counter wrapping. Exported as-is, each of those reads as a huge negative rate.
`CounterTracker` keeps, per series, the last raw reading and a running total:

* the first reading of a series is its baseline, so the total equals the
  hardware counter until the first reset (dashboards and ``ethtool -S`` agree);
* afterwards the total grows by ``raw - last_raw``;
* when the raw value goes down, the new raw value is taken as the count since
  the reset and added whole, and the reset is counted in `resets_total`.

A wrap is indistinguishable from a reset without knowing the counter's width,
so a wrap undercounts by ``2**width - last_raw``; modern kernels expose 64-bit
netdev and extended IB counters, and the legacy 32-bit IB PMA counters
saturate instead of wrapping, so this rarely matters.

Series not observed for ``max_idle_collections`` collections are forgotten,
which bounds memory on hosts where interfaces come and go (veth pairs, VFs). A
forgotten series that comes back starts again from its raw baseline, which a
backend sees as an ordinary counter reset, as after an agent restart.

Pure code: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

SeriesKey = tuple[str, frozenset[tuple[str, str]]]
"""A series' identity: its metric name and its attributes, order-free."""


def parse_counter(text: str) -> int:
    """Parse one raw counter as the kernel prints it, e.g. ``"351884869\\n"``.

    Strict on purpose: ``int()`` would also take ``"-3"``, ``"1_000"`` or
    non-ASCII digits, none of which a kernel counter attribute ever holds.

    Raises:
        ValueError: the text is not one unsigned decimal integer (an empty
            file, garbage, a negative number).
    """
    stripped = text.strip()
    # ASCII and all digits is exactly [0-9]+ (str.isdigit alone also takes other scripts' digits);
    # a kernel counter is read hundreds of times a second, and this is faster than a regex
    if not (stripped.isascii() and stripped.isdigit()):
        raise ValueError(f"not an unsigned counter: {text!r}")
    return int(stripped)


@dataclass(slots=True)
class _Series:
    raw: int
    """The last raw hardware reading."""
    total: int
    """Monotonic total handed out for this series."""
    seen: int
    """Number of the collection that last observed the series."""


class CounterTracker:
    """Monotonic totals for many counter series, keyed by (name, attributes).

    A source calls `observe` for each raw reading in a collection and
    `end_collection` once when the collection is over (in a ``finally``, so a
    collection cut short still ages series).
    """

    def __init__(self, *, max_idle_collections: int = 60) -> None:
        """Track series, forgetting those absent for ``max_idle_collections`` collections.

        Raises:
            ValueError: ``max_idle_collections`` is below 1.
        """
        if max_idle_collections < 1:
            raise ValueError(f"max_idle_collections must be >= 1, got {max_idle_collections}")
        self._max_idle = max_idle_collections
        self._series: dict[SeriesKey, _Series] = {}
        self._collection = 0
        self._resets_total = 0

    @property
    def resets_total(self) -> int:
        """How many times a raw counter went down (reset, reload, wrap) since construction."""
        return self._resets_total

    def __len__(self) -> int:
        """The number of series currently remembered."""
        return len(self._series)

    def observe(self, name: str, attributes: Mapping[str, str], raw: int) -> int:
        """Record a raw cumulative reading and return the series' monotonic total.

        Raises:
            ValueError: ``raw`` is negative; hardware counters are unsigned, so
                this is a parsing bug upstream, not a reset.
        """
        return self.observe_key((name, frozenset(attributes.items())), raw)

    def observe_key(self, key: SeriesKey, raw: int) -> int:
        """`observe` for a caller that keeps the series' key (it saves hashing the attributes each time).

        Raises:
            ValueError: ``raw`` is negative.
        """
        if raw < 0:
            raise ValueError(f"raw counter for {key[0]} {dict(key[1])} is negative: {raw}")
        series = self._series.get(key)
        if series is None:
            self._series[key] = _Series(raw=raw, total=raw, seen=self._collection)
            return raw
        if raw >= series.raw:
            series.total += raw - series.raw
        else:
            # The counter restarted from zero at some point since the last
            # reading; everything it counted since then is the new raw value.
            series.total += raw
            self._resets_total += 1
        series.raw = raw
        series.seen = self._collection
        return series.total

    def end_collection(self) -> int:
        """Close the current collection; forget series idle too long. Returns how many were forgotten."""
        stale = [
            key for key, series in self._series.items() if self._collection - series.seen >= self._max_idle
        ]
        for key in stale:
            del self._series[key]
        self._collection += 1
        return len(stale)
