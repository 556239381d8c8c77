"""The actuator runner against a real chDB store, with scripted plugins: safety policy, idempotency,
approvals, rollback, isolation of failing plugins, and plugin validation at load.

One chDB store per test module (a process hosts one store path at a time); each test uses its
own entities, so cooldowns and idempotency keys of one test never meet another's.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ridethrough.actuators.actions import ActionLog, ActionRecord, Status, actions_ddl
from ridethrough.actuators.contract import Deadline, FleetState, Plan, Result
from ridethrough.actuators.plugins import PluginError, load_plugins, validate
from ridethrough.actuators.policy import RunnerPolicy, UnknownPlan
from ridethrough.actuators.runner import Runner
from ridethrough.detectors.contract import Severity
from ridethrough.detectors.incidents import Incident, State, new_trace_id
from ridethrough.exporters.schema import Table
from ridethrough.exporters.store import Store
from tests.conftest import wait_for

S = 1_000_000_000
T0 = 1_700_000_000 * S
_IDS = itertools.count()


class TappedStore(Store):
    """The real store, remembering every ``actions`` row it took (merges may drop old versions)."""

    def __init__(self, dsn: str) -> None:
        super().__init__(dsn)
        self.action_rows: list[dict[str, Any]] = []

    def insert_columns(self, table: Table, columns: Sequence[Sequence[Any]], *, token: str) -> None:
        super().insert_columns(table, columns, token=token)
        if table.name == "actions":
            rows = zip(*columns, strict=True)
            self.action_rows += [dict(zip(table.insert_columns, row, strict=True)) for row in rows]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TappedStore]:
    s = TappedStore(f"chdb://{tmp_path_factory.mktemp('actuators') / 'store'}")
    s.init_schema()
    yield s
    s.close()


class Clock:
    """The runner's wall clock, moved by the test."""

    def __init__(self, now_ns: int = T0) -> None:
        self.now_ns = now_ns

    def __call__(self) -> int:
        return self.now_ns

    def advance(self, seconds: float) -> None:
        self.now_ns += round(seconds * S)


@dataclass
class Scripted:
    """An actuator that plans what it is told, records its calls, and fails or blocks on request."""

    name: str = "scripted"
    drains: frozenset[str] = frozenset()
    removes: frozenset[str] = frozenset()
    needs_approval: bool = False
    plan_error: Exception | None = None
    apply_error: Exception | None = None
    apply_ok: bool = True
    verify_ok: bool = True
    verify_undecided: bool = False
    rollback_ok: bool = True
    apply_sleep_s: float = 0.0
    gate: threading.Event | None = None
    calls: list[tuple[str, str]] = field(default_factory=list)

    def plan(self, incident: Incident, fleet_state: FleetState) -> Plan | None:
        if self.plan_error is not None:
            raise self.plan_error
        return Plan.for_incident(self.name, incident, summary=f"fix {incident.entity}", steps=("drain", "reroute"),
                                 params={"via": "spine1"}, drains_hosts=self.drains, removes_paths=self.removes,
                                 needs_approval=self.needs_approval)

    def apply(self, plan: Plan, deadline: Deadline) -> Result:
        self.calls.append(("apply", plan.entity))
        if self.gate is not None:
            self.gate.wait(deadline.remaining_s())
        if self.apply_sleep_s:
            time.sleep(self.apply_sleep_s)
        if self.apply_error is not None:
            raise self.apply_error
        return Result(self.apply_ok, "applied" if self.apply_ok else "switch said no")

    def verify(self, plan: Plan, deadline: Deadline) -> Result:
        self.calls.append(("verify", plan.entity))
        if self.verify_undecided:
            return Result.undecided("too few probes by the deadline")
        return Result(self.verify_ok, "paths healthy" if self.verify_ok else "loss still 30%")

    def rollback(self, plan: Plan, deadline: Deadline) -> Result:
        self.calls.append(("rollback", plan.entity))
        return Result(self.rollback_ok, "restored" if self.rollback_ok else "switch unreachable")

    def applied(self) -> int:
        return sum(1 for c in self.calls if c[0] == "apply")


FLEET = FleetState(
    taken_at_ns=T0, hosts=frozenset({"h1", "h2", "h3", "h4"}), drained_hosts=frozenset(),
    paths={"h1": frozenset({"p1", "p2", "p3", "p4"}), "h2": frozenset({"p5", "p6"}),
           "leaf1": frozenset({"p1", "p2", "p5", "p6"})})


def incident(entity: str, *, opened_at_ns: int = T0 - 60 * S, cluster: str = "c1") -> Incident:
    n = next(_IDS)
    return Incident(f"inc-{entity}-{n}", f"link_down:link:{entity}", "link_down", "link", entity, cluster, "link",
                    Severity.ERROR, State.OPEN, opened_at_ns, opened_at_ns, 0, opened_at_ns, 1, 0,
                    f"{entity} is down", "{}", new_trace_id(), 1)


def runner(store: Store, *plugins: Any, clock: Clock | None = None, fleet: FleetState = FLEET,
           **policy: Any) -> Runner:
    settings = {"dry_run": False, "hysteresis_s": 0.0, "cooldown_s": 300.0, **policy}
    return Runner(store=store, plugins=list(plugins), policy=RunnerPolicy(**settings), fleet=lambda: fleet,
                  clock=clock or Clock())


def history(store: Store, action_id: str) -> list[tuple[str, str]]:
    """Every version written for the action, in order (status, reason)."""
    assert isinstance(store, TappedStore)
    return [(r["Status"], r["Reason"]) for r in store.action_rows if r["ActionId"] == action_id]


def outcomes(store: Store, incident_id: str) -> list[tuple[str, int]]:
    """The actions of an incident by their current status: (status, how many)."""
    _, rows = store.query("SELECT s, count() FROM (SELECT argMax(Status, Version) AS s FROM actions "
                          "WHERE IncidentId = {i:String} GROUP BY ActionId) GROUP BY s ORDER BY s",
                          parameters={"i": incident_id})
    return [(r[0], r[1]) for r in rows]


def final(store: Store, action_id: str) -> tuple[str, str, str]:
    _, rows = store.query("SELECT argMax(Status, Version), argMax(Reason, Version), argMax(Detail, Version) "
                          "FROM actions WHERE ActionId = {a:String}", parameters={"a": action_id})
    return rows[0]


def run_one(r: Runner, inc: Incident) -> str:
    [decision] = r.consider([inc])
    assert r.wait_idle(10)
    return decision.action_id


# -- the happy path and dry-run ---------------------------------------------------------------


def test_apply_then_verify_records_every_phase(store: Store) -> None:
    plugin = Scripted()
    r = runner(store, plugin)
    action = run_one(r, incident("ok1"))
    assert plugin.calls == [("apply", "ok1"), ("verify", "ok1")]
    assert [s for s, _ in history(store, action)] == ["applying", "verifying", "succeeded"]
    _, timings = store.query("SELECT Timings, PathShares FROM actions FINAL WHERE ActionId = {a:String}",
                             parameters={"a": action})
    assert set(timings[0][0]) == {"apply_s", "verify_s"} and timings[0][1] == {}


def test_dry_run_records_the_decision_and_applies_nothing(store: Store) -> None:
    plugin = Scripted(removes=frozenset({"p1"}))
    r = runner(store, plugin, dry_run=True)
    inc = incident("dry1")
    [d] = r.consider([inc])
    assert d.status is Status.DRY_RUN and plugin.calls == []
    assert history(store, d.action_id) == [("dry_run", "dry run")]
    _, rows = store.query("SELECT DryRun, PathShares FROM actions FINAL WHERE ActionId = {a:String}",
                          parameters={"a": d.action_id})
    assert rows == [(True, {"h1": 0.25, "leaf1": 0.25})]
    [again] = r.consider([inc])  # a dry run spends the key for other dry runs
    assert again.status is Status.REFUSED and again.reason.startswith("duplicate")
    live = runner(store, plugin)  # ... but not for a live runner: the plan acts once for real
    assert run_one(live, inc) and plugin.applied() == 1


# -- policy -----------------------------------------------------------------------------------


def test_concurrency_cap_refuses_while_actions_are_in_flight(store: Store) -> None:
    gate = threading.Event()
    plugin = Scripted(gate=gate)
    r = runner(store, plugin, max_concurrent=1)
    [first] = r.consider([incident("cc1")])
    [second] = r.consider([incident("cc2")])
    assert first.status is Status.APPLYING
    assert second.status is Status.REFUSED and second.reason == "concurrency: 1 actions in flight (max 1)"
    assert history(store, second.action_id) == [("refused", second.reason)]
    gate.set()
    assert r.wait_idle(10)
    [third] = r.consider([incident("cc3")])
    assert third.status is Status.APPLYING
    assert r.wait_idle(10)


def test_host_drain_cap_counts_hosts_already_drained(store: Store) -> None:
    fleet = FleetState(taken_at_ns=T0, hosts=FLEET.hosts, drained_hosts=frozenset({"h4"}), paths=FLEET.paths)
    r = runner(store, Scripted(drains=frozenset({"h1"})), fleet=fleet, max_drained_hosts=1)
    [d] = r.consider([incident("drain1")])
    assert d.status is Status.REFUSED and d.reason == "blast radius: 2 hosts would be drained (max 1)"
    r2 = runner(store, Scripted(drains=frozenset({"h9"})))
    [unknown] = r2.consider([incident("drain2")])
    assert unknown.reason == "blast radius: drains hosts unknown to the fleet: h9"


def test_path_share_cap_names_the_switch_and_counts_actions_in_flight(store: Store) -> None:
    r = runner(store, Scripted(removes=frozenset({"p1", "p2", "p5"})), max_path_share=0.5)
    [d] = r.consider([incident("share1")])
    assert d.status is Status.REFUSED and d.reason == "blast radius: leaf1 would lose 75% of its paths (max 50%)"
    gate = threading.Event()
    plugin = Scripted(removes=frozenset({"p1", "p2"}), gate=gate)
    r2 = runner(store, plugin, max_path_share=0.5)
    [ok] = r2.consider([incident("share2")])  # h1 and leaf1 lose 2 of 4: allowed
    plugin.removes = frozenset({"p3"})  # h1 would lose 3 of 4 with the one in flight
    [over] = r2.consider([incident("share3")])
    gate.set()
    assert r2.wait_idle(10)
    assert ok.status is Status.APPLYING
    assert over.reason == "blast radius: h1 would lose 75% of its paths (max 50%)"
    [unknown] = runner(store, Scripted(removes=frozenset({"p42"}))).consider([incident("share4")])
    assert unknown.reason == "blast radius: removes paths unknown to the fleet: p42"


def test_hysteresis_waits_for_the_incident_to_persist(store: Store) -> None:
    clock = Clock()
    plugin = Scripted()
    r = runner(store, plugin, clock=clock, hysteresis_s=10.0)
    inc = incident("hyst1", opened_at_ns=T0)
    [early] = r.consider([inc])
    assert early.status is Status.REFUSED and early.reason == "hysteresis: incident open 0.0 s < 10 s"
    clock.advance(5)
    [repeat] = r.consider([inc])  # the same rule again: not recorded twice
    assert repeat.status is Status.REFUSED and repeat.action_id == ""
    clock.advance(5)
    assert run_one(r, inc) and plugin.applied() == 1
    assert outcomes(store, inc.incident_id) == [("refused", 1), ("succeeded", 1)]


def test_a_rolled_back_action_cools_its_own_incident_down_not_another_on_the_entity(store: Store) -> None:
    clock = Clock()
    plugin = Scripted(verify_ok=False)  # verify fails: the action is rolled back, the fleet as it was
    r = runner(store, plugin, clock=clock, cooldown_s=300.0)
    degrading = dataclasses.replace(incident("cool3"), key="link_degrading:link:cool3", kind="link_degrading")
    run_one(r, degrading)
    assert outcomes(store, degrading.incident_id) == [("rolled_back", 1)]
    clock.advance(30)
    [same] = r.consider([dataclasses.replace(degrading, incident_id="inc-cool3-again")])
    assert same.reason.startswith("cooldown"), "the same incident key found again: cooling down"
    plugin.verify_ok = True
    down = incident("cool3")  # the link then fails outright: nothing of the first action is left
    assert run_one(r, down) and outcomes(store, down.incident_id) == [("succeeded", 1)]
    restarted = runner(store, plugin, clock=clock, cooldown_s=300.0)  # the rule holds from the store too
    restarted.load()
    [after] = restarted.consider([dataclasses.replace(down, incident_id="inc-cool3-third")])
    assert after.reason.startswith("cooldown"), "a succeeded action cools every incident on its entity"


def test_cooldown_per_entity_survives_a_restart(store: Store) -> None:
    clock = Clock()
    plugin = Scripted()
    r = runner(store, plugin, clock=clock, cooldown_s=60.0)
    run_one(r, incident("cool1"))
    clock.advance(30)
    [d] = r.consider([incident("cool1")])  # another incident, same entity
    assert d.status is Status.REFUSED and d.reason.startswith("cooldown: last action on cool1 ended 30.0 s ago")
    [other] = r.consider([incident("cool2")])  # another entity is not cooling down
    assert other.status is Status.APPLYING
    restarted = runner(store, plugin, clock=clock, cooldown_s=60.0)
    restarted.load()
    [still] = restarted.consider([incident("cool1")])
    assert still.reason.startswith("cooldown")
    clock.advance(31)
    assert run_one(restarted, incident("cool1"))
    assert r.wait_idle(10) and [c for c in plugin.calls if c[0] == "apply"] == [
        ("apply", "cool1"), ("apply", "cool2"), ("apply", "cool1")]


def test_policy_rejects_bad_values_by_name() -> None:
    with pytest.raises(ValueError, match=r"max_path_share must be within 0\.\.1"):
        RunnerPolicy(max_path_share=1.5)
    with pytest.raises(ValueError, match="max_concurrent must be > 0"):
        RunnerPolicy(max_concurrent=0)
    with pytest.raises(ValueError, match="dry_run must be true or false"):
        RunnerPolicy(dry_run="no")  # type: ignore[arg-type]  # the mistake under test


# -- idempotency ------------------------------------------------------------------------------


def test_a_duplicated_command_acts_once_and_is_refused_once(store: Store) -> None:
    plugin = Scripted()
    r = runner(store, plugin)
    inc = incident("dup1")
    first = run_one(r, inc)
    second, third = r.consider([inc]), r.consider([inc])
    assert plugin.applied() == 1
    assert second[0].status is Status.REFUSED and f"as action {first} (succeeded)" in second[0].reason
    assert third[0].action_id == ""  # the same refusal again is not a new row
    assert outcomes(store, inc.incident_id) == [("refused", 1), ("succeeded", 1)]


def test_a_restarted_runner_never_acts_twice(store: Store) -> None:
    plugin = Scripted()
    inc = incident("dup2")
    run_one(runner(store, plugin), inc)
    [d] = runner(store, plugin).consider([inc])
    assert d.status is Status.REFUSED and d.reason.startswith("duplicate") and plugin.applied() == 1


def left_in_flight(store: Store, plugin: Scripted, inc: Incident, status: Status, *, reason: str = "accepted",
                   recoveries: int = 0, params: dict[str, str] | None = None) -> str:
    """Write the row a runner killed mid-action leaves behind; returns its action id."""
    plan = plugin.plan(inc, FLEET)
    assert plan is not None
    action_id = f"crashed-{next(_IDS)}"
    ActionLog(store).write(ActionRecord(
        action_id, plan.idempotency_key, inc.incident_id, inc.key, inc.trace_id, inc.cluster, plan.plugin, inc.entity,
        status, reason, False, plan.summary, plan.steps, tuple(sorted(plan.drains_hosts)),
        tuple(sorted(plan.removes_paths)), {}, "apply: step 1 of 2 done", T0 - S,
        0 if status is Status.AWAITING_APPROVAL else T0 - S, 0, {"apply_s": 0.5}, 2,
        dict(plan.params) if params is None else params, recoveries))
    return action_id


def recoveries(store: Store, action_id: str) -> int:
    _, rows = store.query("SELECT argMax(Recoveries, Version) FROM actions WHERE ActionId = {a:String}",
                          parameters={"a": action_id})
    return int(rows[0][0])


def test_a_half_applied_action_is_verified_and_completed_after_a_restart_never_reapplied(store: Store) -> None:
    plugin = Scripted(name="resume-ok")
    inc = incident("resume1")
    crashed = left_in_flight(store, plugin, inc, Status.APPLYING)
    r = runner(store, plugin)
    assert r.load() >= 1 and r.wait_idle(10)
    assert plugin.calls == [("verify", "resume1")]  # checked, not applied again
    assert history(store, crashed) == [
        ("applying", "accepted"),
        ("verifying", "runner restarted while applying: verifying what was applied (apply is never repeated)"),
        ("succeeded", "verified after a runner restart")]
    assert recoveries(store, crashed) == 1
    assert final(store, crashed)[2] == "apply: step 1 of 2 done; verify: paths healthy"
    [d] = r.consider([inc])  # the same plan again: it was decided (and is now done)
    assert d.status is Status.REFUSED and f"as action {crashed} (succeeded)" in d.reason and plugin.applied() == 0
    [cooling] = r.consider([incident("resume1")])  # it touched the fleet: the cooldown runs from its end
    assert cooling.reason.startswith("cooldown")


def test_a_half_applied_action_that_does_not_verify_is_rolled_back(store: Store) -> None:
    plugin = Scripted(name="resume-undo", verify_ok=False)
    inc = incident("resume2")
    crashed = left_in_flight(store, plugin, inc, Status.APPLYING)
    r = runner(store, plugin)
    r.load()
    assert r.wait_idle(10)
    assert plugin.calls == [("verify", "resume2"), ("rollback", "resume2")]
    assert [s for s, _ in history(store, crashed)] == ["applying", "verifying", "rolling_back", "rolled_back"]
    assert final(store, crashed)[1] == "verify failed after a runner restart: loss still 30%"


def test_an_action_cut_short_while_rolling_back_is_rolled_back_again(store: Store) -> None:
    plugin = Scripted(name="resume-rollback", rollback_ok=False)
    inc = incident("resume3")
    crashed = left_in_flight(store, plugin, inc, Status.ROLLING_BACK, reason="verify failed: loss still 30%")
    r = runner(store, plugin)
    r.load()
    assert r.wait_idle(10)
    assert plugin.calls == [("rollback", "resume3")]
    assert final(store, crashed)[:2] == (
        "failed", "verify failed: loss still 30%; runner restarted while rolling_back: rolling back again; "
        "rollback failed: switch unreachable")


def test_a_takeover_survives_another_crash_and_is_given_up_after_three(store: Store) -> None:
    gate = threading.Event()

    class StuckVerify(Scripted):
        def verify(self, plan: Plan, deadline: Deadline) -> Result:
            self.calls.append(("verify", plan.entity))
            gate.wait(deadline.remaining_s())
            return Result.success("fine")

    plugin = StuckVerify(name="resume-again")
    inc = incident("resume4")
    crashed = left_in_flight(store, plugin, inc, Status.VERIFYING)
    first = runner(store, plugin, verify_timeout_s=30.0)
    first.load()
    wait_for(lambda: plugin.calls, timeout_s=10, what="the first takeover's verify")
    # The first taker "crashes" inside verify: its row says verifying, taken over once.
    assert final(store, crashed)[0] == "verifying" and recoveries(store, crashed) == 1
    gate.set()
    assert first.wait_idle(10)
    assert final(store, crashed)[:2] == ("succeeded", "verified after a runner restart")
    given_up = left_in_flight(store, plugin, incident("resume5"), Status.VERIFYING, recoveries=3)
    runner(store, plugin).load()
    assert final(store, given_up)[:2] == (
        "interrupted", "runner restarted while verifying; not finished: gave up after 3 takeovers")


def test_actions_that_cannot_be_finished_are_interrupted_and_never_rerun(store: Store) -> None:
    plugin = Scripted(name="resume-gone")
    absent = left_in_flight(store, plugin, incident("gone1"), Status.APPLYING)
    tampered = left_in_flight(store, plugin, incident("gone2"), Status.VERIFYING, params={"via": "elsewhere"})
    waiting = left_in_flight(store, plugin, incident("gone3"), Status.AWAITING_APPROVAL)
    other = Scripted(name="someone-else")
    r = runner(store, other)
    assert r.load() >= 3 and r.wait_idle(10)
    assert final(store, absent)[:2] == (
        "interrupted", "runner restarted while applying; not finished: plugin 'resume-gone' is not loaded")
    assert final(store, waiting)[:2] == ("refused", "runner restarted while awaiting_approval")
    assert final(store, tampered)[0] == "interrupted"  # closed by the first runner, as its plugin was absent
    again = left_in_flight(store, plugin, incident("gone4"), Status.VERIFYING, params={"via": "elsewhere"})
    runner(store, plugin).load()
    assert final(store, again)[1].endswith("not finished: the stored plan does not match its idempotency key")
    dry = left_in_flight(store, plugin, incident("gone5"), Status.APPLYING)
    runner(store, plugin, dry_run=True).load()
    assert final(store, dry)[1].startswith("runner restarted while applying; not finished: the runner is now in "
                                           "dry-run mode")
    assert plugin.calls == [] and other.calls == []
    [cooling] = runner(store, plugin).consider([incident("gone1")])  # it may have touched the fleet
    assert cooling.reason.startswith("cooldown")


def test_listeners_hear_each_action_that_touched_the_fleet_once_it_ends(store: Store) -> None:
    heard: list[tuple[str, str]] = []

    def listener(r: ActionRecord) -> None:
        heard.append((r.entity, r.status.value))

    def broken(r: ActionRecord) -> None:
        raise RuntimeError("pager down")

    plugin = Scripted(name="told")
    r = Runner(store=store, plugins=[plugin], policy=RunnerPolicy(dry_run=False, hysteresis_s=0.0),
               fleet=lambda: FLEET, clock=Clock(), on_end=[broken, listener])
    r.load()  # (tells the ends of other tests' actions again: see below)
    heard.clear()
    run_one(r, incident("told1"))
    plugin.verify_ok = False
    run_one(r, incident("told2"))
    [refused] = r.consider([incident("told1")])  # a refusal took no action: nobody hears of it
    assert refused.status is Status.REFUSED
    assert heard == [("told1", "succeeded"), ("told2", "rolled_back")]
    heard.clear()
    restarted = Runner(store=store, plugins=[plugin], policy=RunnerPolicy(dry_run=False, hysteresis_s=0.0),
                       fleet=lambda: FLEET, clock=Clock(), on_end=[listener], cluster="c1")
    restarted.load()  # recent ends are told again: the last process may have died before telling them
    assert sorted(h for h in heard if h[0].startswith("told")) == [("told1", "succeeded"), ("told2", "rolled_back")]


# -- approvals --------------------------------------------------------------------------------


def test_approval_approve_runs_the_plan(store: Store) -> None:
    plugin = Scripted()
    r = runner(store, plugin, require_approval=True)
    [d] = r.consider([incident("appr1")])
    assert d.status is Status.AWAITING_APPROVAL and d.plan is not None
    assert [p.idempotency_key for p in r.approvals.pending()] == [d.plan.idempotency_key]
    assert plugin.calls == []
    r.approve(d.plan.idempotency_key)
    assert r.wait_idle(10)
    assert [s for s, _ in history(store, d.action_id)] == ["awaiting_approval", "applying", "verifying", "succeeded"]


def test_approval_deny_spends_the_plan(store: Store) -> None:
    plugin = Scripted(needs_approval=True)  # the plan asks, though the policy does not require it
    r = runner(store, plugin)
    inc = incident("appr2")
    [d] = r.consider([inc])
    assert d.status is Status.AWAITING_APPROVAL and d.plan is not None
    r.deny(d.plan.idempotency_key)
    assert r.wait_idle(10) and plugin.calls == []
    assert final(store, d.action_id)[:2] == ("denied", "denied by a human")
    [again] = r.consider([inc])
    assert again.reason.startswith("duplicate") and "(denied)" in again.reason
    with pytest.raises(UnknownPlan, match="no plan 'nope' is awaiting approval"):
        r.approve("nope")


def test_approval_timeout_refuses(store: Store) -> None:
    plugin = Scripted()
    r = runner(store, plugin, require_approval=True, approval_timeout_s=0.2)
    [d] = r.consider([incident("appr3")])
    assert r.wait_idle(10) and plugin.calls == []
    assert final(store, d.action_id)[:2] == ("refused", "approval timed out after 0.2 s")
    assert r.approvals.pending() == []


# -- failures ---------------------------------------------------------------------------------


def test_failed_verify_rolls_back(store: Store) -> None:
    plugin = Scripted(verify_ok=False)
    action = run_one(runner(store, plugin), incident("rb1"))
    assert plugin.calls == [("apply", "rb1"), ("verify", "rb1"), ("rollback", "rb1")]
    assert [s for s, _ in history(store, action)] == ["applying", "verifying", "rolling_back", "rolled_back"]
    assert final(store, action) == ("rolled_back", "verify failed: loss still 30%",
                                    "apply: applied; verify: loss still 30%; rollback: restored")


def test_an_undecided_verify_leaves_the_action_in_place_as_unverified(store: Store) -> None:
    plugin = Scripted(verify_undecided=True)
    action = run_one(runner(store, plugin), incident("uv1"))
    assert plugin.calls == [("apply", "uv1"), ("verify", "uv1")], "no rollback on no evidence"
    assert [s for s, _ in history(store, action)] == ["applying", "verifying", "unverified"]
    assert final(store, action) == ("unverified", "left in place, not verified: too few probes by the deadline",
                                    "apply: applied; verify: too few probes by the deadline")


def test_a_failed_rollback_leaves_the_action_failed(store: Store) -> None:
    plugin = Scripted(verify_ok=False, rollback_ok=False)
    action = run_one(runner(store, plugin), incident("rb2"))
    assert final(store, action)[:2] == ("failed", "verify failed: loss still 30%; rollback failed: "
                                                  "switch unreachable")


def test_a_raising_plugin_is_isolated_and_recorded(store: Store) -> None:
    broken = Scripted(name="broken", plan_error=RuntimeError("topology unknown"))
    healthy = Scripted(name="healthy")
    r = runner(store, broken, healthy)
    inc = incident("raise1")
    failed, ok = r.consider([inc])
    assert failed.status is Status.FAILED and failed.reason == "plan raised RuntimeError: topology unknown"
    assert history(store, failed.action_id) == [("failed", failed.reason)]
    assert ok.status is Status.APPLYING
    crashing = Scripted(name="crashing", apply_error=OSError("agent gone"))
    action = run_one(runner(store, crashing), incident("raise2"))
    assert final(store, action)[:2] == ("rolled_back", "apply failed: crashing.apply raised OSError: agent gone")
    assert r.wait_idle(10) and crashing.calls == [("apply", "raise2"), ("rollback", "raise2")]


def test_a_failed_planning_does_not_start_a_cooldown_after_a_restart(store: Store) -> None:
    [failed] = runner(store, Scripted(plan_error=ValueError("no route"))).consider([incident("raise3")])
    assert failed.status is Status.FAILED and failed.plan is None
    restarted = runner(store, Scripted())
    restarted.load()
    [d] = restarted.consider([incident("raise3")])
    assert d.status is Status.APPLYING and restarted.wait_idle(10)


def test_an_overrunning_apply_fails_at_its_deadline(store: Store) -> None:
    slow = Scripted(name="slow", apply_sleep_s=1.0)
    action = run_one(runner(store, slow, apply_timeout_s=0.3), incident("slow1"))
    assert final(store, action)[1] == "apply failed: slow.apply timed out after 0.3 s"


def test_a_bad_plan_is_recorded_as_failed(store: Store) -> None:
    class Liar(Scripted):
        def plan(self, incident: Incident, fleet_state: FleetState) -> Plan | None:
            return Plan.for_incident("someone-else", incident)

    [d] = runner(store, Liar(name="liar")).consider([incident("liar1")])
    assert d.status is Status.FAILED and "for plugin 'someone-else'" in d.reason


# -- plugins ----------------------------------------------------------------------------------


class NoVerify:
    name = "no-verify"

    def plan(self, incident: Incident, fleet_state: FleetState) -> Plan | None: return None
    def apply(self, plan: Plan, deadline: Deadline) -> Result: return Result.success()
    def rollback(self, plan: Plan, deadline: Deadline) -> Result: return Result.success()


class WrongArity(NoVerify):
    name = "wrong-arity"

    def verify(self, plan: Plan) -> Result: return Result.success()


class AsyncApply(NoVerify):
    name = "async-apply"

    async def apply(self, plan: Plan, deadline: Deadline) -> Result: return Result.success()  # type: ignore[override]  # the mistake under test
    def verify(self, plan: Plan, deadline: Deadline) -> Result: return Result.success()


class Nameless(NoVerify):
    name = 42  # type: ignore[assignment]  # the mistake under test

    def verify(self, plan: Plan, deadline: Deadline) -> Result: return Result.success()


@pytest.mark.parametrize(("plugin", "message"), [
    (NoVerify(), r"actuator plugin no-verify \(no-verify\): missing method verify\(plan, deadline\)"),
    (WrongArity(), r"wrong-arity\): verify\(plan\) cannot be called as verify\(plan, deadline\)"),
    (AsyncApply(), r"async-apply\): apply is async"),
    (Nameless(), r"actuator plugin 42: name must be a non-empty string, got 42"),
    (Scripted, r"Scripted is a class; pass an instance"),
])
def test_validation_names_the_plugin_and_the_problem(plugin: object, message: str) -> None:
    with pytest.raises(PluginError, match=message):
        load_plugins([plugin], entry_points=lambda group: [])


def test_entry_point_discovery(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "rt_fake_actuators.py").write_text(
        "from tests.test_actuator_runner import Scripted\n"
        "PLUGIN = Scripted(name='from-entry-point')\n"
        "def build():\n    return Scripted(name='from-factory')\n")
    dist = tmp_path / "rt_fake_actuators-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: rt-fake-actuators\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[ridethrough.actuators]\ninstance = rt_fake_actuators:PLUGIN\nfactory = rt_fake_actuators:build\n"
        "class = tests.test_actuator_runner:Scripted\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    names = sorted(p.name for p in load_plugins([Scripted(name="explicit")]))
    # beside the project's own plugins (migrate), registered in its pyproject
    assert names == ["explicit", "from-entry-point", "from-factory", "migrate", "reroute", "scripted"]
    with pytest.raises(PluginError, match="name 'scripted' is used by more than one plugin"):
        load_plugins([Scripted()])
    (dist / "entry_points.txt").write_text("[ridethrough.actuators]\nbad = rt_fake_actuators:MISSING\n")
    sys.modules.pop("rt_fake_actuators", None)
    with pytest.raises(PluginError, match=r"actuator plugin bad \(rt_fake_actuators:MISSING\): import failed"):
        load_plugins()


def test_validate_accepts_a_well_formed_plugin() -> None:
    plugin = Scripted(name="fine")
    assert validate(plugin, plugin="fine") is plugin


def test_ddl_is_cluster_aware() -> None:
    local, distributed = actions_ddl(cluster="fleet")
    assert "ReplicatedReplacingMergeTree(" in local and "'{replica}', Version)" in local
    assert "actions_local" in local and "Distributed(`fleet`" in distributed
    [single] = actions_ddl()
    assert "ENGINE = ReplacingMergeTree(Version)" in single
