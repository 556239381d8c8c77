"""Ground truth of lab runs in the store, and ``ridethrough lab run``'s whole job.

One row per timeline item of a run in ``lab_truth``: which entity the fault hits (a link,
NIC, GPU, host, or a host's clock), when it was applied and undone, and the wall-clock
times at which a detector should see a precursor and a hard failure. Detectors and
actuators are scored against these rows. Truth times are anchored to when the fault was
really applied (``StartedAt + (precursor_at - at)``), and left NULL when the fault was not
applied or the run ended before they came.

Example, the faults of the last run of a scenario::

    SELECT FaultIndex, Fault, Entity, Effect, PrecursorAt, FailureAt FROM lab_truth
    WHERE Scenario = 'nic_errors_then_link_down'
      AND RunId = (SELECT argMax(RunId, RunStartedAt) FROM lab_truth WHERE Scenario = 'nic_errors_then_link_down')
    ORDER BY FaultIndex
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ridethrough.exporters import schema
from ridethrough.exporters.schema import Column, Table
from ridethrough.exporters.store import Store
from ridethrough.lab.control import LabControl
from ridethrough.lab.faults import ParamValue
from ridethrough.lab.runner import ActionRecord, JobLauncher, RunResult, run_timeline
from ridethrough.lab.scenario import Scenario, check_lab, load_scenario

_LC = "LowCardinality(String)"
_TIME = "DateTime64(9)"
_MAYBE_TIME = "Nullable(DateTime64(9))"

TRUTH = Table(
    "lab_truth",
    (
        Column("Lab", _LC),
        Column("Scenario", "String"),
        Column("RunId", "String"),
        Column("RunStartedAt", _TIME),
        Column("FaultIndex", "UInt16"),
        Column("Fault", _LC),
        Column("Target", "String"),
        Column("Params", "Map(LowCardinality(String), String)"),
        Column("AtSeconds", "Float64"),
        Column("ForSeconds", "Nullable(Float64)"),
        Column("Kind", _LC),
        Column("Effect", _LC),
        Column("Entity", "String"),
        Column("EntityType", _LC),
        Column("StartedAt", _TIME),
        Column("EndedAt", _MAYBE_TIME),
        Column("PrecursorAt", _MAYBE_TIME),
        Column("FailureAt", _MAYBE_TIME),
        Column("Applied", "Bool"),
        Column("Error", "String"),
    ),
    (),
    "toYYYYMM(RunStartedAt)",
    "(Lab, RunId, FaultIndex)",
    "cityHash64(RunId)",
)
"""``lab_truth``: ``Fault`` is the timeline kind (``nic-ramp``), ``Kind`` the truth kind a detector
should report (``link_errors``), ``Effect`` one of failure/precursor/degradation/recovery."""


def truth_ddl(*, cluster: str = "") -> Iterator[str]:
    """The statements that create ``lab_truth`` (``_local`` + Distributed when clustered)."""
    return schema.domain_ddl(TRUTH, cluster=cluster)


def ensure_truth_table(store: Store) -> None:
    """Create ``lab_truth`` if it is missing (idempotent; ``ON CLUSTER`` for a clustered store)."""
    store.ensure_table(TRUTH)


def truth_columns(*, lab: str, scenario: Scenario, run_id: str, result: RunResult) -> list[list[Any]]:
    """The rows of one run, column by column in `TRUTH`'s insert order."""
    rows = []
    for fault, out in zip(scenario.timeline, result.outcomes, strict=True):
        truth = fault.truth
        rows.append((
            lab, scenario.name, run_id, result.started_at_ns, fault.index, fault.kind, fault.target,
            {k: _text(v) for k, v in fault.params.items() if v is not None}, fault.at_s, fault.for_s,
            truth.kind, truth.effect.value, truth.entity, truth.entity_type.value, out.started_at_ns,
            out.ended_at_ns, out.precursor_at_ns, out.failure_at_ns, out.applied, out.error,
        ))
    return [list(column) for column in zip(*rows, strict=True)] if rows else [[] for _ in TRUTH.insert_columns]


def write_truth(store: Store, *, lab: str, scenario: Scenario, run_id: str, result: RunResult) -> int:
    """Insert a run's truth rows in one insert; writing the same run again is a no-op (token = run id)."""
    columns = truth_columns(lab=lab, scenario=scenario, run_id=run_id, result=result)
    store.insert_columns(TRUTH, columns, token=run_id)
    return len(scenario.timeline)


def run_scenario(path: str | Path | Scenario, *, lab: LabControl, store: Store | None,
                 stop: threading.Event | None = None, print_fn: Callable[[str], object] = print,
                 jobs: JobLauncher | None = None, run_id: str | None = None) -> RunResult:
    """Validate a scenario, run it on ``lab``, write its truth to ``store`` and print a summary.

    Everything that can be checked is checked before the first fault: the file
    (`ScenarioError`), the lab's hosts and links, and the store (the table is created first).
    """
    scenario = path if isinstance(path, Scenario) else load_scenario(path)
    check_lab(scenario, hosts=lab.hosts(), links=lab.links())
    if store is not None:
        ensure_truth_table(store)
    run_id = run_id or uuid.uuid4().hex
    print_fn(f"scenario {scenario.name} on lab {lab.name}: {len(scenario.timeline)} faults over "
             f"{scenario.duration_s:g}s (run {run_id})")
    result = run_timeline(scenario, lab, stop=stop, jobs=jobs, on_event=lambda r: print_fn(_progress(r)))
    print_fn(summary(scenario, result, run_id=run_id))
    if store is not None:
        rows = write_truth(store, lab=lab.name, scenario=scenario, run_id=run_id, result=result)
        print_fn(f"{rows} truth rows written to {TRUTH.name} in {store.dsn} (RunId {run_id})")
    return result


def summary(scenario: Scenario, result: RunResult, *, run_id: str) -> str:
    """A readable table of a run's faults; times are seconds from the run's start."""
    def rel(ns: int | None) -> str:
        return "-" if ns is None else f"{(ns - result.started_at_ns) / 1e9:.1f}s"

    header = ("#", "at", "for", "fault", "target", "applied", "truth", "entity", "precursor", "failure", "ended")
    rows = [header]
    for f, out in zip(scenario.timeline, result.outcomes, strict=True):
        rows.append((str(f.index), f"{f.at_s:g}s", "-" if f.for_s is None else f"{f.for_s:g}s", f.kind, f.target,
                     "yes" if out.applied else "NO", f"{f.truth.kind} ({f.truth.effect})", f.truth.entity,
                     rel(out.precursor_at_ns), rel(out.failure_at_ns), rel(out.ended_at_ns)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    applied = sum(o.applied for o in result.outcomes)
    state = "stopped early" if result.stopped else "completed"
    lines.insert(0, f"run {run_id} {state} after {(result.ended_at_ns - result.started_at_ns) / 1e9:.1f}s: "
                    f"{applied}/{len(result.outcomes)} faults applied")
    lines += [f"  timeline[{o.index}]: {o.error}" for o in result.outcomes if o.error]
    if result.job_error:
        lines.append(f"  jobs: {result.job_error}")
    return "\n".join(lines)


def _progress(r: ActionRecord) -> str:
    outcome = f"FAILED: {r.error}" if r.error else "ok"
    why = "" if r.reason == "timeline" else f" ({r.reason})"
    return f"  +{r.offset_s:7.2f}s  {r.phase:<5}  timeline[{r.index}] {r.kind} {r.target}{why}: {outcome}"


def _text(value: ParamValue) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)
