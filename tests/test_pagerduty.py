"""PagerDuty exporter against a local server that honours the Events API v2 contract.

Events as PagerDuty documents them, routing, retries and what is final, the outbox surviving
SIGKILL (before the send, and between the send and the answer), rate limits per key, and the
integration keys staying out of logs, reprs and the disk.
"""

from __future__ import annotations

import json
import logging
import pickle
import random
import secrets
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from ridethrough.actuators.actions import ActionRecord, Status
from ridethrough.config import ConfigError, load
from ridethrough.detectors.contract import EntityType, Finding, FindingKind, Severity, Window
from ridethrough.detectors.controller import Controller
from ridethrough.detectors.incidents import Incident, IncidentTracker, State, Transition, TransitionKind
from ridethrough.exporters import pagerduty_events as events
from ridethrough.exporters.pagerduty import PagerDutyExporter
from ridethrough.exporters.pagerduty_actions import ActionChanges
from ridethrough.exporters.pagerduty_config import (
    PagerDutyConfig,
    PagerDutyConfigError,
    RoutingKey,
    load_routing_keys,
    route_for,
)
from ridethrough.exporters.pagerduty_delivery import Outcome, TokenBucket, backoff_s, classify
from ridethrough.exporters.pagerduty_outbox import Entry, Outbox, OutboxError
from ridethrough.exporters.store import Store
from tests.conftest import ROOT, wait_for
from tests.pagerduty_server import PagerDutyServer, validate_alert, validate_change

S = 1_000_000_000
T0 = 1_700_000_000 * S
KEY = "0123456789abcdef0123456789abcdef"
KEY_NET = "fedcba9876543210fedcba9876543210"
ENV = {"PD_DEFAULT": KEY, "PD_NET": KEY_NET}
OPENED, ESCALATED, UPDATED, RESOLVED, REOPENED = (
    TransitionKind.OPENED, TransitionKind.ESCALATED, TransitionKind.UPDATED, TransitionKind.RESOLVED,
    TransitionKind.REOPENED)


def incident(**over: Any) -> Incident:
    evidence = json.dumps({"detector": "gpu", "time_to_failure_s": 3600.0, "evidence": {"ecc_rate": 0.4}})
    base = Incident(incident_id="inc-1", key="gpu_failing:gpu:h2/gpu3", kind="gpu_failing", entity_type="gpu",
                    entity="h2/gpu3", cluster="prod", detector="gpu", severity=Severity.WARNING, state=State.OPEN,
                    opened_at_ns=T0, updated_at_ns=T0, resolved_at_ns=0, last_finding_at_ns=T0, findings=1,
                    reopens=0, summary="h2/gpu3 failing: ecc", evidence=evidence, trace_id="ab" * 16, version=1)
    return replace(base, **over)


def step(kind: TransitionKind, inc: Incident, **over: Any) -> tuple[Transition, Incident]:
    """The next version of ``inc`` after ``kind``, as the tracker would write it."""
    state = State.RESOLVED if kind is RESOLVED else State.OPEN
    nxt = replace(inc, state=state, version=inc.version + 1, updated_at_ns=inc.updated_at_ns + S, **over)
    return Transition(kind, nxt, None), nxt


@pytest.fixture
def server() -> Iterator[PagerDutyServer]:
    with PagerDutyServer(routing_keys={KEY, KEY_NET}) as s:
        yield s


def settings(server: PagerDutyServer, tmp_path: Path, **over: Any) -> PagerDutyConfig:
    base: dict[str, Any] = dict(enabled=True, events_url=server.events_url, change_url=server.change_url,
                                routing_keys={"*": "env:PD_DEFAULT"}, outbox=str(tmp_path / "outbox.sqlite3"),
                                initial_backoff_s=0.01, max_backoff_s=0.05, dashboard_url="https://dash.example/")
    return PagerDutyConfig(**{**base, **over})


@pytest.fixture
def make() -> Iterator[Callable[..., PagerDutyExporter]]:
    """``make(cfg, env=ENV, clock=None)``: an exporter, shut down when the test ends."""
    made: list[PagerDutyExporter] = []

    def build(cfg: PagerDutyConfig, env: dict[str, str] = ENV, clock: Callable[[], int] | None = None,
              ) -> PagerDutyExporter:
        if clock is None:
            exp = PagerDutyExporter.from_config(cfg, env=env)
        else:
            exp = PagerDutyExporter(config=cfg, routing_keys=load_routing_keys(cfg, env), outbox=Outbox(cfg.outbox),
                                    clock=clock, rng=random.Random(7))
        made.append(exp)
        return exp

    yield build
    for exp in made:
        exp.shutdown(timeout_s=5)


# --- events ----------------------------------------------------------------------------------


def test_dedup_keys_are_readable_and_long_ones_keep_their_head_and_hash_their_tail() -> None:
    assert events.dedup_key("link_down:link:h3-leaf1r0", cluster="prod") == "ridethrough:prod:link_down:link:h3-leaf1r0"
    assert events.dedup_key("agent_silent:host:h5") == "ridethrough:agent_silent:host:h5"
    long_a, long_b = "straggler:rank:" + "j" * 300 + "/rank1", "straggler:rank:" + "j" * 300 + "/rank2"
    a, b = events.dedup_key(long_a), events.dedup_key(long_b)
    assert len(a) == len(b) == 255 and a != b
    assert a.startswith("ridethrough:straggler:rank:jjj") and a[-33] == "#"
    assert events.dedup_key(long_a) == a  # stable: a restart derives the same key
    unicode = events.dedup_key("link_down:link:hôte-1")
    assert unicode.isascii() and len(unicode) <= 255 and unicode != events.dedup_key("link_down:link:hote-1")


def test_summaries_are_cut_between_whole_characters_within_1024_utf16_units() -> None:
    assert events.truncate("one\nline\t summary") == "one line summary"
    assert events.truncate("x" * 1024) == "x" * 1024
    cut = events.truncate("x" * 2000)
    assert cut.endswith("…") and len(cut) == 1024
    emoji = events.truncate("x" + "\U0001F525" * 1000)  # two UTF-16 units each
    assert len(emoji.encode("utf-16-le")) // 2 <= 1024 and emoji.endswith("\U0001F525…")
    accents = events.truncate("x" * 1022 + "e\u0301" * 10)  # the cut falls between an "e" and its accent
    assert accents == "x" * 1022 + "…"
    assert validate_alert({"routing_key": KEY, "event_action": "trigger",
                           "payload": {"summary": emoji, "source": "h", "severity": "info"}}) == []


@pytest.mark.parametrize(("severity", "expected"), [(Severity.INFO, "info"), (Severity.WARNING, "warning"),
                                                    (Severity.ERROR, "error"), (Severity.CRITICAL, "critical")])
def test_incident_severities_map_onto_pagerduty_severities(severity: Severity, expected: str) -> None:
    finding = Finding(detector="gpu", kind=FindingKind.GPU_FAILING, entity_type=EntityType.GPU, entity="h2/gpu3",
                      severity=severity, confidence=0.9, summary="s", observed_at_ns=T0, time_to_failure_s=120.0)
    body = events.trigger(Transition(OPENED, incident(severity=severity), finding))
    assert body["payload"]["severity"] == expected
    assert body["payload"]["custom_details"]["time_to_failure_s"] == 120.0  # the finding's, newest


def test_a_trigger_carries_every_documented_field_and_the_incident_context() -> None:
    actions = [{"at_ns": T0, "summary": "drained h2/gpu3"}]
    body = events.trigger(Transition(OPENED, incident(), None), dashboard_url="https://dash.example/", actions=actions)
    p = body["payload"]
    assert body["event_action"] == "trigger" and body["dedup_key"] == "ridethrough:prod:gpu_failing:gpu:h2/gpu3"
    assert p["summary"] == "h2/gpu3 failing: ecc (gpu_failing on h2/gpu3, cluster prod)"
    assert (p["source"], p["component"], p["group"], p["class"]) == ("h2", "gpu3", "prod", "gpu_failing")
    assert datetime.fromisoformat(p["timestamp"]).timestamp() == T0 / S
    details = p["custom_details"]
    assert details["evidence"]["evidence"] == {"ecc_rate": 0.4} and details["time_to_failure_s"] == 3600.0
    assert details["actions_taken"] == actions and details["incident_id"] == "inc-1"
    assert body["links"] == [{"href": "https://dash.example/incidents/inc-1", "text": "Incident in ridethrough"},
                             {"href": f"https://dash.example/traces/{'ab' * 16}", "text": "Incident trace"}]
    assert validate_alert({**body, "routing_key": KEY}) == []
    link = events.trigger(Transition(OPENED, incident(entity="h3-leaf1r0", entity_type="link", cluster=""), None))
    assert (link["payload"]["source"], link["payload"]["component"], link["payload"]["group"]) == (
        "h3-leaf1r0", "link", "default")
    assert "links" in link and link["links"] == [] and "client_url" not in link


def test_huge_or_broken_evidence_still_makes_a_valid_event_under_512_kb() -> None:
    huge = events.trigger(Transition(OPENED, incident(evidence=json.dumps({"x": "y" * 600_000})), None))
    assert huge["payload"]["custom_details"]["evidence"]["truncated"] is True
    assert len(json.dumps({**huge, "routing_key": KEY}).encode()) <= events.MAX_EVENT_BYTES
    broken = events.trigger(Transition(OPENED, incident(evidence="{not json"), None))
    assert broken["payload"]["custom_details"]["evidence"] == {"unparsed": "{not json"}
    assert validate_alert({**broken, "routing_key": KEY}) == []
    many = [{"at_ns": T0, "summary": "a" * 200_000}] * 4  # what is left over the limit goes, not the event
    fitted = events.trigger(Transition(OPENED, incident(), None), actions=many)
    assert len(json.dumps(fitted).encode()) <= events.MAX_EVENT_BYTES
    assert "truncated" in fitted["payload"]["custom_details"]


def test_the_local_server_holds_events_to_the_documented_contract() -> None:
    ok: dict[str, Any] = {"routing_key": KEY, "event_action": "trigger",
                          "payload": {"summary": "s", "source": "h", "severity": "error"}}
    assert validate_alert(ok) == [] and validate_alert({**ok, "event_action": "resolve", "dedup_key": "d"}) == []
    bad = [({**ok, "routing_key": KEY[:31]}, "routing_key"), ({**ok, "event_action": "open"}, "event_action"),
           ({**ok, "dedup_key": "d" * 256}, "dedup_key"), ({**ok, "payload": {**ok["payload"], "severity": "high"}},
                                                            "severity"),
           ({**ok, "payload": {**ok["payload"], "summary": "s" * 1025}}, "summary"),
           ({**ok, "payload": {"summary": "s", "severity": "info"}}, "source"),
           ({**ok, "payload": {**ok["payload"], "timestamp": "yesterday"}}, "timestamp"),
           ({**ok, "links": [{"text": "no href"}]}, "href"), ({**ok, "event_action": "resolve"}, "dedup_key"),
           ({**ok, "severity": "error"}, "severity")]
    for doc, field in bad:
        errors = validate_alert(doc, routing_keys={KEY})
        assert errors and any(field in e for e in errors), (doc, errors)
    assert any("known" in e for e in validate_alert({**ok, "routing_key": "x" * 32}, routing_keys={KEY}))
    assert validate_change({"routing_key": KEY, "payload": {"summary": "c"}}) == []
    assert validate_change({"routing_key": KEY, "payload": {"source": "x"}})
    assert validate_change({"routing_key": KEY, "payload": {"summary": "c"}, "event_action": "trigger"})


# --- config, keys and routes -----------------------------------------------------------------


def test_routes_pick_the_most_specific_of_team_severity_team_any_severity_any() -> None:
    cfg = PagerDutyConfig(teams={"link_down": "net", "gpu": "compute"}, routing_keys={
        "net:critical": "env:A", "net": "env:B", "*:critical": "env:C", "*": "env:D"})

    def route(kind: str, etype: str, sev: Severity) -> str | None:
        return route_for(cfg, kind=kind, entity_type=etype, severity=sev)
    assert route("link_down", "link", Severity.CRITICAL) == "net:critical"
    assert route("link_down", "link", Severity.WARNING) == "net"
    assert route("gpu_failed", "gpu", Severity.CRITICAL) == "*:critical"  # team compute has no route of its own
    assert route("straggler", "rank", Severity.WARNING) == "*"
    assert route_for(PagerDutyConfig(routing_keys={"*:critical": "env:C"}), kind="straggler", entity_type="rank",
                     severity=Severity.WARNING) is None


@pytest.mark.parametrize(("over", "message"), [
    ({"routing_keys": {"*": KEY}}, "env:VAR or file:PATH"),
    ({"routing_keys": {"*:crit": "env:A"}}, "did you mean 'critical'"),
    ({"routing_keys": {"ops": "env:A"}}, "names team 'ops'"),
    ({"teams": {"link_dwn": "net"}}, "did you mean 'link_down'"),
    ({"teams": {"link_down": "net team"}}, "a team is"),
    ({"initial_backoff_s": 10.0, "max_backoff_s": 1.0}, "must not exceed"),
    ({"events_url": "events.pagerduty.com/v2/enqueue"}, "http(s)://"),
    ({"min_severity": "page"}, "min_severity"),
])
def test_bad_config_stops_with_a_message_that_names_the_problem(over: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as err:
        PagerDutyConfig(**over)
    assert message in str(err.value)
    assert KEY not in str(err.value)  # a key pasted in place of a reference is not echoed


def test_the_config_loads_through_the_shared_loader_from_env(tmp_path: Path) -> None:
    env = {"RIDETHROUGH_PAGERDUTY_ROUTING_KEYS": "*=env:PD_DEFAULT,net=file:/run/pd-net",
           "RIDETHROUGH_PAGERDUTY_TEAMS": "link_down=net", "RIDETHROUGH_PAGERDUTY_RATE_PER_S": "0.5"}
    cfg = load(PagerDutyConfig, component="pagerduty", env=env).config
    assert dict(cfg.routing_keys) == {"*": "env:PD_DEFAULT", "net": "file:/run/pd-net"} and cfg.rate_per_s == 0.5
    with pytest.raises(ConfigError, match=r"pagerduty\.routing_keys: .*env:VAR or file:PATH.*"
                                          r"from env RIDETHROUGH_PAGERDUTY_ROUTING_KEYS") as err:
        load(PagerDutyConfig, component="pagerduty", env={"RIDETHROUGH_PAGERDUTY_ROUTING_KEYS": f"*={KEY}"})
    assert KEY not in str(err.value)


def test_keys_come_from_env_or_file_and_a_bad_one_stops_the_start_without_showing_it(tmp_path: Path) -> None:
    (tmp_path / "net.key").write_text(KEY_NET + "\n")
    cfg = PagerDutyConfig(teams={"link_down": "net"},
                          routing_keys={"*": "env:PD_DEFAULT", "net": f"file:{tmp_path / 'net.key'}"})
    keys = load_routing_keys(cfg, ENV)
    assert keys["*"].reveal() == KEY and keys["net"].reveal() == KEY_NET
    assert repr(keys["*"]) == "RoutingKey(env:PD_DEFAULT, <redacted>)" and KEY not in str(keys)
    with pytest.raises(TypeError):
        pickle.dumps(keys["*"])
    with pytest.raises(PagerDutyConfigError, match="PD_DEFAULT is not set"):
        load_routing_keys(cfg, {})
    missing = PagerDutyConfig(routing_keys={"*": f"file:{tmp_path / 'absent'}"})
    with pytest.raises(PagerDutyConfigError, match="cannot read the file"):
        load_routing_keys(missing, {})
    wrong = KEY + "0"
    with pytest.raises(PagerDutyConfigError, match="expected 32 letters and digits, got 33") as err:
        load_routing_keys(cfg, {**ENV, "PD_DEFAULT": wrong})
    assert wrong not in str(err.value)
    with pytest.raises(PagerDutyConfigError, match="routing_keys is empty"):
        PagerDutyExporter.from_config(PagerDutyConfig(enabled=True), env=ENV)


# --- outbox ----------------------------------------------------------------------------------


def test_the_outbox_is_idempotent_ordered_per_route_and_remembers_paged_routes(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "o.sqlite3")
    try:
        def entry(idem: str, route: str, alert: str = "") -> Entry:
            return Entry("alert", route, "k1", {"event_action": "trigger", "n": idem}, idem, alert)
        added = box.add([entry("a", "r1", "open"), entry("b", "r1"), entry("c", "r2", "open")], now_ns=T0,
                        actions=[("x", "k1", T0, "rerouted")])
        assert [e.idem for e in added] == ["a", "b", "c"]
        assert box.add([entry("a", "r1"), entry("c", "r2", "close")], now_ns=T0) == []  # ignored, alerts kept
        assert [(p.route, json.loads(p.body)["n"]) for p in box.heads()] == [("r1", "a"), ("r2", "c")]
        assert box.routes("k1") == ["r1", "r2"] and box.actions("k1") == [{"at_ns": T0, "summary": "rerouted"}]
        box.mark_sent(box.heads()[0].seq, now_ns=T0)
        assert [json.loads(p.body)["n"] for p in box.heads()] == ["b", "c"]  # r1's next in line
        box.add([Entry("alert", "r2", "k1", {}, "d", "close")], now_ns=T0)
        assert box.open_alerts() == {"k1": ["r1"]}
        assert box.counts() == {"pending": 3, "sent": 1, "rejected": 0, "dead": 0}
        assert box.prune(before_ns=T0 + 1) == 1 and box.counts()["sent"] == 0
        with pytest.raises(ValueError, match="'rejected' or 'dead'"):
            box.mark_failed(1, state="sent", error="", now_ns=T0)
    finally:
        box.close()


def test_a_second_process_cannot_share_the_outbox_and_a_foreign_file_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "o.sqlite3"
    box = Outbox(path)
    try:
        code = ("import sys\nfrom ridethrough.exporters.pagerduty_outbox import Outbox, OutboxError\n"
                "try:\n    Outbox(sys.argv[1])\nexcept OutboxError as e:\n    print(e)\n")
        done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60)
        assert "in use by another process" in done.stdout, done.stdout + done.stderr
    finally:
        box.close()
    foreign = tmp_path / "notes.txt"
    foreign.write_text("not a database " * 200)
    with pytest.raises(OutboxError, match=r"is not a PagerDuty outbox.*left untouched"):
        Outbox(foreign)
    assert foreign.read_text() == "not a database " * 200


# --- delivery --------------------------------------------------------------------------------


def test_open_escalate_update_resolve_make_one_page_that_resolves(server, tmp_path, make) -> None:
    exp = make(settings(server, tmp_path))
    inc = incident()
    t1 = Transition(OPENED, inc, None)
    t2, inc = step(ESCALATED, inc, severity=Severity.CRITICAL)
    t3, inc = step(UPDATED, inc)
    exp.emit([t1, t2, t3])
    assert server.requests == 0  # emit only queues
    assert exp.flush(timeout_s=10)
    t4, inc = step(RESOLVED, inc)
    exp.emit([t4])
    assert exp.flush(timeout_s=10)
    key = "ridethrough:prod:gpu_failing:gpu:h2/gpu3"
    sent = server.events_for(key)
    assert [(e["event_action"], e.get("payload", {}).get("severity")) for e in sent] == [
        ("trigger", "warning"), ("trigger", "critical"), ("resolve", None)]
    assert server.pages == 1 and server.alerts[0].state == "resolved" and not server.rejected
    assert exp.outbox.counts() == {"pending": 0, "sent": 3, "rejected": 0, "dead": 0}
    exp.emit([t1, t4])  # the same transitions again (a retried emit) queue nothing
    assert exp.outbox.counts()["sent"] == 3 and exp.outbox.counts()["pending"] == 0


def test_an_escalation_to_another_team_pages_it_and_the_resolve_reaches_both(server, tmp_path, make) -> None:
    cfg = settings(server, tmp_path, teams={"gpu_failing": "compute"},
                   routing_keys={"*": "env:PD_DEFAULT", "compute:critical": "env:PD_NET"})
    exp = make(cfg)
    inc = incident()
    t2, inc2 = step(ESCALATED, inc, severity=Severity.CRITICAL)
    t3, _ = step(RESOLVED, inc2)
    exp.emit([Transition(OPENED, inc, None), t2, t3])
    assert exp.flush(timeout_s=10)
    assert sorted((a.routing_key, a.state) for a in server.alerts) == [(KEY, "resolved"), (KEY_NET, "resolved")]


def test_quiet_incidents_page_only_when_they_escalate_and_a_reopen_pages_again(server, tmp_path, make) -> None:
    exp = make(settings(server, tmp_path, min_severity="error"))
    inc = incident(severity=Severity.WARNING)
    t2, inc = step(UPDATED, inc)
    t3, inc = step(RESOLVED, inc)
    exp.emit([Transition(OPENED, inc, None), t2, t3])  # below min_severity: nothing, not even the resolve
    assert exp.flush(timeout_s=10) and server.requests == 0
    t4, inc = step(REOPENED, inc, severity=Severity.WARNING)
    t5, inc = step(ESCALATED, inc, severity=Severity.ERROR)
    t6, inc = step(RESOLVED, inc)
    t7, inc = step(REOPENED, inc)
    exp.emit([t4, t5, t6, t7])
    assert exp.flush(timeout_s=10)
    assert [e["event_action"] for e in server.accepted] == ["trigger", "resolve", "trigger"]
    assert server.pages == 2 and [a.state for a in server.alerts] == ["resolved", "triggered"]
    assert server.accepted[2]["payload"]["custom_details"]["transition"] == "reopened"


def test_429_and_5xx_are_retried_with_backoff_and_400_is_final_and_logged(server, tmp_path, make, caplog) -> None:
    caplog.set_level(logging.INFO, logger="ridethrough.exporters.pagerduty")
    exp = make(settings(server, tmp_path))
    server.fail_next(500, body="oops")
    server.fail_next(429, retry_after="0")
    server.fail_next(503)
    exp.emit([Transition(OPENED, incident(), None)])
    assert exp.flush(timeout_s=10)
    [row] = exp.outbox.events()
    assert (row["state"], row["attempts"], server.requests, len(server.accepted)) == ("sent", 4, 4, 1)
    assert caplog.text.count("retrying in") == 3 and "HTTP 429" in caplog.text
    server.fail_next(400, body='{"status": "invalid event", "errors": ["payload is odd"]}')
    exp.emit([Transition(OPENED, incident(incident_id="inc-2", key="gpu_failing:gpu:h9/gpu0"), None)])
    exp.emit([Transition(OPENED, incident(incident_id="inc-3", key="gpu_failing:gpu:h9/gpu1"), None)])
    assert exp.flush(timeout_s=10)
    rejected = exp.outbox.events("rejected")
    assert len(rejected) == 1 and rejected[0]["attempts"] == 1 and "payload is odd" in rejected[0]["last_error"]
    assert "rejected" in caplog.text and "payload is odd" in caplog.text and "not retried" in caplog.text
    assert server.requests == 6 and len(server.accepted) == 2  # the 400 was not retried; the next event went on


def test_backoff_doubles_up_to_the_cap_with_jitter_and_honours_retry_after(server, tmp_path, make) -> None:
    rng = random.Random(3)
    for attempt in range(1, 12):
        base = min(8.0, 0.5 * 2 ** (attempt - 1))
        assert base / 2 <= backoff_s(attempt, initial_s=0.5, max_s=8.0, rng=rng) <= base
    assert len({backoff_s(3, initial_s=0.5, max_s=8.0, rng=rng) for _ in range(20)}) > 1
    now = [T0]
    exp = make(settings(server, tmp_path, initial_backoff_s=0.5, max_backoff_s=60), clock=lambda: now[0])
    server.fail_next(429, retry_after="30")
    exp.emit([Transition(OPENED, incident(), None)])
    exp.send_due()
    [row] = exp.outbox.events()
    assert row["next_attempt_ns"] == T0 + 30 * S and row["state"] == "pending"
    now[0] += 29 * S
    assert exp.send_due() == pytest.approx(1.0) and server.requests == 1  # not due yet
    now[0] += S
    exp.send_due()
    assert len(server.accepted) == 1


@pytest.mark.parametrize(("status", "outcome"), [(202, Outcome.SENT), (200, Outcome.SENT), (400, Outcome.REJECTED),
                                                 (413, Outcome.REJECTED), (429, Outcome.RETRY), (500, Outcome.RETRY),
                                                 (503, Outcome.RETRY), (403, Outcome.RETRY), (404, Outcome.RETRY)])
def test_status_codes_are_classified_as_pagerduty_documents(status: int, outcome: Outcome) -> None:
    assert classify(status) is outcome


def test_network_errors_are_retried_and_old_or_unroutable_events_are_kept_as_dead(server, tmp_path, make,
                                                                                   caplog) -> None:
    now = [T0]
    with socket.socket() as s:  # a port nothing listens on: connections are refused
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}/v2/enqueue"
    cfg = settings(server, tmp_path, events_url=closed, give_up_after_s=60)
    exp = make(cfg, clock=lambda: now[0])
    exp.emit([Transition(OPENED, incident(), None)])
    exp.send_due()
    [row] = exp.outbox.events()
    assert row["state"] == "pending" and row["attempts"] == 1 and "network error" in row["last_error"]
    now[0] += 61 * S
    exp.send_due()
    assert exp.outbox.events()[0]["state"] == "dead" and "undelivered after 60" in caplog.text
    exp.shutdown()
    renamed = settings(server, tmp_path, routing_keys={"other": "env:PD_DEFAULT"}, teams={"gpu": "other"})
    box = Outbox(renamed.outbox)
    box.add([Entry("alert", "*", "k", {"event_action": "resolve", "dedup_key": "k"}, "z")], now_ns=now[0])
    box.close()
    exp2 = make(renamed)
    assert exp2.flush(timeout_s=10) and server.requests == 0
    assert exp2.outbox.events()[-1]["state"] == "dead" and "no longer configured" in caplog.text


def test_each_integration_key_has_its_own_token_bucket(server, tmp_path, make) -> None:
    bucket = TokenBucket(rate_per_s=2.0, burst=2, now_s=0.0)
    assert [bucket.take(0.0), bucket.take(0.0)] == [0.0, 0.0] and bucket.take(0.0) == pytest.approx(0.5)
    assert bucket.take(0.5) == 0.0 and bucket.take(0.5) > 0
    now = [T0]
    cfg = settings(server, tmp_path, rate_per_s=1.0, burst=2, teams={"link_down": "net"},
                   routing_keys={"*": "env:PD_DEFAULT", "net": "env:PD_NET"})
    exp = make(cfg, clock=lambda: now[0])
    exp.emit([Transition(OPENED, incident(incident_id=f"g{n}", key=f"gpu_failing:gpu:h{n}/gpu0"), None)
              for n in range(4)])
    exp.emit([Transition(OPENED, incident(incident_id="l1", key="link_down:link:l1", kind="link_down",
                                     entity_type="link", entity="l1"), None)])
    assert exp.send_due() == pytest.approx(1.0)
    assert sorted(e["routing_key"] for e in server.accepted) == sorted([KEY, KEY, KEY_NET])  # net not held up
    now[0] += S
    exp.send_due()
    assert len(server.accepted) == 4
    now[0] += S
    exp.send_due()
    assert len(server.accepted) == 5 and exp.outbox.counts()["pending"] == 0


def test_change_events_follow_their_incident_and_later_triggers_list_them(server, tmp_path, make) -> None:
    cfg = settings(server, tmp_path, teams={"gpu": "compute"},
                   routing_keys={"*": "env:PD_DEFAULT", "compute": "env:PD_NET"})
    exp = make(cfg)
    inc = incident()
    exp.emit([Transition(OPENED, inc, None)])
    exp.change(summary="migrated rank 3 off h2/gpu3", at_ns=T0 + 5 * S, source="actuator/migrate",
               details={"action": "migrate", "plan": {"to": "h7/gpu0"}, "at": datetime(2025, 1, 1)},
               incident=inc, idempotency_key="act-1")
    exp.change(summary="migrated rank 3 off h2/gpu3", at_ns=T0 + 5 * S, source="actuator/migrate",
               incident=inc, idempotency_key="act-1")  # a retried call: queued once
    exp.change(summary="fleet-wide config push", at_ns=T0, source="ops")  # no incident: route *
    t2, _ = step(ESCALATED, inc, severity=Severity.CRITICAL)
    exp.emit([t2])
    assert exp.flush(timeout_s=10)
    assert sorted((c["routing_key"], c["payload"]["summary"]) for c in server.changes) == [
        (KEY, "fleet-wide config push"), (KEY_NET, "migrated rank 3 off h2/gpu3")]
    [first] = [c for c in server.changes if c["routing_key"] == KEY_NET]
    assert first["payload"]["custom_details"]["plan"] == {"to": "h7/gpu0"}
    assert first["payload"]["custom_details"]["incident_id"] == "inc-1"
    assert first["links"][0]["href"] == "https://dash.example/incidents/inc-1"
    taken = server.accepted[-1]["payload"]["custom_details"]["actions_taken"]
    assert taken == [{"at_ns": T0 + 5 * S, "summary": "migrated rank 3 off h2/gpu3"}]


def action(status: Status, **over: Any) -> ActionRecord:
    """An action on ``incident()`` in its final ``status``; apply started unless told otherwise."""
    inc = incident()
    base = ActionRecord("act-9", "plan-9", inc.incident_id, inc.key, inc.trace_id, inc.cluster, "migrate", inc.entity,
                        status, "verify failed: rank 3 still on h2/gpu3", False, "move rank 3 to a hot spare",
                        ("pause job", "move rank"), ("h2",), (), {}, "apply: moved; verify: still there", T0,
                        T0 + S, T0 + 7 * S, {"apply_s": 5.0}, 4, {"node": "h2"}, 0)
    return replace(base, **over)


def test_the_local_server_holds_change_events_to_the_documented_contract() -> None:
    ok: dict[str, Any] = {"routing_key": KEY, "payload": {"summary": "c", "source": "h", "custom_details": {}},
                          "links": [{"href": "https://dash.example/incidents/1", "text": "Incident"}]}
    assert validate_change(ok, routing_keys={KEY}) == []
    bad = [({**ok, "payload": {"summary": "s" * 1025}}, "summary"), ({**ok, "payload": {"source": "x"}}, "summary"),
           ({**ok, "payload": {"summary": "c", "severity": "info"}}, "severity"),
           ({**ok, "payload": {"summary": "c", "timestamp": "now"}}, "timestamp"),
           ({**ok, "payload": {"summary": "c", "custom_details": "text"}}, "custom_details"),
           ({**ok, "dedup_key": "k"}, "dedup_key"), ({**ok, "images": []}, "images"),
           ({**ok, "links": [{"href": "/incidents/1"}]}, "href"), ({**ok, "links": [{"text": "t"}]}, "href"),
           ({**ok, "routing_key": "short"}, "routing_key")]
    for doc, field in bad:
        errors = validate_change(doc, routing_keys={KEY})
        assert errors and any(field in e for e in errors), (doc, errors)


def test_actions_taken_become_change_events_once_and_refusals_none(server, tmp_path, make) -> None:
    cfg = settings(server, tmp_path, teams={"gpu": "compute"},
                   routing_keys={"*": "env:PD_DEFAULT", "compute": "env:PD_NET"})
    exp = make(cfg)
    inc = incident()
    exp.emit([Transition(OPENED, inc, None)])
    told = ActionChanges(exp, incident_of=lambda r: inc if r.incident_key == inc.key else None)
    server.fail_next(429, retry_after="0")  # the first delivery is retried, as a page's would be
    told(action(Status.ROLLED_BACK))
    told(action(Status.ROLLED_BACK))  # told again (a restart replays recent ends): queued once
    told(action(Status.REFUSED, started_at_ns=0, action_id="refused"))  # changed nothing: not sent
    told(action(Status.DRY_RUN, started_at_ns=0, dry_run=True, action_id="dry"))
    told(action(Status.VERIFYING, action_id="running"))  # not ended yet
    other = incident(incident_id="inc-gone", key="gpu_failed:gpu:h5/gpu1", entity="h5/gpu1", trace_id="cd" * 16)
    told(action(Status.SUCCEEDED, action_id="act-10", incident_id=other.incident_id, incident_key=other.key,
                trace_id=other.trace_id, entity=other.entity, summary="x" * 2000))  # its incident is forgotten
    assert exp.flush(timeout_s=10)
    [rolled] = server.changes_for(KEY_NET)  # where its incident paged
    payload = rolled["payload"]
    assert payload["summary"] == ("ridethrough migrate on h2/gpu3: rolled back (verify failed: rank 3 still on "
                                  "h2/gpu3); move rank 3 to a hot spare")
    assert payload["source"] == "h2" and payload["timestamp"] == "2023-11-14T22:13:27.000+00:00"
    details = payload["custom_details"]
    assert details["outcome"] == "rolled_back" and details["action_id"] == "act-9" and details["trace_id"] == "ab" * 16
    assert details["incident_key"] == inc.key and details["timings_s"] == {"apply_s": 5.0}
    assert [link["href"] for link in rolled["links"]] == [
        "https://dash.example/incidents/inc-1", f"https://dash.example/traces/{'ab' * 16}"]
    [done] = server.changes_for(KEY)  # no incident at hand and no open alert: the catch-all route
    assert len(done["payload"]["summary"]) == 1024 and done["payload"]["summary"].endswith("…")
    assert [link["href"] for link in done["links"]] == [
        "https://dash.example/incidents/inc-gone", f"https://dash.example/traces/{'cd' * 16}"]
    taken = exp.outbox.actions("ridethrough:prod:gpu_failing:gpu:h2/gpu3")
    assert [a["summary"][:40] for a in taken] == ["ridethrough migrate on h2/gpu3: rolled b"]


def test_reconcile_pages_what_never_paged_and_resolves_what_closed_while_down(server, tmp_path, make) -> None:
    exp = make(settings(server, tmp_path))
    gone = incident(incident_id="gone", key="link_down:link:l9", kind="link_down", entity_type="link", entity="l9")
    exp.emit([Transition(OPENED, gone, None)])
    assert exp.flush(timeout_s=10)
    fresh = incident(incident_id="new", version=4)  # opened while the exporter was not there
    assert exp.reconcile([fresh]) == 2
    assert exp.reconcile([fresh]) == 0  # nothing left to do
    assert exp.flush(timeout_s=10)
    assert [(e["event_action"], e["dedup_key"]) for e in server.accepted[1:]] == [
        ("trigger", "ridethrough:prod:gpu_failing:gpu:h2/gpu3"), ("resolve", "ridethrough:prod:link_down:link:l9")]


def test_integration_keys_never_reach_logs_reprs_or_the_disk(server, tmp_path, make, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    key = secrets.token_hex(16)
    cfg = settings(server, tmp_path, routing_keys={"*": "env:PD_SECRET"})
    with PagerDutyServer(routing_keys={key}) as echo:
        cfg = replace(cfg, events_url=echo.events_url, change_url=echo.change_url)
        echo.fail_next(500, body=f'{{"echo": "{key}"}}')  # a server that echoes the key it got
        echo.fail_next(400, body=f'{{"errors": ["bad routing_key {key}"]}}')
        exp = make(cfg, env={"PD_SECRET": key})
        exp.emit([Transition(OPENED, incident(), None)])
        exp.emit([Transition(OPENED, incident(incident_id="i2", key="gpu_failing:gpu:h3/gpu1"), None)])
        exp.change(summary="rerouted", at_ns=T0, source="actuator", incident=incident())
        exp.start()
        assert exp.flush(timeout_s=10)
        exp.stop()
        assert [e["routing_key"] for e in echo.accepted] == [key] and echo.changes[0]["routing_key"] == key
    assert "<redacted>" in caplog.text  # the echoes were scrubbed, not merely missing
    shown = [caplog.text, repr(exp), repr(cfg), str(load_routing_keys(cfg, {"PD_SECRET": key})),
             str(exp.outbox.events()), str(RoutingKey(key, ref="env:PD_SECRET"))]
    assert all(key not in text for text in shown)
    on_disk = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.is_file())
    assert on_disk and key.encode() not in on_disk


def test_the_sender_thread_starts_stops_and_leaves_the_rest_queued(server, tmp_path, make) -> None:
    exp = make(settings(server, tmp_path))
    exp.start()
    exp.emit([Transition(OPENED, incident(), None)])
    wait_for(lambda: len(server.accepted) == 1, timeout_s=10, what="the sender to deliver")
    exp.stop()
    exp.emit([Transition(OPENED, incident(incident_id="i2", key="gpu_failing:gpu:h3/gpu1"), None)])
    assert exp.outbox.counts()["pending"] == 1 and len(server.accepted) == 1
    exp.start()
    wait_for(lambda: len(server.accepted) == 2, timeout_s=10, what="the restarted sender to deliver")
    # The server has the event before the sender has read the 202 and counted it: wait for the count.
    wait_for(lambda: exp.metrics.registry.get_sample_value("ridethrough_pagerduty_events_total",
                                                           {"endpoint": "alert", "outcome": "sent"}) == 2,
             timeout_s=10, what="the sender to count both events sent")


@dataclass
class Finds:
    """A detector that finds its ``entities`` (a list the test changes between ticks)."""

    entities: list[str]
    name: str = "scripted"
    interval_s: float = 1.0
    window_s: float = 60.0

    def detect(self, window: Window) -> list[Finding]:
        return [Finding(detector=self.name, kind=FindingKind.LINK_DOWN, entity_type=EntityType.LINK, entity=e,
                        severity=Severity.CRITICAL, confidence=1.0, summary=f"link {e} down",
                        observed_at_ns=window.end_ns) for e in self.entities]


@pytest.mark.integration
def test_the_controller_pages_and_resolves_through_emit(server, tmp_path, make) -> None:
    store = Store(f"chdb://{tmp_path / 'store'}")
    try:
        store.init_schema()
        exp = make(settings(server, tmp_path))
        detector = Finds(["h3-leaf1r0"])
        tracker = IncidentTracker(store, quiet_s=30, reopen_hysteresis_s=120, cluster="pd")
        controller = Controller(store=store, detectors=[detector], tracker=tracker, emit=exp.emit, cluster="pd")
        [opened] = controller.tick(T0)
        detector.entities = []
        [resolved] = controller.tick(T0 + 31 * S)
        assert (opened.kind, resolved.kind) == (OPENED, RESOLVED)
        assert controller.metrics.registry.get_sample_value("ridethrough_controller_emit_errors_total") == 0
        assert exp.flush(timeout_s=10)
    finally:
        store.close()
    key = "ridethrough:pd:link_down:link:h3-leaf1r0"
    assert [e["event_action"] for e in server.events_for(key)] == ["trigger", "resolve"]
    trigger = server.events_for(key)[0]
    assert trigger["payload"]["summary"] == "link h3-leaf1r0 down (link_down on h3-leaf1r0, cluster pd)"
    assert trigger["payload"]["custom_details"]["incident_id"] == opened.incident.incident_id
    assert server.pages == 1 and server.alerts[0].state == "resolved"


# --- a real process killed with SIGKILL ------------------------------------------------------

CHILD = r"""
import json, sys, time
from ridethrough.detectors.contract import Severity
from ridethrough.detectors.incidents import Incident, State, Transition, TransitionKind
from ridethrough.exporters.pagerduty import PagerDutyExporter
from ridethrough.exporters.pagerduty_config import PagerDutyConfig

args = json.loads(sys.argv[1])
exp = PagerDutyExporter.from_config(PagerDutyConfig(**args["config"]))
if args["incident"]:
    fields = {**args["incident"], "severity": Severity(args["incident"]["severity"]), "state": State.OPEN}
    exp.emit([Transition(TransitionKind.OPENED, Incident(**fields), None)])
print("queued", flush=True)
if args["mode"] == "queue-only":
    time.sleep(600)  # killed here
exp.start()
drained = exp.flush(30)
print(json.dumps({"drained": drained, "counts": exp.outbox.counts()}), flush=True)
exp.shutdown()
"""


def _child(server: PagerDutyServer, tmp_path: Path, mode: str, *, with_incident: bool, n: int) -> tuple[
        subprocess.Popen[bytes], Path]:
    cfg = {"enabled": True, "events_url": server.events_url, "change_url": server.change_url,
           "routing_keys": {"*": "env:PD_DEFAULT"}, "outbox": str(tmp_path / "outbox.sqlite3"),
           "initial_backoff_s": 0.01, "max_backoff_s": 0.05}
    inc = incident(severity=Severity.CRITICAL)
    fields = {f: getattr(inc, f) for f in Incident.__dataclass_fields__} | {"severity": 4, "state": "open"}
    args = {"config": cfg, "mode": mode, "incident": fields if with_incident else None}
    out = tmp_path / f"child-{n}.out"
    with open(out, "wb") as sink:
        proc = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(args)], stdout=sink,
                                stderr=subprocess.STDOUT, cwd=ROOT, env={"PD_DEFAULT": KEY, "PATH": "/usr/bin:/bin"})
    return proc, out


def _finish(proc: subprocess.Popen[bytes], out: Path) -> dict[str, Any]:
    assert proc.wait(60) == 0, out.read_text()
    return dict(json.loads(out.read_text().splitlines()[-1]))


def _counts(tmp_path: Path) -> dict[str, int]:
    box = Outbox(tmp_path / "outbox.sqlite3")
    try:
        return box.counts()
    finally:
        box.close()


@pytest.mark.integration
def test_a_kill_between_send_and_answer_resends_and_pagerduty_dedups_to_one_page(server, tmp_path) -> None:
    server.hold_next(1)
    proc, out = _child(server, tmp_path, "send", with_incident=True, n=0)
    try:
        wait_for(lambda: server.held == 1, timeout_s=60, what=f"the held request ({out})")
        assert len(server.accepted) == 1  # PagerDuty has the event; its 202 never reaches the sender
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        server.release()
    assert _counts(tmp_path)["pending"] == 1  # not marked sent: it will go again
    result = _finish(*_child(server, tmp_path, "send", with_incident=False, n=1))
    assert result == {"drained": True, "counts": {"pending": 0, "sent": 1, "rejected": 0, "dead": 0}}
    sent = server.events_for("ridethrough:prod:gpu_failing:gpu:h2/gpu3")
    assert len(sent) == 2 and sent[0] == sent[1]  # at least once, the same event
    assert server.pages == 1 and server.alerts[0].events == sent  # one page: deduplicated on dedup_key
    requests = server.requests
    _finish(*_child(server, tmp_path, "send", with_incident=False, n=2))
    assert server.requests == requests  # marked sent: a third start sends nothing


@pytest.mark.integration
def test_a_kill_after_emit_and_before_any_send_loses_nothing(server, tmp_path) -> None:
    proc, out = _child(server, tmp_path, "queue-only", with_incident=True, n=0)
    try:
        wait_for(lambda: "queued" in out.read_text(), timeout_s=60, what=f"the child to queue ({out})")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert server.requests == 0 and _counts(tmp_path)["pending"] == 1
    result = _finish(*_child(server, tmp_path, "send", with_incident=False, n=1))
    assert result["counts"]["sent"] == 1 and server.pages == 1 and len(server.accepted) == 1
