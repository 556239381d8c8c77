"""The live feed: wake a fast detector as soon as the gateway has written evidence it cares about.

Scheduled detectors see a hard failure up to one interval late. A detector that declares
``triggers`` (gauge metric name → a test of one value, e.g. ``ridethrough.nic.up`` → "not 1")
is run at once when a series of that metric *turns* bad in a freshly written batch (its previous
point passed the test's opposite, or it is new): the feed only says *when* to look, the
detector still decides from the store, so evidence and findings stay the same as on the
schedule. Edge-triggered, so a port that stays down does not wake anything again.

    feed = LiveFeed(controller.detectors, wake=controller.wake)
    pipeline.observe(feed)
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from ridethrough.detectors.contract import Detector
from ridethrough.exporters.rows import Rows
from ridethrough.exporters.schema import GAUGE

log = logging.getLogger(__name__)

Trigger = Callable[[float], bool]
"""True for a gauge value that should wake the detector now."""


def triggers_of(detector: Detector) -> Mapping[str, Trigger]:
    """A detector's ``triggers`` (optional: none for scheduled-only detectors)."""
    found = getattr(detector, "triggers", None)
    return found if isinstance(found, Mapping) else {}


def runs_live(detector: Detector) -> bool:
    """Whether ``detector`` belongs in the controller's live lane: the feed can wake it (``triggers``), or it
    decides from what the feed gave it and queries the store little or not at all (``live`` true)."""
    return bool(triggers_of(detector)) or getattr(detector, "live", False) is True


class LiveFeed:
    """Scans each written batch's gauge points and wakes the detectors whose triggers match.

    A detector is woken at most once per ``min_gap_s``; only rows of watched metrics are looked
    at beyond their name, and one bit per watched series is kept (the last verdict). A detector
    with ``follow_feed()`` gets every written batch too, through the observer that returns.
    """

    def __init__(self, detectors: Iterable[Detector], *, wake: Callable[[Sequence[str]], None],
                 min_gap_s: float = 0.25, clock: Callable[[], float] = time.monotonic) -> None:
        self._by_metric: dict[str, list[tuple[str, Trigger]]] = {}
        self._followers: list[Callable[[Rows], None]] = []
        for d in detectors:
            for metric, test in triggers_of(d).items():
                self._by_metric.setdefault(metric, []).append((d.name, test))
            follow = getattr(d, "follow_feed", None)
            if callable(follow):
                self._followers.append(follow())
        self._wake = wake
        self._gap = min_gap_s
        self._clock = clock
        self._last: dict[str, float] = {}
        self._bad: dict[tuple[str, str, str, tuple[tuple[str, str], ...]], bool] = {}
        self._lock = threading.Lock()

    @property
    def metrics(self) -> frozenset[str]:
        """The gauge metrics the feed watches."""
        return frozenset(self._by_metric)

    def __call__(self, rows: Rows) -> None:
        """Look at one written batch (the pipeline's observer)."""
        for follower in self._followers:
            try:
                follower(rows)
            except Exception:  # one follower's bug must not keep the batch from the triggers or the others
                log.exception("live-feed follower %r failed", follower)
        if not self._by_metric:
            return
        cols = rows.columns.get(GAUGE.name)
        if not cols:
            return
        due: set[str] = set()
        watched = self._by_metric
        values, resources, attrs = cols["Value"], cols["ResourceAttributes"], cols["Attributes"]
        for i, name in enumerate(cols["MetricName"]):
            tests = watched.get(name)
            if tests is None:
                continue
            node = resources[i].get("ridethrough.node.id", "")
            labels = tuple(sorted(attrs[i].items()))
            for detector, test in tests:
                key = (detector, name, node, labels)
                bad = bool(test(values[i]))
                if bad and not self._bad.get(key, False):
                    due.add(detector)
                self._bad[key] = bad
        if due:
            self._fire(due)

    def _fire(self, due: set[str]) -> None:
        now = self._clock()
        with self._lock:
            ready = sorted(d for d in due if now - self._last.get(d, -self._gap) >= self._gap)
            for d in ready:
                self._last[d] = now
        if ready:
            log.debug("live feed wakes %s", ", ".join(ready))
            self._wake(ready)
