"""Human approval through the store: ``ridethrough actions list|approve|deny`` against the embedded chDB
store, the controller's approval poller passing decisions to a real runner, and the built controller
acting once an operator approves.

One chDB store per module (a process hosts one store path at a time); the CLI opens the same path
in this process, as an operator's command would open the store the controller writes. Each test
uses its own entities, so idempotency keys and cooldowns of one test never meet another's.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner, Result

from ridethrough.actuators.actions import ActionLog, ActionRecord, Status
from ridethrough.actuators.approvals import ApprovalPoller
from ridethrough.actuators.approvals_events import printable
from ridethrough.actuators.approvals_table import ApprovalLog, Decision, Verdict, approvals_ddl
from ridethrough.actuators.contract import Deadline, FleetState, Plan
from ridethrough.actuators.contract import Result as ActResult
from ridethrough.actuators.policy import RunnerPolicy, UnknownPlan
from ridethrough.actuators.runner import Runner
from ridethrough.cli import app
from ridethrough.controller_wiring import build_controller
from ridethrough.detectors.contract import EntityType, Finding, FindingKind, Severity, Window
from ridethrough.detectors.controller import ControllerMetrics
from ridethrough.detectors.incidents import Incident, State, new_trace_id
from ridethrough.exporters.gateway_metrics import GatewayMetrics
from ridethrough.exporters.store import Store
from ridethrough.settings import ActuatorConfig, ControllerConfig
from tests import test_actuator_runner as runner_tests
from tests.conftest import wait_for

S = 1_000_000_000
_IDS = itertools.count()
HOSTILE = "ok'); DROP TABLE actions; --\n\x1b[31m{x:String} \\' \u202e ünï\x00 end"
"""An operator's reason that is SQL, a query parameter, a terminal escape, a NUL and bidi text at once."""


@pytest.fixture(scope="module")
def dsn(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"chdb://{tmp_path_factory.mktemp('approvals') / 'store'}"


class TappedStore(runner_tests.TappedStore):
    """The runner tests' tapped store, reading back the (status, reason) versions of one action."""

    def reasons(self, action_id: str) -> list[tuple[str, str]]:
        """Every version written for the action, in order: (status, reason)."""
        return [(r["Status"], r["Reason"]) for r in self.action_rows if r["ActionId"] == action_id]


@pytest.fixture(scope="module")
def store(dsn: str) -> Iterator[TappedStore]:
    s = TappedStore(dsn)
    s.init_schema()
    ActionLog(s).ensure_table()
    yield s
    s.close()


class Fixes:
    """An actuator that fixes any incident, asking a human first when told to; records its calls."""

    name = "fixes"

    def __init__(self, *, needs_approval: bool = False) -> None:
        self.needs_approval = needs_approval
        self.calls: list[str] = []

    def plan(self, incident: Incident, fleet_state: FleetState) -> Plan | None:
        return Plan.for_incident(self.name, incident, summary=f"route around {incident.entity}",
                                 steps=("move routes",), needs_approval=self.needs_approval)

    def apply(self, plan: Plan, deadline: Deadline) -> ActResult:
        self.calls.append("apply")
        return ActResult.success("moved")

    def verify(self, plan: Plan, deadline: Deadline) -> ActResult:
        self.calls.append("verify")
        return ActResult.success("loss 0%")

    def rollback(self, plan: Plan, deadline: Deadline) -> ActResult:
        self.calls.append("rollback")
        return ActResult.success("restored")


def incident(entity: str) -> Incident:
    opened = time.time_ns() - 60 * S
    return Incident(f"inc-{entity}-{next(_IDS)}", f"link_down:link:{entity}", "link_down", "link", entity, "c1",
                    "link", Severity.ERROR, State.OPEN, opened, opened, 0, opened, 1, 0, f"{entity} is down", "{}",
                    new_trace_id(), 1)


def runner(store: Store, plugin: Fixes, **policy: float | bool) -> Runner:
    settings = {"dry_run": False, "hysteresis_s": 0.0, **policy}
    return Runner(store=store, plugins=[plugin], policy=RunnerPolicy(**settings),
                  fleet=lambda: FleetState(taken_at_ns=time.time_ns()))


def cli(dsn: str, *args: str, user: str | None = "ops") -> Result:
    return CliRunner().invoke(app, ["actions", *args, "--store", dsn], env={"USER": user})


def final(store: Store, action_id: str) -> tuple[str, str]:
    _, rows = store.query("SELECT argMax(Status, Version), argMax(Reason, Version) FROM actions "
                          "WHERE ActionId = {a:String}", parameters={"a": action_id})
    return rows[0]


@pytest.fixture
def waiting(store: Store, request: pytest.FixtureRequest) -> Iterator[tuple[Runner, Fixes, str]]:
    """A runner holding one action awaiting approval, with an approval poller on it."""
    plugin = Fixes()
    r = runner(store, plugin, require_approval=True)
    [d] = r.consider([incident(request.node.name[:40])])
    assert d.status is Status.AWAITING_APPROVAL
    poller = ApprovalPoller(runner=r, log=ApprovalLog(store), interval_s=0.05, cluster="c1")  # the controller's
    poller.start()
    yield r, plugin, d.action_id
    poller.stop()
    r.shutdown(10)


def test_approve_through_the_cli_lets_the_waiting_action_apply(store: TappedStore, dsn: str, waiting) -> None:
    r, plugin, action = waiting
    listed = cli(dsn, "list", "--pending")
    assert listed.exit_code == 0 and action[:12] in listed.stdout and "awaiting_approval" in listed.stdout
    time.sleep(0.3)  # several poller ticks with no decision: the action still waits
    assert plugin.calls == [] and action in r.awaiting_approval()
    done = cli(dsn, "approve", action[:10], "--by", "alice", "--reason", "spine1 is drained anyway")
    assert done.exit_code == 0, done.output
    assert f"approved action {action}" in done.stdout and "as alice" in done.stdout
    wait_for(lambda: final(store, action)[0] == "succeeded", timeout_s=30, what="the approved action to end")
    assert plugin.calls == ["apply", "verify"]
    assert store.reasons(action)[:2] == [("awaiting_approval", "approval required"),
                                         ("applying", "approved by alice: spine1 is drained anyway")]
    _, spans = store.query("SELECT SpanAttributes['approval.by'], SpanAttributes['approval.verdict'] "
                           "FROM otel_traces WHERE SpanName = 'action.approval' "
                           "AND SpanAttributes['action.id'] = {a:String}", parameters={"a": action})
    assert spans == [("alice", "approved")]
    again = cli(dsn, "approve", action)
    assert again.exit_code == 1 and "is succeeded, not awaiting approval" in again.stderr


def test_deny_refuses_with_the_operators_name_and_reason(store: Store, dsn: str, waiting) -> None:
    r, plugin, action = waiting
    done = cli(dsn, "deny", action, "--reason", "maintenance window at 14:00", user="bob")  # --by from $USER
    assert done.exit_code == 0, done.output
    wait_for(lambda: final(store, action)[0] == "denied", timeout_s=30, what="the denied action to end")
    assert final(store, action) == ("denied", "denied by bob: maintenance window at 14:00")
    assert plugin.calls == [] and r.awaiting_approval() == {}


def test_a_second_decision_on_the_same_action_is_refused(store: Store, dsn: str, waiting) -> None:
    _, _, action = waiting
    first = cli(dsn, "deny", action, "--by", "carol")
    assert first.exit_code == 0, first.output
    late = cli(dsn, "approve", action, "--by", "dave")
    # the first answer wins: either the controller already acted on it, or the decision is still on its way
    assert late.exit_code == 1 and ("already answered: deny by carol" in late.stderr
                                    or "is denied, not awaiting approval" in late.stderr)
    wait_for(lambda: final(store, action)[0] == "denied", timeout_s=30, what="the first decision to win")


def test_hostile_reason_is_stored_verbatim_and_shown_escaped(store: TappedStore, dsn: str, waiting) -> None:
    _, _, action = waiting
    done = cli(dsn, "approve", action, "--by", "mallory", "--reason", HOSTILE)
    assert done.exit_code == 0, done.output
    wait_for(lambda: final(store, action)[0] == "succeeded", timeout_s=30, what="the approved action to end")
    decided = ApprovalLog(store).first_decisions([action])[action]
    assert decided.reason == HOSTILE and decided.operator == "mallory" and decided.verdict is Verdict.APPROVE
    assert store.reasons(action)[1] == ("applying", f"approved by mallory: {HOSTILE}")
    _, tables = store.query("EXISTS TABLE actions")
    assert tables == [(1,)]
    shown = cli(dsn, "list", "--limit", "50")
    assert shown.exit_code == 0 and "\x1b" not in shown.stdout and "\x00" not in shown.stdout
    assert printable(HOSTILE) == "ok'); DROP TABLE actions; --\\n\\x1b[31m{x:String} \\' \\u202e ünï\\x00 end"


def test_approval_timeout_still_refuses_and_a_late_approve_fails_clearly(store: Store, dsn: str) -> None:
    plugin = Fixes(needs_approval=True)  # the plan asks, though the policy does not require it
    r = runner(store, plugin, approval_timeout_s=0.3)
    poller = ApprovalPoller(runner=r, log=ApprovalLog(store), interval_s=0.05, cluster="c1")  # the controller's
    poller.start()
    try:
        [d] = r.consider([incident("timeout1")])
        assert r.wait_idle(30)
    finally:
        poller.stop()
    assert plugin.calls == [] and final(store, d.action_id) == ("refused", "approval timed out after 0.3 s")
    late = cli(dsn, "approve", d.action_id)
    assert late.exit_code == 1 and "is refused, not awaiting approval (approval timed out" in late.stderr


def test_unknown_ambiguous_and_anonymous_ids_fail_clearly(store: Store, dsn: str) -> None:
    log, now = ActionLog(store), time.time_ns()
    for aid in ("feed0001" + "0" * 24, "feed0002" + "0" * 24):
        log.write(ActionRecord(aid, "plan-" + aid, "inc-x", "k", "0" * 32, "c1", "fixes", "ambig",
                               Status.AWAITING_APPROVAL, "approval required", False, "", (), (), (), {}, "", now))
    unknown = cli(dsn, "approve", "0123456789abcdef")
    assert unknown.exit_code == 1 and "no action with id '0123456789abcdef'" in unknown.stderr
    ambiguous = cli(dsn, "deny", "feed000")
    assert ambiguous.exit_code == 1 and "ambiguous" in ambiguous.stderr and "feed0002" in ambiguous.stderr
    nobody = cli(dsn, "approve", "feed0001", user=None)
    assert nobody.exit_code == 1 and "--by must name who decides" in nobody.stderr
    listed = cli(dsn, "list", "--pending", "--limit", "1")
    assert listed.exit_code == 0 and len(listed.stdout.splitlines()) == 2  # a header and one action
    # Nothing was decided by the failed commands.
    assert ApprovalLog(store).first_decisions(["feed0001" + "0" * 24, "feed0002" + "0" * 24]) == {}


class Holds:
    """A runner holding fixed plans for approval; answers as the real one does (UnknownPlan once answered)."""

    def __init__(self, waiting: dict[str, str]) -> None:
        self.waiting = dict(waiting)
        self.answers: list[tuple[str, str, str, str]] = []

    def awaiting_approval(self) -> dict[str, str]:
        return dict(self.waiting)

    def approve(self, plan_id: str, *, by: str = "", reason: str = "") -> None:
        self._answer("approve", plan_id, by, reason)

    def deny(self, plan_id: str, *, by: str = "", reason: str = "") -> None:
        self._answer("deny", plan_id, by, reason)

    def _answer(self, verdict: str, plan_id: str, by: str, reason: str) -> None:
        if plan_id == "gone":
            raise UnknownPlan(f"no plan {plan_id!r} is awaiting approval")
        self.answers.append((verdict, plan_id, by, reason))


def test_poller_passes_only_matching_decisions_on_and_skips_plans_no_longer_waiting(store: Store) -> None:
    approvals = ApprovalLog(store)
    now = time.time_ns()
    for did, aid, pid, verdict in (("d1", "p-act1", "plan1", Verdict.APPROVE), ("d2", "p-act2", "other", Verdict.DENY),
                                   ("d3", "p-act3", "gone", Verdict.DENY), ("d4", "p-act4", "plan4", Verdict.DENY),
                                   ("d5", "p-act4", "plan4", Verdict.APPROVE)):
        approvals.write(Decision(did, aid, pid, "c1", verdict, "erin", f"why {did}", now + int(did[1])))
    held = Holds({"p-act1": "plan1", "p-act2": "plan2", "p-act3": "gone", "p-act4": "plan4", "p-act5": "plan5"})
    poller = ApprovalPoller(runner=held, log=approvals)
    passed = poller.poll_once()
    # p-act2's decision names another plan; p-act3's plan stopped waiting (UnknownPlan); p-act4: the first wins
    assert [d.decision_id for d in passed] == ["d1", "d4"]
    assert held.answers == [("approve", "plan1", "erin", "why d1"), ("deny", "plan4", "erin", "why d4")]
    assert poller.poll_once() == [] and len(held.answers) == 2  # answered once, not at every tick


def test_approvals_ddl_is_an_append_only_table_that_store_init_creates() -> None:
    [single] = approvals_ddl()
    assert "CREATE TABLE IF NOT EXISTS `approvals`" in single and "ENGINE = MergeTree" in single
    assert "ORDER BY (Cluster, ActionId, DecidedAt)" in single
    printed = CliRunner().invoke(app, ["store", "init", "--print-sql", "--store", "chdb://unused"])
    assert printed.exit_code == 0 and single in printed.stdout


class Finds:
    """A detector that reports one link down."""

    name = "finds"
    interval_s = 3600.0
    window_s = 60.0

    def detect(self, window: Window) -> list[Finding]:
        return [Finding(detector=self.name, kind=FindingKind.LINK_DOWN, entity_type=EntityType.LINK,
                        entity="h7-leaf0r0", severity=Severity.CRITICAL, confidence=1.0, summary="h7-leaf0r0 down",
                        observed_at_ns=window.end_ns)]


def test_the_built_controller_acts_once_an_operator_approves(store: Store, dsn: str, monkeypatch) -> None:
    monkeypatch.setattr("ridethrough.controller_wiring.default_detectors", lambda cfg: [Finds()])
    plugin = Fixes()
    monkeypatch.setattr("ridethrough.controller_wiring.load_plugins", lambda: [plugin])
    parts = build_controller(ControllerConfig(cluster="approving"), store=store,
                             metrics=ControllerMetrics.create(), event_metrics=GatewayMetrics.create(),
                             actuators=ActuatorConfig(enabled=True, dry_run=False, hysteresis_s=0.0,
                                                      require_approval=True))
    assert parts.approvals is not None and parts.runner is not None
    parts.start()
    try:
        action = wait_for(lambda: next(iter(parts.runner.awaiting_approval()), None) if parts.runner else None,
                          timeout_s=60, what="an action awaiting approval")
        done = cli(dsn, "approve", action[:8], "--by", "frank")
        assert done.exit_code == 0, done.output
        wait_for(lambda: final(store, action)[0] == "succeeded", timeout_s=60, what="the approved action to end")
    finally:
        parts.stop()
    assert plugin.calls == ["apply", "verify"] and final(store, action) == ("succeeded", "verified")


def test_a_backdated_decision_on_another_plan_neither_wins_nor_hides_the_real_one(store: Store, dsn: str,
                                                                                waiting) -> None:
    r, _, action = waiting
    plan = r.awaiting_approval()[action]
    approvals = ApprovalLog(store)
    approvals.ensure_table()
    approvals.write(Decision("forged01", action, "not-" + plan, "c1", Verdict.DENY, "mallory", "x", 1))
    done = cli(dsn, "approve", action, "--by", "alice")  # the forged record is no answer: the CLI still decides
    assert done.exit_code == 0, done.output
    wait_for(lambda: final(store, action)[0] == "succeeded", timeout_s=30, what="the real approval to apply")
    assert ApprovalLog(store).first_decisions([action], plans={action: plan})[action].operator == "alice"
