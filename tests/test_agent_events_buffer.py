"""The agent's events survive a gateway that is away: failed batches wait and go out oldest first."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent import futures

import grpc
from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.sdk._logs import LoggerProvider, ReadableLogRecord
from opentelemetry.sdk._logs.export import (
    BatchLogRecordProcessor,
    LogRecordExporter,
    LogRecordExportResult,
    SimpleLogRecordProcessor,
)

from ridethrough.collector.export_logs import BufferingLogExporter


class LogsEndpoint:
    """An OTLP logs endpoint that refuses (INVALID_ARGUMENT: final at once) while ``refusing`` is set."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.refusing = threading.Event()
        self.refusing.set()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        handler = grpc.unary_unary_rpc_method_handler(self._export, request_deserializer=None,
                                                      response_serializer=None)
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "opentelemetry.proto.collector.logs.v1.LogsService", {"Export": handler}),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def _export(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        if self.refusing.is_set():
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "not now")
        request = ExportLogsServiceRequest.FromString(raw)
        for rl in request.resource_logs:
            for sl in rl.scope_logs:
                for rec in sl.log_records:
                    attrs = {kv.key: kv.value.string_value for kv in rec.attributes}
                    self.steps.append(int(attrs["job.step"]))
        return b""


def test_steps_emitted_while_the_gateway_refuses_all_arrive_in_order_once_it_is_back() -> None:
    endpoint = LogsEndpoint()
    buffered = BufferingLogExporter(OTLPLogExporter(endpoint=f"127.0.0.1:{endpoint.port}", insecure=True, timeout=5),
                                    max_batches=50)
    provider = LoggerProvider()
    provider.add_log_record_processor(BatchLogRecordProcessor(buffered, schedule_delay_millis=50))
    events = provider.get_logger("test")
    try:
        for step in range(10):
            events.emit(body="step", event_name="job.step", attributes={"job.step": str(step)})
            time.sleep(0.02)
        provider.force_flush()  # every step handed to the exporter (which queues what the gateway refused)
        assert buffered.buffered_batches > 0 and endpoint.steps == []
        endpoint.refusing.clear()
        assert buffered.retry(), "the queue drains without a new event"
        assert endpoint.steps == list(range(10))
        events.emit(body="step", event_name="job.step", attributes={"job.step": "10"})
        provider.force_flush()
        assert endpoint.steps == list(range(11)) and buffered.dropped_records == 0
    finally:
        provider.shutdown()
        endpoint.server.stop(None)


class Refusing(LogRecordExporter):
    """Fails every export until ``ok``; keeps the records of those it took."""

    def __init__(self) -> None:
        self.ok = False
        self.taken: list[str] = []
        self.sends: list[int] = []
        """How many records each successful export carried."""

    def export(self, batch: Sequence[ReadableLogRecord]) -> LogRecordExportResult:
        if not self.ok:
            return LogRecordExportResult.FAILURE
        self.taken += [str(r.log_record.body) for r in batch]
        self.sends.append(len(batch))
        return LogRecordExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True

    def shutdown(self) -> None:
        self.ok = False


def _batch(*bodies: str) -> list[ReadableLogRecord]:
    """Records as the SDK's processors hand them to an exporter."""
    keep = Refusing()
    keep.ok = True
    out: list[ReadableLogRecord] = []
    keep.export = lambda batch: out.extend(batch) or LogRecordExportResult.SUCCESS  # type: ignore[method-assign]
    provider = LoggerProvider()
    provider.add_log_record_processor(SimpleLogRecordProcessor(keep))
    for body in bodies:
        provider.get_logger("test").emit(body=body)
    return out


def test_a_full_buffer_drops_the_oldest_batch_and_counts_its_events() -> None:
    inner = Refusing()
    buffered = BufferingLogExporter(inner, max_batches=2)
    for batch in (("a", "b"), ("c",), ("d", "e", "f")):
        assert buffered.export(_batch(*batch)) is LogRecordExportResult.FAILURE
    assert buffered.buffered_batches == 2 and buffered.dropped_records == 2
    inner.ok = True
    assert buffered.force_flush()
    assert inner.taken == ["c", "d", "e", "f"] and buffered.buffered_batches == 0


def test_after_shutdown_nothing_is_sent_and_the_queue_is_kept_counted() -> None:
    inner = Refusing()
    buffered = BufferingLogExporter(inner, max_batches=5)
    assert buffered.export(_batch("a")) is LogRecordExportResult.FAILURE
    buffered.shutdown()
    inner.ok = True
    assert not buffered.retry() and inner.taken == [] and buffered.buffered_batches == 1


def test_a_backlog_goes_out_joined_in_sends_that_grow_back_to_the_record_cap() -> None:
    inner = Refusing()
    buffered = BufferingLogExporter(inner, max_batches=10, max_records=4)
    for batch in (("a", "b"), ("c",), ("d",), ("e", "f", "g"), ("h",)):
        assert buffered.export(_batch(*batch)) is LogRecordExportResult.FAILURE
    inner.ok = True
    assert buffered.export(_batch("i")) is LogRecordExportResult.SUCCESS
    assert inner.taken == list("abcdefghi"), "oldest first, none twice"
    # the failed joined send (a+b+c) halved the budget: a+b alone, c+d, then as full as the cap allows
    assert inner.sends == [2, 2, 4, 1]
    assert buffered.buffered_batches == 0


def test_a_batch_over_the_cap_still_goes_out_alone() -> None:
    inner = Refusing()
    buffered = BufferingLogExporter(inner, max_batches=10, max_records=2)
    assert buffered.export(_batch("a", "b", "c")) is LogRecordExportResult.FAILURE
    assert buffered.export(_batch("d")) is LogRecordExportResult.FAILURE
    inner.ok = True
    assert buffered.force_flush()
    assert inner.sends == [3, 1] and inner.taken == list("abcd")
