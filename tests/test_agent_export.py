"""The agent's OTLP/gRPC sender: sends encoded requests as they are, retries like the SDK, buffers."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from google.rpc.error_details_pb2 import RetryInfo
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.sdk.metrics.export import MetricExportResult
from opentelemetry.sdk.resources import Resource

from ridethrough.certs import make_certs
from ridethrough.collector.agent import SCOPE
from ridethrough.collector.export import BufferingMetricExporter, MergeEncoded, OTLPBytesExporter
from ridethrough.collector.otlp_encode import EncodedMetrics, SampleEncoder
from ridethrough.collector.sample import MetricKind, Sample


class FakeGateway:
    """An in-process OTLP metrics endpoint: records what arrives, fails the first ``fail`` calls with ``code``,
    and every call over ``max_bytes`` (a gateway too busy to convert that much in a call's time)."""

    def __init__(self, *, fail: int = 0, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
                 retry_delay_s: float | None = None, rejected: int = 0,
                 credentials: grpc.ServerCredentials | None = None, max_bytes: int | None = None) -> None:
        self.max_bytes = max_bytes
        self.sizes: list[int] = []
        self.received: list[ExportMetricsServiceRequest] = []
        self.calls = 0
        self.user_agents: list[str] = []
        self.metadata: list[dict[str, str]] = []
        self._fail, self._code, self._delay, self._rejected = fail, code, retry_delay_s, rejected
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        handler = grpc.unary_unary_rpc_method_handler(self._export, request_deserializer=None,
                                                      response_serializer=None)
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "opentelemetry.proto.collector.metrics.v1.MetricsService", {"Export": handler}),))
        self.port = self.server.add_insecure_port("127.0.0.1:0") if credentials is None \
            else self.server.add_secure_port("127.0.0.1:0", credentials)
        self.server.start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _export(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        with self._lock:
            self.calls += 1
            self.metadata.append(dict(context.invocation_metadata()))
            self.user_agents.append(self.metadata[-1].get("user-agent", ""))
            self.sizes.append(len(raw))
            if self.calls <= self._fail or (self.max_bytes is not None and len(raw) > self.max_bytes):
                if self._delay is not None:
                    info = RetryInfo(retry_delay=Duration(nanos=int(self._delay * 1e9)))
                    context.set_trailing_metadata((("google.rpc.retryinfo-bin", info.SerializeToString()),))
                context.set_code(self._code)
                context.set_details("not now")
                return b""
            self.received.append(ExportMetricsServiceRequest.FromString(raw))
        response = ExportMetricsServiceResponse()
        if self._rejected:
            response.partial_success.rejected_data_points = self._rejected
            response.partial_success.error_message = "bad points"
        return response.SerializeToString()

    def stop(self) -> None:
        self.server.stop(grace=None)


@pytest.fixture
def gateway() -> Iterator[FakeGateway]:
    fake = FakeGateway()
    yield fake
    fake.stop()


def _batch(value: float = 1.0, n: int = 3) -> EncodedMetrics:
    encoder = SampleEncoder(resource=Resource.create({"service.name": "t"}), scope=SCOPE)
    samples = [Sample("m", value + i, MetricKind.GAUGE, "1", {"i": str(i)}) for i in range(n)]
    return encoder.encode([("m", samples)], start_ns=1, now_ns=2)


def _values(request: ExportMetricsServiceRequest) -> list[float]:
    return [p.as_double for p in request.resource_metrics[0].scope_metrics[0].metrics[0].gauge.data_points]


def test_delivers_the_encoded_request_as_is(gateway: FakeGateway) -> None:
    exporter = OTLPBytesExporter(endpoint=gateway.endpoint, timeout_s=5)
    batch = _batch()
    assert exporter.export(batch) is MetricExportResult.SUCCESS
    assert gateway.received == [ExportMetricsServiceRequest.FromString(batch.payload)]
    assert _values(gateway.received[0]) == [1.0, 2.0, 3.0]
    assert gateway.user_agents[0].startswith("ridethrough-agent")
    exporter.shutdown()


def test_headers_go_with_every_request_and_credentials_make_a_tls_channel(tmp_path: Path) -> None:
    issued = make_certs(tmp_path, names=["gateway"])
    cert, key = (p.read_bytes() for p in issued.leaves["gateway"])
    gateway = FakeGateway(credentials=grpc.ssl_server_credentials([(key, cert)]))
    exporter = OTLPBytesExporter(endpoint=gateway.endpoint, timeout_s=5, headers=[("authorization", "Bearer t0k")],
                                 credentials=grpc.ssl_channel_credentials(issued.ca_cert.read_bytes()))
    plain = OTLPBytesExporter(endpoint=gateway.endpoint, timeout_s=0.5)
    try:
        assert exporter.export(_batch()) is MetricExportResult.SUCCESS
        assert gateway.metadata[0]["authorization"] == "Bearer t0k"
        assert plain.export(_batch()) is MetricExportResult.FAILURE, "plaintext does not reach a TLS listener"
        assert len(gateway.received) == 1
    finally:
        exporter.shutdown()
        plain.shutdown()
        gateway.stop()


def test_retries_a_retryable_code_after_the_gateways_retry_delay() -> None:
    gateway = FakeGateway(fail=2, retry_delay_s=0.05)
    exporter = OTLPBytesExporter(endpoint=gateway.endpoint, timeout_s=5)
    try:
        started = time.monotonic()
        assert exporter.export(_batch()) is MetricExportResult.SUCCESS
        assert gateway.calls == 3 and len(gateway.received) == 1
        assert time.monotonic() - started < 1.0, "waited the 50 ms asked for, not the default 1 s and 2 s"
    finally:
        exporter.shutdown()
        gateway.stop()


def test_a_code_not_worth_retrying_fails_at_once() -> None:
    gateway = FakeGateway(fail=1, code=grpc.StatusCode.INVALID_ARGUMENT)
    exporter = OTLPBytesExporter(endpoint=gateway.endpoint, timeout_s=5)
    try:
        assert exporter.export(_batch()) is MetricExportResult.FAILURE
        assert gateway.calls == 1 and not gateway.received
    finally:
        exporter.shutdown()
        gateway.stop()


def test_gives_up_within_its_timeout_when_nothing_listens() -> None:
    gateway = FakeGateway()
    endpoint = gateway.endpoint
    gateway.stop()  # the port is now closed
    exporter = OTLPBytesExporter(endpoint=endpoint, timeout_s=0.5)
    started = time.monotonic()
    assert exporter.export(_batch()) is MetricExportResult.FAILURE
    assert time.monotonic() - started < 3.0
    exporter.shutdown()


def test_shutdown_interrupts_a_retry_wait() -> None:
    gateway = FakeGateway(fail=100, retry_delay_s=0.9)
    exporter = OTLPBytesExporter(endpoint=gateway.endpoint, timeout_s=30)
    results: list[MetricExportResult] = []
    worker = threading.Thread(target=lambda: results.append(exporter.export(_batch())))
    try:
        worker.start()
        deadline = time.monotonic() + 10
        while gateway.calls < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        started = time.monotonic()
        exporter.shutdown()
        worker.join(5)
        assert results == [MetricExportResult.FAILURE] and time.monotonic() - started < 0.8
    finally:
        gateway.stop()


def test_partial_success_is_logged_and_still_a_success(caplog) -> None:
    gateway = FakeGateway(rejected=2)
    exporter = OTLPBytesExporter(endpoint=gateway.endpoint, timeout_s=5)
    try:
        assert exporter.export(_batch()) is MetricExportResult.SUCCESS
        assert any("rejected 2 point(s): bad points" in r.message for r in caplog.records)
    finally:
        exporter.shutdown()
        gateway.stop()


def test_buffer_keeps_failed_exports_and_sends_them_oldest_first_when_the_gateway_is_back() -> None:
    gateway = FakeGateway(fail=3, code=grpc.StatusCode.INVALID_ARGUMENT)  # each failure is final at once
    exporter = BufferingMetricExporter(OTLPBytesExporter(endpoint=gateway.endpoint, timeout_s=5), max_batches=3)
    try:
        results = [exporter.export(_batch(value=10.0 * k)) for k in range(3)]
        assert results == [MetricExportResult.FAILURE] * 3
        assert exporter.buffered_batches == 3 and exporter.dropped_batches == 0
        assert exporter.export(_batch(value=30.0)) is MetricExportResult.SUCCESS  # the queue overflows, then drains
        assert exporter.dropped_batches == 1 and exporter.dropped_points == 3
        assert [_values(r)[0] for r in gateway.received] == [10.0, 20.0, 30.0], "the oldest batch was the one dropped"
        assert exporter.buffered_batches == 0 and exporter.sent_batches == 3
    finally:
        exporter.shutdown()
        gateway.stop()



def test_a_merged_backlog_reaches_the_gateway_in_few_requests_the_newest_readings_with_the_last() -> None:
    gateway = FakeGateway(fail=3, code=grpc.StatusCode.INVALID_ARGUMENT)
    exporter = BufferingMetricExporter(OTLPBytesExporter(endpoint=gateway.endpoint, timeout_s=5), max_batches=10,
                                       merge=MergeEncoded())
    try:
        assert [exporter.export(_batch(value=10.0 * k)) for k in range(3)] == [MetricExportResult.FAILURE] * 3
        assert exporter.export(_batch(value=30.0)) is MetricExportResult.SUCCESS
        # the failed joined send halved the budget to one batch; each success doubles it: 1, 2, then the rest
        assert [len(r.resource_metrics) for r in gateway.received] == [1, 2, 1]
        assert [[p.as_double for p in rm.scope_metrics[0].metrics[0].gauge.data_points]
                for r in gateway.received for rm in r.resource_metrics] == [[10.0 * k + i for i in range(3)]
                                                                            for k in range(4)]
        assert exporter.buffered_batches == 0 and exporter.sent_batches == 4
    finally:
        exporter.shutdown()
        gateway.stop()


def test_a_backlog_too_large_for_a_busy_gateway_goes_in_halves_until_it_fits_then_drains() -> None:
    """A gateway that can take three batches in a call's time: the agent's joined sends shrink to fit,
    everything arrives once and in order, and the budget grows back as sends succeed."""
    one = len(_batch().payload)
    gateway = FakeGateway(fail=8, code=grpc.StatusCode.INVALID_ARGUMENT, max_bytes=3 * one)
    exporter = BufferingMetricExporter(OTLPBytesExporter(endpoint=gateway.endpoint, timeout_s=5), max_batches=20,
                                       merge=MergeEncoded(max_bytes=16 * one))
    try:
        for k in range(8):  # the gateway is away: the backlog grows to eight batches
            assert exporter.export(_batch(value=10.0 * k)) is MetricExportResult.FAILURE
        # back, but busy: a call of more than three batches fails (with a fixed cap, every call would carry
        # all nine and fail, and the backlog would never drain)
        for k in range(8, 12):
            exporter.export(_batch(value=10.0 * k))
        assert exporter.buffered_batches == 0 and exporter.sent_batches == 12
        firsts = [rm.scope_metrics[0].metrics[0].gauge.data_points[0].as_double
                  for r in gateway.received for rm in r.resource_metrics]
        assert firsts == [10.0 * k for k in range(12)], "every batch once, oldest first"
        assert max(len(r.resource_metrics) for r in gateway.received) == 3, "batches still go joined, up to the fit"
    finally:
        exporter.shutdown()
        gateway.stop()


def test_a_merged_send_stays_under_its_byte_cap() -> None:
    one = len(_batch().payload)
    gateway = FakeGateway(fail=4, code=grpc.StatusCode.INVALID_ARGUMENT)
    exporter = BufferingMetricExporter(OTLPBytesExporter(endpoint=gateway.endpoint, timeout_s=5), max_batches=10,
                                       merge=MergeEncoded(max_bytes=2 * one))
    try:
        for k in range(4):
            exporter.export(_batch(value=10.0 * k))
        assert exporter.export(_batch(value=40.0)) is MetricExportResult.SUCCESS
        # the failed joined send halved the budget to one batch; it doubles back to the cap, never past it
        assert [len(r.resource_metrics) for r in gateway.received] == [1, 2, 2]
        assert [_values(r)[0] for r in gateway.received] == [0.0, 10.0, 30.0]
    finally:
        exporter.shutdown()
        gateway.stop()
