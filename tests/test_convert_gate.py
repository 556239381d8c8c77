"""The gateway converts requests in turns and refuses, unconverted, those that could not finish in time."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ridethrough.exporters.convert_gate import ConvertGate
from ridethrough.exporters.signals import Signal
from ridethrough.exporters.store import Store
from tests.otlp_util import gauge_request
from tests.test_fuzz import stored
from tests.test_ingest_auth import export, serving


def test_turns_are_taken_one_at_a_time_and_a_wait_past_the_time_left_is_refused() -> None:
    gate = ConvertGate(slots=1)
    inside, release = threading.Event(), threading.Event()

    def hold() -> None:
        with gate.turn(100, None) as turn:
            assert turn
            inside.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert inside.wait(10)
        started = time.monotonic()
        with gate.turn(100, 0.3) as turn:
            assert not turn, "the only slot is taken for longer than the call has left"
        assert 0.25 <= time.monotonic() - started < 5
        assert gate.refused == 1
    finally:
        release.set()
        holder.join(10)
    with gate.turn(100, 5.0) as turn:
        assert turn, "free again (the holder's long turn set the rate: 100 bytes in about 0.3 s)"


def test_a_request_whose_conversion_would_outlast_its_call_is_refused_at_once() -> None:
    gate = ConvertGate(slots=2)
    assert gate.estimate_s(10_000) == 0.0, "nothing measured yet: no estimate, no refusal"
    with gate.turn(1_000, None) as turn:
        assert turn
        time.sleep(0.2)
    assert gate.estimate_s(10_000) == pytest.approx(2.0, rel=0.5), "10x the bytes, 10x the time"
    started = time.monotonic()
    with gate.turn(10_000, 1.0) as turn:
        assert not turn
    assert time.monotonic() - started < 0.1, "refused without waiting: both slots were free"
    with gate.turn(500, 1.0) as turn:
        assert turn, "a small one fits"


def test_slots_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        ConvertGate(slots=0)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    s = Store(f"chdb://{tmp_path_factory.mktemp('gate') / 'store'}")
    s.init_schema()
    yield s
    s.close()


@pytest.mark.integration
def test_a_burst_of_requests_with_short_deadlines_stores_some_in_time_instead_of_none(
        store: Store, tmp_path: Path) -> None:
    """Eight senders at once, each with time for a few conversions: converted side by side, the eight
    would share the time and most would miss their deadlines together; in turns, the first ones are
    stored and the rest hear "busy" unconverted, while their call still has time to run."""
    raws = [gauge_request(20_000, service="burst", start_seq=20_000 * k, attrs_per_point=3).SerializeToString()
            for k in range(9)]
    with serving(store, tmp_path / "spool", max_inflight_bytes=1 << 30, workers=16) as gw:
        started = time.monotonic()
        assert export(gw.target, raws[0], timeout_s=60)[0] == "OK"  # alone: the conversion rate is measured
        one_s = time.monotonic() - started
        results: list[tuple[str, float]] = []
        lock = threading.Lock()

        def send(raw: bytes) -> None:
            t0 = time.monotonic()
            code, _ = export(gw.target, raw, timeout_s=3.5 * one_s)
            with lock:
                results.append((code, time.monotonic() - t0))

        threads = [threading.Thread(target=send, args=(raw,)) for raw in raws[1:]]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    codes = [code for code, _ in results]
    assert len(codes) == 8 and set(codes) <= {"OK", "UNAVAILABLE", "DEADLINE_EXCEEDED"}, codes
    # measured here: side by side (convert_slots=16), 6 of 8 DEADLINE_EXCEEDED at 3.7 s and 2 OK; two at a time
    # (the default), 4 OK and 4 refused unconverted, none late
    assert codes.count("OK") > codes.count("DEADLINE_EXCEEDED"), f"one call alone took {one_s:.2f} s: {results}"
    assert stored(store, Signal.METRICS, "burst") == 20_000 * (1 + codes.count("OK")), "none stored twice or lost"
