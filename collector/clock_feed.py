"""Per-node clock corrections from the clock service, polled over HTTP in the background.

The service (`ridethrough.exporters.clock_service`) answers ``GET /clock/corrections`` with

    {"reference": "h0", "computed_at_ns": 1764480000000000000,
     "nodes": {"h1": {"offset_ns": 2500000.0, "drift_ppm": -40.0, "uncertainty_ns": 900.0,
                      "at_ns": 1764479999000000000}}}

A poll runs in its own thread so that a slow or absent service never stalls the agent's
collection; failures are counted and the last good corrections kept (they carry their drift,
so they stay usable for a while).
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.request
from collections.abc import Mapping
from typing import Any

from ridethrough.collector.probe_stats import Correction

_log = logging.getLogger(__name__)


def parse_corrections(doc: Mapping[str, Any]) -> dict[str, Correction]:
    """The service's JSON as `Correction`s; ValueError when it is not that shape."""
    try:
        return {str(node): Correction(round(float(c["offset_ns"])), float(c["drift_ppm"]), int(c["at_ns"]))
                for node, c in dict(doc["nodes"]).items()}
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"malformed clock corrections: {exc!r}") from exc


class CorrectionsFeed:
    """Callable: the latest corrections fetched from ``url`` (empty until the first success)."""

    def __init__(self, url: str, *, interval_s: float = 2.0, timeout_s: float = 0.5) -> None:
        self.url = url
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._latest: dict[str, Correction] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fetches = 0
        self.failures = 0
        """Polls that failed (service away, bad answer): counted, logged at debug, otherwise ignored."""

    def __call__(self) -> Mapping[str, Correction]:
        return self._latest

    def poll_once(self) -> bool:
        """Fetch now; True when the corrections were replaced."""
        try:
            with urllib.request.urlopen(self.url, timeout=self._timeout_s) as resp:
                self._latest = parse_corrections(json.load(resp))
            self.fetches += 1
            return True
        except (OSError, ValueError) as exc:
            self.failures += 1
            _log.debug("clock corrections from %s: %s", self.url, exc)
            return False

    def start(self) -> None:
        """Poll every ``interval_s`` until `stop`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="clock-corrections", daemon=True)
            self._thread.start()

    def stop(self, *, timeout_s: float) -> None:
        """Stop polling (waits for an in-flight poll at most ``timeout_s``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll_once()
            self._stop.wait(self._interval_s)
