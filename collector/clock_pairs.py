"""The agent's half of clock sync: one Huygens estimator per peer node, fed by the prober.

`PairwiseClocks.add` takes every `ProbeSample` (in the prober's thread); when a sample closes a
peer's window, that window's `PairEstimate` becomes the peer's latest. Each `samples` call (the
probe source's `collect`, in the agent's thread) reports every peer's latest estimate as
``ridethrough.clock.pair.*`` gauges, again at every collection until a newer window replaces it:
the agent exports a source's last collection, and a window reported once could fall between two
exports. An estimate ``STALE_WINDOWS`` behind the newest (a peer no longer probed) is dropped.

The clock service reads them from the store and solves the probe graph (`ridethrough.exporters.clock_service`).

An OTLP gauge point carries the export's time, not the window's: the window's reference time
(this node's clock) travels as its own gauge, ``ridethrough.clock.pair.reference``, so the
service can carry every offset to one common time along its drift.
"""

from __future__ import annotations

import threading

from ridethrough.collector.huygens import DEFAULT_CONFIG, HuygensConfig, PairEstimate, PairEstimator
from ridethrough.collector.probe_sample import ProbeSample
from ridethrough.collector.sample import MetricKind, Sample

PAIR = "ridethrough.clock.pair."
_NS_PER_S = 1e9
STALE_WINDOWS = 3


class PairwiseClocks:
    """Per-peer pairwise estimators; thread-safe between the prober and the collector."""

    def __init__(self, *, node: str, config: HuygensConfig = DEFAULT_CONFIG) -> None:
        self.node = node
        self._config = config
        self._lock = threading.Lock()
        self._estimators: dict[str, PairEstimator] = {}
        self._latest: dict[str, PairEstimate] = {}
        self.estimates = 0
        """Window estimates produced so far (all peers)."""

    def add(self, sample: ProbeSample) -> None:
        """One sample of this node's prober; a sample from another source node is ignored."""
        if sample.src_node != self.node or sample.dst_node == self.node:
            return
        with self._lock:
            estimator = self._estimators.get(sample.dst_node)
            if estimator is None:
                # Windows start at multiples of window_ns on this node's clock: every peer's
                # windows line up, and so do the other nodes' (within their clocks' offsets).
                estimator = self._estimators[sample.dst_node] = PairEstimator(config=self._config)
            done = estimator.add(sample)
            if done is not None:
                self._latest[sample.dst_node] = done
                self.estimates += 1

    def latest(self) -> list[PairEstimate]:
        """Every peer's latest finished window, sorted by peer; stale peers forgotten."""
        with self._lock:
            if self._latest:
                newest = max(e.reference_ns for e in self._latest.values())
                horizon = newest - STALE_WINDOWS * self._config.window_ns
                self._latest = {p: e for p, e in self._latest.items() if e.reference_ns >= horizon}
            return [self._latest[peer] for peer in sorted(self._latest)]

    def samples(self) -> list[Sample]:
        """`latest` as ``ridethrough.clock.pair.*`` gauges (see ``ridethrough/metrics/probe.yaml``)."""
        return [s for est in self.latest() for s in estimate_samples(est)]


def estimate_samples(est: PairEstimate) -> list[Sample]:
    """One window's estimate as gauges, attributes ``clock.src.node`` and ``clock.dst.node``."""
    attrs = {"clock.src.node": est.src, "clock.dst.node": est.dst}
    gauge = MetricKind.GAUGE
    return [
        Sample(PAIR + "offset", est.offset_ns / _NS_PER_S, gauge, "s", attrs),
        Sample(PAIR + "drift", est.drift_ppm, gauge, "{ppm}", attrs),
        Sample(PAIR + "uncertainty", est.uncertainty_ns / _NS_PER_S, gauge, "s", attrs),
        Sample(PAIR + "step", 1.0 if est.step_detected else 0.0, gauge, "1", attrs),
        Sample(PAIR + "reference", est.reference_ns / _NS_PER_S, gauge, "s", attrs),
    ]
