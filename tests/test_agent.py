"""The agent keeps running whatever its sources and its gateway do."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterable
from pathlib import Path

import clickhouse_connect
import pytest
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.sdk.metrics.export import MetricExportResult, MetricsData

from ridethrough.collector.agent import Agent, AgentIdentity
from ridethrough.collector.export import BufferingMetricExporter
from ridethrough.collector.sample import MetricKind, Sample
from tests.conftest import FIXTURES, read_ready, wait_for


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Exploding:
    name = "exploding"
    interval_s = 0.05

    def collect(self, now_ns: int) -> Iterable[Sample]:
        raise OSError("device vanished")


class Steady:
    name = "steady"
    interval_s = 0.05

    def __init__(self) -> None:
        self.calls = 0

    def collect(self, now_ns: int) -> Iterable[Sample]:
        self.calls += 1
        return [Sample("test.value", float(self.calls), MetricKind.GAUGE, "1", {"k": "v"})]


def test_a_failing_source_is_counted_and_skipped_while_others_run() -> None:
    steady = Steady()
    agent = Agent(identity=AgentIdentity(node_id="n", host_name="h", cluster="c"),
                  sources=[Exploding(), steady], gateway=f"127.0.0.1:{_free_port()}",
                  export_interval_s=60, export_timeout_s=0.2)
    agent.start()
    try:
        wait_for(lambda: agent.source_errors["exploding"] >= 3 and steady.calls >= 3, timeout_s=10,
                 what="ticks with one failing source")
    finally:
        agent.stop(timeout_s=2)


def test_buffer_is_bounded_and_counts_what_it_drops() -> None:
    inner = OTLPMetricExporter(endpoint=f"127.0.0.1:{_free_port()}", insecure=True, timeout=0.3)
    exporter = BufferingMetricExporter(inner, max_batches=2)
    empty = MetricsData(resource_metrics=[])
    results = [exporter.export(empty, timeout_millis=300) for _ in range(5)]
    assert results == [MetricExportResult.FAILURE] * 5
    assert exporter.buffered_batches == 2 and exporter.dropped_batches == 3
    exporter.shutdown()


@pytest.mark.integration
def test_agent_started_before_its_gateway_delivers_what_it_buffered(spawn, tmp_path: Path) -> None:
    port = _free_port()
    agent = spawn("agent", "--gateway", f"127.0.0.1:{port}", "--sysfs-root", str(FIXTURES / "sysfs" / "ib_host"),
                  "--interval", "0.2", "--export-interval", "0.5", "--node-id", "early", name="agent",
                  env={"RIDETHROUGH_AGENT_EXPORT_TIMEOUT_S": "1"})
    time.sleep(3)  # the agent runs with no gateway for a while: that is the scenario, not a wait
    assert agent.alive()
    gateway_started_ns = time.time_ns()
    ready = tmp_path / "ready.json"
    server = spawn("server", "--store", f"chdb://{tmp_path}/store", "--spool", str(tmp_path / "spool"),
                   "--otlp-listen", f"127.0.0.1:{port}", "--store-http-listen", "127.0.0.1:0",
                   "--ready-file", str(ready), name="server")
    host, http_port = read_ready(ready, server)["store_http"].removeprefix("http://").rsplit(":", 1)
    db = clickhouse_connect.get_client(host=host, port=int(http_port))
    earliest = wait_for(lambda: db.query(
        "SELECT toUnixTimestamp64Nano(min(TimeUnix)) FROM otel_metrics_sum "
        "WHERE ResourceAttributes['ridethrough.node.id'] = 'early'").result_rows[0][0], timeout_s=60,
        what="buffered rows")
    assert earliest < gateway_started_ns - 1_000_000_000, "points from before the gateway existed arrived"
    assert agent.alive()
