"""The agent keeps running whatever its sources and its gateway do."""

from __future__ import annotations

import itertools
import logging
import socket
import statistics
import time
from collections.abc import Iterable
from pathlib import Path

import clickhouse_connect
import pytest
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.sdk.metrics.export import MetricExportResult, MetricsData

from ridethrough.collector.agent import Agent
from ridethrough.collector.export import BufferingMetricExporter
from ridethrough.collector.identity import AgentIdentity
from ridethrough.collector.sample import MetricKind, Sample
from ridethrough.collector.snapshot import Snapshot
from tests.conftest import FIXTURES, read_ready, wait_for


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Exploding:
    name = "exploding"
    interval_s = 0.05

    def collect(self, now_ns: int) -> Iterable[Sample]:
        raise OSError("device vanished")


class Steady:
    name = "steady"
    interval_s = 0.05

    def __init__(self) -> None:
        self.calls = 0

    def collect(self, now_ns: int) -> Iterable[Sample]:
        self.calls += 1
        return [Sample("test.value", float(self.calls), MetricKind.GAUGE, "1", {"k": "v"})]


def test_a_failing_source_is_counted_and_skipped_while_others_run() -> None:
    steady = Steady()
    agent = Agent(identity=AgentIdentity(node_id="n", host_name="h", cluster="c"),
                  sources=[Exploding(), steady], gateway=f"127.0.0.1:{_free_port()}",
                  export_interval_s=60, export_timeout_s=0.2)
    agent.start()
    try:
        wait_for(lambda: agent.source_errors["exploding"] >= 3 and steady.calls >= 3, timeout_s=10,
                 what="ticks with one failing source")
    finally:
        agent.stop(timeout_s=2)


def test_buffer_is_bounded_and_counts_what_it_drops() -> None:
    inner = OTLPMetricExporter(endpoint=f"127.0.0.1:{_free_port()}", insecure=True, timeout=0.3)
    exporter = BufferingMetricExporter(inner, max_batches=2)
    empty = MetricsData(resource_metrics=[])
    results = [exporter.export(empty, timeout_millis=300) for _ in range(5)]
    assert results == [MetricExportResult.FAILURE] * 5
    assert exporter.buffered_batches == 2 and exporter.dropped_batches == 3
    exporter.shutdown()


@pytest.mark.integration
def test_agent_started_before_its_gateway_delivers_what_it_buffered(spawn, tmp_path: Path) -> None:
    port = _free_port()
    agent = spawn("agent", "--gateway", f"127.0.0.1:{port}", "--sysfs-root", str(FIXTURES / "sysfs" / "ib_host"),
                  "--interval", "0.2", "--export-interval", "0.5", "--node-id", "early", name="agent",
                  env={"RIDETHROUGH_AGENT_EXPORT_TIMEOUT_S": "1"})
    # the agent runs with no gateway for a few exports (however long it takes to start on a busy machine)
    wait_for(lambda: "3 export(s) buffered" in agent.output(), timeout_s=60, what="exports buffered")
    assert agent.alive()
    gateway_started_ns = time.time_ns()
    ready = tmp_path / "ready.json"
    server = spawn("server", "--store", f"chdb://{tmp_path}/store", "--spool", str(tmp_path / "spool"),
                   "--otlp-listen", f"127.0.0.1:{port}", "--store-http-listen", "127.0.0.1:0",
                   "--ready-file", str(ready), name="server")
    host, http_port = read_ready(ready, server)["store_http"].removeprefix("http://").rsplit(":", 1)
    db = clickhouse_connect.get_client(host=host, port=int(http_port))
    earliest = wait_for(lambda: db.query(
        "SELECT toUnixTimestamp64Nano(min(TimeUnix)) FROM otel_metrics_sum "
        "WHERE ResourceAttributes['ridethrough.node.id'] = 'early'").result_rows[0][0], timeout_s=60,
        what="buffered rows")
    assert earliest < gateway_started_ns - 1_000_000_000, "points from before the gateway existed arrived"
    assert agent.alive()


def _series(n: int, name: str = "m", start: int = 0) -> list[Sample]:
    return [Sample(name, float(i), MetricKind.GAUGE, "1", {"i": str(i)}) for i in range(start, start + n)]


def test_snapshot_caps_series_keeps_held_ones_updating_and_counts_refusals(caplog) -> None:
    snap = Snapshot(max_series=5)
    snap.replace("a", _series(3))
    with caplog.at_level(logging.WARNING, logger="ridethrough.collector.agent"):
        snap.replace("b", _series(4, "n"))
        snap.replace("b", _series(4, "n"))
    assert len(snap.samples()) == 5 and snap.dropped == {"b": 4}, "2 of b's 4 refused, on both ticks"
    assert sum("series limit (5) reached" in r.message for r in caplog.records) == 1, "warned once"
    # a's new series wait for room; the ones it holds keep updating
    snap.replace("a", [*_series(1, start=7), *(Sample(s.name, s.value + 100, s.kind, s.unit, s.attributes)
                                               for s in _series(3))])
    assert sorted(s.value for s in snap.samples() if s.name == "m") == [100, 101, 102]
    assert snap.dropped == {"a": 1, "b": 4}
    snap.replace("b", [])  # b's series are gone: their room is free again
    snap.replace("a", _series(6))
    assert len([s for s in snap.samples() if s.name == "m"]) == 5 and snap.dropped["a"] == 2


def test_agent_counts_dropped_series_in_its_self_metrics() -> None:
    class Wide:
        name = "wide"
        interval_s = 0.05

        def collect(self, now_ns: int) -> Iterable[Sample]:
            return _series(10)

    agent = Agent(identity=AgentIdentity(node_id="n", host_name="h", cluster="c"), sources=[Wide()],
                  gateway=f"127.0.0.1:{_free_port()}", export_interval_s=60, export_timeout_s=0.2, max_series=4)
    agent.start()
    try:
        def dropped() -> float:
            return sum(s.value for s in agent.self_samples() if s.name == "ridethrough.agent.series.dropped")
        wait_for(lambda: dropped() >= 12, timeout_s=10, what="series drops counted")
        assert len([s for s in agent.samples() if s.name == "m"]) == 4
    finally:
        agent.stop(timeout_s=2)


class Timed:
    """A source that notes when it is read."""

    name = "timed"

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.read_at: list[float] = []

    def collect(self, now_ns: int) -> Iterable[Sample]:
        self.read_at.append(time.monotonic())
        return [Sample("test.value", 1.0, MetricKind.GAUGE, "1", {"k": "v"})]


def test_exports_follow_collection_rounds_once_per_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    """Readings leave right after they are read (not up to an export interval later), and no more often."""
    source = Timed(interval_s=0.4)
    agent = Agent(identity=AgentIdentity(node_id="n", host_name="h", cluster="c"), sources=[source],
                  gateway=f"127.0.0.1:{_free_port()}", export_interval_s=0.4, export_timeout_s=0.2)
    exported_at: list[float] = []
    monkeypatch.setattr(agent, "export", lambda: exported_at.append(time.monotonic()) or True)
    agent.start()
    try:
        wait_for(lambda: len(exported_at) >= 8, timeout_s=30, what="eight exports")
    finally:
        agent.stop(timeout_s=2)
    lags = [e - max(r for r in source.read_at if r <= e) for e in exported_at[:8] if e >= source.read_at[0]]
    assert statistics.median(lags) < 0.1, lags  # scheduled independently, the median would be ~0.2 s
    gaps = [b - a for a, b in itertools.pairwise(exported_at[:8])]
    assert min(gaps) >= 0.9 * 0.4 - 0.02, gaps  # no more often than about once an interval


def test_an_agent_with_a_key_file_serves_signed_route_and_job_commands(tmp_path: Path, caplog) -> None:
    from ridethrough import wiring
    from ridethrough.actuators.command_auth import KeyRing
    from ridethrough.actuators.control_client import ControlCallError, ControlClient
    from ridethrough.settings import AgentConfig

    secret = "ab" * 32
    keys = tmp_path / "keys"
    keys.write_text(f"k1={secret}\n")
    cfg = AgentConfig(gateway=f"127.0.0.1:{_free_port()}", node_id="n1", sources=(), control_listen="127.0.0.1:0",
                      control_keys_file=str(keys), job_run_dir=str(tmp_path / "run"))
    agent = wiring.build_agent(cfg)
    agent.start()
    try:
        target = agent.addresses["control"]
        with ControlClient(keys=KeyRing({"k1": bytes.fromhex(secret)}), key_id="k1") as client:
            pong = client.call(target=target, node="n1", command="ping", key="p1")
            status = client.call(target=target, node="n1", command="job.status", key="j1", args={"gpu": 0})
            with pytest.raises(ControlCallError) as wrong:
                ControlClient(keys=KeyRing({"k1": b"\x01" * 32}), key_id="k1").call(
                    target=target, node="n1", command="ping", key="p2")
    finally:
        agent.stop(timeout_s=2)
    assert pong.ok and pong.data["node"] == "n1"
    assert not status.ok and status.command == "job.status", "no launcher in the run dir: said, not raised"
    assert wrong.value.reason == "bad_signature"
    assert secret not in caplog.text


def test_an_agent_without_a_key_file_runs_no_control_plane_and_a_bad_one_stops_the_start(tmp_path: Path) -> None:
    from ridethrough import wiring
    from ridethrough.settings import AgentConfig

    plain = wiring.build_agent(AgentConfig(gateway="127.0.0.1:4317", node_id="n1", sources=()))
    assert plain._services == {}
    bad = tmp_path / "keys"
    bad.write_text("k1=" + "cd" * 8 + "\n")  # too short a key
    with pytest.raises(ValueError, match="at least 32") as err:
        wiring.build_agent(AgentConfig(gateway="127.0.0.1:4317", node_id="n1", sources=(),
                                       control_listen="127.0.0.1:0", control_keys_file=str(bad)))
    assert "cd" * 8 not in str(err.value)
    with pytest.raises(ValueError, match="cannot read control keys"):
        wiring.build_agent(AgentConfig(gateway="127.0.0.1:4317", node_id="n1", sources=(),
                                       control_listen="127.0.0.1:0", control_keys_file=str(tmp_path / "none")))


def test_a_link_change_is_read_and_exported_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """`collect_now` (the link watch's call) reads the named sources and exports them, intervals notwithstanding."""
    links, other = Timed(interval_s=60.0), Timed(interval_s=60.0)
    other.name = "other"
    agent = Agent(identity=AgentIdentity(node_id="n", host_name="h", cluster="c"), sources=[links, other],
                  gateway=f"127.0.0.1:{_free_port()}", export_interval_s=60.0, export_timeout_s=0.2,
                  on_link_change=["timed", "absent"])
    exported_at: list[float] = []
    monkeypatch.setattr(agent, "export", lambda: exported_at.append(time.monotonic()) or True)
    agent.start()
    try:
        wait_for(lambda: links.read_at and other.read_at, timeout_s=10, what="the first round")
        time.sleep(0.3)
        assert not exported_at, "the first round waits for its interval"
        agent.collect_now(["timed"])
        wait_for(lambda: exported_at, timeout_s=10, what="an export right after the link change")
    finally:
        agent.stop(timeout_s=2)
    assert len(links.read_at) == 2 and links.read_at[1] <= exported_at[0], "read again, then exported"
    assert len(other.read_at) == 1, "a source not named waits for its interval"
