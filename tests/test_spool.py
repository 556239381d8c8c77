"""The spool: whole-or-absent files, checksums, quarantine, limits."""

from __future__ import annotations

from pathlib import Path

import pytest

from ridethrough.exporters.signals import Signal
from ridethrough.exporters.spool import Spool, SpoolCorrupt, SpoolFull, decode, encode


def test_round_trip_keeps_token_order_and_bytes(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=1 << 20)
    reqs = [(Signal.METRICS, b"\x01\x02"), (Signal.LOGS, b""), (Signal.TRACES, bytes(range(256)))]
    first = spool.write("tok-a", reqs)
    second = spool.write("tok-b", reqs[:1])
    assert spool.pending() == [first, second]
    batch = spool.load(first)
    assert batch.token == "tok-a" and batch.requests == tuple(reqs)
    assert spool.bytes_used == first.stat().st_size + second.stat().st_size
    spool.remove(first)
    assert spool.pending() == [second]
    assert spool.bytes_used == second.stat().st_size


def test_a_reopened_spool_counts_what_it_holds_and_sweeps_half_writes(tmp_path: Path) -> None:
    Spool(tmp_path, max_bytes=1 << 20).write("t", [(Signal.METRICS, b"x" * 100)])
    (tmp_path / ".tmp-00001-t.spool").write_bytes(b"half a write")
    reopened = Spool(tmp_path, max_bytes=1 << 20)
    assert len(reopened.pending()) == 1 and reopened.bytes_used > 100
    assert not list(tmp_path.glob(".tmp-*"))


@pytest.mark.parametrize("damage", [lambda b: b[:-1], lambda b: b[:5], lambda b: b[:20] + b"\0" + b[21:],
                                    lambda b: b"NOTSPOOL" + b[8:]])
def test_damaged_file_is_quarantined_with_its_reason(tmp_path: Path, damage) -> None:
    spool = Spool(tmp_path, max_bytes=1 << 20)
    path = spool.write("t", [(Signal.METRICS, b"payload" * 10)])
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(SpoolCorrupt):
        spool.load(path)
    assert not path.exists() and spool.pending() == []
    assert (tmp_path / "quarantine" / path.name).exists()
    assert (tmp_path / "quarantine" / (path.name + ".reason")).read_text().strip()


def test_full_spool_refuses_and_keeps_its_count(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=300)
    spool.write("a", [(Signal.METRICS, b"x" * 150)])
    with pytest.raises(SpoolFull):
        spool.write("b", [(Signal.METRICS, b"x" * 150)])
    assert len(spool.pending()) == 1 and spool.bytes_used < 300


def test_decode_rejects_unknown_signal() -> None:
    data = bytearray(encode("t", [(Signal.METRICS, b"ab")], created_ns=1))
    with pytest.raises(ValueError):
        decode(bytes(data[:-4]) + b"\0\0\0\0")
