"""Prometheus exposition: OTel → Prometheus names, the collector, and a real Prometheus scraping the agent."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ridethrough.collector.agent import Agent
from ridethrough.collector.identity import AgentIdentity
from ridethrough.collector.prometheus import SnapshotCollector, label_name, labels_of, prometheus_name
from ridethrough.collector.sample import MetricKind, Sample
from tests.conftest import FIXTURES, read_ready, wait_for

PROMETHEUS = Path("/usr/bin/prometheus")
C, G = MetricKind.COUNTER, MetricKind.GAUGE
TX = {"network.io.direction": "transmit"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(("name", "unit", "kind", "expected"), [
    ("system.network.io", "By", C, "system_network_io_bytes_total"),
    ("system.network.packet.count", "{packet}", C, "system_network_packet_count_total"),
    ("ridethrough.ib.port.rate", "Gbit/s", G, "ridethrough_ib_port_rate_Gbit_per_second"),
    ("ridethrough.nic.speed", "Mbit/s", G, "ridethrough_nic_speed_Mbit_per_second"),
    ("system.cpu.utilization", "1", G, "system_cpu_utilization_ratio"),
    ("ridethrough.ib.port.hw_counter", "1", C, "ridethrough_ib_port_hw_counter_total"),
    ("process.cpu.time", "s", C, "process_cpu_time_seconds_total"),
    ("gpu.temperature", "Cel", G, "gpu_temperature_celsius"),
    ("gpu.power", "W", G, "gpu_power_watts"),
    ("queue.wait_seconds", "s", G, "queue_wait_seconds"),
    ("requests_total", "{request}", C, "requests_total"),
    ("rate", "By/s", G, "rate_bytes_per_second"),
    ("per.thing", "{x}/s", G, "per_thing_per_second"),
    ("odd..name-with spaces", "", G, "odd_name_with_spaces"),
    ("9lives", "", G, "_9lives"),
    ("utilisation", "%", G, "utilisation_percent"),
])
def test_names_follow_the_otel_to_prometheus_conventions(name: str, unit: str, kind: MetricKind,
                                                         expected: str) -> None:
    assert prometheus_name(name, unit, kind) == expected


def test_label_names_are_sanitised_and_colliding_values_joined_in_key_order() -> None:
    assert label_name("network.io.direction") == "network_io_direction"
    assert label_name("ib..device") == "ib_device"
    assert label_name("0day") == "key_0day"
    assert labels_of({"a_b": "2", "a.b": "1", "c": "3"}) == {"a_b": "1;2", "c": "3"}


def _scrape(collector: SnapshotCollector) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {f.name: [(s.name, s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(text)}


def test_collector_converts_samples_and_adds_scope_and_target_info() -> None:
    samples = [
        Sample("system.network.io", 10, C, "By", {"network.interface.name": "eth0", "network.io.direction": "receive"}),
        Sample("system.network.io", 20, C, "By", {"network.interface.name": "eth0", **TX}),
        Sample("system.network.io", 99, C, "By", {"network.interface.name": "eth0", **TX}),
        Sample("ridethrough.nic.mtu", 9000, G, "By", {"network.interface.name": "eth0"}),
        Sample("odd", 1, G, "", {"a": "x"}),
        Sample("odd", 2, G, "", {"b": "y"}),
    ]
    collector = SnapshotCollector(read=lambda: samples, scope="ridethrough.collector",
                                  resource={"host.name": "h1", "ridethrough.node.id": "n1"},
                                  descriptions={"system.network.io": "Bytes."})
    families = _scrape(collector)
    io = families["system_network_io_bytes"]
    scope = {"otel_scope_name": "ridethrough.collector"}
    assert io == [  # the duplicate series is served once, first value kept
        ("system_network_io_bytes_total", {**scope, "network_interface_name": "eth0",
                                           "network_io_direction": "receive"}, 10.0),
        ("system_network_io_bytes_total", {**scope, "network_interface_name": "eth0",
                                           "network_io_direction": "transmit"}, 20.0),
    ]
    assert families["ridethrough_nic_mtu_bytes"][0][2] == 9000
    assert sorted((s[1].get("a", ""), s[1].get("b", "")) for s in families["odd"]) == [("", "y"), ("x", "")]
    assert families["target_info"] == [("target_info", {"host_name": "h1", "ridethrough_node_id": "n1"}, 1.0)]
    registry = CollectorRegistry()
    registry.register(collector)
    assert "# HELP system_network_io_bytes_total Bytes." in generate_latest(registry).decode()


def test_names_that_clash_in_prometheus_are_served_once() -> None:
    samples = [Sample("a.b", 1, G), Sample("a_b", 2, G)]
    families = _scrape(SnapshotCollector(read=lambda: samples, scope="s", resource={}))
    assert families["a_b"] == [("a_b", {"otel_scope_name": "s"}, 1.0)]


class Fixed:
    name = "fixed"
    interval_s = 0.05

    def collect(self, now_ns: int) -> list[Sample]:
        return [Sample("test.bytes", 42, C, "By", {"k": "v"})]


def test_agent_serves_its_snapshot_and_self_metrics_at_metrics() -> None:
    agent = Agent(identity=AgentIdentity(node_id="n-9", host_name="h", cluster="c"), sources=[Fixed()],
                  gateway=f"127.0.0.1:{_free_port()}", export_interval_s=60, export_timeout_s=0.2,
                  prometheus_listen="127.0.0.1:0")
    agent.start()
    try:
        url = f"http://{agent.addresses['prometheus']}/metrics"

        def scraped() -> str | None:
            text = urllib.request.urlopen(url, timeout=5).read().decode()
            return text if "test_bytes_total{" in text else None
        text = wait_for(scraped, timeout_s=10, what="the source's sample at /metrics")
    finally:
        agent.stop(timeout_s=2)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["test_bytes"].samples[0].value == 42
    assert families["ridethrough_agent_series_dropped"].samples[0].labels["source"] == "fixed"
    assert families["target_info"].samples[0].labels["ridethrough_node_id"] == "n-9"
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=2)


# --- a real Prometheus scraping a real agent ---------------------------------------------------


def _need_prometheus() -> None:
    if PROMETHEUS.exists():
        return
    why = f"{PROMETHEUS} is missing (Debian package prometheus; `make test` installs it)"
    if os.geteuid() == 0 or os.environ.get("CI"):
        pytest.fail(why)  # CI runs `make test` as root, which installs it: missing there is a bug
    pytest.skip(f"{why}; not root, so it cannot be installed here: sudo apt-get install prometheus")


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[[str], str]]:
    """``start(target)`` runs a Prometheus scraping ``target`` every second; returns its base URL."""
    _need_prometheus()
    procs: list[subprocess.Popen[bytes]] = []

    def start(target: str) -> str:
        port = _free_port()
        config = tmp_path / "prometheus.yml"
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "ridethrough-agent", "scrape_interval": "1s",
                                "static_configs": [{"targets": [target]}]}],
        }))
        log_path = tmp_path / "prometheus.log"
        with open(log_path, "wb") as out:
            procs.append(subprocess.Popen(
                [str(PROMETHEUS), f"--config.file={config}", f"--web.listen-address=127.0.0.1:{port}",
                 f"--storage.tsdb.path={tmp_path / 'tsdb'}"], stdout=out, stderr=subprocess.STDOUT))
        return f"http://127.0.0.1:{port}"

    yield start
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _query(base: str, promql: str) -> list[dict[str, Any]]:
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    try:
        body = json.loads(urllib.request.urlopen(url, timeout=5).read())
    except OSError:
        return []  # not up yet
    return list(body["data"]["result"]) if body.get("status") == "success" else []


@pytest.mark.integration
def test_a_real_prometheus_scrapes_the_agent(spawn, prometheus, tmp_path: Path) -> None:
    root = FIXTURES / "sysfs" / "ib_host"
    ready = tmp_path / "agent.json"
    agent = spawn("agent", "--gateway", f"127.0.0.1:{_free_port()}", "--sysfs-root", str(root),
                  "--node-id", "prom-node-1", "--interval", "0.5", "--prometheus-listen", "127.0.0.1:0",
                  "--ready-file", str(ready), name="agent")
    target = read_ready(ready, agent)["prometheus"]
    base = prometheus(target)
    rx_bytes = float((root / "class" / "net" / "eth0" / "statistics" / "rx_bytes").read_text())

    up = wait_for(lambda: [r for r in _query(base, 'up{job="ridethrough-agent"}') if r["value"][1] == "1"],
                  timeout_s=60, what="Prometheus scraping the agent (up == 1)")
    assert up
    query = 'system_network_io_bytes_total{network_interface_name="eth0",network_io_direction="receive"}'
    result = wait_for(lambda: _query(base, query), timeout_s=30, what=query)
    assert float(result[0]["value"][1]) == rx_bytes
    info = wait_for(lambda: _query(base, 'target_info{ridethrough_node_id="prom-node-1"}'), timeout_s=30,
                    what="target_info with the node id")
    assert info[0]["metric"]["service_name"] == "ridethrough-agent"
    assert agent.alive()
