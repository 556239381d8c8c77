"""Detector evaluation: run lab scenarios, score the controller's incidents against the truth.

One lab (8 hosts, 2 racks, 2 rails, 2 spines, 8 fake GPUs each) with its server (gateway, chDB
store, controller) and agents. Each scenario's fault timeline runs on it in turn, with a pause
between runs so one run's incidents don't count against the next; then a healthy soak (an
all-reduce job on every host, no faults) counts false alarms. The incidents are read back from
the store through the server's read-only HTTP endpoint and scored by `ridethrough.lab.score`:
per truth class recall, localisation and timings; per incident kind precision.

Targets (issue #6): recall and precision >= 0.95 on every class, exact localisation >= 0.95,
positive lead time on every precursor-bearing fault, hard link failure (`HARD_LINK_CLASSES`) detected
in <= 2 s p99, zero false alarms on a 30-minute healthy soak.

Human-readable progress goes to stderr; the last line on stdout is one JSON object.
Run: ``.venv/bin/python bench/detect_eval.py [--quick] [--scenarios a,b] [--soak-s N]``. Needs root.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from ridethrough.lab.fabric import Lab
from ridethrough.lab.jobs import LabJobLauncher
from ridethrough.lab.netns import unavailable_reason
from ridethrough.lab.runner import RunResult
from ridethrough.lab.scenario import Job, Scenario, load_scenario, parse_scenario
from ridethrough.lab.score import NS, Opened, Run, TruthFault, false_alarms_per_100h, percentile, score
from ridethrough.lab.topology import TopologySpec
from ridethrough.lab.truth import run_scenario

SCENARIOS = Path(__file__).resolve().parent.parent / "lab" / "scenarios"
HARD_LINK_CLASSES = ("link_down", "link_flap", "link_errors")
"""Truth classes whose faults take a link down: a cut, a flap, and a NIC's link that fails after its errors
climbed (the failure after the precursor); their detection latencies make ``link_detect_p99_s``."""
FULL = ("link_cut", "link_flap", "nic_errors_then_link_down", "spine_link_degrades", "gpu_ecc_then_fail",
        "gpu_thermal", "host_freeze", "straggler", "clock_step", "congestion", "mtu_mismatch")
QUICK = """
name: quick_link_and_gpu
description: A host link is cut and a GPU falls off the bus (the quick subset).
duration: 20s
timeline:
  - at: 3s
    fault: link-down
    target: h2-leaf0r1
  - at: 12s
    fault: link-up
    target: h2-leaf0r1
  - at: 5s
    fault: gpu
    target: h1
    gpu: 0
    gpu_fault: xid
    code: 79
"""
LATENCY_TARGET_S = 2.0


def _sql(store_http: str, sql: str) -> list[list[Any]]:
    url = f"{store_http}/?query={urllib.parse.quote(sql + ' FORMAT JSONCompact')}"
    with urllib.request.urlopen(url, timeout=30) as r:
        return list(json.loads(r.read())["data"])


def _wait_rows(store_http: str, hosts: int, timeout_s: float = 90.0) -> None:
    sql = "SELECT uniqExact(ResourceAttributes['ridethrough.node.id']) FROM otel_metrics_gauge"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if int(_sql(store_http, sql)[0][0]) >= hosts:
                return
        except (OSError, ValueError, KeyError, IndexError):
            pass
        time.sleep(0.5)
    raise SystemExit(f"detect_eval: agents' rows did not reach the store within {timeout_s:.0f} s")


def opened_incidents(store_http: str, since_ns: int) -> list[Opened]:
    """Every incident's first version opened since ``since_ns``, with the hosts its evidence names and when it
    first resolved."""
    rows = _sql(store_http, f"""
        SELECT IncidentId, argMin(Kind, Version), argMin(EntityType, Version), argMin(Entity, Version),
               toString(toUnixTimestamp64Nano(min(OpenedAt))), argMin(Evidence, Version),
               toString(toUnixTimestamp64Nano(minIf(ResolvedAt, State = 'resolved'))), countIf(State = 'resolved')
        FROM incidents GROUP BY IncidentId
        HAVING min(OpenedAt) >= fromUnixTimestamp64Nano(toInt64({int(since_ns)}))""")
    out = []
    for iid, kind, etype, entity, opened, evidence, resolved, resolutions in rows:
        out.append(Opened(iid, kind, etype, entity, int(opened), _evidence_hosts(evidence),
                          _evidence_candidates(evidence), int(resolved) if int(resolutions) else None))
    return out


def _evidence_candidates(evidence: str) -> tuple[str, ...]:
    """The entities a finding could not tell apart from its own (tomography's ``candidates``).

    The incidents table keeps the finding's own evidence under ``evidence`` (`detectors.incidents._evidence`).
    """
    try:
        data = json.loads(evidence)
        found = data.get("evidence", {}).get("candidates", data.get("candidates", []))
    except (ValueError, AttributeError):
        return ()
    return tuple(sorted(c for c in found if isinstance(c, str))) if isinstance(found, list) else ()


def _evidence_hosts(evidence: str) -> tuple[str, ...]:
    try:
        data = json.loads(evidence)
    except ValueError:
        return ()
    found: list[str] = []

    def walk(v: object) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                if k in ("host", "node", "host.name") and isinstance(x, str):
                    found.append(x)
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)
    walk(data)
    return tuple(sorted(set(found)))


def truth_of(scenario: Scenario, result: RunResult, run_id: str) -> Run:
    """The scored faults of one finished run (only those really applied)."""
    faults = []
    for fault, out in zip(scenario.timeline, result.outcomes, strict=True):
        t = fault.truth
        if not out.applied:
            continue
        kind = "gpu_xid_precursor" if t.kind == "gpu_xid" and out.failure_at_ns is None else t.kind
        faults.append(TruthFault(run_id, fault.index, kind, t.entity, t.entity_type.value, out.started_at_ns,
                                 out.ended_at_ns, out.precursor_at_ns, out.failure_at_ns))
    return Run(run_id, scenario.name, result.started_at_ns, result.ended_at_ns, tuple(faults))


def nic_link_for(lab: Lab) -> Any:
    """``h2/nic1`` or ``h2/mlx5_1`` → the link that NIC is cabled to (None if it names no lab NIC)."""
    def nic_link(entity: str) -> str | None:
        host, _, nic = entity.partition("/")
        digits = nic.rsplit("_", 1)[-1] if nic.startswith("mlx5_") else nic.removeprefix("nic")
        try:
            return lab.topology.nic_link(host, f"nic{int(digits)}").name
        except ValueError:
            return None
    return nic_link


def main() -> int:
    """Bring the lab up, run the scenarios and the soak, score; print one JSON line last."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="One short scenario and a short soak (under a minute).")
    ap.add_argument("--scenarios", help=f"Comma-separated scenario names (default: {','.join(FULL)}).")
    ap.add_argument("--soak-s", type=float, help="Healthy soak seconds (default 1800; --quick: 8).")
    ap.add_argument("--gap-s", type=float, help="Pause after each run (default 25; --quick: 6).")
    ap.add_argument("--warmup-s", type=float, help="Seconds of telemetry before the first fault (default 30; "
                                                   "--quick: 6).")
    ap.add_argument("--keep", action="store_true", help="Keep the lab's directory (its chDB store) after the run, "
                                                         "to read the data the detectors saw.")
    args = ap.parse_args()
    if reason := unavailable_reason():
        print(f"detect_eval: {reason}", file=sys.stderr)
        return 2
    quick = args.quick
    soak_s = args.soak_s if args.soak_s is not None else (8.0 if quick else 1800.0)
    gap_s = args.gap_s if args.gap_s is not None else (6.0 if quick else 25.0)
    warmup_s = args.warmup_s if args.warmup_s is not None else (6.0 if quick else 30.0)
    if args.scenarios:
        scenarios = [load_scenario(SCENARIOS / f"{n.strip()}.yaml") for n in args.scenarios.split(",")]
    elif quick:
        scenarios = [parse_scenario(QUICK, source="<quick>")]
    else:
        scenarios = [load_scenario(SCENARIOS / f"{n}.yaml") for n in FULL]
    spec = TopologySpec()
    lab = Lab.up(spec, name=f"deval{os.getpid() % 10000}", agents=True)
    try:
        return _evaluate(lab, spec, scenarios, soak_s=soak_s, gap_s=gap_s, warmup_s=warmup_s, quick=quick)
    finally:
        kept = lab.state()["dir"] if args.keep else None
        lab.down(keep_dir=args.keep)
        if kept:
            print(f"detect_eval: lab directory kept: {kept}", file=sys.stderr)


def _evaluate(lab: Lab, spec: TopologySpec, scenarios: list[Scenario], *, soak_s: float, gap_s: float,
              warmup_s: float, quick: bool) -> int:
    store = lab.server["store_http"]
    _wait_rows(store, spec.hosts)
    print(f"agents reporting; warming up {warmup_s:g} s", file=sys.stderr)
    time.sleep(warmup_s)
    began = time.time_ns()
    runs: list[Run] = []
    jobs_dir = Path(lab.state()["dir"]) / "jobs"
    for scenario in scenarios:
        run_id = f"{scenario.name}-{len(runs)}"
        # a job id is unique per launch on a real cluster: two runs' jobs must not read as one job
        sc = dataclasses.replace(scenario, jobs=tuple(dataclasses.replace(j, name=f"{j.name}-{len(runs)}")
                                                      for j in scenario.jobs))
        result = run_scenario(sc, lab=lab, store=None, jobs=LabJobLauncher(lab, log_dir=jobs_dir), run_id=run_id,
                              print_fn=lambda s: print(s, file=sys.stderr))
        runs.append(truth_of(sc, result, run_id))
        time.sleep(gap_s)
    soak_started = time.time_ns()
    jobs = LabJobLauncher(lab, log_dir=jobs_dir)
    jobs.start([Job("soak", tuple(lab.hosts()), ("python3", "-m", "ridethrough.lab.allreduce"))])
    print(f"healthy soak: {soak_s:g} s, all-reduce on {spec.hosts} hosts", file=sys.stderr)
    try:
        time.sleep(soak_s)
    finally:
        jobs.stop()
    soak_ended = time.time_ns()
    incidents = opened_incidents(store, began)
    scores = score(runs, incidents, grace_s=gap_s, nic_link=nic_link_for(lab))
    soak = [i for i in incidents if soak_started <= i.opened_ns <= soak_ended]
    print(json.dumps(_figures(scores, soak, spec.hosts, (soak_ended - soak_started) / NS, quick)))
    return 0


def _figures(scores: dict[str, Any], soak: list[Opened], hosts: int, soak_s: float, quick: bool) -> dict[str, Any]:
    truth, kinds = scores["truth"], scores["incidents"]
    recalls = [c.detected / c.faults for c in truth.values() if c.faults]
    precisions = [c.true_incidents / c.incidents for c in kinds.values() if c.incidents]
    detected = sum(c.detected for c in truth.values())
    localised = sum(c.localised for c in truth.values())
    latency = [v for k in HARD_LINK_CLASSES if k in truth for v in truth[k].latency_s]
    p99 = percentile(latency, 0.99)
    return {
        "bench": "detect_eval",
        "min_recall": round(min(recalls), 4) if recalls else None,
        "min_precision": round(min(precisions), 4) if precisions else None,
        "localisation": round(localised / detected, 4) if detected else None,
        "false_alarms_per_100h": false_alarms_per_100h(len(soak), hosts, soak_s),
        "soak_false_alarms": [f"{i.kind}:{i.entity}" for i in soak],
        "soak_host_hours": round(hosts * soak_s / 3600, 3),
        "lead_time_s": {k: c.lead_s for k, c in truth.items() if c.lead_s},
        "link_detect_p99_s": None if p99 is None else round(p99, 3),
        "link_detect_target_s": LATENCY_TARGET_S,
        "classes": {k: c.truth_figures() for k, c in sorted(truth.items())},
        "incident_kinds": {k: c.incident_figures() for k, c in sorted(kinds.items())},
        "quick": quick,
    }


if __name__ == "__main__":
    sys.exit(main())
