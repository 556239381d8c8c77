"""Audits in the dashboard: recorded both ways (the ``audits`` table, and an OTLP log record through a real
gateway), listed, opened, and their HTML report served; in Debian chromium driven by Playwright.

The audits are real: `ridethrough.audit.Audit` runs on a simulated fabric (`tests.test_audit.SimFabric`) and
crafted agent telemetry, one with faults (a rate-capped link, a NIC down, a GPU with a pending row remap)
and one healthy. Screenshots go to tests/artifacts/.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ridethrough.audit import Audit, AuditConfig, store_query
from ridethrough.audit_cli import app as audit_app
from ridethrough.audit_events import RecordError, logs_request, result_from_json, send_audit
from ridethrough.audit_model import AuditResult, Expected, Status
from ridethrough.audit_report import SECTIONS, render_html
from ridethrough.audit_store import write_audit
from ridethrough.dashboards import queries_audits
from ridethrough.dashboards.app import RENDERED_JS
from ridethrough.dashboards.config import DashboardConfig
from ridethrough.dashboards.pages_common import Context
from ridethrough.dashboards.serve import DashServer, wsgi_app
from ridethrough.exporters.store import Store
from ridethrough.lab.topology import Topology, TopologySpec
from tests.browser_netns import BrowserNetns
from tests.conftest import ROOT, read_ready
from tests.test_audit import SimFabric, _telemetry

pytestmark = [pytest.mark.integration, pytest.mark.slow]
CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = ROOT / "tests" / "artifacts"
TIMEOUT_MS = 90_000
TOPO = Topology(TopologySpec(hosts=4, racks=2, rails=1, spines=1, gpus=2))
EXPECTED = Expected.from_topology(TOPO, rails=1, gpus=2)


def _run(store: Store, cluster: str, *, faults: bool) -> AuditResult:
    """A real audit of the simulated 4-host fabric against crafted telemetry in ``store``."""
    _telemetry(store, cluster, EXPECTED, remap_pending={"h3/gpu1"} if faults else set(),
               nic_down={"h1/nic0"} if faults else set())
    sim = SimFabric(TOPO, caps_mbit={"leaf1r0-spine0": 20.0} if faults else {})
    cfg = AuditConfig(budget_s=60, cluster=cluster, errors_pad_s=0.2, fresh_timeout_s=3, load_s=0.5)
    return Audit(EXPECTED, store_query(store), driver=sim, config=cfg).run()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[AuditResult, AuditResult]]:
    st = Store(f"chdb://{tmp_path_factory.mktemp('audit_runs') / 'store'}")
    st.init_schema()
    bad, good = _run(st, "rack-a", faults=True), _run(st, "rack-b", faults=False)
    st.close()
    # the healthy one is partial: crafted telemetry carries no driver versions to compare
    assert bad.status is Status.FAIL and good.status is Status.PARTIAL and not good.anomalies, good.dumps()
    yield bad, good


def test_a_result_read_back_from_its_json_renders_the_same_report(results: tuple[AuditResult, AuditResult]) -> None:
    for r in results:
        back = result_from_json(json.loads(r.dumps()))
        assert back == r and render_html(back) == render_html(r)
    with pytest.raises(ValueError, match="not an audit result"):
        result_from_json({"audit_id": "x"})


def test_an_audit_sent_to_a_real_gateway_is_listed_with_its_report(results: tuple[AuditResult, AuditResult],
                                                                    spawn: Any, tmp_path: Path) -> None:
    bad, good = results
    ready = tmp_path / "ready.json"
    server = spawn("server", "--store", f"chdb://{tmp_path / 'store'}", "--spool", str(tmp_path / "spool"),
                   "--otlp-listen", "127.0.0.1:0", "--store-http-listen", "127.0.0.1:0", "--ready-file", str(ready),
                   env={"RIDETHROUGH_CONTROLLER_ENABLED": "false"}, name="server")
    addresses = read_ready(ready, server, timeout_s=120)
    send_audit(addresses["otlp"], bad)
    send_audit(addresses["otlp"], bad)  # a retry: the dashboard still lists it once
    reader = Store(addresses["store_http"], timeout_s=30)
    (listed,) = queries_audits.audits(reader)
    assert (listed.audit_id, listed.status, listed.cluster) == (bad.audit_id, "fail", "rack-a")
    assert (listed.hosts, listed.hosts_failed, listed.anomalies) == (4, 2, 3)  # h1 (a NIC), h3 (a GPU); a spine link
    assert queries_audits.audits(reader, cluster="rack-b") == []
    stored = queries_audits.audit(reader, bad.audit_id)
    assert stored is not None and stored.result == json.loads(bad.dumps())
    assert stored.report_html == render_html(bad)
    assert queries_audits.audit(reader, good.audit_id) is None
    with pytest.raises(RecordError, match="did not store"):
        send_audit("127.0.0.1:9", good, timeout_s=2)
    # the command line records through the gateway too (a store it can only read, a gateway that writes it)
    inventory = tmp_path / "fleet.json"
    inventory.write_text(json.dumps({"mtu": 1500, "hosts": {"n1": {"nics": {"eth0": "n1-sw"}}}}))
    run = CliRunner().invoke(audit_app, ["--inventory", str(inventory), "--store", addresses["store_http"],
                                         "--record-gateway", addresses["otlp"], "--budget", "3s",
                                         "--out", str(tmp_path / "out")])
    assert run.exit_code == 3, run.output  # partial: n1 has no agent
    assert "recorded through the gateway" in run.output
    assert [a.status for a in queries_audits.audits(reader)] == ["partial", "fail"]  # newest first


# -- in the browser ---------------------------------------------------------------------------------------


def _sync_api() -> Any:
    api = pytest.importorskip("playwright.sync_api", reason="Playwright for Python is not installed")
    if not CHROMIUM.exists():
        pytest.skip(f"Debian chromium is not installed at {CHROMIUM}")
    return api


@pytest.fixture(scope="module")
def dashboard(results: tuple[AuditResult, AuditResult],
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A dashboard over a store holding the failed audit in the ``audits`` table and the healthy one as the
    gateway stores an audit record (its own conversion and write path)."""
    from ridethrough.exporters.gateway_metrics import GatewayMetrics
    from ridethrough.exporters.pipeline import write_requests
    from ridethrough.exporters.rows import strict
    from ridethrough.exporters.signals import Signal

    _sync_api()
    bad, good = results
    st = Store(f"chdb://{tmp_path_factory.mktemp('audit_dashboard') / 'store'}")
    st.init_schema()
    write_audit(st, bad, render_html(bad))
    write_requests(st, [(Signal.LOGS, logs_request(good))], token="audit-event", metrics=GatewayMetrics.create(),
                   check=strict("audit record"))
    # The dashboard reads this process's store directly (it is the store's one owner here).
    server = DashServer(wsgi_app(Context(store=st, cfg=DashboardConfig(refresh_s=0))), listen="127.0.0.1:0")
    yield server.start()
    server.stop()
    st.close()


@pytest.fixture
def page(dashboard: str, tmp_path: Path) -> Iterator[Any]:
    api = _sync_api()
    # Chromium in a network namespace of its own: a lab coming up or down elsewhere changes this host's
    # addresses, and Chromium fails every request in flight on such a change (see tests/browser_netns.py)
    ns = BrowserNetns.start()
    executable = CHROMIUM if ns is None else ns.launcher(CHROMIUM, tmp_path)
    try:
        if ns is not None:
            ns.expose(dashboard)
        with api.sync_playwright() as pw:
            args = ["--no-sandbox"] if os.geteuid() == 0 else []
            browser = pw.chromium.launch(executable_path=str(executable), headless=True, args=args)
            tab = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
            tab.set_default_timeout(TIMEOUT_MS)
            yield tab
            browser.close()
    finally:
        if ns is not None:
            ns.close()


def _shot(page: Any, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"dashboard-{name}.png"), full_page=True)


def test_the_audits_page_lists_both_and_opens_one_with_its_evidence_and_report(
        page: Any, dashboard: str, results: tuple[AuditResult, AuditResult]) -> None:
    bad = results[0]
    page.goto(dashboard + "/")
    page.wait_for_function(RENDERED_JS, timeout=TIMEOUT_MS)
    page.locator("#nav-audits").click()
    page.wait_for_url("**/audits")
    page.wait_for_function(RENDERED_JS, timeout=TIMEOUT_MS)
    drawn = page.evaluate("() => document.querySelector('#audits-history .js-plotly-plot').data.length")
    assert drawn == 3  # hosts failed, links failed, anomalies
    rows = page.locator("#audits-list tbody tr")
    assert rows.count() == 2
    listed = page.inner_text("#audits-list")
    assert "rack-a" in listed and "rack-b" in listed and "fail" in listed and "partial" in listed
    assert "2 / 4" in listed  # the failed audit's hosts
    assert "2 audits, 1 failed" in page.inner_text("#audits-status")
    _shot(page, "audits")
    page.locator(f"#audits-list a[href='/audits/{bad.audit_id}']").click()
    page.wait_for_url(f"**/audits/{bad.audit_id}")
    page.wait_for_function("() => document.querySelector('#audit-title') !== null")
    assert "fail" in page.inner_text("#audit-title")
    blocks = page.locator(".rt-audit-anomaly")
    assert blocks.count() == len(bad.anomalies) == 3
    text = page.inner_text("#audit-anomalies")
    for a in bad.anomalies:
        assert a.entity in text and a.action in text
    page.locator(".rt-audit-anomaly details summary").first.click()
    assert "{" in page.locator(".rt-audit-anomaly details pre").first.inner_text()  # the evidence, as JSON
    assert page.locator("#audit-hosts-table tbody tr").count() == 4
    assert "leaf1r0-spine0" in page.inner_text("#audit-links-table")
    _shot(page, "audit")
    with page.expect_popup() as opened:
        page.locator("#audit-report-link").click()
    report = opened.value
    report.wait_for_load_state()
    for s in SECTIONS:
        assert report.locator(f"section#{s} > h2").is_visible(), s
    assert report.locator("#anomalies .anomaly").count() == 3
    _shot(report, "audit-report")


def test_the_report_route_serves_both_kinds_and_refuses_unknown_ids(dashboard: str,
                                                                    results: tuple[AuditResult, AuditResult]) -> None:
    bad, good = results
    for r in (bad, good):
        with urllib.request.urlopen(f"{dashboard}/audits/{r.audit_id}/report", timeout=30) as answer:
            assert answer.headers["Content-Type"].startswith("text/html")
            assert "default-src 'none'" in answer.headers["Content-Security-Policy"]
            assert answer.read().decode() == render_html(r)
    for missing in ("0" * 32, "not.an.id"):  # unknown; refused by its shape
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"{dashboard}/audits/{missing}/report", timeout=30)
        assert err.value.code == 404
