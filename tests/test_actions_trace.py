"""Actions in their incident's trace, in a real chDB store: the incident's root span, then decide,
apply (with its steps and an agent's span propagated through ``traceparent``), verify and
rollback, and a restarted runner's takeover; ``ridethrough trace`` printing that tree.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import typer
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from typer.testing import CliRunner

from ridethrough.actuators.actions import ActionLog, ActionRecord, Status
from ridethrough.actuators.contract import Deadline, FleetState, Plan, Result
from ridethrough.actuators.policy import RunnerPolicy
from ridethrough.actuators.runner import Runner
from ridethrough.actuators.trace_view import SpanRow, TraceNotFound, render, show, trace_command
from ridethrough.actuators.tracing import (
    SPAN_NAMES,
    ActionTrace,
    SpanWriter,
    action_attributes,
    current_traceparent,
    parse_traceparent,
    step,
)
from ridethrough.detectors.contract import EntityType, Finding, FindingKind, Severity
from ridethrough.detectors.incident_events import IncidentEmitter, root_span_id
from ridethrough.detectors.incidents import Incident, IncidentTracker, Transition
from ridethrough.exporters.gateway_metrics import GatewayMetrics
from ridethrough.exporters.pipeline import write_requests
from ridethrough.exporters.rows import kv
from ridethrough.exporters.schema import Table
from ridethrough.exporters.signals import Signal
from ridethrough.exporters.store import Store, StoreUnavailable

S = 1_000_000_000
T0 = 1_700_000_000 * S


class RefusingStore(Store):
    """The real store, except that tables named in ``refuse`` are away (as a store outage looks)."""

    def __init__(self, dsn: str) -> None:
        super().__init__(dsn)
        self.refuse: set[str] = set()

    def insert_columns(self, table: Table, columns: Sequence[Sequence[Any]], *, token: str) -> None:
        if table.name in self.refuse:
            raise StoreUnavailable(f"{table.name} is away")
        super().insert_columns(table, columns, token=token)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RefusingStore]:
    s = RefusingStore(f"chdb://{tmp_path_factory.mktemp('actions-trace') / 'store'}")
    s.init_schema()
    yield s
    s.close()


class Ticking:
    """A wall clock that moves 1 ms each time it is read (spans get distinct, known times)."""

    def __init__(self, start_ns: int) -> None:
        self._ns = itertools.count(start_ns, 1_000_000)

    def __call__(self) -> int:
        return next(self._ns)


class Agent:
    """The far end of a control RPC: continues the caller's trace from ``traceparent`` metadata."""

    def __init__(self, store: Store, clock: Ticking) -> None:
        self._store, self._clock = store, clock
        self.seen: list[str] = []

    def reroute(self, metadata: dict[str, str]) -> None:
        parent = parse_traceparent(metadata["traceparent"])
        self.seen.append(metadata["traceparent"])
        req = ExportTraceServiceRequest()
        rs = req.resource_spans.add()
        rs.resource.attributes.append(kv("service.name", "ridethrough-agent"))
        span = rs.scope_spans.add().spans.add()
        span.trace_id, span.parent_span_id = bytes.fromhex(parent.trace_id), bytes.fromhex(parent.span_id)
        span.span_id, span.name = bytes.fromhex("a9e0" * 4), "agent.reroute"
        span.start_time_unix_nano = self._clock()
        span.end_time_unix_nano = self._clock()
        write_requests(self._store, [(Signal.TRACES, req)], token=f"agent:{parent.span_id}",
                       metrics=GatewayMetrics.create())


class Reroute:
    """Routes around a link: one step that calls the agent, with the step's traceparent."""

    name = "reroute"

    def __init__(self, agent: Agent | None, *, verify_ok: bool = True) -> None:
        self.agent, self.verify_ok = agent, verify_ok

    def plan(self, incident: Incident, fleet_state: FleetState) -> Plan | None:
        return Plan.for_incident(self.name, incident, summary="route around", steps=("drain h3",))

    def apply(self, plan: Plan, deadline: Deadline) -> Result:
        for name in plan.steps:
            with step(name):
                if self.agent is not None:
                    self.agent.reroute({"traceparent": current_traceparent() or ""})
        return Result.success("rerouted")

    def verify(self, plan: Plan, deadline: Deadline) -> Result:
        return Result(self.verify_ok, "loss 0%" if self.verify_ok else "loss still 30%")

    def rollback(self, plan: Plan, deadline: Deadline) -> Result:
        with step("restore routes"):
            pass
        return Result.success("restored")


def open_incident(store: Store, entity: str) -> Transition:
    """An incident opened by the real tracker, its root span written by the real emitter."""
    tracker = IncidentTracker(store, clock=lambda: T0, cluster=entity)
    tracker.load()
    finding = Finding(detector="link", kind=FindingKind.LINK_DOWN, entity_type=EntityType.LINK, entity=entity,
                      severity=Severity.ERROR, confidence=1.0, summary=f"{entity} down", observed_at_ns=T0,
                      cluster=entity)
    [opened] = tracker.observe([finding], T0)
    IncidentEmitter(store=store, metrics=GatewayMetrics.create())([opened])
    return opened


def act(store: Store, entity: str, **plugin: Any) -> tuple[Transition, Runner, Agent]:
    opened = open_incident(store, entity)
    clock = Ticking(T0 + 20 * S)
    agent = Agent(store, clock)
    runner = Runner(store=store, plugins=[Reroute(agent, **plugin)],
                    policy=RunnerPolicy(dry_run=False, hysteresis_s=5.0), fleet=lambda: FleetState(T0), clock=clock)
    assert len(runner.on_transitions([opened])) == 1
    assert runner.wait_idle(10)
    return opened, runner, agent


def spans(store: Store, trace_id: str) -> dict[str, list[tuple[str, str, str, str]]]:
    """SpanName → [(SpanId, ParentSpanId, StatusCode, ServiceName)] of one trace."""
    _, rows = store.query("SELECT SpanName, SpanId, ParentSpanId, StatusCode, ServiceName, TraceId FROM otel_traces "
                          "WHERE TraceId = {t:String} ORDER BY Timestamp", parameters={"t": trace_id})
    out: dict[str, list[tuple[str, str, str, str]]] = {}
    for name, sid, parent, status, service, trace in rows:
        assert trace == trace_id
        out.setdefault(name, []).append((sid, parent, status, service))
    return out


def test_an_action_continues_its_incidents_trace(store: Store) -> None:
    opened, _, agent = act(store, "tr1")
    trace = opened.incident.trace_id
    got = spans(store, trace)
    root = root_span_id(trace).hex()
    [(root_id, root_parent, _, _)] = got["incident"]
    assert (root_id, root_parent) == (root, "")
    [(_, decide_parent, decide_status, _)] = got["action.decide"]
    [(apply_id, apply_parent, apply_status, _)] = got["action.apply"]
    [(step_id, step_parent, _, _)] = got["action.step"]
    [(_, verify_parent, verify_status, _)] = got["action.verify"]
    [(_, agent_parent, _, agent_service)] = got["agent.reroute"]
    assert decide_parent == apply_parent == verify_parent == root
    assert step_parent == apply_id and agent_parent == step_id and agent_service == "ridethrough-agent"
    assert decide_status == apply_status == verify_status == "Ok"
    assert agent.seen == [f"00-{trace}-{step_id}-01"]
    assert "action.rollback" not in got
    assert {n for n in got if n.startswith("action.")} <= set(SPAN_NAMES)


def test_decide_span_carries_the_decision(store: Store) -> None:
    opened, _, _ = act(store, "tr2")
    _, rows = store.query(
        "SELECT SpanAttributes FROM otel_traces WHERE TraceId = {t:String} AND SpanName = 'action.decide'",
        parameters={"t": opened.incident.trace_id})
    attrs = rows[0][0]
    assert attrs["action.plugin"] == "reroute" and attrs["action.status"] == "applying"
    assert attrs["incident.id"] == opened.incident.incident_id and attrs["plan.steps"] == "drain h3"
    _, final = store.query("SELECT argMax(Status, Version), argMax(TraceId, Version) FROM actions "
                           "WHERE ActionId = {a:String}", parameters={"a": attrs["action.id"]})
    assert final == [("succeeded", opened.incident.trace_id)]


def test_a_failed_verify_shows_as_an_error_then_a_rollback(store: Store) -> None:
    opened, _, _ = act(store, "tr3", verify_ok=False)
    got = spans(store, opened.incident.trace_id)
    root = root_span_id(opened.incident.trace_id).hex()
    [(_, _, verify_status, _)] = got["action.verify"]
    [(rollback_id, rollback_parent, rollback_status, _)] = got["action.rollback"]
    assert verify_status == "Error" and rollback_parent == root and rollback_status == "Ok"
    assert rollback_id in {parent for _, parent, _, _ in got["action.step"]}  # "restore routes" is its child
    assert {n for n in got if n.startswith("action.")} <= set(SPAN_NAMES)


def test_spans_the_store_refuses_cost_nothing_but_a_count(store: RefusingStore) -> None:
    opened = open_incident(store, "tr4")
    store.refuse = {"otel_traces"}
    try:
        runner = Runner(store=store, plugins=[Reroute(None)],
                        policy=RunnerPolicy(dry_run=False, hysteresis_s=0.0), fleet=lambda: FleetState(T0))
        [decision] = runner.consider([opened.incident])
        assert runner.wait_idle(10)
    finally:
        store.refuse = set()
    _, final = store.query("SELECT argMax(Status, Version) FROM actions WHERE ActionId = {a:String}",
                           parameters={"a": decision.action_id})
    assert final == [("succeeded",)]
    assert runner.metrics.registry.get_sample_value("ridethrough_actuator_store_errors_total",
                                                    {"what": "spans"}) == 3  # decide, apply, verify


def test_trace_view_prints_the_tree(store: Store) -> None:
    opened, _, _ = act(store, "tr5")
    text = show(store, opened.incident.incident_id)
    lines = text.splitlines()
    assert lines[0].startswith(f"incident {opened.incident.incident_id} link_down:link:tr5, trace "
                               f"{opened.incident.trace_id} (6 spans over 20.")
    names = [line.split("  +")[0].rstrip() for line in lines[1:]]
    assert names == ["incident", "  action.decide", "  action.apply", "    action.step", "      agent.reroute",
                     "  action.verify"]
    decide = next(line for line in lines if "action.decide" in line)
    assert "Ok" in decide and "action.plugin=reroute action.status=applying" in decide and " ms " in decide
    assert "step.name=drain h3" in next(line for line in lines if "action.step" in line)
    assert "[ridethrough-agent]" in next(line for line in lines if "agent.reroute" in line)
    with pytest.raises(TraceNotFound, match="no incident 'nope'"):
        show(store, "nope")


def test_trace_command(store: Store) -> None:
    opened, _, _ = act(store, "tr6")
    app = typer.Typer()
    app.command("trace")(trace_command)
    app.command("other")(lambda: None)  # two commands: typer keeps "trace" as a subcommand
    cli = CliRunner()
    ok = cli.invoke(app, ["trace", opened.incident.incident_id, "--store", store.dsn])
    assert ok.exit_code == 0, ok.output
    assert "      agent.reroute" in ok.output
    missing = cli.invoke(app, ["trace", "nope", "--store", store.dsn])
    assert missing.exit_code == 1 and "no incident 'nope'" in missing.output


def test_render_marks_spans_whose_parent_is_missing() -> None:
    rows = [SpanRow("a" * 16, "", "incident", "ridethrough-controller", T0, 0, "Unset", "", {}),
            SpanRow("b" * 16, "c" * 16, "agent.late", "ridethrough-agent", T0 + S, 2_500_000, "Error", "nic down",
                    {})]
    text = render("f" * 32, "k", "i1", rows)
    assert text.splitlines()[1] == "incident       +0.000 s        0.0 ms  Unset"
    assert text.splitlines()[2] == ("agent.late     +1.000 s        2.5 ms  Error  [ridethrough-agent] error=nic down"
                                    "  (parent not in store)")


def test_traceparent_outside_an_action_and_malformed() -> None:
    assert current_traceparent() is None
    with step("alone") as ctx:
        assert ctx is None
    parsed = parse_traceparent("00-" + "ab" * 16 + "-" + "cd" * 8 + "-01")
    assert parsed.traceparent() == "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    for bad in ("", "00-" + "0" * 32 + "-" + "cd" * 8 + "-01", "00-xyz-abc-01"):
        with pytest.raises(ValueError, match="malformed traceparent"):
            parse_traceparent(bad)


def test_a_taken_over_action_continues_the_same_trace_with_fresh_span_ids(store: Store) -> None:
    opened = open_incident(store, "tr9")
    inc = opened.incident
    plan = Reroute(None).plan(inc, FleetState(T0))
    assert plan is not None
    # What the killed runner left: its decide span, and the row that says apply had started.
    record = ActionRecord("killed-tr9", plan.idempotency_key, inc.incident_id, inc.key, inc.trace_id, inc.cluster,
                          plan.plugin, inc.entity, Status.APPLYING, "accepted", False, plan.summary, plan.steps, (), (),
                          {}, "", T0 + S, T0 + S)
    ActionLog(store).write(record)
    dead = ActionTrace(trace_id=inc.trace_id, action_id=record.action_id, clock=Ticking(T0 + S))
    decide = dead.start("action.decide", action_attributes(record))
    decide.end(T0 + 2 * S)
    SpanWriter(store=store, metrics=GatewayMetrics.create()).write([decide])
    runner = Runner(store=store, plugins=[Reroute(None)], policy=RunnerPolicy(dry_run=False, hysteresis_s=0.0),
                    fleet=lambda: FleetState(T0), clock=Ticking(T0 + 30 * S), cluster=inc.cluster)
    assert runner.load() == 1 and runner.wait_idle(10)
    got = spans(store, inc.trace_id)
    root = root_span_id(inc.trace_id).hex()
    [(_, recover_parent, _, _)] = got["action.recover"]
    [(_, verify_parent, verify_status, _)] = got["action.verify"]
    assert recover_parent == verify_parent == root and verify_status == "Ok"
    assert "action.apply" not in got  # never applied again
    ids = [sid for rows in got.values() for sid, _, _, _ in rows]
    assert len(ids) == len(set(ids))  # the new runner's span ids do not collide with the dead one's
    assert {n for n in got if n.startswith("action.")} <= set(SPAN_NAMES)
