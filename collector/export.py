"""A metric exporter that keeps what it could not send while the gateway is away.

The OTLP exporter alone retries one export and then drops it. Wrapped in
`BufferingMetricExporter`, a failed export waits in a bounded queue and is sent, oldest
first, before the next one; when the queue is full the oldest batch is dropped and
counted. The agent keeps running whatever the gateway does.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData

log = logging.getLogger(__name__)


class BufferingMetricExporter(MetricExporter):
    """Delegates to ``inner``; queues failed exports, at most ``max_batches`` of them."""

    def __init__(self, inner: MetricExporter, *, max_batches: int) -> None:
        super().__init__()  # cumulative temporality, the default the OTLP exporter also uses
        self._inner = inner
        self._queue: deque[MetricsData] = deque()
        self._max = max_batches
        self._lock = threading.Lock()
        self.dropped_batches = 0
        self.dropped_points = 0
        self.sent_batches = 0

    @property
    def buffered_batches(self) -> int:
        """Exports waiting for the gateway."""
        return len(self._queue)

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: object) -> MetricExportResult:
        """Send queued exports, then this one; queue whatever fails."""
        with self._lock:
            self._queue.append(metrics_data)
            self._trim()
            while self._queue:
                if self._inner.export(self._queue[0], timeout_millis=timeout_millis) is not MetricExportResult.SUCCESS:
                    log.warning("gateway unreachable; %d export(s) buffered", len(self._queue))
                    return MetricExportResult.FAILURE
                self._queue.popleft()
                self.sent_batches += 1
            return MetricExportResult.SUCCESS

    def _trim(self) -> None:
        while len(self._queue) > self._max:
            lost = self._queue.popleft()
            self.dropped_batches += 1
            self.dropped_points += _count_points(lost)
            log.error("agent buffer full: dropped an export (%d dropped so far)", self.dropped_batches)

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        """Flush the inner exporter."""
        return self._inner.force_flush(timeout_millis=timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: object) -> None:
        """Shut the inner exporter down; what is still queued is lost (and was counted as buffered)."""
        self._inner.shutdown(timeout_millis=timeout_millis)


def _count_points(data: MetricsData) -> int:
    return sum(len(m.data.data_points) for rm in data.resource_metrics
               for sm in rm.scope_metrics for m in sm.metrics)
