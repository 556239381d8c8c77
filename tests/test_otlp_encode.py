"""The agent's caching OTLP encoder builds exactly the request the SDK's encoder builds."""

from __future__ import annotations

from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from ridethrough.collector.agent import Agent, AgentIdentity
from ridethrough.collector.otlp_encode import CachingMetricsEncoder, CachingOTLPMetricExporter
from ridethrough.collector.sample import MetricKind, Sample

RESOURCE = Resource.create({"service.name": "t", "host.name": "h", "ridethrough.node.id": "n"})
SCOPE = InstrumentationScope("ridethrough.collector")
NOW = 4 * 10**18  # later than any start time of the agent


def _data(metrics: list[Metric]) -> MetricsData:
    return MetricsData([ResourceMetrics(RESOURCE, [ScopeMetrics(SCOPE, metrics, "")], "")])


def _numbers(tick: int) -> MetricsData:
    nics = [{"network.interface.name": f"nic{i}", "network.io.direction": d} for i in range(3)
            for d in ("receive", "transmit")]
    return _data([
        Metric("system.network.io", "Bytes.", "By", Sum(
            [NumberDataPoint(a, 100, 200 + tick, 1000 * tick + i) for i, a in enumerate(nics)],
            AggregationTemporality.CUMULATIVE, True)),
        Metric("gpu.temperature", "", "Cel", Gauge(
            [NumberDataPoint({"gpu.index": "0", "flag": True, "n": 3, "x": 1.5}, 0, 200 + tick, 41.5 + tick)])),
        Metric("plain", "", "1", Gauge([NumberDataPoint({}, 0, 5, 7)])),
        Metric("empty", "", "1", Sum([], AggregationTemporality.CUMULATIVE, True)),
    ])


def test_same_request_as_the_sdk_encoder_tick_after_tick() -> None:
    encoder = CachingMetricsEncoder()
    for tick in range(3):  # the later ticks come from the cache
        data = _numbers(tick)
        assert encoder.encode(data) == encode_metrics(data)


def test_what_it_does_not_handle_goes_to_the_sdk_encoder() -> None:
    histogram = Metric("h", "", "s", Histogram(
        [HistogramDataPoint({}, 1, 2, 3, 4.0, [1, 2], [1.0], 0.5, 2.0)], AggregationTemporality.CUMULATIVE))
    listed = Metric("l", "", "1", Gauge([NumberDataPoint({"a": ["x", "y"]}, 0, 1, 2)]))
    for data in (_data([histogram]), _data([listed])):
        assert CachingMetricsEncoder().encode(data) == encode_metrics(data)


def test_cache_is_bounded() -> None:
    encoder = CachingMetricsEncoder(max_entries=2)
    for tick in range(2):
        assert encoder.encode(_numbers(tick)) == encode_metrics(_numbers(tick))
    assert len(encoder._attrs) <= 2


def test_the_exporter_translates_through_the_cache() -> None:
    exporter = CachingOTLPMetricExporter(endpoint="127.0.0.1:1", insecure=True, timeout_s=0.1)
    data = _numbers(1)
    # if an SDK release renames its translation hook, the override goes unused: this notices
    assert exporter._translate_data(data) == encode_metrics(data)
    assert exporter.encoder._attrs, "the agent's exporter encodes through the cache"
    exporter.shutdown()


class Mixed:
    name = "mixed"
    interval_s = 1.0

    def collect(self, now_ns: int) -> list[Sample]:
        return [Sample("c", 5, MetricKind.COUNTER, "By", {"k": "v"}), Sample("g", 2.5, MetricKind.GAUGE, "1")]


def test_agent_batch_has_sums_gauges_resource_and_descriptions() -> None:
    agent = Agent(identity=AgentIdentity(node_id="n", host_name="h", cluster="c"), sources=[Mixed()],
                  gateway="127.0.0.1:1", export_timeout_s=0.1, descriptions={"c": "A counter."})
    agent._collect_source(Mixed(), 0)
    data = agent.metrics_data(now_ns=NOW)
    rm = data.resource_metrics[0]
    assert rm.resource.attributes["ridethrough.node.id"] == "n"
    metrics = {m.name: m for m in rm.scope_metrics[0].metrics}
    c, g = metrics["c"], metrics["g"]
    assert isinstance(c.data, Sum) and c.data.is_monotonic and c.description == "A counter." and c.unit == "By"
    assert c.data.aggregation_temporality is AggregationTemporality.CUMULATIVE
    assert [(p.attributes, p.value, p.time_unix_nano) for p in c.data.data_points] == [({"k": "v"}, 5, NOW)]
    assert c.data.data_points[0].start_time_unix_nano < NOW
    assert isinstance(g.data, Gauge) and g.data.data_points[0].value == 2.5
    assert "ridethrough.agent.series.dropped" in metrics
    assert CachingMetricsEncoder().encode(data) == encode_metrics(data)
    agent.exporter.shutdown()
