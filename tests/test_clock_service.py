"""The clock service against a real chDB store: pair gauges in, a solved graph out (HTTP and store)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

from ridethrough.catalogue import metric, metrics_of
from ridethrough.collector.clock_pairs import estimate_samples
from ridethrough.collector.huygens import PairEstimate
from ridethrough.exporters.clock_http import PATH, ClockEndpoint
from ridethrough.exporters.clock_service import NODE, ClockService, latest_pairs
from ridethrough.exporters.gateway_metrics import GatewayMetrics
from ridethrough.exporters.pipeline import write_batch
from ridethrough.exporters.rows import Limits, Rejections, Rows
from ridethrough.exporters.signals import Signal
from ridethrough.exporters.store import Store

T0 = 1_764_480_000_000_000_000
TRUTH = {"h0": 0.0, "h1": 2_500_000.0, "h2": -700_000.0, "h3": 4_000_000.0}
"""clock_node - clock_h0, in ns (no drift)."""


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    s = Store(f"chdb://{tmp_path_factory.mktemp('clock') / 'store'}")  # one chDB path for this module
    s.init_schema()
    yield s
    s.close()


def estimate(src: str, dst: str, *, error_ns: float = 0.0, reference_ns: int = T0, drift_ppm: float = 0.0,
             uncertainty_ns: float = 1_000.0) -> PairEstimate:
    return PairEstimate(src, dst, TRUTH[dst] - TRUTH[src] + error_ns, drift_ppm, uncertainty_ns, 1.0, 10, 10, 10,
                        50_000.0, 50_000.0, reference_ns - 10**9, reference_ns + 10**9, reference_ns)


def insert(store: Store, estimates: list[PairEstimate], *, time_ns: int) -> None:
    """The estimates as their agents export them: the pair gauges, through the gateway's conversion."""
    req = ExportMetricsServiceRequest()
    sm = req.resource_metrics.add().scope_metrics.add()
    for est in estimates:
        for sample in estimate_samples(est):
            m = sm.metrics.add(name=sample.name, unit=sample.unit)
            point = m.gauge.data_points.add(time_unix_nano=time_ns, as_double=sample.value)
            for k, v in sample.attributes.items():
                point.attributes.add(key=k).value.string_value = v
    rows = Rows()
    Signal.METRICS.convert(req.SerializeToString(), Limits(), rows, Rejections())
    write_batch(store, rows, f"test:{time_ns}:{len(estimates)}", GatewayMetrics.create())


def test_the_graph_fixes_a_bad_edge_and_the_corrections_are_served_and_stored(store: Store) -> None:
    ring = [("h0", "h1"), ("h1", "h2"), ("h2", "h3"), ("h3", "h0"), ("h0", "h2"), ("h1", "h3")]
    old = [estimate(a, b, error_ns=1e6) for a, b in ring]  # an older export, superseded below
    insert(store, old, time_ns=T0)
    edges = [estimate(a, b) for a, b in ring]
    edges[1] = estimate("h1", "h2", error_ns=300_000.0)  # a path with asymmetric delays: loops expose it
    insert(store, edges, time_ns=T0 + 10**9)
    pairs = latest_pairs(store, since_ns=T0 - 10**9)
    assert [(p.src, p.dst) for p in pairs] == sorted(ring) and all(p.reference_ns == T0 for p in pairs)

    service = ClockService(store=store, metrics=GatewayMetrics.create(), clock=lambda: T0 + 2 * 10**9)
    snap = service.run_once()
    assert snap is not None and snap.reference == "h0" and set(snap.nodes) == set(TRUTH)
    for node, truth in TRUTH.items():
        assert abs(snap.nodes[node].offset_ns - truth) < 5_000, (node, snap.nodes[node])
        assert snap.nodes[node].at_ns == T0

    endpoint = ClockEndpoint(snapshot=service.snapshot, host="127.0.0.1", port=0)
    host, port = endpoint.start()
    try:
        with urllib.request.urlopen(f"http://{host}:{port}{PATH}", timeout=5) as resp:
            doc = json.load(resp)
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(f"http://{host}:{port}/other", timeout=5)
        assert missing.value.code == 404
    finally:
        endpoint.stop()
    assert doc["reference"] == "h0" and doc["computed_at_ns"] == T0 + 2 * 10**9
    assert abs(doc["nodes"]["h3"]["offset_ns"] - 4e6) < 5_000 and doc["nodes"]["h3"]["at_ns"] == T0

    _, rows = store.query(f"SELECT MetricName, MetricUnit, Attributes['clock.node'], Value, "
                          f"arraySort(mapKeys(Attributes)), toUnixTimestamp64Nano(TimeUnix) FROM otel_metrics_gauge "
                          f"WHERE MetricName LIKE '{NODE}%'")
    assert {r[0] for r in rows} == {m.name for m in metrics_of("clock")}  # held to the catalogue both ways
    for name, unit, node, value, keys, t_ns in rows:
        spec = metric(name)
        assert (spec.source, spec.unit, tuple(keys)) == ("clock", unit, tuple(sorted(spec.attributes)))
        assert t_ns == T0, "stamped with the time the offset holds at, not the 2 s later it was computed"
        if name == NODE + "offset":
            assert abs(value * 1e9 - TRUTH[node]) < 5_000


def test_offsets_are_carried_to_the_newest_window_along_their_drift(store: Store) -> None:
    """Pairs reported from different windows still add up: each offset is moved to one time first."""
    at = T0 + 100 * 10**9
    later = [estimate("h0", "h1", reference_ns=at - 2 * 10**9, drift_ppm=10.0,
                      error_ns=-10.0 * 2_000),  # 10 ppm for 2 s: 20 µs less, back then
             estimate("h1", "h3", reference_ns=at)]
    insert(store, later, time_ns=at)
    service = ClockService(store=store, metrics=GatewayMetrics.create(), clock=lambda: at + 10**9, reference="h1")
    snap = service.run_once()
    assert snap is not None and snap.reference == "h1" and set(snap.nodes) == {"h0", "h1", "h3"}
    assert abs(snap.nodes["h0"].offset_ns - (TRUTH["h0"] - TRUTH["h1"])) < 100
    assert abs(snap.nodes["h3"].offset_ns - (TRUTH["h3"] - TRUTH["h1"])) < 100


def test_nothing_to_solve_publishes_nothing_and_the_endpoint_says_so(store: Store) -> None:
    service = ClockService(store=store, metrics=GatewayMetrics.create(), clock=lambda: T0 + 10**12)
    assert service.run_once() is None and service.snapshot() is None
    endpoint = ClockEndpoint(snapshot=service.snapshot, host="127.0.0.1", port=0)
    host, port = endpoint.start()
    try:
        with pytest.raises(urllib.error.HTTPError) as unsolved:
            urllib.request.urlopen(f"http://{host}:{port}{PATH}", timeout=5)
        assert unsolved.value.code == 503
    finally:
        endpoint.stop()
