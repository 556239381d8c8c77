"""The catalogue is a contract: sources emit what it lists, and it lists only what they emit."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ridethrough.catalogue import MetricSpec, metric, metrics, metrics_of
from ridethrough.collector.sample import MetricKind, Sample, Source
from ridethrough.collector.sources import InfinibandSource, NetdevSource

FIXTURES = Path(__file__).parent / "fixtures" / "sysfs"
TREES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())
SOURCE_NAMES = ("netdev", "infiniband")


def sources_for(tree: str) -> list[Source]:
    root = FIXTURES / tree
    # exclude=() so that lo is read too: every interface a host can have must fit the catalogue.
    return [NetdevSource(sysfs_root=root, exclude=()), InfinibandSource(sysfs_root=root)]


def emitted() -> Iterator[tuple[str, str, Sample]]:
    """(tree, source name, sample) for every sample of every source over every fixture tree."""
    for tree in TREES:
        for source in sources_for(tree):
            for sample in source.collect(0):
                yield tree, source.name, sample


def test_there_are_fixture_trees() -> None:
    assert {"virtio_vm", "ib_host", "roce_host", "broken"} <= set(TREES)


def test_names_are_unique_and_rows_are_well_formed() -> None:
    names = [spec.name for spec in metrics()]
    assert len(names) == len(set(names))
    for spec in metrics():
        assert isinstance(spec.kind, MetricKind)
        assert spec.unit, spec.name
        assert spec.description, spec.name
        assert len(spec.attributes) == len(set(spec.attributes)), spec.name
        assert len(spec.equivalents) == len(set(spec.equivalents)), spec.name


def test_lookup_by_name() -> None:
    spec = metric("system.network.io")
    assert spec == MetricSpec(
        name="system.network.io",
        unit="By",
        kind=MetricKind.COUNTER,
        attributes=("network.interface.name", "network.io.direction"),
        description=spec.description,
        source="netdev",
        equivalents=("node_network_receive_bytes_total", "node_network_transmit_bytes_total"),
    )
    assert "node_infiniband_symbol_error_total" in metric("ridethrough.ib.port.errors").equivalents
    assert "node_infiniband_port_data_received_bytes_total" in metric("ridethrough.ib.port.io").equivalents


def test_unknown_name_raises_key_error_naming_close_matches() -> None:
    with pytest.raises(KeyError) as typo:
        metric("system.network.iops")
    assert "'system.network.iops' is not in the catalogue" in str(typo.value)
    assert "did you mean 'system.network.io'" in str(typo.value)
    with pytest.raises(KeyError) as nonsense:
        metric("zzz")
    assert "did you mean" not in str(nonsense.value)


def test_sources_emit_only_catalogued_metrics_exactly_as_catalogued() -> None:
    for tree, source_name, sample in emitted():
        where = f"{sample.name} from {source_name} on {tree}"
        spec = metric(sample.name)
        assert spec.source == source_name, where
        assert sample.unit == spec.unit, where
        assert sample.kind is spec.kind, where
        assert sorted(sample.attributes) == sorted(spec.attributes), where
        assert all(isinstance(v, str) and v for v in sample.attributes.values()), where


@pytest.mark.parametrize("source_name", SOURCE_NAMES)
def test_every_catalogued_metric_is_emitted_by_some_fixture(source_name: str) -> None:
    seen = {sample.name for _, name, sample in emitted() if name == source_name}
    catalogued = {spec.name for spec in metrics_of(source_name)}
    assert catalogued, source_name
    assert catalogued - seen == set()


def test_agent_self_metrics_match_the_catalogue_both_ways() -> None:
    from ridethrough.collector.agent import SELF_METRICS

    assert {name for name, _, _ in SELF_METRICS} == {m.name for m in metrics_of("agent")}
    for name, kind, unit in SELF_METRICS:
        assert (metric(name).kind, metric(name).unit) == (kind, unit)
