"""Getting the agent's metrics to the gateway: an OTLP/gRPC sender and a buffer for when the gateway is away.

`OTLPBytesExporter` sends requests that `ridethrough.collector.otlp_encode.SampleEncoder`
already serialised: gRPC gets the bytes as they are, where the SDK's exporter would take
a protobuf message and serialise it again. It retries as the SDK's exporter does (the same
retryable status codes, exponential backoff with jitter inside the export's deadline, a
fresh channel after the first UNAVAILABLE, waits that a shutdown interrupts).

The exporter alone retries one export and then gives up on it. Wrapped in
`BufferingMetricExporter`, a failed export waits in a bounded queue and is sent, oldest
first, before the next one; when the queue is full the oldest batch is dropped and
counted. The agent keeps running whatever the gateway does. Given a ``merge``, the queue
sends its backlog in as few calls as a size cap allows (serialised OTLP requests merge by
concatenation): after a busy spell the newest readings reach the gateway one round trip
later, not one round trip per batch queued ahead of them.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import grpc
from google.protobuf.message import DecodeError
from google.rpc.error_details_pb2 import RetryInfo
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceResponse
from opentelemetry.sdk.metrics.export import MetricExportResult, MetricsData

from ridethrough.collector.otlp_encode import EncodedMetrics

log = logging.getLogger(__name__)

METRICS_EXPORT = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"
RETRYABLE = frozenset({
    grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ABORTED, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS,
})
"""Status codes worth another try (the OTLP exporter specification's list, as the SDK has it)."""
MAX_ATTEMPTS = 6
USER_AGENT = "ridethrough-agent"
RETRY_INFO_KEY = "google.rpc.retryinfo-bin"

Batch = TypeVar("Batch", MetricsData, EncodedMetrics)
Batch_contra = TypeVar("Batch_contra", MetricsData, EncodedMetrics, contravariant=True)
Queued = TypeVar("Queued")


class BatchExporter(Protocol[Batch_contra]):
    """What `BufferingMetricExporter` wraps: the SDK's metric exporters, or `OTLPBytesExporter`."""

    def export(self, batch: Batch_contra, /, timeout_millis: float = 10_000) -> MetricExportResult:
        """Send one batch."""
        ...

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        """Send what is pending."""
        ...

    def shutdown(self, timeout_millis: float = 30_000) -> None:
        """Stop; later exports fail."""
        ...


class OTLPBytesExporter:
    """Sends `EncodedMetrics` to an OTLP/gRPC endpoint (``HOST:PORT``) within ``timeout_s`` each.

    Plaintext unless ``credentials`` are given (TLS, mutual TLS); ``headers`` go with every
    request as gRPC metadata (e.g. ``("authorization", "Bearer ...")``).
    """

    def __init__(self, *, endpoint: str, timeout_s: float, credentials: grpc.ChannelCredentials | None = None,
                 headers: Sequence[tuple[str, str]] = ()) -> None:
        self._endpoint = endpoint
        self._timeout_s = timeout_s
        self._credentials = credentials
        self._headers = tuple(headers)
        self._shutdown = threading.Event()
        self._channel: grpc.Channel | None = None
        self._call: Any = None
        self._connect()

    def _connect(self) -> None:
        if self._channel is not None:
            self._channel.close()
        options = [("grpc.primary_user_agent", USER_AGENT)]
        self._channel = grpc.insecure_channel(self._endpoint, options=options) if self._credentials is None \
            else grpc.secure_channel(self._endpoint, self._credentials, options=options)
        self._call = self._channel.unary_unary(METRICS_EXPORT, request_serializer=_as_is,
                                               response_deserializer=ExportMetricsServiceResponse.FromString)

    def export(self, batch: EncodedMetrics, /, timeout_millis: float = 10_000) -> MetricExportResult:
        """Send ``batch``, retrying what is worth retrying until the deadline; never raises for gRPC errors."""
        deadline = time.monotonic() + min(self._timeout_s, timeout_millis / 1000)
        for attempt in range(MAX_ATTEMPTS):
            if self._shutdown.is_set():
                return MetricExportResult.FAILURE
            try:
                response = self._call(batch.payload, timeout=max(0.0, deadline - time.monotonic()),
                                      metadata=self._headers)
            except grpc.RpcError as err:
                code = err.code()
                if code is grpc.StatusCode.UNAVAILABLE and attempt == 0:
                    # gRPC's own reconnect backoff grows to minutes; a new channel tries at once
                    self._connect()
                # the gateway's RetryInfo (backpressure) if it sent one, else doubling, +/-20% so agents drift apart
                backoff_s = _retry_delay_s(err) or 2 ** attempt * random.uniform(0.8, 1.2)
                if code not in RETRYABLE or attempt + 1 == MAX_ATTEMPTS or backoff_s > deadline - time.monotonic():
                    log.error("metric export to %s failed: %s %s", self._endpoint, code, err.details())
                    return MetricExportResult.FAILURE
                log.warning("metric export to %s: %s, retrying in %.2f s", self._endpoint, code, backoff_s)
                if self._shutdown.wait(backoff_s):
                    return MetricExportResult.FAILURE
                continue
            _note_partial_success(response, self._endpoint)
            return MetricExportResult.SUCCESS
        return MetricExportResult.FAILURE

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        """Nothing is held here: every export is sent before it returns."""
        return True

    def shutdown(self, timeout_millis: float = 30_000) -> None:
        """Interrupt any retry wait and close the channel."""
        self._shutdown.set()
        if self._channel is not None:
            self._channel.close()


def _as_is(payload: bytes) -> bytes:
    return payload


def _retry_delay_s(err: grpc.RpcError) -> float | None:
    """The delay a ``google.rpc.RetryInfo`` in the error's trailers asks for, if there is one."""
    try:
        raw = dict(err.trailing_metadata() or ()).get(RETRY_INFO_KEY)
        if raw is None:
            return None
        delay = RetryInfo.FromString(raw).retry_delay
    except (DecodeError, TypeError, ValueError):  # a trailer we cannot read: back off as if there were none
        return None
    return float(delay.seconds + delay.nanos / 1e9)


def _note_partial_success(response: ExportMetricsServiceResponse, endpoint: str) -> None:
    rejected = response.partial_success.rejected_data_points
    if rejected or response.partial_success.error_message:
        log.warning("gateway %s rejected %d point(s): %s", endpoint, rejected, response.partial_success.error_message)


class Merge(Protocol[Queued]):
    """How a queue joins batches into one send: ``join`` several into one, ``size`` of one against ``max_size``."""

    max_size: int

    def join(self, batches: Sequence[Queued], /) -> Queued:
        """One batch carrying all of ``batches``."""

    def size(self, batch: Queued, /) -> int:
        """A batch's size in the unit of ``max_size``."""


class RetryQueue(Generic[Queued]):
    """Batches that failed to send, oldest first, at most ``max_batches``; when full, the oldest is dropped.

    ``count`` says how many items (points, records) a batch holds, for the drop counters; ``what``
    names them in the log. With ``merge``, the batches at the head go out joined in one send, as
    many as fit in the send budget (always at least one); they leave the queue together when it
    succeeds. The budget starts at ``merge.max_size``; a joined send that fails halves it and one
    that succeeds doubles it back (up to ``merge.max_size``): a gateway too busy to take the whole
    backlog in one call's time gets smaller calls, not the same large one again and again.
    """

    def __init__(self, *, max_batches: int, count: Callable[[Queued], int], what: str,
                 merge: Merge[Queued] | None = None) -> None:
        self._queue: deque[Queued] = deque()
        self._max = max_batches
        self._count = count
        self._what = what
        self._merge = merge
        self._budget = merge.max_size if merge is not None else 0
        self._lock = threading.Lock()
        self.dropped_batches = 0
        self.dropped_items = 0
        self.sent_batches = 0

    def __len__(self) -> int:
        return len(self._queue)

    def send(self, batch: Queued | None, attempt: Callable[[Queued], bool], *, wait: bool = True) -> bool:
        """Queue ``batch`` (if any), then send the queue oldest first with ``attempt``; False at the first failure.

        ``wait=False``: when another thread is sending, return False at once instead of waiting for it
        (that thread drains the queue anyway).
        """
        if not self._lock.acquire(blocking=wait):
            return False
        try:
            if batch is not None:
                self._queue.append(batch)
                self._trim()
            while self._queue:
                head, size = self._head()
                if not attempt(head[0] if len(head) == 1 else self._merge.join(head)):  # type: ignore[union-attr]
                    log.warning("gateway unreachable; %d export(s) buffered (%s)", len(self._queue), self._what)
                    if len(head) > 1:
                        self._budget = max(1, size // 2)
                    return False
                for _ in head:
                    self._queue.popleft()
                self.sent_batches += len(head)
                if self._merge is not None:
                    self._budget = min(self._merge.max_size, max(self._budget, size) * 2)
            return True
        finally:
            self._lock.release()

    def _head(self) -> tuple[list[Queued], int]:
        """The batches the next send carries (the oldest, and those after it that fit the budget with it),
        and their size."""
        head = [self._queue[0]]
        if self._merge is None:
            return head, 0
        total = self._merge.size(head[0])
        for batch in itertools.islice(self._queue, 1, None):
            size = self._merge.size(batch)
            if total + size > self._budget:
                break
            total += size
            head.append(batch)
        return head, total

    def _trim(self) -> None:
        while len(self._queue) > self._max:
            lost = self._queue.popleft()
            self.dropped_batches += 1
            self.dropped_items += self._count(lost)
            log.error("agent %s buffer full: dropped an export (%d dropped so far)", self._what, self.dropped_batches)


class BufferingMetricExporter(Generic[Batch]):
    """Delegates to ``inner``; queues failed exports, at most ``max_batches`` of them (``merge``: see `RetryQueue`)."""

    def __init__(self, inner: BatchExporter[Batch], *, max_batches: int, merge: Merge[Batch] | None = None) -> None:
        self._inner: BatchExporter[Batch] = inner
        self._queue: RetryQueue[Batch] = RetryQueue(max_batches=max_batches, count=count_points, what="metric",
                                                    merge=merge)

    @property
    def buffered_batches(self) -> int:
        """Exports waiting for the gateway."""
        return len(self._queue)

    @property
    def dropped_batches(self) -> int:
        """Exports dropped because the buffer was full."""
        return self._queue.dropped_batches

    @property
    def dropped_points(self) -> int:
        """Data points in the dropped exports."""
        return self._queue.dropped_items

    @property
    def sent_batches(self) -> int:
        """Exports the gateway took."""
        return self._queue.sent_batches

    def export(self, batch: Batch, timeout_millis: float = 10_000) -> MetricExportResult:
        """Send queued exports, then this one; queue whatever fails."""
        def attempt(b: Batch) -> bool:
            return self._inner.export(b, timeout_millis=timeout_millis) is MetricExportResult.SUCCESS
        return MetricExportResult.SUCCESS if self._queue.send(batch, attempt) else MetricExportResult.FAILURE

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        """Flush the inner exporter."""
        return self._inner.force_flush(timeout_millis=timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000) -> None:
        """Shut the inner exporter down; what is still queued is lost (and was counted as buffered)."""
        self._inner.shutdown(timeout_millis=timeout_millis)


def count_points(batch: MetricsData | EncodedMetrics) -> int:
    """The data points in one batch."""
    if isinstance(batch, EncodedMetrics):
        return batch.points
    return sum(len(m.data.data_points) for rm in batch.resource_metrics for sm in rm.scope_metrics for m in sm.metrics)


class MergeEncoded:
    """Joins serialised ``ExportMetricsServiceRequest``s: protobuf concatenates a repeated field's
    entries when messages are concatenated, so the bytes laid end to end are one request holding
    every batch's resource metrics. ``max_size`` in bytes (keep it under the gateway's message limit)."""

    def __init__(self, max_bytes: int = 4 << 20) -> None:
        self.max_size = max_bytes

    def join(self, batches: Sequence[EncodedMetrics], /) -> EncodedMetrics:
        """One request with every batch's points."""
        return EncodedMetrics(payload=b"".join(b.payload for b in batches), points=sum(b.points for b in batches))

    def size(self, batch: EncodedMetrics, /) -> int:
        """The serialised request's bytes."""
        return len(batch.payload)
