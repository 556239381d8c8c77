"""A store swap (the gateway's SIGHUP) waits for the batch being written: the old store is never closed under it."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from ridethrough.exporters.convert_metrics import convert_metrics
from ridethrough.exporters.gateway_metrics import GatewayMetrics
from ridethrough.exporters.pipeline import BatchPolicy, Pipeline
from ridethrough.exporters.rows import Limits, Rejections, Rows
from ridethrough.exporters.signals import Signal
from ridethrough.exporters.spool import Spool
from ridethrough.exporters.store import Store
from tests.otlp_util import gauge_request


class Held:
    """A store whose inserts wait until ``release`` is set (an embedded store busy under load)."""

    def __init__(self, inner: Store) -> None:
        self.inner, self.entered, self.release = inner, threading.Event(), threading.Event()

    def insert_columns(self, *args: Any, **kwargs: Any) -> None:
        self.entered.set()
        assert self.release.wait(30)
        self.inner.insert_columns(*args, **kwargs)


class Counted:
    """A store that counts the inserts it takes (one embedded store per process: both stand on one)."""

    def __init__(self, inner: Store) -> None:
        self.inner, self.inserts = inner, 0

    def insert_columns(self, *args: Any, **kwargs: Any) -> None:
        self.inserts += 1
        self.inner.insert_columns(*args, **kwargs)


def test_a_swap_waits_for_the_write_in_flight_then_the_next_batch_goes_to_the_new_store(tmp_path: Path) -> None:
    db = Store(f"chdb://{tmp_path / 'store'}")
    db.init_schema()
    held, new_store = Held(db), Counted(db)
    pipeline = Pipeline(store=held, spool=Spool(tmp_path / "spool", max_bytes=1 << 20),  # type: ignore[arg-type]
                        limits=Limits(), policy=BatchPolicy(max_age_s=0.01), metrics=GatewayMetrics.create())
    pipeline.start()
    try:
        req = gauge_request(1, name="ridethrough.nic.up", values=[1.0])
        rows = Rows()
        convert_metrics(req, Limits(), rows, Rejections())
        first = pipeline.submit(Signal.METRICS, req.SerializeToString(), rows)
        assert held.entered.wait(10)
        swapped: list[Any] = []
        swap = threading.Thread(target=lambda: swapped.append(pipeline.swap_store(new_store)))  # type: ignore[arg-type]
        swap.start()
        swap.join(0.5)
        assert swap.is_alive() and not swapped, "the swap returned while a batch was being written to the old store"
        held.release.set()
        swap.join(10)
        assert swapped == [held] and first.wait(10) and first.error is None
        second = pipeline.submit(Signal.METRICS, req.SerializeToString(), rows)
        assert second.wait(10) and second.error is None
    finally:
        pipeline.shutdown()
    assert new_store.inserts == 1 and db.query("SELECT count() FROM otel_metrics_gauge")[1] == [(2,)]
    db.close()
