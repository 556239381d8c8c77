"""End to end: the shipped rules in a real Prometheus, a real Alertmanager, the local PagerDuty server.

The test serves a tiny exposition (what an agent would: ``target_info`` with its host and one
NIC's ``ridethrough_nic_up_ratio``), Prometheus scrapes it and evaluates rules/ridethrough.rules.yml,
and Alertmanager's ``pagerduty_configs`` posts to `tests.pagerduty_server.PagerDutyServer`,
which holds every event to the Events API v2 contract. The NIC goes down: a ``LinkDown``
trigger must arrive with the alert's labels; it comes back: the same alert must resolve.

The rules are copied with one change: ``LinkDown``'s ``for: 30s`` becomes ``1s``. The hold-down
keeps a bounce that the agent's reflex rides through from paging anyone; what is tested here is
the path from rule to page, and promtool's unit tests (tests/test_prom_rules.py) already hold
``for:`` to its value. Everything else in the file is evaluated as shipped.
"""

from __future__ import annotations

import json
import socket
import subprocess
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, Gauge, Info, start_http_server

from tests.conftest import ROOT, wait_for
from tests.pagerduty_server import PagerDutyServer

PROMETHEUS = Path("/usr/bin/prometheus")
ALERTMANAGER = Path("/usr/bin/prometheus-alertmanager")
RULES = ROOT / "rules" / "ridethrough.rules.yml"
ROUTING_KEY = "e2e0alertmanager0routing0key0001"
HOST, NIC = "e2e-host", "eth0"

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _need(binary: Path, package: str) -> None:
    if not binary.exists():
        pytest.skip(f"{binary} is missing: install the Debian package {package} (`make test` does)")


def _rules_with_short_for(path: Path, *, alert: str, hold: str) -> Path:
    doc = yaml.safe_load(RULES.read_text())
    rules = [r for g in doc["groups"] for r in g["rules"] if r.get("alert") == alert]
    assert len(rules) == 1, f"the shipped rules have no single {alert} alert"
    rules[0]["for"] = hold
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _alertmanager_config(server: PagerDutyServer) -> dict[str, Any]:
    labels = "{{ .CommonLabels.%s }}"
    return {
        "route": {"receiver": "pagerduty", "group_by": ["alertname", "host", "device"],
                  "group_wait": "1s", "group_interval": "1s", "repeat_interval": "1h"},
        "receivers": [{"name": "pagerduty", "pagerduty_configs": [{
            "routing_key": ROUTING_KEY, "url": server.events_url, "send_resolved": True,
            "severity": labels % "severity", "class": labels % "alertname", "component": labels % "device",
            "group": labels % "job", "client": "alertmanager-e2e",
            "details": {"alertname": labels % "alertname", "host": labels % "host", "device": labels % "device"},
        }]}],
    }


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[[str, list[str]], str]]:
    """``start(name, argv)`` runs a binary with its output in ``tmp_path/NAME.log``; stopped at the end."""
    procs: list[subprocess.Popen[bytes]] = []

    def run(name: str, argv: list[str]) -> str:
        log = tmp_path / f"{name}.log"
        with open(log, "wb") as out:
            procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT))
        return str(log)

    yield run
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def _link_down_events(server: PagerDutyServer, action: str) -> list[dict[str, Any]]:
    return [e for e in server.accepted if e["event_action"] == action
            and e.get("payload", {}).get("class") == "LinkDown"]


def test_a_shipped_alert_pages_through_a_real_alertmanager_and_resolves(tmp_path: Path, start) -> None:
    _need(PROMETHEUS, "prometheus")
    _need(ALERTMANAGER, "prometheus-alertmanager")
    registry = CollectorRegistry()
    Info("target", "The agent's resource", registry=registry).info({"host_name": HOST})
    nic_up = Gauge("ridethrough_nic_up_ratio", "1 while the NIC is up", ["network_interface_name"],
                   registry=registry)
    nic_up.labels(network_interface_name=NIC).set(0)
    exposition, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
    with PagerDutyServer(routing_keys={ROUTING_KEY}) as server:
        try:
            am_port, prom_port = _free_port(), _free_port()
            am_config = tmp_path / "alertmanager.yml"
            am_config.write_text(json.dumps(_alertmanager_config(server)))  # JSON is YAML
            am_log = start("alertmanager", [
                str(ALERTMANAGER), f"--config.file={am_config}", f"--storage.path={tmp_path / 'am'}",
                f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address=", "--log.level=debug"])
            wait_for(lambda: _ready(f"http://127.0.0.1:{am_port}/-/ready"), timeout_s=60,
                     what=f"Alertmanager ready (log: {am_log})")
            rules = _rules_with_short_for(tmp_path / "rules.yml", alert="LinkDown", hold="1s")
            prom_config = tmp_path / "prometheus.yml"
            prom_config.write_text(json.dumps({
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(rules)],
                "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
                "scrape_configs": [{"job_name": "ridethrough-agent", "static_configs": [
                    {"targets": [f"127.0.0.1:{exposition.server_port}"]}]}],
            }))
            prom_log = start("prometheus", [
                str(PROMETHEUS), f"--config.file={prom_config}", f"--web.listen-address=127.0.0.1:{prom_port}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}"])

            [trigger] = wait_for(lambda: _link_down_events(server, "trigger")[:1], timeout_s=120,
                                 what=f"a LinkDown trigger (logs: {prom_log}, {am_log})")
            payload = trigger["payload"]
            assert trigger["routing_key"] == ROUTING_KEY and len(trigger["dedup_key"]) <= 255
            assert (payload["severity"], payload["class"], payload["component"], payload["group"]) == (
                "critical", "LinkDown", NIC, "ridethrough-agent")
            assert "LinkDown" in payload["summary"]
            details = payload["custom_details"]
            assert (details["alertname"], details["host"], details["device"]) == ("LinkDown", HOST, NIC)
            for label in ("alertname = LinkDown", f"host = {HOST}", f"device = {NIC}", "severity = critical"):
                assert label in details["firing"], details["firing"]

            nic_up.labels(network_interface_name=NIC).set(1)
            [resolve] = wait_for(lambda: _link_down_events(server, "resolve")[:1], timeout_s=120,
                                 what=f"the LinkDown resolve (logs: {prom_log}, {am_log})")
            assert resolve["dedup_key"] == trigger["dedup_key"] and resolve["routing_key"] == ROUTING_KEY
            [alert] = [a for a in server.alerts if a.dedup_key == trigger["dedup_key"]]
            assert alert.state == "resolved"
            assert server.rejected == []  # every event Alertmanager sent honours the documented contract
        finally:
            exposition.shutdown()
            exposition.server_close()
