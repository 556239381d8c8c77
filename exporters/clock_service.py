"""The clock service: solve the agents' pairwise clock estimates into per-node corrections.

Every agent estimates its clock against each peer it probes (``ridethrough.clock.pair.*``, see
`ridethrough.collector.clock_pairs`). Every window the service reads the latest estimate of
each (src, dst) pair from the store, carries each offset to one common time along its drift,
solves the probe graph (`ridethrough.collector.clock_graph.solve`: loops expose a bad edge that
one pair cannot) and

* publishes the per-node corrections (`snapshot`, served as JSON by `ClockEndpoint`) for the
  agents to turn raw probe timestamps into one-way delays;
* writes them into the store as ``ridethrough.clock.node.*`` through the gateway's columnar
  path (an OTLP request converted to rows), catalogued under source ``clock``.

A failing window (store away, no estimates yet) is logged and counted; the last good snapshot
stays published.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

from ridethrough.collector.clock_graph import GraphSolution, PairEdge, solve
from ridethrough.exporters.gateway_metrics import GatewayMetrics
from ridethrough.exporters.pipeline import write_requests
from ridethrough.exporters.rows import kv
from ridethrough.exporters.signals import Signal
from ridethrough.exporters.store import Store, StoreError, StoreUnavailable

log = logging.getLogger(__name__)

PAIR = "ridethrough.clock.pair."
NODE = "ridethrough.clock.node."
_NS_PER_S = 1e9
_PAIR_FIELDS = ("offset", "drift", "uncertainty", "step", "reference")

# The latest export of each (src, dst) pair: one map of its gauges per export time, then the
# newest of those per pair (ClickHouse does the aggregation; the service gets one row a pair).
_LATEST_PAIRS = """
SELECT src, dst, argMax(fields, t) FROM (
    SELECT Attributes['clock.src.node'] AS src, Attributes['clock.dst.node'] AS dst, TimeUnix AS t,
           mapFromArrays(groupArray(MetricName), groupArray(Value)) AS fields
    FROM otel_metrics_gauge
    WHERE MetricName IN ({names}) AND TimeUnix >= fromUnixTimestamp64Nano(toInt64({since_ns}))
    GROUP BY src, dst, t)
WHERE length(fields) = {n_fields}
GROUP BY src, dst
"""


@dataclass(frozen=True, slots=True)
class PairRow:
    """One pair's latest window estimate as the agent reported it."""

    src: str
    dst: str
    offset_ns: float
    drift_ppm: float
    uncertainty_ns: float
    reference_ns: int
    step: bool

    def edge(self, at_ns: int) -> PairEdge:
        """An edge with the offset carried from the window's reference time to ``at_ns``."""
        offset = self.offset_ns + self.drift_ppm * 1e-6 * (at_ns - self.reference_ns)
        return PairEdge(self.src, self.dst, offset, self.drift_ppm, self.uncertainty_ns)


@dataclass(frozen=True, slots=True)
class NodeCorrection:
    """clock_node - clock_reference at ``at_ns``, drifting at ``drift_ppm``."""

    offset_ns: float
    drift_ppm: float
    uncertainty_ns: float
    at_ns: int


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One window's solution, as published."""

    reference: str
    computed_at_ns: int
    nodes: dict[str, NodeCorrection]

    def to_json(self) -> dict[str, Any]:
        """The ``GET /clock/corrections`` document."""
        return {"reference": self.reference, "computed_at_ns": self.computed_at_ns,
                "nodes": {n: {"offset_ns": c.offset_ns, "drift_ppm": c.drift_ppm,
                              "uncertainty_ns": c.uncertainty_ns, "at_ns": c.at_ns}
                          for n, c in sorted(self.nodes.items())}}


def latest_pairs(store: Store, *, since_ns: int) -> list[PairRow]:
    """The newest complete estimate of every pair reported since ``since_ns``."""
    names = ", ".join(f"'{PAIR}{f}'" for f in _PAIR_FIELDS)
    sql = _LATEST_PAIRS.format(names=names, since_ns=int(since_ns), n_fields=len(_PAIR_FIELDS))
    _, rows = store.query(sql)
    out = []
    for src, dst, fields in rows:
        if not src or not dst or src == dst:
            continue
        out.append(PairRow(src, dst, fields[PAIR + "offset"] * _NS_PER_S, fields[PAIR + "drift"],
                           fields[PAIR + "uncertainty"] * _NS_PER_S,
                           round(fields[PAIR + "reference"] * _NS_PER_S), fields[PAIR + "step"] > 0))
    return sorted(out, key=lambda r: (r.src, r.dst))


def solve_pairs(pairs: Sequence[PairRow], *, reference: str = "", computed_at_ns: int) -> Snapshot | None:
    """The graph's per-node corrections at the newest window's reference time; None without pairs.

    ``reference`` empty (or not among the nodes) picks the lexicographically first node.
    """
    if not pairs:
        return None
    nodes = sorted({n for p in pairs for n in (p.src, p.dst)})
    ref = reference if reference in nodes else nodes[0]
    at_ns = max(p.reference_ns for p in pairs)
    solution: GraphSolution = solve([p.edge(at_ns) for p in pairs], reference=ref)
    return Snapshot(ref, computed_at_ns, {
        n: NodeCorrection(c.offset_ns, c.drift_ppm, c.offset_uncertainty_ns, at_ns)
        for n, c in solution.nodes.items()})


def snapshot_request(snap: Snapshot) -> ExportMetricsServiceRequest:
    """The snapshot as an OTLP request: ``ridethrough.clock.node.*`` gauges, one point per node.

    Each point is stamped with the time its offset holds at (the newest pair estimate's), not with when it
    was computed: on a busy store the pairs' query can wait for tens of seconds, and a drifting offset
    stamped that far from its own time sat off its line by drift x delay (64 ppm x 23 s: 1.5 ms), which
    the clock detectors read as a step on every node at once.
    """
    req = ExportMetricsServiceRequest()
    rm = req.resource_metrics.add()
    rm.resource.attributes.append(kv("service.name", "ridethrough-clock"))
    sm = rm.scope_metrics.add()
    sm.scope.name = "ridethrough.clock"
    values: tuple[tuple[str, str, Callable[[NodeCorrection], float]], ...] = (
        ("offset", "s", lambda c: c.offset_ns / _NS_PER_S),
        ("drift", "{ppm}", lambda c: c.drift_ppm),
        ("uncertainty", "s", lambda c: c.uncertainty_ns / _NS_PER_S))
    for field, unit, value in values:
        metric = sm.metrics.add()
        metric.name, metric.unit = NODE + field, unit
        for node, corr in sorted(snap.nodes.items()):
            point = metric.gauge.data_points.add()
            point.time_unix_nano = corr.at_ns
            point.as_double = value(corr)
            point.attributes.extend([kv("clock.node", node), kv("clock.reference", snap.reference)])
    return req


class ClockService:
    """Every ``window_s``: read the pairs, solve, publish, write (see the module docstring)."""

    def __init__(self, *, store: Store, metrics: GatewayMetrics, window_s: float = 2.0, reference: str = "",
                 clock: Callable[[], int] = time.time_ns) -> None:
        self._store = store
        self._metrics = metrics
        self._window_s = window_s
        self._reference = reference
        self._clock = clock
        self._lock = threading.Lock()
        self._snapshot: Snapshot | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failures = 0
        """Windows that could not be solved or written (logged, counted, skipped)."""

    def snapshot(self) -> Snapshot | None:
        """The latest published corrections (None before the first solution)."""
        with self._lock:
            return self._snapshot

    def run_once(self) -> Snapshot | None:
        """One window now: the new snapshot, or None when there was nothing to solve."""
        # Two windows back: an agent that just missed one window's export still counts.
        since = self._clock() - round(3 * self._window_s * _NS_PER_S)
        pairs = latest_pairs(self._store, since_ns=since)
        now = self._clock()  # after the query, which may have waited its turn at the store for long
        snap = solve_pairs(pairs, reference=self._reference, computed_at_ns=now)
        if snap is None:
            return None
        with self._lock:
            self._snapshot = snap
        write_requests(self._store, [(Signal.METRICS, snapshot_request(snap))], token=f"clock:{now}",
                       metrics=self._metrics)
        return snap

    def start(self) -> None:
        """Run a window every ``window_s`` in a thread, until `stop`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="clock-service", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop after the window in progress."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.wait(self._window_s):
            try:
                self.run_once()
            except (StoreUnavailable, StoreError) as exc:
                self.failures += 1
                log.warning("clock service: window skipped: %s", exc)
            except Exception:  # a solver bug must not end the service: log it, try next window
                self.failures += 1
                log.exception("clock service: window failed")
