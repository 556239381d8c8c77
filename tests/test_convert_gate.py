"""The gateway converts requests in turns and refuses, unconverted, those that could not finish in time."""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def busy(gate: ConvertGate) -> Iterator[None]:
    """Another request being converted meanwhile."""
    inside, release = threading.Event(), threading.Event()

    def hold() -> None:
        with gate.turn(1, None):
            inside.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    assert inside.wait(10)
    try:
        yield
    finally:
        release.set()
        holder.join(10)


def test_a_request_whose_conversion_would_outlast_its_call_is_refused_at_once_while_others_convert() -> None:
    gate = ConvertGate(slots=3)
    assert gate.estimate_s(10_000) == 0.0, "nothing measured yet: no estimate, no refusal"
    with gate.turn(1_000, None) as turn:
        assert turn
        time.sleep(0.2)
    assert gate.estimate_s(10_000) == pytest.approx(2.0, rel=0.5), "10x the bytes, 10x the time"
    with busy(gate):
        started = time.monotonic()
        with gate.turn(10_000, 1.0) as turn:
            assert not turn
        assert time.monotonic() - started < 0.1, "refused without waiting: a slot was free"
        with gate.turn(500, 1.0) as turn:
            assert turn, "a small one fits"


def test_an_idle_gate_converts_whatever_its_estimate_says_and_measures_the_rate_again() -> None:
    """A rate measured in a busy spell must not refuse that size for good: only conversions measure it."""
    gate = ConvertGate(slots=2)
    with gate.turn(1_000, None):
        time.sleep(0.3)  # a starved conversion: 0.3 ms a byte
    assert gate.estimate_s(10_000) > 1.0
    with gate.turn(10_000, 1.0) as turn:
        assert turn, "nothing else converting: taken, though the estimate (3 s) is over the time left"
    assert gate.estimate_s(10_000) < 0.5, "the fast conversion brought the rate back"
    assert gate.refused == 0


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
def test_a_request_the_gateway_could_not_convert_before_its_deadline_is_refused_unconverted(
        store: Store, tmp_path: Path) -> None:
    raw = gauge_request(40_000, service="late", attrs_per_point=3).SerializeToString()
    with serving(store, tmp_path / "spool", max_inflight_bytes=1 << 30) as gw:
        assert export(gw.target, raw, timeout_s=60)[0] == "OK"  # converted once: the gateway knows its rate
        estimate_s = gw.receiver.gate.estimate_s(len(raw))
        received = gw.metrics.received.labels(signal="metrics")._value.get()
        with busy(gw.receiver.gate):  # another request converting
            # the call arrives with its margin (0.25 s) and 0.9 of a conversion's time left: too little
            code, details = export(gw.target, raw, timeout_s=0.25 + 0.9 * estimate_s)
        assert (code, gw.receiver.gate.refused) == ("UNAVAILABLE", 1), (code, details, estimate_s)
        assert "would not be converted before the call's deadline" in details
        assert gw.metrics.received.labels(signal="metrics")._value.get() == received, "refused before converting"
        assert export(gw.target, raw, timeout_s=60)[0] == "OK", "the same request with time to convert it"
    assert stored(store, Signal.METRICS, "late") == 2 * 40_000
