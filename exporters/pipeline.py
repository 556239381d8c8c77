"""From converted requests to durable rows: batching, inserting, spooling, replaying.

A request is answered OK only once its rows are in the store or fsynced in the spool.
The batcher joins requests into batches bounded by rows and age and inserts each batch
column-wise with one deduplication token per table. When the store is away the batch
goes to the spool, and the replayer feeds the spool back with exponential backoff and
jitter. When both the store and the spool are full, `submit` refuses with `Backpressure`
so that senders slow down instead of the gateway growing without bound.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from google.protobuf.message import Message

from ridethrough.exporters import schema
from ridethrough.exporters.gateway_metrics import GatewayMetrics
from ridethrough.exporters.rows import Limits, Rejections, Rows
from ridethrough.exporters.signals import Signal
from ridethrough.exporters.spool import Spool, SpoolCorrupt, SpooledBatch, SpoolFull
from ridethrough.exporters.store import Store, StoreError, StoreUnavailable

log = logging.getLogger(__name__)


class Backpressure(Exception):
    """The gateway cannot take more now; retry after ``retry_after_s``."""

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True, slots=True)
class BatchPolicy:
    """How big and how old a batch may grow, and how much may wait in memory."""

    max_rows: int = 50_000
    max_age_s: float = 0.2
    max_pending_rows: int = 200_000
    replay_initial_backoff_s: float = 0.5
    replay_max_backoff_s: float = 30.0


@dataclass(eq=False)
class Ticket:
    """One submitted request's wait for durability."""

    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None

    def wait(self, timeout_s: float) -> bool:
        """True once the rows are durable; False on failure or timeout (see ``error``)."""
        if not self.done.wait(timeout_s):
            self.error = self.error or "timed out waiting for the store or the spool"
            return False
        return self.error is None


def write_batch(store: Store, rows: Rows, token: str, metrics: GatewayMetrics) -> None:
    """Insert every table of ``rows``, each with a token derived from the batch's."""
    for name, count in rows.counts.items():
        if not count:
            continue
        table = schema.TABLES_BY_NAME[name]
        store.insert_columns(table, rows.ordered(table), token=f"{token}:{name}")
        metrics.inserted.labels(table=name).inc(count)


def write_requests(store: Store, requests: Sequence[tuple[Signal, Message]], *, token: str,
                   metrics: GatewayMetrics, limits: Limits | None = None,
                   check: Callable[[Rejections], None] | None = None) -> None:
    """Store OTLP requests the server builds itself (clock corrections, incident events).

    They take the gateway's own conversion and columnar insert; ``token`` makes a retry a
    no-op; ``check`` sees what the converter rejected before anything is written.
    """
    rows, rej = Rows(), Rejections()
    for signal, request in requests:
        signal.convert(request.SerializeToString(), limits or Limits(), rows, rej)
    if check is not None:
        check(rej)
    write_batch(store, rows, token, metrics)


def rebuild(requests: tuple[tuple[Signal, bytes], ...], limits: Limits) -> Rows:
    """The rows a spooled batch held (conversion is deterministic, so tokens still match)."""
    rows = Rows()
    rej = Rejections()
    for signal, raw in requests:
        signal.convert(raw, limits, rows, rej)
    return rows


class Pipeline:
    """The batcher and the replayer, each on its own thread."""

    def __init__(self, *, store: Store, spool: Spool, limits: Limits, policy: BatchPolicy,
                 metrics: GatewayMetrics) -> None:
        self.store = store
        self._store_lock = threading.Lock()  # held while a batch is written: a swap waits for it
        self.spool = spool
        self.limits = limits
        self.policy = policy
        self.metrics = metrics
        self._cond = threading.Condition()
        self._pending: list[tuple[Signal, bytes, Rows, Ticket]] = []
        self._pending_rows = 0
        self._oldest = 0.0
        self._stopping = False
        self._replay_wake = threading.Event()
        self._store_down = False
        self._observers: list[Callable[[Rows], None]] = []
        self._threads = [threading.Thread(target=self._batch_loop, name="rt-batcher", daemon=True),
                         threading.Thread(target=self._replay_loop, name="rt-replayer", daemon=True)]
        self._update_spool_gauges()

    def observe(self, observer: Callable[[Rows], None]) -> None:
        """Call ``observer`` with each batch's rows once they are in the store (the live feed).

        It runs on the batcher thread, so it must be quick; one that raises is logged and the
        batch stays written.
        """
        self._observers.append(observer)

    def start(self) -> None:
        """Start batching and replaying."""
        for t in self._threads:
            t.start()

    def submit(self, signal: Signal, raw: bytes, rows: Rows) -> Ticket:
        """Queue a converted request; `Backpressure` if the gateway is full."""
        ticket = Ticket()
        with self._cond:
            if self._stopping:
                raise Backpressure("gateway is shutting down", retry_after_s=1.0)
            if self._pending_rows + rows.total > self.policy.max_pending_rows and self._pending:
                self.metrics.backpressure.inc()
                raise Backpressure("gateway batch queue is full", retry_after_s=self._retry_after())
            if self._store_down and self.spool.bytes_used >= self.spool.max_bytes:
                self.metrics.backpressure.inc()
                raise Backpressure("store unavailable and spool full", retry_after_s=self._retry_after())
            first = not self._pending
            if first:
                self._oldest = time.monotonic()
            self._pending.append((signal, raw, rows, ticket))
            self._pending_rows += rows.total
            # Wake the batcher to start the batch's age clock, or to flush a full batch.
            if first or self._pending_rows >= self.policy.max_rows:
                self._cond.notify_all()
        return ticket

    def _retry_after(self) -> float:
        return min(self.policy.replay_max_backoff_s, max(1.0, self.policy.replay_initial_backoff_s * 4))

    def _batch_loop(self) -> None:
        while True:
            with self._cond:
                batch = self._take_batch()
                if batch is None:
                    return
            if batch:
                self._flush(batch)

    def _take_batch(self) -> list[tuple[Signal, bytes, Rows, Ticket]] | None:
        """Wait until a batch is due (size or age) and take it; None once stopped and drained."""
        while True:
            if self._pending:
                age = time.monotonic() - self._oldest
                if self._stopping or self._pending_rows >= self.policy.max_rows or age >= self.policy.max_age_s:
                    batch, self._pending, self._pending_rows = self._pending, [], 0
                    return batch
                self._cond.wait(self.policy.max_age_s - age)
            elif self._stopping:
                return None
            else:
                self._cond.wait()

    def _flush(self, batch: list[tuple[Signal, bytes, Rows, Ticket]]) -> None:
        rows = Rows()
        for _, _, r, _ in batch:
            rows.extend(r)
        token = uuid.uuid4().hex
        error = self._insert_or_spool(rows, token, [(s, raw) for s, raw, _, _ in batch])
        for _, _, _, ticket in batch:
            ticket.error = error
            ticket.done.set()

    def _insert_or_spool(self, rows: Rows, token: str, requests: list[tuple[Signal, bytes]]) -> str | None:
        if not self._store_down:
            started = time.perf_counter()
            try:
                with self._store_lock:
                    write_batch(self.store, rows, token, self.metrics)
                self.metrics.batch_seconds.observe(time.perf_counter() - started)
                self._notify(rows)
                return None
            except (StoreUnavailable, StoreError) as exc:
                log.warning("store insert failed, spooling batch %s: %s", token, exc)
                self._store_down = isinstance(exc, StoreUnavailable)
            except Exception:  # an unexpected client error must not kill the batcher: keep the batch on disk
                log.exception("store insert raised unexpectedly, spooling batch %s", token)
        return self._spool(token, requests)

    def _notify(self, rows: Rows) -> None:
        for observer in self._observers:
            try:
                observer(rows)
            except Exception:  # a watcher's bug must not turn a written batch into a spooled one
                log.exception("live-feed observer %r failed", observer)

    def _spool(self, token: str, requests: list[tuple[Signal, bytes]]) -> str | None:
        try:
            self.spool.write(token, requests)
        except (SpoolFull, OSError) as exc:
            log.error("cannot spool batch %s: %s", token, exc)
            return f"store unavailable and spool refused the batch: {exc}"
        self.metrics.spooled_batches.inc()
        self._update_spool_gauges()
        self._replay_wake.set()
        return None

    def _update_spool_gauges(self) -> None:
        self.metrics.spool_bytes.set(self.spool.bytes_used)
        self.metrics.spool_files.set(len(self.spool.pending()))

    def swap_store(self, store: Store) -> Store:
        """Write to ``store`` from now on; returns the old one, which no batch is being written to any more
        (closing a store, an embedded one above all, while a thread writes to it can hang both)."""
        with self._store_lock:
            old, self.store = self.store, store
        self.wake_replayer()
        return old

    def wake_replayer(self) -> None:
        """Try the spool again now (the store may be back)."""
        self._store_down = False
        self._replay_wake.set()

    def replay_once(self) -> bool:
        """Replay every spooled batch in order; True when the spool is empty afterwards."""
        for path in self.spool.pending():
            try:
                batch = self.spool.load(path)
            except SpoolCorrupt:
                self.metrics.quarantined_batches.inc()
                continue
            if not self._replay(batch):
                return False
        self._store_down = False
        self._update_spool_gauges()
        return True

    def _replay(self, batch: SpooledBatch) -> bool:
        try:
            with self._store_lock:
                write_batch(self.store, rebuild(batch.requests, self.limits), batch.token, self.metrics)
        except StoreUnavailable as exc:
            log.info("replay of %s deferred: %s", batch.path.name, exc)
            self._store_down = True
            return False
        except StoreError as exc:
            # The store refuses this batch itself (not its own absence): set it aside.
            self.spool.quarantine(batch.path, f"store rejected the batch: {exc}")
            self.metrics.quarantined_batches.inc()
            return True
        self.spool.remove(batch.path)
        self.metrics.replayed_batches.inc()
        self._update_spool_gauges()
        return True

    def _replay_loop(self) -> None:
        backoff = self.policy.replay_initial_backoff_s
        while not self._stopping:
            try:
                replayed = self.replay_once()
            except Exception:  # a full disk or a bug: the replayer must outlive it and try again later
                log.exception("spool replay failed; retrying after a pause")
                replayed = False
            if replayed:
                backoff = self.policy.replay_initial_backoff_s
                self._replay_wake.wait(timeout=5.0)
            else:
                # Full jitter: spread the retries of many gateways after a shared outage.
                self._replay_wake.wait(timeout=random.uniform(0, backoff))
                backoff = min(backoff * 2, self.policy.replay_max_backoff_s)
            self._replay_wake.clear()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Flush what is queued (to the store or the spool) and stop both threads."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._replay_wake.set()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            if t.is_alive():
                t.join(max(0.0, deadline - time.monotonic()))
