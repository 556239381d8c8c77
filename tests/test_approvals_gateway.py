"""Human approval where the store has one writer: ``ridethrough actions approve|deny --gateway`` reads the
actions through the server's read-only store endpoint and sends the decision to a real gateway as an
``action.decision`` log record; the controller's approval poller, reading ``otel_logs`` beside ``approvals``,
passes it to a real runner.

One embedded store per module, held by this process as ``ridethrough server`` holds it: the gateway writes
it, the read-only HTTP endpoint serves it, and the runner and poller share it. Each test uses its own
entities, so idempotency keys of one test never meet another's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from ridethrough.actuators.actions import ActionLog
from ridethrough.actuators.approvals import ApprovalPoller
from ridethrough.actuators.approvals_events import EVENT, SERVICE, printable
from ridethrough.actuators.approvals_table import ApprovalLog, Decision, Verdict
from ridethrough.actuators.runner import Runner
from ridethrough.cli import app
from ridethrough.exporters.store import Store
from ridethrough.exporters.store_http import StoreHttpEndpoint
from ridethrough.settings import GatewayConfig
from ridethrough.wiring import GatewayRuntime
from tests import test_approvals
from tests.conftest import wait_for
from tests.test_approvals import HOSTILE, Fixes, final, incident, runner

pytestmark = pytest.mark.integration  # a real gateway and store endpoint, on port 0
waiting = test_approvals.waiting  # the same fixture: a runner holding one action awaiting approval, polled
TOKEN = "0123456789abcdef" * 4
"""The operators' ingest token on the gateway that requires one (at least 32 characters)."""


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    s = Store(f"chdb://{tmp_path_factory.mktemp('approvals-gw') / 'store'}")
    s.init_schema()
    ActionLog(s).ensure_table()
    yield s
    s.close()


@pytest.fixture(scope="module")
def endpoint(store: Store) -> Iterator[str]:
    """The store's read-only HTTP endpoint, as the server's --store-http-listen serves it."""
    with StoreHttpEndpoint(client=store.client(), host="127.0.0.1", port=0, lock=store.lock) as served:
        host, port = served.address
        yield f"http://{host}:{port}"


def _gateway(store: Store, spool: Path, *, tokens_file: str = "", require_token: bool = False) -> GatewayRuntime:
    cfg = GatewayConfig(otlp_listen="127.0.0.1:0", store="chdb://unused", spool=str(spool), batch_max_age_s=0.02,
                        tokens_file=tokens_file, require_token=require_token)
    runtime = GatewayRuntime(cfg=cfg, store=store)
    runtime.start()
    return runtime


@pytest.fixture(scope="module")
def gateway(store: Store, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real gateway (receiver, pipeline, spool) writing the store, as the server's --otlp-listen."""
    runtime = _gateway(store, tmp_path_factory.mktemp("spool"))
    yield runtime.addresses["otlp"]
    runtime.stop(10)


def cli(*args: str, user: str = "ops") -> Result:
    return CliRunner().invoke(app, ["actions", *args], env={"USER": user})


def recorded(store: Store, action_id: str) -> list[tuple[str, str, str, str]]:
    """The action's decision records in otel_logs: (verdict, operator, reason, body)."""
    _, rows = store.query("SELECT LogAttributes['decision.verdict'], LogAttributes['decision.operator'], "
                          "LogAttributes['decision.reason'], Body FROM otel_logs WHERE ServiceName = {s:String} "
                          "AND LogAttributes['event.name'] = {e:String} AND LogAttributes['action.id'] = {a:String}",
                          parameters={"s": SERVICE, "e": EVENT, "a": action_id})
    return [tuple(r) for r in rows]


def test_approve_through_the_gateway_lets_the_waiting_action_apply(store: Store, endpoint: str, gateway: str,
                                                                   waiting: tuple[Runner, Fixes, str]) -> None:
    r, plugin, action = waiting
    listed = cli("list", "--pending", "--store", endpoint)
    assert listed.exit_code == 0 and action[:12] in listed.stdout, listed.output
    # Without --gateway the read-only endpoint refuses the decision, and the error names the way.
    refused = cli("approve", action, "--store", endpoint)
    assert refused.exit_code == 1 and "READONLY" in refused.stderr and "--gateway HOST:PORT" in refused.stderr
    assert plugin.calls == [] and action in r.awaiting_approval()
    done = cli("approve", action[:10], "--by", "alice", "--reason", "spine1 is drained anyway", "--store", endpoint,
               "--gateway", gateway)
    assert done.exit_code == 0, done.output
    assert f"approved action {action}" in done.stdout and f"through the gateway {gateway}" in done.stdout
    wait_for(lambda: final(store, action)[0] == "succeeded", timeout_s=60, what="the approved action to end")
    assert plugin.calls == ["apply", "verify"]
    [(verdict, by, reason, body)] = recorded(store, action)
    assert (verdict, by, reason) == ("approve", "alice", "spine1 is drained anyway")
    assert body.startswith(f"approve action {action} (fixes on ")
    assert body.endswith("by alice: spine1 is drained anyway")
    again = cli("deny", action, "--store", endpoint, "--gateway", gateway)
    assert again.exit_code == 1 and "is succeeded, not awaiting approval" in again.stderr
    assert len(recorded(store, action)) == 1  # the refused command sent nothing


def test_deny_through_the_gateway_refuses_with_the_operators_reason(store: Store, endpoint: str, gateway: str,
                                                                    waiting: tuple[Runner, Fixes, str]) -> None:
    r, plugin, action = waiting
    done = cli("deny", action, "--reason", "maintenance window at 14:00", "--store", endpoint, "--gateway", gateway,
               user="bob")
    assert done.exit_code == 0, done.output
    wait_for(lambda: final(store, action)[0] == "denied", timeout_s=60, what="the denied action to end")
    assert final(store, action) == ("denied", "denied by bob: maintenance window at 14:00")
    assert plugin.calls == [] and r.awaiting_approval() == {}


def test_hostile_reason_through_the_gateway_is_stored_verbatim(store: Store, endpoint: str, gateway: str,
                                                               waiting: tuple[Runner, Fixes, str]) -> None:
    _, _, action = waiting
    done = cli("approve", action, "--by", "mallory", "--reason", HOSTILE, "--store", endpoint, "--gateway", gateway)
    assert done.exit_code == 0, done.output
    wait_for(lambda: final(store, action)[0] == "succeeded", timeout_s=60, what="the approved action to end")
    [(verdict, by, reason, body)] = recorded(store, action)
    assert (verdict, by, reason) == ("approve", "mallory", HOSTILE)
    assert "\n" not in body and "\x1b" not in body and body.endswith(printable(HOSTILE))
    decided = ApprovalLog(store).first_decisions([action])[action]
    assert (decided.reason, decided.operator, decided.verdict) == (HOSTILE, "mallory", Verdict.APPROVE)
    _, tables = store.query("EXISTS TABLE actions")
    assert tables == [(1,)]


def test_a_gateway_that_is_away_fails_the_command_and_the_action_still_waits(
        endpoint: str, waiting: tuple[Runner, Fixes, str]) -> None:
    r, plugin, action = waiting
    started = time.monotonic()
    away = cli("approve", action, "--store", endpoint, "--gateway", "127.0.0.1:9")  # discard port: nothing listens
    assert away.exit_code == 1 and "the decision was NOT recorded" in away.stderr and "UNAVAILABLE" in away.stderr
    assert time.monotonic() - started < 60
    time.sleep(0.3)  # several poller ticks: nothing arrived, nothing applied
    assert plugin.calls == [] and action in r.awaiting_approval()


def test_the_first_decision_wins_across_the_table_and_the_gateway(store: Store, endpoint: str, gateway: str) -> None:
    """A later decision in the table loses to an earlier one through the gateway (in the poller's read and
    in the command's check), whichever the poller reads first."""
    plugin = Fixes()
    r = runner(store, plugin, require_approval=True)
    try:
        [d] = r.consider([incident("first-wins")])
        plan_id = r.awaiting_approval()[d.action_id]
        done = cli("deny", d.action_id, "--by", "carol", "--store", endpoint, "--gateway", gateway)
        assert done.exit_code == 0, done.output
        log = ApprovalLog(store)
        wait_for(lambda: d.action_id in log.first_decisions([d.action_id]), timeout_s=60,
                 what="the gateway's record to be stored")
        log.ensure_table()
        log.write(Decision("late", d.action_id, plan_id, "c1", Verdict.APPROVE, "dave", "", time.time_ns()))
        first = log.first_decisions([d.action_id])[d.action_id]
        assert (first.verdict, first.operator) == (Verdict.DENY, "carol")
        late = cli("approve", d.action_id, "--store", endpoint, "--gateway", gateway)
        assert late.exit_code == 1 and "already answered: deny by carol" in late.stderr
        poller = ApprovalPoller(runner=r, log=log)
        assert [p.operator for p in poller.poll_once()] == ["carol"]
        assert r.wait_idle(30) and final(store, d.action_id)[0] == "denied"
    finally:
        r.shutdown(10)
    assert plugin.calls == []


def test_a_gateway_that_requires_a_token_takes_the_decision_only_with_it(
        store: Store, endpoint: str, tmp_path: Path, waiting: tuple[Runner, Fixes, str]) -> None:
    _, plugin, action = waiting
    tokens, token = tmp_path / "tokens", tmp_path / "token"
    tokens.write_text(f"ops={TOKEN}\n")
    token.write_text(TOKEN + "\n")
    runtime = _gateway(store, tmp_path / "spool", tokens_file=str(tokens), require_token=True)
    try:
        target = runtime.addresses["otlp"]
        bare = cli("approve", action, "--store", endpoint, "--gateway", target)
        assert bare.exit_code == 1 and "NOT recorded" in bare.stderr and "UNAUTHENTICATED" in bare.stderr
        assert TOKEN not in bare.output
        done = cli("approve", action, "--store", endpoint, "--gateway", target, "--ingest-token-file", str(token))
        assert done.exit_code == 0, done.output
        wait_for(lambda: final(store, action)[0] == "succeeded", timeout_s=60, what="the approved action to end")
    finally:
        runtime.stop(10)
    assert plugin.calls == ["apply", "verify"]


def test_a_token_pinned_to_another_cluster_cannot_answer_this_clusters_action(
        store: Store, endpoint: str, tmp_path: Path, waiting: tuple[Runner, Fixes, str]) -> None:
    r, plugin, action = waiting  # an action of cluster c1, its controller's poller reading decisions for c1
    other, ours = "f" * 64, "e" * 64
    (tmp_path / "tokens").write_text(f"ops/c2={other}\nops/c1={ours}\n")
    (tmp_path / "other").write_text(other)
    (tmp_path / "ours").write_text(ours)
    runtime = _gateway(store, tmp_path / "spool", tokens_file=str(tmp_path / "tokens"), require_token=True)
    try:
        target = runtime.addresses["otlp"]
        sent = cli("approve", action, "--store", endpoint, "--gateway", target, "--ingest-token-file",
                   str(tmp_path / "other"))
        assert sent.exit_code == 0, sent.output  # the gateway takes it, stamped with the token's cluster c2
        wait_for(lambda: recorded(store, action), timeout_s=30, what="the c2 decision in otel_logs")
        time.sleep(0.5)  # several poller ticks
        assert plugin.calls == [] and action in r.awaiting_approval(), "a c2 token answered a c1 action"
        done = cli("approve", action, "--store", endpoint, "--gateway", target, "--ingest-token-file",
                   str(tmp_path / "ours"))
        assert done.exit_code == 0, done.output  # the c2 record was no answer: this is the first
        wait_for(lambda: final(store, action)[0] == "succeeded", timeout_s=60, what="the approved action to end")
    finally:
        runtime.stop(10)
    assert plugin.calls == ["apply", "verify"]


def test_bad_options_fail_before_anything_is_sent(store: Store, endpoint: str, gateway: str, tmp_path: Path,
                                                  waiting: tuple[Runner, Fixes, str]) -> None:
    _, _, action = waiting
    missing = cli("approve", action, "--store", endpoint, "--gateway", gateway,
                  "--ingest-token-file", str(tmp_path / "absent"))
    assert missing.exit_code == 2 and "--ingest-token-file" in missing.stderr
    (tmp_path / "token").write_text(TOKEN)
    alone = cli("approve", action, "--store", endpoint, "--ingest-token-file", str(tmp_path / "token"))
    assert alone.exit_code == 2 and "give --gateway HOST:PORT too" in alone.stderr
    both = cli("approve", action, "--store", endpoint, "--lab", "nolab")
    assert both.exit_code == 2 and "--lab or --store, not both" in both.stderr
    too_long = cli("approve", action, "--reason", "é" * 4000, "--store", endpoint, "--gateway", gateway)
    assert too_long.exit_code == 1 and "NOT recorded" in too_long.stderr and "8000 bytes" in too_long.stderr
    assert recorded(store, action) == []
