"""Probe bookkeeping, pure: peer tables, path plans, peer choice, suspension, loss split, stats."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from ridethrough.collector.probe_paths import (
    PathCounters,
    PathHealth,
    PeerPicker,
    ReplayWindow,
    TokenBucket,
    load_peers,
    parse_address,
    parse_peers,
    plan_paths,
)
from ridethrough.collector.probe_sample import ProbeSample, TimestampKind
from ridethrough.collector.probe_stats import (
    Correction,
    PairMatcher,
    PathWindow,
    SampleAggregator,
    one_way_delays,
    pair_purity,
    quantiles,
)
from ridethrough.collector.probe_wire import Endpoint

T0 = 1_764_480_000_000_000_000


# -- peer tables and plans -------------------------------------------------------------------------------


def test_addresses_take_a_default_port() -> None:
    assert parse_address("10.64.0.1", 7447) == ("10.64.0.1", 7447)
    assert parse_address("10.64.0.1:9000", 7447) == ("10.64.0.1", 9000)
    assert parse_address("[fd00::1]:9000", 7447) == ("fd00::1", 9000)
    assert parse_address("fd00::1", 7447) == ("fd00::1", 7447)
    for bad in ("h0", "10.64.0.1:x", "10.64.0.1:70000", "[fd00::1"):
        with pytest.raises(ValueError):
            parse_address(bad, 7447)


def test_peer_tables_are_checked_and_name_the_bad_entry(tmp_path: Path) -> None:
    table = parse_peers({"h0": {"nic0": "10.64.0.1", "nic1": "10.65.0.1:7000"}}, default_port=7447)
    assert table == {"h0": {"nic0": ("10.64.0.1", 7447), "nic1": ("10.65.0.1", 7000)}}
    for bad, where in (([], "expected"), ({"h 0": {"nic0": "10.0.0.1"}}, "'h 0'"), ({"h0": {}}, "'h0'"),
                       ({"h0": {"nic0": "nowhere"}}, "'h0'"), ({"h0": {"n" * 17: "10.0.0.1"}}, "NIC name")):
        with pytest.raises(ValueError, match=where):
            parse_peers(bad, default_port=7447)
    path = tmp_path / "peers.json"
    path.write_text(json.dumps({"h1": {"nic0": "10.64.0.3"}}))
    assert load_peers(path, default_port=1) == {"h1": {"nic0": ("10.64.0.3", 1)}}
    path.write_text("{half")
    with pytest.raises(ValueError, match=str(path)):
        load_peers(path, default_port=1)


def test_nics_pair_by_name_or_else_in_order() -> None:
    peers = parse_peers({"h1": {"nic0": "10.64.0.3", "nic1": "10.65.0.3"}, "x": {"ib0": "10.9.0.1", "ib1": "10.9.1.1"},
                         "one": {"nic1": "10.65.0.9"}}, default_port=7447)
    paths = plan_paths("h0", ["nic0", "nic1"], peers, ["h1", "x", "one", "absent"])
    assert [(p.local.nic, p.peer.node, p.peer.nic) for p in paths] == [
        ("nic0", "h1", "nic0"), ("nic1", "h1", "nic1"), ("nic0", "x", "ib0"), ("nic1", "x", "ib1"),
        ("nic1", "one", "nic1")]
    assert paths[0].peer_addr == ("10.64.0.3", 7447) and paths[0].local == Endpoint("h0", "nic0")


def test_peer_picker_keeps_pinned_draws_k_and_redraws_slowly() -> None:
    nodes = [f"h{i}" for i in range(20)]
    picker = PeerPicker(k=3, pinned=("h7", "gone"), redraw_s=60.0, rng=random.Random(3))
    first = picker.pick(nodes, now_s=0.0)
    assert first[0] == "h7" and len(first) == 4 and len(set(first)) == 4
    assert picker.pick(nodes, now_s=30.0) == first
    drawn = first[1:]
    fewer = [n for n in nodes if n != drawn[0]]
    replaced = picker.pick(fewer, now_s=31.0)
    assert drawn[0] not in replaced and set(drawn[1:]) <= set(replaced) and len(replaced) == 4
    later = {tuple(picker.pick(nodes, now_s=60.0 * i)) for i in range(1, 8)}
    assert len(later) > 1  # re-drawn
    assert PeerPicker(k=10).pick(["a", "b"], 0.0) == ["a", "b"]


# -- suspension, replay, rate --------------------------------------------------------------------------


def test_a_path_is_suspended_after_losses_and_backs_off_exponentially() -> None:
    rng, health = random.Random(1), PathHealth(losses_to_suspend=3, backoff_min_s=5.0, backoff_max_s=12.0)
    assert not health.on_loss(0.0, rng) and not health.on_loss(0.5, rng)
    assert health.on_loss(1.0, rng) and not health.active(1.0)
    assert 4.0 <= health.suspended_until_s - 1.0 <= 6.0  # 5 s ± 20 %
    assert not health.on_loss(2.0, rng)  # probes still timing out from before: no escalation
    retry = health.suspended_until_s
    assert health.active(retry)
    assert not health.on_loss(retry + 1, rng) and health.on_loss(retry + 1.1, rng)  # a lost retry pair
    assert health.backoff_s == 10.0 and health.suspensions == 2
    health.active(1e9)
    health.on_loss(1e9, rng)
    health.on_loss(1e9, rng)
    assert health.backoff_s == 12.0  # capped
    health.on_reply()
    assert health.active(0.0) and health.backoff_s == 0.0 and health.consecutive_losses == 0


def test_replay_window_accepts_each_sequence_number_once() -> None:
    w = ReplayWindow()
    assert all(w.accept(s) for s in (10, 12, 11, 100))
    assert not w.accept(12) and not w.accept(100) and not w.accept(100 - 64)
    assert w.accept(100 - 63) and w.accept(1000) and not w.accept(999 - 63)


def test_token_bucket() -> None:
    bucket = TokenBucket(2.0, 3.0, 0.0)
    assert [bucket.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert bucket.take(0.5) and not bucket.take(0.5)


# -- loss split ---------------------------------------------------------------------------------------


def test_a_probe_lost_on_the_way_there_is_forward_loss() -> None:
    c = PathCounters()
    c.sent = 4
    c.on_reply(1, 1, epoch=7)
    c.on_reply(3, 2, epoch=7)  # probe 2 never reached the responder
    c.on_reply(4, 3, epoch=7)
    c.on_lost(2.0)  # probe 2 times out after the replies that explain it
    assert (c.lost, c.lost_forward, c.lost_reverse) == (1, 1, 0)


def test_a_reply_lost_on_the_way_back_is_reverse_loss() -> None:
    c = PathCounters()
    c.on_reply(1, 1, epoch=7)
    c.on_lost(1.0)  # probe 2's reply was lost; the responder counted the probe
    assert (c.lost_forward, c.lost_reverse) == (0, 0)  # unsettled until a reply says which
    c.on_reply(3, 3, epoch=7)
    assert (c.lost_forward, c.lost_reverse) == (0, 1)


def test_losses_no_reply_explains_become_forward_after_grace_and_a_new_epoch_restarts_counts() -> None:
    c = PathCounters()
    c.on_reply(1, 500, epoch=1)
    for t in (1.0, 1.1, 1.2):
        c.on_lost(t)
    c.settle(2.0, grace_s=2.0)
    assert c.lost_forward == 0
    c.settle(3.15, grace_s=2.0)
    assert (c.lost_forward, c.lost_reverse) == (2, 0)
    c.on_reply(5, 1, epoch=2)  # the responder restarted: its count starts again
    c.on_lost(4.0)
    c.on_reply(7, 3, epoch=2)  # probe 6 reached it, its reply did not come back
    assert (c.lost, c.lost_forward, c.lost_reverse) == (4, 2, 1)
    c.settle(100.0, grace_s=2.0)
    assert c.lost_forward + c.lost_reverse == c.lost


# -- stats --------------------------------------------------------------------------------------------


def sample(t1: int, owd_fwd: int, turnaround: int, owd_rev: int, *, pair_id: int = 1, index: int = 0,
           offset_dst: int = 0) -> ProbeSample:
    t2 = t1 + owd_fwd + offset_dst
    t3 = t2 + turnaround
    return ProbeSample("a", "nic0", "b", "nic0", 1, pair_id, index, t1, t2, t3, t3 + owd_rev - offset_dst)


def test_quantiles_by_nearest_rank() -> None:
    assert quantiles([]) == []
    assert quantiles([5.0]) == [("min", 5.0), ("p50", 5.0), ("p99", 5.0), ("max", 5.0)]
    values = [float(v) for v in range(1, 101)]
    assert dict(quantiles(values)) == {"min": 1.0, "p50": 50.0, "p99": 99.0, "max": 100.0}


def test_one_way_delays_need_both_ends_corrected() -> None:
    s = sample(T0, 3_000, 50_000, 7_000, offset_dst=2_000_000)
    assert s.rtt_ns == 10_000
    assert one_way_delays(s, {"a": Correction(0)}) is None
    assert one_way_delays(s, {"a": Correction(0), "b": Correction(2_000_000)}) == (3_000, 7_000)
    drifting = Correction(1_000_000, drift_ppm=100.0, at_ns=T0 - 10**10)  # 1 ms + 100 ppm of (10 s + 2 ms)
    fwd, rev = one_way_delays(s, {"a": Correction(0), "b": drifting}) or (0, 0)
    assert (fwd, rev) == (3_000 - 200, 7_000 + 205)


def test_a_pair_is_pure_when_its_gap_survives() -> None:
    a = sample(T0, 3_000, 50_000, 3_000)
    same = sample(T0 + 20_000, 3_000, 50_000, 3_000, index=1)
    queued_there = sample(T0 + 20_000, 40_000, 50_000, 3_000, index=1)
    assert pair_purity(a, same, 1_000) == (True, True)
    assert pair_purity(a, queued_there, 1_000) == (False, True)  # t3, t4 move with t2: the back gap holds
    assert pair_purity(a, sample(T0 + 20_000, 3_000, 50_000, 30_000, index=1), 1_000) == (True, False)


def test_pairs_match_across_one_collection_only() -> None:
    m = PairMatcher()
    first, second = sample(T0, 1, 1, 1, pair_id=9), sample(T0 + 20_000, 1, 1, 1, pair_id=9, index=1)
    assert m.match(second) is None
    m.next_round()
    assert m.match(first) == (first, second)
    m.match(sample(T0, 1, 1, 1, pair_id=10))
    m.next_round()
    m.next_round()
    assert m.match(sample(T0, 1, 1, 1, pair_id=10, index=1)) is None


def test_windows_fall_back_to_half_the_rtt_and_say_so() -> None:
    agg = SampleAggregator(pure_tolerance_ns=1_000)
    agg.add(sample(T0, 3_000, 50_000, 7_000))
    agg.add(sample(T0 + 20_000, 3_000, 50_000, 7_000, index=1))
    window = agg.take()[("a", "nic0", "b", "nic0")]
    assert window.forward_ns == [5_000.0, 5_000.0] and not window.corrected
    assert (window.pairs, window.pure_forward, window.pure_reverse) == (1, 1, 1)
    assert window.rx_kind is TimestampKind.KERNEL
    assert agg.take() == {}
    w = PathWindow()
    w.add(sample(T0, 3_000, 50_000, 7_000), {"a": Correction(0), "b": Correction(0)})
    assert w.corrected and w.forward_ns == [3_000] and w.reverse_ns == [7_000]
