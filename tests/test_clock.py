"""Scripted clocks: offset, drift and steps as the lab sets them, read back by the agent's clock."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from ridethrough.collector.clock import ClockScript, ClockSpec, ScriptedClock

T0 = 1_764_480_000_000_000_000


def test_offset_drift_and_steps_compose() -> None:
    spec = ClockSpec(offset_ns=2_000_000, drift_ppm=50.0, epoch_ns=T0, steps=((T0 + 10**9, -500_000),))
    assert spec.local(T0) == T0 + 2_000_000
    assert spec.local(T0 + 10**9 - 1) == T0 + 10**9 - 1 + 2_000_000 + 50_000  # 50 ppm of ~1 s, rounded
    assert spec.local(T0 + 10**9) == T0 + 10**9 + 2_000_000 + 50_000 - 500_000


def test_agent_clock_follows_the_lab_script(tmp_path: Path) -> None:
    now = [T0]
    script = ClockScript(tmp_path / "clock.json")
    clock = ScriptedClock(tmp_path / "clock.json", true_clock=lambda: now[0], recheck_s=0)
    assert clock() == T0, "no file is a perfect clock"
    script.set(-3_000_000, -100.0, epoch_ns=T0)
    assert clock() == T0 - 3_000_000
    now[0] = T0 + 2 * 10**9
    script.step(7_000_000, at_ns=T0 + 10**9)
    assert clock() == T0 + 2 * 10**9 - 3_000_000 - 200_000 + 7_000_000


def test_limits_and_malformed_files(tmp_path: Path) -> None:
    script = ClockScript(tmp_path / "clock.json")
    with pytest.raises(ValueError, match="within"):
        script.set(20_000_000, 0.0)
    with pytest.raises(ValueError, match="within"):
        script.set(0, 150.0)
    script.set(1000, 1.0, epoch_ns=T0)
    clock = ScriptedClock(tmp_path / "clock.json", true_clock=lambda: T0, recheck_s=0)
    assert clock() == T0 + 1000
    (tmp_path / "clock.json").write_text("{not json")
    assert clock() == T0 + 1000, "a broken file keeps the last good spec"
    with pytest.raises(ValueError, match="clock script"):
        script.read()


def test_the_agent_looks_at_its_clock_file_at_most_every_recheck(tmp_path: Path) -> None:
    script = ClockScript(tmp_path / "clock.json")
    script.set(1000, 0.0, epoch_ns=T0)
    clock = ScriptedClock(tmp_path / "clock.json", true_clock=lambda: T0, recheck_s=0.3)
    assert clock() == T0 + 1000
    script.set(2000, 0.0, epoch_ns=T0)
    assert clock() == T0 + 1000, "read again before recheck_s: the spec already in force"
    time.sleep(0.35)
    assert clock() == T0 + 2000


def test_a_thread_reading_while_another_first_reads_the_file_gets_the_scripted_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prober and the responder share one clock: the one that came second, while the first was still reading
    the file, was handed true time (the lab's sample one-way delays then came out off by the host's offset)."""
    from ridethrough.collector import clock as clock_module

    ClockScript(tmp_path / "clock.json").set(5_000_000, 0.0, epoch_ns=T0)
    reading, read = threading.Event(), clock_module.read_spec

    def slow_read(path: Path) -> ClockSpec:
        reading.set()
        time.sleep(0.2)  # a loaded machine between the stat and the read
        return read(path)

    monkeypatch.setattr(clock_module, "read_spec", slow_read)
    clock = ScriptedClock(tmp_path / "clock.json", true_clock=lambda: T0)
    first = threading.Thread(target=clock)
    first.start()
    assert reading.wait(5)
    assert clock() == T0 + 5_000_000
    first.join(5)
