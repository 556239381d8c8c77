"""The OTLP/gRPC gateway: receive metrics, traces and logs, store them in ClickHouse.

Handlers take the raw request bytes (so a malformed message is our error to report,
not a crash in a deserializer) and answer with the OTLP semantics:

* OK, with ``partial_success`` counting the items rejected as invalid;
* UNAUTHENTICATED when an `IngestAuth` is given and the call has no valid bearer token
  (checked before the body is looked at; counted by reason, the token never echoed);
* INVALID_ARGUMENT for bytes that are not the message they claim to be;
* RESOURCE_EXHAUSTED for a message over the size limit (enforced by gRPC itself);
* UNAVAILABLE with a ``RetryInfo`` delay when the gateway is full (backpressure) or
  could neither insert nor spool the rows.

Memory: a request's rows take far more room than its bytes (a bare gauge point is 11 bytes on
the wire and about 45 times that as a row), so the receiver admits requests by their size:
while ``max_inflight_bytes`` of requests are being converted or wait for the store, a further
one is refused with UNAVAILABLE (backpressure, counted) rather than grow the heap. One request
is always admitted, so a message of the largest accepted size still gets through alone.
A request whose deadline would pass before its rows are stored is refused the same way before
they are queued: its sender would give up and retry, and they would be stored twice. It must
have ``min_time_left_s`` left when it is taken up, and once converted, that plus the recent
wait for the store (the longest wait lately, halving every `ACK_HALF_LIFE_S`). Requests are
converted in turns (`ConvertGate`): one that, at the recent conversion rate and after waiting its
turn, would not be converted with that much time still left is refused as busy unconverted.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import grpc
from google.protobuf.duration_pb2 import Duration
from google.protobuf.message import DecodeError
from google.rpc import code_pb2, error_details_pb2, status_pb2

from ridethrough.exporters.convert_gate import ConvertGate
from ridethrough.exporters.gateway_metrics import GatewayMetrics
from ridethrough.exporters.ingest_auth import IngestAuth, Principal, Unauthenticated
from ridethrough.exporters.pipeline import Backpressure, Pipeline
from ridethrough.exporters.rows import Limits, Rejections, Rows
from ridethrough.exporters.signals import Signal

log = logging.getLogger(__name__)

Handler = Callable[[bytes, grpc.ServicerContext], bytes]
ACK_HALF_LIFE_S = 2.0


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """What the gRPC server itself enforces."""

    max_message_bytes: int = 16 << 20
    workers: int = 16
    ack_timeout_s: float = 30.0


class OtlpReceiver:
    """The three OTLP Export methods over one `Pipeline`."""

    def __init__(self, *, pipeline: Pipeline, limits: Limits, metrics: GatewayMetrics,
                 ack_timeout_s: float = 30.0, auth: IngestAuth | None = None,
                 max_inflight_bytes: int = 64 << 20, min_time_left_s: float = 0.25, convert_slots: int = 2) -> None:
        """``auth``: check bearer tokens and stamp tenants (None: every caller is accepted as is);
        ``convert_slots``: requests converted at once (`ConvertGate`)."""
        self._pipeline = pipeline
        self._limits = limits
        self._metrics = metrics
        self._ack_timeout_s = ack_timeout_s
        self._auth = auth
        self._max_inflight_bytes = max_inflight_bytes
        self._min_time_left_s = min_time_left_s
        self.gate = ConvertGate(slots=convert_slots)
        """The turns at converting requests: its recent rate and how many it refused."""
        self._inflight_bytes = 0
        self._ack_s, self._ack_at = 0.0, time.monotonic()  # the recent wait for the store (a decaying max)
        self._lock = threading.Lock()
        self._refusals: collections.Counter[str] = collections.Counter()

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
        principal = None
        if self._auth is not None:
            try:
                principal = self._auth.authenticate(context.invocation_metadata())
            except Unauthenticated as exc:
                return self._unauthenticated(signal, context, exc)
        if self._too_late(context, 0.0):
            return self._busy(signal, context)
        if not self._admit(len(raw)):
            self._metrics.backpressure.inc()
            return self._unavailable(signal, context, "gateway is converting too many bytes at once", 1.0)
        try:
            return self._convert_and_store(signal, raw, principal, context)
        finally:
            with self._lock:
                self._inflight_bytes -= len(raw)

    def _too_late(self, context: grpc.ServicerContext, wait_s: float) -> bool:
        left = context.time_remaining()
        return left is not None and left < self._min_time_left_s + wait_s

    def _recent_ack_s(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        return self._ack_s * math.pow(0.5, (now - self._ack_at) / ACK_HALF_LIFE_S)

    def _note_ack(self, waited_s: float) -> None:
        now = time.monotonic()
        with self._lock:
            self._ack_s, self._ack_at = max(waited_s, self._recent_ack_s(now)), now

    def _busy(self, signal: Signal, context: grpc.ServicerContext,
              why: str = "too little of the call's deadline is left") -> bytes:
        self._metrics.backpressure.inc()
        return self._unavailable(signal, context, f"gateway is busy: {why}", 1.0)

    def _admit(self, size: int) -> bool:
        with self._lock:
            if self._inflight_bytes and self._inflight_bytes + size > self._max_inflight_bytes:
                return False
            self._inflight_bytes += size
            return True

    def _convert_and_store(self, signal: Signal, raw: bytes, principal: Principal | None,
                           context: grpc.ServicerContext) -> bytes:
        rows, rej = Rows(), Rejections()
        left = context.time_remaining()
        # the rows must also be stored in time: what is left after the margin and the recent wait for the store
        budget_s = None if left is None else left - self._min_time_left_s - self._recent_ack_s()
        with self.gate.turn(len(raw), budget_s) as turn:
            if not turn:
                return self._busy(signal, context, "it would not be converted before the call's deadline")
            try:
                if self._auth is not None:  # the stamped bytes are what is stored and spooled
                    raw = self._auth.stamp(raw, principal, request_type=signal.request_type)
                items = signal.convert(raw, self._limits, rows, rej)
            except DecodeError as exc:
                return self._fail(signal, context, grpc.StatusCode.INVALID_ARGUMENT,
                                  f"malformed {signal.request_type.__name__}: {exc}")
        label = signal.name.lower()
        self._metrics.received.labels(signal=label).inc(items)
        if rej.count:
            self._metrics.rejected.labels(signal=label).inc(rej.count)
        if rows.total:
            if self._too_late(context, self._recent_ack_s()):
                return self._busy(signal, context)
            try:
                ticket = self._pipeline.submit(signal, raw, rows)
            except Backpressure as exc:
                return self._unavailable(signal, context, str(exc), exc.retry_after_s)
            queued = time.monotonic()
            stored = ticket.wait(self._ack_timeout_s)
            self._note_ack(time.monotonic() - queued)
            if not stored:
                return self._unavailable(signal, context, ticket.error or "not stored", 1.0)
        self._metrics.requests.labels(signal=label, code="OK").inc()
        return signal.partial_success(rej.count, rej.message())

    def _unauthenticated(self, signal: Signal, context: grpc.ServicerContext, exc: Unauthenticated) -> bytes:
        self._metrics.auth_failures.labels(reason=exc.reason).inc()
        with self._lock:
            self._refusals[exc.reason] += 1
            count = self._refusals[exc.reason]
        if str(count).strip("0") == "1":  # log the 1st, 10th, 100th, ... of each reason: a flood is not a log flood
            log.warning("refused an unauthenticated %s export from %s: %s", signal.name.lower(), context.peer(), exc)
        return self._fail(signal, context, grpc.StatusCode.UNAUTHENTICATED, str(exc))

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


def build_server(receiver: OtlpReceiver, *, listen: str, options: ServerOptions,
                 credentials: grpc.ServerCredentials | None = None) -> tuple[grpc.Server, int]:
    """A started gRPC server serving the OTLP services on ``listen``; returns it and its port.

    ``credentials`` (`ingest_auth.server_credentials`) serve TLS or mutual TLS; None serves plaintext.
    """
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
    port = server.add_secure_port(listen, credentials) if credentials else server.add_insecure_port(listen)
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    server.start()
    return server, port
