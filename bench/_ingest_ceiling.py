"""The ingest benchmark's ceiling: the same rows inserted straight into a store, in the gateway's batches.

A fresh process converts the timed requests with the gateway's own converter and joins them
into batches (outside the clock), then times only `Store.insert_columns` of those batches.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from _ingest_clients import Plan, client_pool, send_order

COUNT_SQL = "SELECT (SELECT count() FROM otel_metrics_gauge) + (SELECT count() FROM otel_metrics_sum)"


def stored_points(store: Any) -> int:
    """Rows in the tables the benchmark's gauge and sum points go to."""
    _, rows = store.query(COUNT_SQL)
    return int(rows[0][0])


@dataclass(slots=True)
class CeilingRun:
    """Direct columnar inserts of the same rows, in the same batch size."""

    rows: int
    batches: int
    elapsed_s: float
    cpu_s: float
    stored_rows: int

    @property
    def datapoints_per_s(self) -> float:
        """Rows inserted per second of `Store.insert_columns`."""
        return self.rows / self.elapsed_s


def ceiling_batches(plan: Plan) -> list[Any]:
    """The timed requests as converted `Rows` batches, in send order; equal batches are one object."""
    from ridethrough.exporters.rows import Limits, Rejections, Rows
    from ridethrough.exporters.signals import Signal

    pools = [client_pool(plan, c) for c in range(plan.clients)]
    converted: dict[tuple[int, int], Any] = {}
    for c, pool in enumerate(pools):
        for j, raw in enumerate(pool):
            rows, rej = Rows(), Rejections()
            Signal.METRICS.convert(raw, Limits(), rows, rej)
            if rej.count:
                raise RuntimeError(f"the converter rejected {rej.count} points: {rej.message()}")
            converted[c, j] = rows
    order = list(send_order(plan))
    merged: dict[tuple[tuple[int, int], ...], Any] = {}
    batches = []
    for i in range(0, len(order), plan.batch_requests):
        key = tuple(order[i:i + plan.batch_requests])
        if key not in merged:
            merged[key] = Rows()
            for item in key:
                merged[key].extend(converted[item])
        batches.append(merged[key])
    return batches


def insert_batch(store: Any, rows: Any) -> None:
    """Insert one batch table by table, each with its own token, as the gateway does."""
    from ridethrough.exporters.schema import TABLES_BY_NAME

    token = uuid.uuid4().hex
    for name, count in rows.counts.items():
        if count:
            table = TABLES_BY_NAME[name]
            store.insert_columns(table, rows.ordered(table), token=f"{token}:{name}")


def ceiling_main(plan: Plan, store_path: str) -> CeilingRun:
    """A ceiling run (in a fresh process): prepare outside the clock, time only the inserts."""
    from ridethrough.exporters.store import Store

    batches = ceiling_batches(plan)
    store = Store(f"chdb://{store_path}")
    store.init_schema()
    insert_batch(store, batches[0])  # warm-up: the first insert loads the serialisation code paths
    warmup_rows = batches[0].total
    cpu0, t0 = time.process_time(), time.perf_counter()
    for rows in batches:
        insert_batch(store, rows)
    elapsed_s, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    return CeilingRun(rows=sum(b.total for b in batches), batches=len(batches), elapsed_s=elapsed_s, cpu_s=cpu_s,
                      stored_rows=stored_points(store) - warmup_rows)
