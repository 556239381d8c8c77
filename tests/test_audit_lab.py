"""The fleet audit on a real namespace lab with agents: hidden faults found exactly, the CLI, partial results.

Needs root and network namespaces (skipped with the reason otherwise). One small lab (4 hosts in 2
racks, 1 rail, 1 spine, 2 fake GPUs each) serves every test, the healthy ones first: the one that
plants faults runs last (``Lab.restore_link`` does not remove a ``tbf`` yet), and the lab is removed
at the end (its namespaces with it).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ridethrough.audit import Audit, AuditConfig, store_query
from ridethrough.audit_cli import app as audit_app
from ridethrough.audit_lab import LabDriver
from ridethrough.audit_model import Status
from ridethrough.audit_report import SECTIONS
from ridethrough.dashboards import queries_audits
from ridethrough.exporters.store import Store
from ridethrough.lab import netns
from ridethrough.lab.control import Direction, GpuFault
from ridethrough.lab.fabric import Lab
from ridethrough.lab.load_faults import LoadErrors
from ridethrough.lab.topology import TopologySpec
from tests.conftest import wait_for
from tests.test_audit import check_report_sections

REASON = netns.unavailable_reason()
pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(REASON is not None, reason=REASON or "")]
SPEC = TopologySpec(hosts=4, racks=2, rails=1, spines=1, gpus=2)


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with Lab.up(SPEC, name=f"taud{os.getpid() % 100000}", agents=True) as running:
        store = Store(running.server["store_http"], timeout_s=30.0)
        sql = ("SELECT uniqExactIf(ResourceAttributes['ridethrough.node.id'], MetricName = 'ridethrough.nic.up'), "
               "uniqExactIf(Attributes['clock.node'], MetricName = 'ridethrough.clock.node.uncertainty') "
               "FROM otel_metrics_gauge")

        def ready() -> bool:
            try:
                agents, clocks = store.query(sql)[1][0]
            except Exception:  # the server may still be starting: any failure means "not yet"
                return False
            return bool(agents >= SPEC.hosts and clocks >= SPEC.hosts)
        wait_for(ready, timeout_s=120, interval_s=0.5, what="every agent and clock correction in the store")
        yield running
    assert not [n for n in netns.list_names() if n.startswith(f"rt-{running.name}-")]


def _audit(lab: Lab, **cfg: Any) -> Audit:
    driver = LabDriver(lab)
    store = Store(lab.server["store_http"], timeout_s=30.0)
    return Audit(driver.expected(), store_query(store), driver=driver,
                 config=AuditConfig(cluster=lab.name, **cfg))


def test_the_cli_audits_the_lab_says_what_it_did_not_cover_and_its_report_opens(lab: Lab, tmp_path: Path) -> None:
    run = CliRunner().invoke(audit_app, ["--lab", lab.name, "--hosts", "h0,h1,h7", "--budget", "2m",
                                         "--out", str(tmp_path)])
    assert run.exit_code == 3, run.output  # partial: h7 is not in the lab; the rest passed
    assert "recorded through the gateway" in run.output
    (page,) = tmp_path.glob("audit-*.html")
    check_report_sections(page, SECTIONS, anomalies=["h7"], hosts=["h0", "h1", "h7"])
    (doc,) = tmp_path.glob("audit-*.json")
    assert '"h7": "not_covered"' in doc.read_text()
    # the lab's dashboard lists it, and serves the same report, read from the lab's own store
    audit_id = json.loads(doc.read_text())["audit_id"]
    store = Store(lab.server["store_http"], timeout_s=30.0)
    listed = wait_for(lambda: [a for a in queries_audits.audits(store, cluster=lab.name) if a.audit_id == audit_id],
                      timeout_s=60, interval_s=0.5, what="the audit in the lab's store")
    assert listed[0].status == "partial" and listed[0].hosts == 3
    stored = queries_audits.audit(store, audit_id)
    assert stored is not None and stored.report_html == page.read_text()


def test_an_agent_that_stops_reporting_leaves_its_host_not_covered_not_crashed(lab: Lab) -> None:
    lab.freeze_host("h3")  # its agent stops; the audit's own endpoints there still start
    try:
        time.sleep(6)
        result = _audit(lab, budget_s=120, inventory_window_s=5, fresh_timeout_s=5).run()
    finally:
        lab.thaw_host("h3")
        thawed_ns = time.time_ns()
        store = Store(lab.server["store_http"], timeout_s=30.0)
        sql = ("SELECT count() FROM otel_metrics_gauge WHERE MetricName = 'ridethrough.clock.node.uncertainty' "
               "AND Attributes['clock.node'] = 'h3' AND toUnixTimestamp64Nano(TimeUnix) > {t:Int64}")
        # put the lab back as it was: the clock service corrects h3 again once its agent probes again
        wait_for(lambda: store.query(sql, parameters={"t": thawed_ns})[1][0][0] > 0, timeout_s=120, interval_s=1,
                 what="a clock correction for h3 after the thaw")
    assert [(a.entity, a.kind) for a in result.anomalies] == [("h3", "no_telemetry")], result.dumps()
    assert result.status is Status.PARTIAL and result.hosts["h3"] is Status.NOT_COVERED
    assert result.links["h3-leaf1r0"] is Status.PASS  # its cable was still loaded end to end


def test_hidden_faults_are_each_found_on_their_own_entity_and_nothing_else_is(lab: Lab) -> None:
    lab.degrade_link("leaf1r0-spine0", rate_mbit=20, direction=Direction.BOTH)
    lab.set_mtu("h1-leaf0r0", end="leaf0r0", mtu=1400)
    lab.gpu_fault("h3", 1, GpuFault.ROW_REMAP_PENDING, {"rows": 1, "rate_per_s": 0.0})
    errors = LoadErrors(lab, "h2", "nic0", errors_per_mbyte=2.0).start()
    try:
        result = _audit(lab, budget_s=150).run()
    finally:
        errors.stop()
        lab.clear_nic("h2", "nic0")
        lab.clear_gpu("h3", 1)
        for link in ("leaf1r0-spine0", "h1-leaf0r0"):
            lab.restore_link(link)
    found = {(a.entity, a.kind, a.candidates) for a in result.anomalies}
    assert found == {("leaf1r0-spine0", "fails_under_load", ()), ("h1-leaf0r0", "mtu_mismatch", ()),
                     ("h2/nic0", "nic_errors_under_load", ()), ("h3/gpu1", "gpu_failing", ())}, result.dumps()
    mtu = next(a for a in result.anomalies if a.kind == "mtu_mismatch")
    assert "leaf0r0 refuses" in mtu.summary  # the end with the small MTU is named
    assert Status.NOT_COVERED not in result.links.values()
    assert result.hosts == {"h0": Status.PASS, "h1": Status.FAIL, "h2": Status.FAIL, "h3": Status.FAIL}
    assert result.duration_s < 150
