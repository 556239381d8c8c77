"""The telemetry spine end to end, with real processes: agent → OTLP/gRPC → server → chDB."""

from __future__ import annotations

from pathlib import Path

import clickhouse_connect
import pytest
from opentelemetry import trace
from opentelemetry._logs import SeverityNumber
from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import SimpleLogRecordProcessor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from tests.conftest import FIXTURES, read_ready, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.e2e]


@pytest.fixture
def server(spawn, tmp_path: Path) -> dict[str, str]:
    ready = tmp_path / "server.json"
    proc = spawn("server", "--store", f"chdb://{tmp_path}/store", "--spool", str(tmp_path / "spool"),
                 "--otlp-listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                 "--store-http-listen", "127.0.0.1:0", "--ready-file", str(ready), name="server")
    return read_ready(ready, proc)


def _reader(server: dict[str, str]):
    url = server["store_http"].removeprefix("http://")
    host, port = url.rsplit(":", 1)
    return clickhouse_connect.get_client(host=host, port=int(port))


def _sysfs_fixture() -> Path:
    return FIXTURES / "sysfs" / "ib_host"


def test_agent_metrics_land_with_names_values_attributes_and_resource(spawn, server) -> None:
    root = _sysfs_fixture()
    spawn("agent", "--gateway", server["otlp"], "--sysfs-root", str(root), "--node-id", "node-7",
          "--cluster", "lab-a", "--rack", "r1", "--interval", "0.2", "--export-interval", "0.3", name="agent")
    db = _reader(server)
    # rx_bytes of the fixture's first non-loopback interface, as the file says.
    iface = sorted(p.name for p in (root / "class" / "net").iterdir() if p.name != "lo")[0]
    rx_bytes = int((root / "class" / "net" / iface / "statistics" / "rx_bytes").read_text())

    def landed():
        return db.query(
            "SELECT Value, ResourceAttributes, IsMonotonic, MetricUnit FROM otel_metrics_sum "
            "WHERE MetricName = 'system.network.io' AND Attributes['network.interface.name'] = {i:String} "
            "AND Attributes['network.io.direction'] = 'receive' ORDER BY TimeUnix DESC LIMIT 1",
            parameters={"i": iface}).result_rows
    value, resource, monotonic, unit = wait_for(landed, timeout_s=30, what="netdev rows")[0]
    assert value == rx_bytes
    assert monotonic is True and unit == "By"
    assert resource["ridethrough.node.id"] == "node-7"
    assert resource["ridethrough.cluster"] == "lab-a"
    assert resource["ridethrough.rack"] == "r1"
    assert resource["service.name"] == "ridethrough-agent"
    assert resource["host.name"]

    ib = wait_for(lambda: db.query(
        "SELECT Value, Attributes FROM otel_metrics_sum WHERE MetricName = 'ridethrough.ib.port.io' "
        "AND Attributes['network.io.direction'] = 'transmit' ORDER BY TimeUnix DESC LIMIT 1").result_rows,
        what="infiniband rows")[0]
    dev, port = ib[1]["ib.device"], ib[1]["ib.port"]
    words = int((root / "class" / "infiniband" / dev / "ports" / port / "counters" / "port_xmit_data").read_text())
    assert ib[0] == words * 4, "IB octet counters are in 4-byte words"
    gauges = db.query("SELECT DISTINCT MetricName FROM otel_metrics_gauge").result_rows
    assert ("ridethrough.nic.mtu",) in gauges
    started = wait_for(lambda: db.query("SELECT count() FROM otel_logs WHERE "
                                        "LogAttributes['event.name'] = 'agent.started'").result_rows[0][0],
                       what="agent.started event")
    assert started >= 1


def test_sdk_traces_and_logs_land(server) -> None:
    resource = Resource.create({"service.name": "sdk-test", "host.name": "h1"})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=server["otlp"], insecure=True)))
    tracer = provider.get_tracer("tests")
    with tracer.start_as_current_span("incident.detect", kind=trace.SpanKind.SERVER) as parent:
        parent.set_attribute("incident.id", "inc-1")
        with tracer.start_as_current_span("action.apply") as child:
            child.add_event("route.changed", {"link": "leaf1-spine0"})
    provider.shutdown()
    logs = LoggerProvider(resource=resource)
    logs.add_log_record_processor(SimpleLogRecordProcessor(OTLPLogExporter(endpoint=server["otlp"], insecure=True)))
    logs.get_logger("tests").emit(body="link down", severity_number=SeverityNumber.ERROR, severity_text="ERROR",
                                  attributes={"link": "leaf1-spine0"})
    logs.shutdown()

    db = _reader(server)
    spans = wait_for(lambda: db.query(
        "SELECT SpanName, SpanKind, ParentSpanId, SpanAttributes, Events.Name, TraceId FROM otel_traces "
        "WHERE ServiceName = 'sdk-test' ORDER BY SpanName").result_rows, what="spans")
    assert [s[0] for s in spans] == ["action.apply", "incident.detect"]
    child, parent_row = spans
    assert parent_row[1] == "Server" and parent_row[3]["incident.id"] == "inc-1"
    assert child[4] == ["route.changed"] and child[5] == parent_row[5] and child[2]
    lookup = db.query("SELECT count() FROM otel_traces_trace_id_ts WHERE TraceId = {t:String}",
                      parameters={"t": parent_row[5]}).result_rows
    assert lookup[0][0] >= 1, "the trace-id materialized view fills"
    row = wait_for(lambda: db.query("SELECT Body, SeverityText, LogAttributes FROM otel_logs "
                                    "WHERE ServiceName = 'sdk-test'").result_rows, what="log row")[0]
    assert row[0] == "link down" and row[1] == "ERROR" and row[2]["link"] == "leaf1-spine0"


def test_gateway_metrics_endpoint_counts(server) -> None:
    import urllib.request

    from tests.otlp_util import gauge_request, grpc_export

    status, _ = grpc_export(server["otlp"], gauge_request(5, service="metrics-test"))
    assert status == "OK"
    text = urllib.request.urlopen(f"http://{server['metrics']}/metrics", timeout=10).read().decode()
    assert 'ridethrough_gateway_received_items_total{signal="metrics"} 5.0' in text
    assert 'ridethrough_gateway_inserted_rows_total{table="otel_metrics_gauge"} 5.0' in text
