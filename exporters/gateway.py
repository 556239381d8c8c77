"""The OTLP/gRPC gateway: receive metrics, traces and logs, store them in ClickHouse.

Handlers take the raw request bytes (so a malformed message is our error to report,
not a crash in a deserializer) and answer with the OTLP semantics:

* OK, with ``partial_success`` counting the items rejected as invalid;
* INVALID_ARGUMENT for bytes that are not the message they claim to be;
* RESOURCE_EXHAUSTED for a message over the size limit (enforced by gRPC itself);
* UNAVAILABLE with a ``RetryInfo`` delay when the gateway is full (backpressure) or
  could neither insert nor spool the rows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import grpc
from google.protobuf.duration_pb2 import Duration
from google.protobuf.message import DecodeError
from google.rpc import code_pb2, error_details_pb2, status_pb2

from ridethrough.exporters.gateway_metrics import GatewayMetrics
from ridethrough.exporters.pipeline import Backpressure, Pipeline
from ridethrough.exporters.rows import Limits, Rejections, Rows
from ridethrough.exporters.signals import Signal

log = logging.getLogger(__name__)

Handler = Callable[[bytes, grpc.ServicerContext], bytes]


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """What the gRPC server itself enforces."""

    max_message_bytes: int = 16 << 20
    workers: int = 16
    ack_timeout_s: float = 30.0


class OtlpReceiver:
    """The three OTLP Export methods over one `Pipeline`."""

    def __init__(self, *, pipeline: Pipeline, limits: Limits, metrics: GatewayMetrics,
                 ack_timeout_s: float = 30.0) -> None:
        self._pipeline = pipeline
        self._limits = limits
        self._metrics = metrics
        self._ack_timeout_s = ack_timeout_s

    def handler(self, signal: Signal) -> Handler:
        """The unary handler for one signal's Export method."""
        def export(raw: bytes, context: grpc.ServicerContext) -> bytes:
            return self.export(signal, raw, context)
        return export

    def export(self, signal: Signal, raw: bytes, context: grpc.ServicerContext) -> bytes:
        """Handle one Export call; never raises into gRPC."""
        try:
            return self._export(signal, raw, context)
        except Exception:  # a bug here must cost one request, not the gateway
            log.exception("unexpected error handling %s export", signal.name.lower())
            return self._fail(signal, context, grpc.StatusCode.INTERNAL, "internal error; see gateway log")

    def _export(self, signal: Signal, raw: bytes, context: grpc.ServicerContext) -> bytes:
        rows, rej = Rows(), Rejections()
        try:
            items = signal.convert(raw, self._limits, rows, rej)
        except DecodeError as exc:
            return self._fail(signal, context, grpc.StatusCode.INVALID_ARGUMENT,
                              f"malformed {signal.request_type.__name__}: {exc}")
        label = signal.name.lower()
        self._metrics.received.labels(signal=label).inc(items)
        if rej.count:
            self._metrics.rejected.labels(signal=label).inc(rej.count)
        if rows.total:
            try:
                ticket = self._pipeline.submit(signal, raw, rows)
            except Backpressure as exc:
                return self._unavailable(signal, context, str(exc), exc.retry_after_s)
            if not ticket.wait(self._ack_timeout_s):
                return self._unavailable(signal, context, ticket.error or "not stored", 1.0)
        self._metrics.requests.labels(signal=label, code="OK").inc()
        return signal.partial_success(rej.count, rej.message())

    def _fail(self, signal: Signal, context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> bytes:
        self._metrics.requests.labels(signal=signal.name.lower(), code=code.name).inc()
        context.set_code(code)
        context.set_details(message)
        return b""

    def _unavailable(self, signal: Signal, context: grpc.ServicerContext, message: str, delay_s: float) -> bytes:
        # RetryInfo travels both the standard way (google.rpc.Status in grpc-status-details-bin)
        # and under the key the OpenTelemetry SDK exporters read.
        info = error_details_pb2.RetryInfo(retry_delay=Duration(seconds=int(delay_s),
                                                                nanos=int((delay_s % 1) * 1e9)))
        status = status_pb2.Status(code=code_pb2.UNAVAILABLE, message=message)
        status.details.add().Pack(info)
        context.set_trailing_metadata((("grpc-status-details-bin", status.SerializeToString()),
                                       ("google.rpc.retryinfo-bin", info.SerializeToString())))
        return self._fail(signal, context, grpc.StatusCode.UNAVAILABLE, message)


def build_server(receiver: OtlpReceiver, *, listen: str, options: ServerOptions) -> tuple[grpc.Server, int]:
    """A started gRPC server serving the OTLP services on ``listen``; returns it and its port."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=options.workers, thread_name_prefix="rt-otlp"),
        options=[("grpc.max_receive_message_length", options.max_message_bytes),
                 ("grpc.max_send_message_length", 4 << 20),
                 ("grpc.so_reuseport", 0)],
        maximum_concurrent_rpcs=options.workers * 4,
    )
    for signal in Signal:
        handler = grpc.unary_unary_rpc_method_handler(
            receiver.handler(signal), request_deserializer=None, response_serializer=None)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(signal.service,
                                                                              {"Export": handler}),))
    port = server.add_insecure_port(listen)
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    server.start()
    return server, port
