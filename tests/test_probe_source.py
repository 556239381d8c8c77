"""Source ``probe``: two nodes on loopback probing each other, held to the catalogue both ways."""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from ridethrough.catalogue import metric, metrics_of
from ridethrough.collector.clock_pairs import PairwiseClocks
from ridethrough.collector.huygens import HuygensConfig
from ridethrough.collector.probe_sample import ProbeSample
from ridethrough.collector.probe_stats import Correction
from ridethrough.collector.prober import ProberSettings
from ridethrough.collector.sample import BackgroundSource, Sample
from ridethrough.collector.sources.probe import ProbeSource, from_config
from ridethrough.settings import AgentConfig
from tests.conftest import wait_for

FAST = ProberSettings(interval_s=0.05, timeout_s=0.3)
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="kernel timestamps are Linux's")


def _noop(_: object) -> None:
    pass


@pytest.fixture
def two_nodes() -> Iterator[tuple[ProbeSource, ProbeSource, list[ProbeSample]]]:
    """Node a (clock corrections known, pairwise clocks on short windows) and node b (neither), probing each
    other over two NICs."""
    hooked: list[ProbeSample] = []

    def broken_consumer(s: ProbeSample) -> None:
        hooked.append(s)
        raise RuntimeError("an estimator bug")

    a = ProbeSource(node="a", local={"nic0": "127.0.0.41", "nic1": "127.0.0.42"}, port=0, settings=FAST,
                    corrections=lambda: {"a": Correction(0), "b": Correction(0)}, on_sample=broken_consumer,
                    clocks=PairwiseClocks(node="a", config=HuygensConfig(window_ns=100_000_000)))
    b = ProbeSource(node="b", local={"nic0": "127.0.0.43", "nic1": "127.0.0.44"}, port=0, settings=FAST)
    for source in (a, b):
        source.start(emit=_noop)
    table = {"a": a.addresses, "b": b.addresses}
    for source in (a, b):
        source.set_peers(table)
    try:
        yield a, b, hooked
    finally:
        for source in (a, b):
            source.stop(timeout_s=2.0)


def by_name(samples: list[Sample], name: str) -> list[Sample]:
    return [s for s in samples if s.name == name]


def test_a_probe_source_is_a_background_source(two_nodes: tuple[ProbeSource, ProbeSource, list[ProbeSample]]) -> None:
    a, _, _ = two_nodes
    assert isinstance(a, BackgroundSource) and a.name == "probe"


def test_paths_report_delay_loss_and_purity_as_catalogued_both_ways(
        two_nodes: tuple[ProbeSource, ProbeSource, list[ProbeSample]]) -> None:
    a, b, hooked = two_nodes
    wait_for(lambda: len(hooked) >= 8, timeout_s=10, what="samples at the hook")  # it raises; probing goes on
    a.collect(0)
    b.collect(0)
    wait_for(lambda: len(hooked) >= 40, timeout_s=10, what="more samples")
    emitted = a.collect(0) + b.collect(0)
    for s in emitted:
        spec = metric(s.name)
        assert (spec.source, s.unit, s.kind) == ("probe", spec.unit, spec.kind), s
        assert sorted(s.attributes) == sorted(spec.attributes), s
        assert all(isinstance(v, str) and v for v in s.attributes.values()), s
    assert {s.name for s in emitted} == {m.name for m in metrics_of("probe")}

    rtt = {s.attributes["probe.quantile"]: s.value for s in by_name(emitted, "ridethrough.probe.rtt")
           if s.attributes["probe.src.node"] == "a" and s.attributes["probe.src.nic"] == "nic0"}
    assert 0 < rtt["min"] <= rtt["p50"] <= rtt["p99"] <= rtt["max"] < 0.05
    owd = by_name(emitted, "ridethrough.probe.owd")
    assert {s.attributes["probe.clock.corrected"] for s in owd if s.attributes["probe.src.node"] == "a"} == {"true"}
    assert {s.attributes["probe.clock.corrected"] for s in owd if s.attributes["probe.src.node"] == "b"} == {"false"}
    assert {s.attributes["probe.timestamp.kind"] for s in owd} == {"kernel"}
    assert all(s.value == 0 for s in by_name(emitted, "ridethrough.probe.loss.ratio"))
    assert all(s.value == 0 for s in by_name(emitted, "ridethrough.probe.lost"))
    assert all(0 <= s.value <= 1 for s in by_name(emitted, "ridethrough.probe.pure.ratio"))
    paths = {tuple(s.attributes[k] for k in ("probe.src.node", "probe.src.nic", "probe.dst.node", "probe.dst.nic"))
             for s in by_name(emitted, "ridethrough.probe.sent")}
    assert paths == {("a", "nic0", "b", "nic0"), ("a", "nic1", "b", "nic1"), ("b", "nic0", "a", "nic0"),
                     ("b", "nic1", "a", "nic1")}
    answered = {s.attributes["probe.dst.nic"]: s.value for s in a.collect(0)
                if s.name == "ridethrough.probe.answered"}
    assert answered["nic0"] > 0 and answered["nic1"] > 0


def test_a_peers_file_that_comes_later_starts_probing_and_changes_are_followed(tmp_path: Path) -> None:
    peers = tmp_path / "peers.json"
    source = ProbeSource(node="a", peers_file=peers, port=0, settings=FAST)
    source.start(emit=_noop)
    try:
        assert source.addresses == {} and by_name(source.collect(0), "ridethrough.probe.sent") == []
        peers.write_text(json.dumps({"a": {"nic0": "127.0.0.45:0"}}))
        source.collect(0)
        assert set(source.addresses) == {"nic0"}
        peers.write_text(json.dumps({"a": {"nic0": "127.0.0.45:0"}, "b": {"nic0": "127.0.0.46:9"}}))
        wait_for(lambda: by_name(source.collect(0), "ridethrough.probe.sent"), timeout_s=5, what="a path to b")
        peers.write_text("{not json")
        assert by_name(source.collect(0), "ridethrough.probe.sent")  # a broken file keeps the table we have
    finally:
        source.stop(timeout_s=2.0)


def test_from_config_reads_probe_fields_with_defaults() -> None:
    source = from_config(AgentConfig(node_id="h3"))
    assert source.node == "h3" and source.interval_s == 1.0
    assert source.settings == ProberSettings()  # the defaults until the config has probe fields
    cfg = types.SimpleNamespace(node_id="h4", clock_script="", interval_s=2.0, probe_k=3, probe_interval_s=0.25,
                                probe_pair_gap_us=30.0, probe_pinned=("h1",), probe_bind={"nic0": "10.64.0.1"},
                                probe_port=9000, probe_peers_file="/nonexistent")
    source = from_config(cfg)  # type: ignore[arg-type]
    assert (source.settings.k, source.settings.interval_s, source.settings.pair_gap_ns) == (3, 0.25, 30_000)
    assert source.settings.pinned == ("h1",) and source.local == {"nic0": "10.64.0.1"} and source.port == 9000
