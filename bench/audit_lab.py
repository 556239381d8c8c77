"""Fleet audit on a lab with hidden faults: are they found, localised exactly, and is the rest left alone?

One lab with agents (8 hosts, 2 racks, 2 rails, 2 spines, 8 fake GPUs each; ``--quick``: 4 hosts,
2 racks, 1 rail, 1 spine, 2 GPUs). Once every agent reports, faults are planted through the lab's
own fault catalogue (`ridethrough.lab.faults.KINDS`), and the audit is not told about them:

* a link capped with ``tbf`` at 20 Mbit/s (small packets pass; load does not);
* an MTU mismatch: one end of a host link at 1400 while the fabric runs 1500;
* a NIC whose error counters climb only under load (`ridethrough.lab.load_faults.LoadErrors`);
* a GPU with a pending row remap.

``--quick`` plants the first and the last. Then ``ridethrough audit`` runs (`ridethrough.audit.Audit`
with the lab driver) within ``--budget``. Each planted fault is **found** when an anomaly names its
entity (or, for the NIC, the link it is cabled to, or names it among candidates), **localised** when
an anomaly names exactly its entity with no candidates; time to localise is that anomaly's. Every
anomaly that matches no planted fault is a **false finding**. Targets (issue #11): all found and
localised, no false findings, the audit within 5 minutes.

The audit is then recorded as ``ridethrough audit --lab`` records it, through the lab's gateway, and
``recorded`` says whether the lab's dashboard (Audits page) lists it. Progress goes to stderr; the last
line on stdout is one JSON object. ``--out DIR`` keeps the JSON result and the HTML report.
Run: ``.venv/bin/python bench/audit_lab.py [--quick]``. Needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ridethrough.audit import Audit, AuditConfig, store_query
from ridethrough.audit_events import RecordError, send_audit
from ridethrough.audit_lab import LabDriver
from ridethrough.audit_model import AuditResult
from ridethrough.audit_report import render_html
from ridethrough.dashboards import queries_audits
from ridethrough.exporters.store import Store
from ridethrough.lab.fabric import Lab
from ridethrough.lab.faults import KINDS, Call, Names
from ridethrough.lab.load_faults import LoadErrors
from ridethrough.lab.netns import unavailable_reason
from ridethrough.lab.topology import TopologySpec

FULL = TopologySpec()
QUICK = TopologySpec(hosts=4, racks=2, rails=1, spines=1, gpus=2)
TARGET_S = 300.0


@dataclass(frozen=True, slots=True)
class Planted:
    """One hidden fault: the entity an exact localisation names, and entities that count as found."""

    name: str
    entity: str
    related: tuple[str, ...] = ()


class Progress:
    """The audit's phases as lines on stderr."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def start(self, phase: str, total: int) -> None:
        """A phase begins."""
        print(f"  [{time.monotonic() - self.t0:6.1f}s] {phase} ({total} steps)", file=sys.stderr)

    def advance(self, phase: str, steps: int = 1) -> None:
        """Steps are done (not shown: the phases are enough)."""

    def note(self, text: str) -> None:
        """A line."""
        print(f"  {text}", file=sys.stderr)


def _plant(lab: Lab, kind: str, target: str, params: dict[str, Any]) -> None:
    """Through the fault catalogue, as a scenario would: validated parameters, the lab's own calls."""
    fk = KINDS[kind]
    names = Names.of(lab.topology)
    values = {p.name: p.default for p in fk.params_for(params)} | params
    fk.start(lab, Call(target, values, names))


def plant(lab: Lab, *, quick: bool) -> tuple[list[Planted], LoadErrors | None]:
    """Hide the faults; what was planted, and the load-error injector to stop at the end."""
    if quick:
        _plant(lab, "degrade", "leaf1r0-spine0", {"rate_mbit": 20.0, "direction": "both"})
        _plant(lab, "gpu", "h3", {"gpu_fault": "row_remap_pending", "gpu": 1})
        return [Planted("tbf_rate_cap", "leaf1r0-spine0"), Planted("gpu_row_remap_pending", "h3/gpu1")], None
    _plant(lab, "degrade", "leaf1r0-spine1", {"rate_mbit": 20.0, "direction": "both"})
    _plant(lab, "mtu", "h2-leaf0r1", {"end": "leaf0r1", "mtu": 1400})
    _plant(lab, "gpu", "h6", {"gpu_fault": "row_remap_pending", "gpu": 3})
    errors = LoadErrors(lab, "h5", "nic0", errors_per_mbyte=2.0).start()
    return [Planted("tbf_rate_cap", "leaf1r0-spine1"), Planted("mtu_mismatch", "h2-leaf0r1"),
            Planted("nic_errors_under_load", "h5/nic0", ("h5-leaf1r0", "h5/mlx5_0")),
            Planted("gpu_row_remap_pending", "h6/gpu3")], errors


def wait_agents(store: Store, hosts: list[str], *, timeout_s: float = 120.0) -> None:
    """Until every host's agent has rows in the store and the clock service has corrected every host."""
    deadline = time.monotonic() + timeout_s
    sql = ("SELECT uniqExactIf(ResourceAttributes['ridethrough.node.id'], MetricName = 'ridethrough.nic.up'), "
           "uniqExactIf(Attributes['clock.node'], MetricName = 'ridethrough.clock.node.uncertainty') "
           "FROM otel_metrics_gauge")
    got: tuple[Any, ...] = ()
    while time.monotonic() < deadline:
        try:
            got = store.query(sql)[1][0]
            if got[0] >= len(hosts) and got[1] >= len(hosts):
                return
        except Exception:  # the server may still be starting: any failure means "not yet"
            pass
        time.sleep(0.5)
    raise SystemExit(f"audit_lab: agents and clock corrections not all in the store after {timeout_s:.0f} s "
                     f"(agents, clocks: {got})")


def score(planted: list[Planted], result: AuditResult) -> dict[str, Any]:
    """Found, localised, time to localise per planted fault; anomalies that match none."""
    per: dict[str, Any] = {}
    matched: set[str] = set()
    for p in planted:
        hits = [a for a in result.anomalies
                if a.entity == p.entity or a.entity in p.related or p.entity in a.candidates]
        exact = [a for a in hits if a.entity == p.entity and not a.candidates]
        matched |= {a.entity for a in hits}
        per[p.name] = {"entity": p.entity, "found": bool(hits), "localised": bool(exact),
                       "time_to_localise_s": round(exact[0].localised_at_s, 1) if exact else None,
                       "anomalies": [f"{a.kind}:{a.entity}" for a in hits]}
    false = [f"{a.kind}:{a.entity}" for a in result.anomalies if a.entity not in matched]
    return {"faults": per, "false": false}


def record(lab: Lab, store: Store, result: AuditResult, *, timeout_s: float = 60.0) -> bool:
    """Record the audit as ``ridethrough audit --lab`` does (through the lab's gateway, the one writer of its
    store), and whether the lab's dashboard lists it (`ridethrough.dashboards.queries_audits`) before the lab goes."""
    try:
        send_audit(lab.server["otlp"], result)
    except RecordError as exc:
        print(f"audit_lab: {exc}", file=sys.stderr)
        return False
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(a.audit_id == result.audit_id for a in queries_audits.audits(store, cluster=lab.name)):
            return True
        time.sleep(0.5)
    return False


def main() -> int:
    """Bring a lab up, hide faults, audit, score; print one JSON line last."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="A 4-host lab with two faults (under a minute).")
    ap.add_argument("--budget-s", type=float, help="The audit's budget (default 300; --quick: 35).")
    ap.add_argument("--out", type=Path, help="Keep the JSON result and the HTML report here.")
    args = ap.parse_args()
    if reason := unavailable_reason():
        print(f"audit_lab: {reason}", file=sys.stderr)
        return 2
    spec = QUICK if args.quick else FULL
    budget_s = args.budget_s or (35.0 if args.quick else TARGET_S)
    started = time.monotonic()
    with Lab.up(spec, name=f"audit{os.getpid() % 10000}", agents=True) as lab:
        store = Store(lab.server["store_http"], timeout_s=30.0)
        wait_agents(store, lab.hosts())
        print(f"lab up, agents and clocks in the store after {time.monotonic() - started:.1f} s", file=sys.stderr)
        planted, errors = plant(lab, quick=args.quick)
        print("planted: " + ", ".join(f"{p.name} on {p.entity}" for p in planted), file=sys.stderr)
        driver = LabDriver(lab)
        cfg = AuditConfig(budget_s=budget_s, cluster=lab.name, load_s=1.0 if args.quick else 2.0)
        try:
            result = Audit(driver.expected(), store_query(store), driver=driver, config=cfg, progress=Progress()).run()
        finally:
            if errors is not None:
                errors.stop()
        recorded = record(lab, store, result)
    out = args.out or Path(tempfile.mkdtemp(prefix="audit_lab-"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "audit.json").write_text(result.dumps())
    (out / "audit.html").write_text(render_html(result))
    scored = score(planted, result)
    for a in result.anomalies:
        print(f"  anomaly {a.kind} {a.entity} at {a.localised_at_s:.1f}s: {a.summary}", file=sys.stderr)
    print(f"report: {out / 'audit.html'}; whole run {time.monotonic() - started:.1f} s", file=sys.stderr)
    faults = scored["faults"].values()
    print(json.dumps({
        "bench": "audit_lab", "planted": len(planted), "found": sum(f["found"] for f in faults),
        "localised": sum(f["localised"] for f in faults), "false_findings": len(scored["false"]),
        "duration_s": round(result.duration_s, 1), "target_s": TARGET_S, "budget_s": budget_s,
        "status": result.status.value, "not_covered": result.not_covered(), "faults": scored["faults"],
        "false": scored["false"], "recorded": recorded, "hosts": spec.hosts, "links": len(result.links),
        "quick": args.quick}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
