"""Goodput: known answers on hand-built event sets, the reference and the SQL held to each other,
the report formats and the ``goodput report`` command.

Times are whole seconds after `T0` so the arithmetic in each test can be checked by hand.
Store tests write each scenario under its own customer (and cluster), so they never see each other.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from typer.testing import CliRunner

from ridethrough.collector.sample import Event
from ridethrough.collector.sources.job import JobSource
from ridethrough.dashboards import goodput_report as report
from ridethrough.dashboards.goodput import (
    Category,
    JobGoodput,
    JobRecord,
    RankEvent,
    StepRun,
    account,
    merge,
    overlap,
    total,
)
from ridethrough.dashboards.goodput_cli import app
from ridethrough.dashboards.goodput_sql import GoodputError, Period, buckets, job_goodput, materialized_cte
from ridethrough.detectors.contract import Severity
from ridethrough.detectors.incidents import INCIDENTS, Incident, State
from ridethrough.exporters import schema
from ridethrough.exporters.gateway_metrics import GatewayMetrics
from ridethrough.exporters.pipeline import write_requests
from ridethrough.exporters.rows import kv
from ridethrough.exporters.signals import Signal
from ridethrough.exporters.store import Store
from tests.conftest import wait_for

S = 10**9
T0 = 1_718_000_000 * S
_tokens = itertools.count()


def at(seconds: float) -> int:
    return T0 + round(seconds * S)


def run(rank: int, step: int, a: float, b: float, **kw: Any) -> StepRun:
    return StepRun(rank, step, at(a), at(b), **kw)


def ev(rank: int, kind: str, t: float, reason: str = "") -> RankEvent:
    return RankEvent(rank, kind, at(t), reason)


def seconds(g: JobGoodput) -> dict[str, float]:
    """Non-zero categories, rounded to the microsecond."""
    return {c.value: round(v, 6) for c, v in g.seconds.items() if round(v, 6)}


# Scenario A: a failure after step 4, a restart, the checkpoint after step 2 reloaded (steps 3, 4 redone).
JOB_A = JobRecord("acme", "a", 1, runs=[
    run(0, 1, 0, 10), run(0, 2, 10, 20, checkpoint_s=2.0, tokens=100), run(0, 3, 20, 30, wait_s=3.0, tokens=100),
    run(0, 4, 30, 40, tokens=100), run(0, 3, 60, 70, tokens=100), run(0, 4, 70, 80, tokens=100),
    run(0, 5, 80, 90, tokens=100)],
    events=[ev(0, "start", 0), ev(0, "end", 45, "failed"), ev(0, "start", 50), ev(0, "end", 90, "completed")])
A_WHOLE = {"productive": 48.0, "checkpoint_stall": 2.0, "recomputation": 20.0, "restart": 20.0}

# Scenario B: two ranks; overlapping incidents in a gap with no restart; a migration inside step 5.
_B_RUNS = [(1, 0, 10, {}), (2, 10, 20, {}), (3, 20, 30, {}), (4, 50, 60, {}), (5, 60, 100, {"wait_s": 30.0})]
JOB_B = JobRecord("bravo", "b", 2,
                  runs=[run(r, n, a, b, **kw) for r in (0, 1) for n, a, b, kw in _B_RUNS],
                  events=[ev(r, "end", 100, "completed") for r in (0, 1)],
                  incidents=[(at(35), at(45)), (at(40), at(48))], migrations=[(at(70), at(90))])
B_WHOLE = {"productive": 100.0, "migration_pause": 40.0, "straggler_wait": 20.0, "restart": 26.0, "idle": 14.0}

# Scenario C: world 2, only rank 0 reports; a restart without rollback (lifecycle events only);
# phases that add up to more than the step.
JOB_C = JobRecord("charlie", "c", 2, runs=[
    run(0, 1, 0, 10, checkpoint_s=15.0, wait_s=4.0), run(0, 2, 10, 20), run(0, 3, 50, 60, wait_s=4.0)],
    events=[ev(0, "end", 25, "oom"), ev(0, "start", 40)])
C_WHOLE = {"checkpoint_stall": 10.0, "productive": 16.0, "straggler_wait": 4.0, "restart": 30.0, "idle": 60.0}


# --- the definitions, in the reference -------------------------------------------------------


def test_interval_helpers() -> None:
    assert merge([(5, 7), (1, 5), (2, 3), (9, 9), (10, 12)]) == [(1, 7), (10, 12)]
    assert overlap(0, 11, [(1, 7), (10, 12)]) == 7


@pytest.mark.parametrize(("job", "expected", "allocated"), [(JOB_A, A_WHOLE, 90.0), (JOB_B, B_WHOLE, 200.0),
                                                            (JOB_C, C_WHOLE, 120.0)])
def test_reference_known_answers(job: JobRecord, expected: dict[str, float], allocated: float) -> None:
    g = account(job, at(0), at(1000))
    assert seconds(g) == expected
    assert g.allocated_s == allocated and sum(g.seconds.values()) == pytest.approx(allocated)


def test_reference_counts_steps_tokens_and_rollbacks() -> None:
    g = account(JOB_A, at(0), at(1000))
    assert (g.steps, g.steps_rolled_back, g.tokens) == (5, 2, 400)
    assert g.goodput == pytest.approx(48 / 90) and g.badput_s == pytest.approx(42)


def test_reference_clips_to_the_period() -> None:
    # [15, 65): half of step 2 (and half its checkpoint), the two redone runs, the restart gap, half the rerun of 3
    g = account(JOB_A, at(15), at(65))
    assert seconds(g) == {"productive": 9.0, "checkpoint_stall": 1.0, "recomputation": 20.0, "restart": 20.0}
    assert (g.allocated_s, g.steps, g.steps_rolled_back) == (50.0, 1, 2)


def test_reference_periods_add_up() -> None:
    whole = account(JOB_B, at(0), at(1000))
    parts = [account(JOB_B, at(a), at(b)) for a, b in ((0, 37), (37, 75), (75, 1000))]
    summed = total(parts, customer="bravo", start_ns=at(0), end_ns=at(1000))
    assert summed.allocated_s == pytest.approx(whole.allocated_s)
    for c in Category:
        assert summed.seconds[c] == pytest.approx(whole.seconds[c]), c


def test_reference_duplicate_runs_count_once() -> None:
    doubled = JobRecord("acme", "a", 1, runs=[*JOB_A.runs, *JOB_A.runs], events=JOB_A.events)
    assert seconds(account(doubled, at(0), at(1000))) == A_WHOLE


def test_reference_rejects_an_empty_period() -> None:
    with pytest.raises(ValueError, match="empty"):
        account(JOB_A, at(10), at(10))


# --- the same definitions, in SQL on a real store ---------------------------------------------


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    st = Store(f"chdb://{tmp_path_factory.mktemp('goodput') / 'store'}")
    st.init_schema()
    yield st
    st.close()


def _log(cluster: str, node: str, t_ns: int, attrs: Mapping[str, str]) -> dict[str, Any]:
    res = {"service.name": "ridethrough-agent", "host.name": node, "ridethrough.node.id": node,
           "ridethrough.cluster": cluster}
    return {"Timestamp": t_ns, "ServiceName": "ridethrough-agent", "Body": attrs["event.name"],
            "ResourceAttributes": res, "LogAttributes": dict(attrs), "SeverityText": "INFO"}


def job_logs(job: JobRecord, *, cluster: str, nodes: Mapping[int, str]) -> list[dict[str, Any]]:
    """The otel_logs rows the job source's events become (attribute layout of JobSource._event)."""
    who = {"job.id": job.job, "job.customer": job.customer, "job.world_size": str(job.world_size)}
    rows = []
    for r in job.runs:
        attrs = {**who, "event.name": "job.step", "job.rank": str(r.rank), "job.step": str(r.step),
                 "job.step.start_ns": str(r.start_ns), "job.step.end_ns": str(r.end_ns),
                 "job.step.duration_s": repr((r.end_ns - r.start_ns) / 1e9), "job.tokens": str(r.tokens),
                 "job.samples": str(r.samples), "job.phase.checkpoint_s": repr(r.checkpoint_s),
                 "job.phase.wait_s": repr(r.wait_s)}
        rows.append(_log(cluster, nodes[r.rank], r.end_ns, attrs))
    for e in job.events:
        attrs = {**who, "event.name": "job.started" if e.kind == "start" else "job.ended",
                 "job.rank": str(e.rank), "job.time_ns": str(e.time_ns)}
        if e.kind == "end":
            attrs["job.end.reason"] = e.reason
        rows.append(_log(cluster, nodes[e.rank], e.time_ns, attrs))
    return rows


def insert(store: Store, table: schema.Table, rows: Sequence[Mapping[str, Any]]) -> None:
    def default(typ: str) -> Any:
        return {} if typ.startswith("Map") else [] if typ.startswith("Array") else "" if "String" in typ else 0
    cols = [c for c in table.columns if c.insert]
    store.insert_columns(table, [[row.get(c.name, default(c.type)) for row in rows] for c in cols],
                         token=f"goodput-test-{next(_tokens)}")


def incident(cluster: str, entity: str, opened: float, resolved: float | None, *, version: int = 1,
             iid: str = "") -> Incident:
    state = State.OPEN if resolved is None else State.RESOLVED
    return Incident(iid or f"i{next(_tokens)}", f"k:{entity}", "gpu_failed", "gpu", entity, cluster, "gpu",
                    Severity.ERROR, state, at(opened), at(opened), 0 if resolved is None else at(resolved),
                    at(opened), 1, 0, "", "{}", "", version)


def add_incidents(store: Store, incidents: Sequence[Incident]) -> None:
    from ridethrough.detectors.incidents import ensure_incidents_table
    ensure_incidents_table(store)
    store.insert_columns(INCIDENTS, [list(c) for c in zip(*(i.row() for i in incidents), strict=True)],
                         token=f"goodput-test-{next(_tokens)}")


def sql_goodput(store: Store, customer: str, a: float = 0, b: float = 1000, **kw: Any) -> JobGoodput:
    (g,) = job_goodput(store, customer=customer, periods=[Period(at(a), at(b))], **kw)
    return g


def test_sql_known_answer_with_rollback_and_restart(store: Store) -> None:
    insert(store, schema.LOGS, job_logs(JOB_A, cluster="ca", nodes={0: "n1"}))
    g = sql_goodput(store, "acme")
    assert seconds(g) == A_WHOLE
    assert materialized_cte(store)  # chDB keeps the events' CTE; a server that cannot gets the same answer:
    assert sql_goodput(store, "acme", materialize=False) == g
    assert (g.job, g.world_size, g.allocated_s, g.steps, g.steps_rolled_back, g.tokens) == ("a", 1, 90.0, 5, 2, 400)
    assert seconds(sql_goodput(store, "acme", 15, 65)) == seconds(account(JOB_A, at(15), at(65)))


def test_sql_counts_a_retried_insert_once(store: Store) -> None:
    job = JobRecord("acme2", "a", 1, runs=JOB_A.runs, events=JOB_A.events)
    rows = job_logs(job, cluster="ca2", nodes={0: "n1"})
    insert(store, schema.LOGS, rows)
    insert(store, schema.LOGS, rows)  # another token: stored twice
    assert seconds(sql_goodput(store, "acme2")) == A_WHOLE


def test_sql_overlapping_incidents_and_a_migration(store: Store) -> None:
    from ridethrough.actuators.actions import ACTIONS, ensure_actions_table
    insert(store, schema.LOGS, job_logs(JOB_B, cluster="cb", nodes={0: "n1", 1: "n2"}))
    add_incidents(store, [
        incident("cb", "n1/gpu0", 35, 45), incident("cb", "n2", 40, 48),      # overlapping: counted once
        incident("cb", "b/rank1", 36, 44),                                     # a rank of the job: inside them
        incident("cb", "n9/gpu0", 0, 1000), incident("other", "n1/gpu0", 0, 1000),  # not this job
        incident("cb", "n10", 0, 1000)])                                       # n10 is not n1
    try:
        no_actions = sql_goodput(store, "bravo")
        assert no_actions.seconds[Category.MIGRATION] == 0  # no actions table: no migration pause
        ensure_actions_table(store)
        action = {"ActionId": "m1", "Cluster": "cb", "Plugin": "migrate", "Entity": "n2/gpu0",
                  "Status": "succeeded", "StartedAt": at(70), "EndedAt": at(90), "DecidedAt": at(69), "Version": 2}
        insert(store, ACTIONS, [
            {**action, "Status": "applying", "EndedAt": 0, "Version": 1}, action,
            {**action, "ActionId": "dry", "DryRun": True, "StartedAt": at(0), "EndedAt": at(100)},
            {**action, "ActionId": "rr", "Plugin": "reroute", "StartedAt": at(0), "EndedAt": at(100)}])
        g = sql_goodput(store, "bravo")
    finally:
        store.command("DROP TABLE IF EXISTS actions")
    assert seconds(g) == B_WHOLE
    assert seconds(account(JOB_B, at(0), at(1000))) == B_WHOLE


def test_sql_world_size_restart_markers_and_capped_phases(store: Store) -> None:
    insert(store, schema.LOGS, job_logs(JOB_C, cluster="cc", nodes={0: "n1"}))
    assert seconds(sql_goodput(store, "charlie")) == C_WHOLE


def test_sql_open_incident_lasts_to_the_period_end_and_newest_version_wins(store: Store) -> None:
    job = JobRecord("delta", "d", 1, runs=[run(0, 1, 0, 10), run(0, 2, 30, 40), run(0, 3, 70, 80)])
    insert(store, schema.LOGS, job_logs(job, cluster="cd", nodes={0: "n1"}))
    add_incidents(store, [incident("cd", "n1", 15, None),  # open: covers [15, 20) of the gap, then step 2 ...
                          incident("cd", "n1", 45, None, iid="x"),
                          incident("cd", "n1", 45, 50, iid="x", version=2)])  # ... resolved in its newest version
    g = sql_goodput(store, "delta", 0, 80)
    # gap [10, 30): incident from 15 -> 15 s restart, 5 idle; gap [40, 70): incidents cover all of it -> 30 restart
    assert seconds(g) == {"productive": 30.0, "restart": 45.0, "idle": 5.0}


def test_sql_buckets_add_up_and_match_the_reference(store: Store) -> None:
    job = JobRecord("echo", "e", 2, runs=[*JOB_B.runs, run(0, 5, 95, 120)], events=JOB_B.events,
                    incidents=[(at(35), at(48))])
    insert(store, schema.LOGS, job_logs(job, cluster="ce", nodes={0: "n1", 1: "n2"}))
    add_incidents(store, [incident("ce", "n1", 35, 48)])
    parts = buckets(Period(at(0), at(130)), 4)
    rows = job_goodput(store, customer="echo", periods=parts)
    assert [(r.start_ns, r.end_ns) for r in rows] == [(p.start_ns, p.end_ns) for p in parts]
    for r in rows:
        assert seconds(r) == seconds(account(job, r.start_ns, r.end_ns))
    whole = total(rows, customer="echo", start_ns=at(0), end_ns=at(130))
    assert seconds(whole) == seconds(account(job, at(0), at(130)))


def test_sql_reads_nothing_of_other_customers_or_periods(store: Store) -> None:
    insert(store, schema.LOGS, job_logs(JobRecord("foxtrot", "f", 1, runs=[run(0, 1, 0, 10)]),
                                        cluster="cf", nodes={0: "n1"}))
    assert job_goodput(store, customer="foxtrot", periods=[Period(at(20), at(30))]) == []
    assert job_goodput(store, customer="nobody", periods=[Period(at(0), at(30))]) == []
    assert job_goodput(store, customer="foxtrot'; DROP TABLE otel_logs; --", periods=[Period(at(0), at(30))]) == []
    assert len(job_goodput(store, customer="foxtrot", periods=[Period(at(0), at(30))], job="f")) == 1
    assert job_goodput(store, customer="foxtrot", periods=[Period(at(0), at(30))], job="g") == []


def test_sql_reads_back_to_the_nanosecond_though_the_key_it_prunes_by_is_in_seconds(store: Store) -> None:
    # the look-back starts mid-second (20.5 s): a step that ended later in that second (20.7 s) is read,
    # though the sorting key it is found by (TimestampTime) holds whole seconds
    job = JobRecord("india", "i", 1, runs=[run(0, 1, 0, 20.2), run(0, 2, 20.2, 20.7)])
    insert(store, schema.LOGS, job_logs(job, cluster="ci", nodes={0: "n1"}))
    (g,) = job_goodput(store, customer="india", periods=[Period(at(20.5), at(25))], lookback_s=0)
    assert (g.steps, g.allocated_s) == (1, pytest.approx(0.2))
    assert job_goodput(store, customer="india", periods=[Period(at(20.8), at(25))], lookback_s=0) == []


def test_sql_refuses_bad_arguments_and_a_foreign_actions_table(store: Store) -> None:
    with pytest.raises(GoodputError, match="empty"):
        Period(at(5), at(5))
    with pytest.raises(GoodputError, match="at least one"):
        job_goodput(store, customer="acme", periods=[])
    with pytest.raises(GoodputError, match="lookback"):
        job_goodput(store, customer="acme", periods=[Period(at(0), at(1))], lookback_s=-1)
    store.command("CREATE TABLE actions (ActionId String, Kind String) ENGINE = MergeTree ORDER BY ActionId")
    try:
        with pytest.raises(GoodputError, match="Cluster, DryRun, EndedAt, Entity, Plugin"):
            job_goodput(store, customer="acme", periods=[Period(at(0), at(1))])
    finally:
        store.command("DROP TABLE IF EXISTS actions")


# --- the real job source, through the gateway's write path ------------------------------------


def _messages(job: JobRecord) -> list[tuple[int, dict[str, Any]]]:
    who = {"v": 1, "job": job.job, "customer": job.customer, "world_size": job.world_size}
    out: list[tuple[int, dict[str, Any]]] = []
    for r in job.runs:
        phases = {"checkpoint_s": r.checkpoint_s, "wait_s": r.wait_s}
        out.append((r.start_ns, {**who, "rank": r.rank, "type": "step", "step": r.step, "start_ns": r.start_ns,
                                 "end_ns": r.end_ns, "tokens": r.tokens, "phases": phases}))
    for e in job.events:
        msg = {**who, "rank": e.rank, "type": e.kind, "time_ns": e.time_ns}
        out.append((e.time_ns, {**msg, "reason": e.reason} if e.kind == "end" else msg))
    return sorted(out, key=lambda m: m[0])


def _logs_request(events: Sequence[Event], *, node: str, cluster: str) -> ExportLogsServiceRequest:
    """The OTLP logs the agent exports for these events (AgentIdentity.resource, Agent.emit)."""
    req = ExportLogsServiceRequest()
    rl = req.resource_logs.add()
    for key, value in {"service.name": "ridethrough-agent", "host.name": node, "ridethrough.node.id": node,
                       "ridethrough.cluster": cluster}.items():
        rl.resource.attributes.append(kv(key, value))
    sl = rl.scope_logs.add()
    for e in events:
        record = sl.log_records.add()
        record.time_unix_nano = e.time_ns
        record.severity_text = e.severity
        record.body.string_value = e.body
        record.attributes.extend(kv(k, v) for k, v in {"event.name": e.name, **e.attributes}.items())
    return req


def test_job_source_events_in_the_store_give_the_known_answer(store: Store) -> None:
    job = JobRecord("golf", "g", 1, runs=JOB_A.runs, events=JOB_A.events)
    sock_dir = Path(tempfile.mkdtemp(prefix="rtgp-", dir="/tmp"))  # AF_UNIX paths are short
    events: list[Event] = []
    mono = itertools.count(0.0, 60.0)  # a minute between messages: no event is rate-limited
    source = JobSource(socket_path=sock_dir / "job.sock", clock=lambda: next(mono), wall_clock=lambda: at(95))
    source.start(emit=events.append)
    tx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        messages = _messages(job)
        for _, msg in messages:
            tx.sendto(json.dumps(msg).encode(), os.fspath(sock_dir / "job.sock"))
        wait_for(lambda: len(events) == len(messages), timeout_s=10, interval_s=0.01, what="job events")
    finally:
        tx.close()
        source.stop(timeout_s=5)
        shutil.rmtree(sock_dir, ignore_errors=True)
    request = _logs_request(events, node="n1", cluster="cg")
    write_requests(store, [(Signal.LOGS, request)], token="goodput-source", metrics=GatewayMetrics.create())
    assert seconds(sql_goodput(store, "golf")) == A_WHOLE


# --- reports ---------------------------------------------------------------------------------


def _report() -> report.Report:
    rows = [account(JOB_A, at(0), at(100)), account(JobRecord("acme", "b&<x>", 1, runs=JOB_B.runs[:5]),
                                                     at(0), at(100))]
    timeline = [total([account(JOB_A, at(a), at(a + 25))], customer="acme", start_ns=at(a), end_ns=at(a + 25))
                for a in range(0, 100, 25)]
    return report.Report("acme", at(0), at(100), rows, timeline)


def test_report_csv_parses_with_one_row_per_job_and_a_total() -> None:
    text = report.render(_report(), "csv")
    rows = list(csv.DictReader(io.StringIO(text)))
    assert [r["job"] for r in rows] == ["a", "b&<x>", "*"]
    assert float(rows[0]["productive_s"]) == 48.0 and float(rows[2]["allocated_s"]) == pytest.approx(90 + 100)
    assert set(rows[0]) >= {f"{c.value}_s" for c in Category} | {"goodput", "allocated_s"}


def test_report_json_schema() -> None:
    doc = json.loads(report.render(_report(), "json"))
    assert doc["customer"] == "acme" and doc["from"].startswith("2024-06-10T") and doc["to"]
    assert doc["categories"] == [c.value for c in Category]
    assert doc["total"]["goodput"] == pytest.approx(doc["total"]["productive_s"] / doc["total"]["allocated_s"])
    assert [j["job"] for j in doc["jobs"]] == ["a", "b&<x>"] and len(doc["timeline"]) == 4
    assert doc["jobs"][0]["recomputation_s"] == 20.0


def test_report_table_names_every_job_and_the_total() -> None:
    text = report.render(_report(), "table")
    assert re.search(r"^a\s", text, re.M) and "b&<x>" in text and re.search(r"^\*\s", text, re.M)


def test_report_html_is_self_contained_and_escaped() -> None:
    page = report.render(_report(), "html")
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page
    assert not re.search(r"""(?:src|href)\s*=\s*["']?(?:https?:)?//""", page, re.I)
    assert "@import" not in page and "url(" not in page
    assert "b&amp;&lt;x&gt;" in page and "b&<x>" not in page
    for c in Category:
        assert c.value.replace("_", " ") in page


def test_report_rejects_an_unknown_format() -> None:
    with pytest.raises(ValueError, match="format"):
        report.render(_report(), "xml")


# --- the command ------------------------------------------------------------------------------


def test_cli_report_from_the_store(store: Store, tmp_path: Path) -> None:
    insert(store, schema.LOGS, job_logs(JobRecord("hotel", "h", 1, runs=JOB_A.runs, events=JOB_A.events),
                                        cluster="ch", nodes={0: "n1"}))
    # T0 and T0 + 100 s, with two ways of saying UTC
    args = ["report", "--store", store.dsn, "--customer", "hotel", "--from", "2024-06-10T06:13:20Z",
            "--to", "2024-06-10T06:15:00+00:00"]
    result = CliRunner().invoke(app, [*args, "--format", "json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["total"]["productive_s"] == 48.0 and doc["jobs"][0]["job"] == "h"
    out = tmp_path / "r.html"
    result = CliRunner().invoke(app, [*args, "--format", "html", "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_text().startswith("<!DOCTYPE html>")


@pytest.mark.parametrize(("args", "message"), [
    (["--from", "yesterday"], "--from"),
    (["--from", "2024-06-10T06:15:00Z", "--to", "2024-06-10T06:13:20Z"], "before"),
    (["--format", "xml"], "--format"),
    (["--customer", ""], "--customer"),
])
def test_cli_report_bad_input_is_a_clear_error(store: Store, args: list[str], message: str) -> None:
    base = {"--store": store.dsn, "--customer": "hotel", "--from": "2024-06-10T06:13:20Z",
            "--to": "2024-06-10T06:15:00Z"}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    result = CliRunner().invoke(app, ["report", *itertools.chain.from_iterable(base.items())])
    assert result.exit_code == 2 and message in result.output


def test_cli_report_store_and_output_failures_are_clear(store: Store, tmp_path: Path) -> None:
    args = ["report", "--customer", "hotel", "--from", "1718000000", "--to", "1718000100"]
    result = CliRunner().invoke(app, [*args, "--store", "http://127.0.0.1:1/default"])
    assert result.exit_code == 1 and "unreachable" in result.output
    result = CliRunner().invoke(app, [*args, "--store", store.dsn, "--output", str(tmp_path / "no" / "r.csv"),
                                      "--format", "csv"])
    assert result.exit_code == 1 and "cannot write" in result.output
