"""The agent's sample encoder writes exactly the request the SDK's encoder builds from the same samples."""

from __future__ import annotations

import logging

from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.sdk.metrics.export import AggregationTemporality, Gauge, Sum
from opentelemetry.sdk.resources import Resource

from ridethrough.collector.agent import SCOPE, Agent
from ridethrough.collector.identity import AgentIdentity
from ridethrough.collector.otlp_encode import SampleEncoder
from ridethrough.collector.sample import MetricKind, Sample

NOW = 4 * 10**18  # later than any start time of the agent


class Scripted:
    """A source that returns whatever the test sets, the same objects each tick unless changed."""

    name = "scripted"
    interval_s = 1.0

    def __init__(self, samples: list[Sample]) -> None:
        self.samples = samples

    def collect(self, now_ns: int) -> list[Sample]:
        return list(self.samples)


def _agent(source: Scripted, **kwargs: object) -> Agent:
    return Agent(identity=AgentIdentity(node_id="n", host_name="h", cluster="c", rack="r1", labels={"x": "y"}),
                 sources=[source], gateway="127.0.0.1:1", export_timeout_s=0.1, **kwargs)  # type: ignore[arg-type]


def _parsed(agent: Agent, now_ns: int) -> ExportMetricsServiceRequest:
    return ExportMetricsServiceRequest.FromString(agent.encoded(now_ns).payload)


def _mixed(tick: int) -> list[Sample]:
    shared = {"network.interface.name": "nic0"}  # one mapping behind a counter and a gauge
    nics = [{"network.interface.name": f"nic{i}", "network.io.direction": d} for i in range(3)
            for d in ("receive", "transmit")]
    return [
        *(Sample("system.network.io", float(1000 * tick + i), MetricKind.COUNTER, "By", a)
          for i, a in enumerate(nics)),
        Sample("ridethrough.nic.carrier_changes", 3.0, MetricKind.COUNTER, "{change}", shared),
        Sample("ridethrough.nic.up", 1.0, MetricKind.GAUGE, "1", shared),
        Sample("gpu.temperature", 41.5 + tick, MetricKind.GAUGE, "Cel", {"gpu.index": "0", "hw.model": "H100 ü"}),
        Sample("plain", 7, MetricKind.GAUGE, "1"),  # an int: as_int, as the SDK writes it
        Sample("big", 2.0**70, MetricKind.COUNTER, "1", {"k": "v"}),
        Sample("nan", float("nan") if tick < 0 else -0.5, MetricKind.GAUGE, "1", {}),
    ]


def test_same_request_as_the_sdk_encoder_tick_after_tick() -> None:
    source = Scripted(_mixed(0))
    agent = _agent(source, descriptions={"system.network.io": "Bytes.", "plain": "Plain ü."})
    for tick in range(4):  # later ticks come from the caches; values change, mappings are reused or new
        if tick != 2:
            source.samples = _mixed(tick)
        agent._collect_source(source, 0)
        now = NOW + tick
        encoded = agent.encoded(now)
        assert ExportMetricsServiceRequest.FromString(encoded.payload) == encode_metrics(agent.metrics_data(now))
        assert encoded.points == len(agent.samples())
    agent.exporter.shutdown()


def test_a_bool_value_goes_as_an_int() -> None:  # the SDK's encoder refuses one outright
    source = Scripted([Sample("flag", True, MetricKind.GAUGE, "1", {"k": "v"})])
    agent = _agent(source)
    agent._collect_source(source, 0)
    metrics = {m.name: m for m in _parsed(agent, NOW).resource_metrics[0].scope_metrics[0].metrics}
    assert metrics["flag"].gauge.data_points[0].as_int == 1
    agent.exporter.shutdown()


def test_attributes_with_list_values_are_encoded_every_time() -> None:
    listed = {"a": ["x", "y"], "n": 3}  # not a Mapping[str, str], but an attribute OTLP can carry
    source = Scripted([Sample("l", 2.0, MetricKind.GAUGE, "1", listed)])  # type: ignore[arg-type]
    agent = _agent(source)
    agent._collect_source(source, 0)
    for now in (NOW, NOW + 1):
        assert _parsed(agent, now) == encode_metrics(agent.metrics_data(now))
    agent.exporter.shutdown()


def test_points_that_are_not_numbers_are_left_out_counted_and_logged_once(caplog) -> None:
    bad = Sample("bad", "many", MetricKind.GAUGE, "1", {"k": "v"})  # type: ignore[arg-type]
    also_bad = Sample("bad", None, MetricKind.GAUGE, "1", {"k": "w"})  # type: ignore[arg-type]
    good = Sample("bad", 2.5, MetricKind.GAUGE, "1", {"k": "x"})
    only_bad = Sample("worse", "x", MetricKind.COUNTER, "1")  # type: ignore[arg-type]
    source = Scripted([bad, also_bad, good, only_bad, Sample("ok", 1.0, MetricKind.GAUGE, "1")])
    agent = _agent(source)
    agent._collect_source(source, 0)
    with caplog.at_level(logging.WARNING, logger="ridethrough.collector.otlp_encode"):
        request = _parsed(agent, NOW)
        _parsed(agent, NOW + 1)
    metrics = {m.name: m for m in request.resource_metrics[0].scope_metrics[0].metrics}
    assert [p.as_double for p in metrics["bad"].gauge.data_points] == [2.5], "the good point of the metric stays"
    assert "worse" not in metrics, "a metric with no good point is left out, not sent empty"
    assert "ok" in metrics and "ridethrough.agent.source.errors" in metrics
    assert agent._encoder.invalid_points == 6, "3 points on each of 2 exports"
    assert sum("not a number" in r.message for r in caplog.records) == 1
    agent.exporter.shutdown()


def test_attribute_cache_is_bounded_and_output_stays_right() -> None:
    resource = Resource.create({"service.name": "t"})
    encoder = SampleEncoder(resource=resource, scope=SCOPE, max_entries=2)
    for tick in range(3):
        samples = [Sample("m", float(i), MetricKind.GAUGE, "1", {"i": str(i), "t": str(tick)}) for i in range(5)]
        encoded = encoder.encode([("m", samples)], start_ns=1, now_ns=2)
        points = ExportMetricsServiceRequest.FromString(encoded.payload).resource_metrics[0] \
            .scope_metrics[0].metrics[0].gauge.data_points
        assert [(p.as_double, {kv.key: kv.value.string_value for kv in p.attributes}) for p in points] == \
            [(float(i), {"i": str(i), "t": str(tick)}) for i in range(5)]
        assert len(encoder._heads) <= 2


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
    request = _parsed(agent, NOW)
    assert request == encode_metrics(data)
    wire = {m.name: m for m in request.resource_metrics[0].scope_metrics[0].metrics}
    assert wire["c"].sum.is_monotonic and wire["c"].sum.data_points[0].as_int == 5
    agent.exporter.shutdown()
