"""The agent's events keep while the gateway is away, as its metrics do.

The SDK's `BatchLogRecordProcessor` drops a batch its exporter fails to send. For the agent's
events that loses exactly what matters most when the fleet is struggling: job steps (goodput and
straggler detection read them), XIDs, reflex reroutes. `BufferingLogExporter` sits between the
processor and the OTLP exporter: a batch that fails waits in a bounded `RetryQueue` and goes out,
oldest first, before the next one (the backlog joined into sends of up to ``max_records`` events);
`retry` sends the queue without a new batch (the agent calls it every export interval, so a lone
event does not wait for the next one). A retried batch the gateway had in fact stored arrives
twice; readers count distinct events (steps by job, rank and step).
"""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry.sdk._logs import ReadableLogRecord
from opentelemetry.sdk._logs.export import LogRecordExporter, LogRecordExportResult

from ridethrough.collector.export import RetryQueue

LogBatch = tuple[ReadableLogRecord, ...]


class MergeRecords:
    """Joins event batches (tuples of records) into one, up to ``max_size`` records."""

    def __init__(self, max_records: int) -> None:
        self.max_size = max_records

    def join(self, batches: Sequence[LogBatch], /) -> LogBatch:
        """The records of every batch, oldest first."""
        return tuple(r for b in batches for r in b)

    def size(self, batch: LogBatch, /) -> int:
        """How many records."""
        return len(batch)


class BufferingLogExporter(LogRecordExporter):
    """Delegates to ``inner``; queues failed exports, at most ``max_batches`` of them (the oldest dropped first)."""

    def __init__(self, inner: LogRecordExporter, *, max_batches: int, max_records: int = 2048) -> None:
        """``max_records``: at most this many events in one send of the backlog (batches are joined up to it)."""
        self._inner = inner
        self._queue: RetryQueue[LogBatch] = RetryQueue(max_batches=max_batches, count=len, what="event",
                                                       merge=MergeRecords(max_records))
        self._stopped = False

    @property
    def buffered_batches(self) -> int:
        """Event exports waiting for the gateway."""
        return len(self._queue)

    @property
    def dropped_records(self) -> int:
        """Events lost because the buffer was full."""
        return self._queue.dropped_items

    def export(self, batch: Sequence[ReadableLogRecord]) -> LogRecordExportResult:
        """Send queued batches, then this one; queue whatever fails."""
        sent = self._queue.send(tuple(batch), self._attempt)
        return LogRecordExportResult.SUCCESS if sent else LogRecordExportResult.FAILURE

    def retry(self) -> bool:
        """Send what is queued (nothing new) unless an export is under way; True when the queue is empty."""
        # not behind the processor's own export (it may be retrying for its whole timeout): that one drains too
        return len(self._queue) == 0 or self._queue.send(None, self._attempt, wait=False)

    def _attempt(self, batch: LogBatch) -> bool:
        return not self._stopped and self._inner.export(batch) is LogRecordExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """Send the queue; True when nothing is left waiting."""
        return self.retry()

    def shutdown(self) -> None:
        """Shut the inner exporter down; what is still queued is lost (and was counted as buffered)."""
        self._stopped = True
        self._inner.shutdown()  # type: ignore[no-untyped-call]  # the SDK leaves it unannotated
