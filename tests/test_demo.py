"""``ridethrough demo``: its PagerDuty sink, its mode check, ``--down``, and the whole story end to end in a lab."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from ridethrough.demo_sink import ALERT_PATH, CHANGE_PATH, PagerDutySink
from ridethrough.demo_stack import detect_mode
from ridethrough.lab import netns
from tests.conftest import ROOT
from tests.demo_run import act, query, run_demo, steps_reported, tail

# Alone, after the parallel suite (`make unit`): the story's detections are timed against the machine.
pytestmark = pytest.mark.serial

KEY = "a" * 32


def _post(url: str, doc: Any) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=json.dumps(doc).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture
def sink(tmp_path: Path):
    s = PagerDutySink(record_file=tmp_path / "sink.jsonl")
    base = s.start()
    yield s, base
    s.stop()


def _trigger(dedup: str, **payload: Any) -> dict[str, Any]:
    body = {"summary": "link_down on h3-leaf1r0", "source": "ridethrough", "severity": "critical",
            "timestamp": "2026-11-30T10:00:00.123+00:00", **payload}
    return {"routing_key": KEY, "event_action": "trigger", "dedup_key": dedup, "payload": body}


def test_sink_keeps_alerts_as_pagerduty_does(sink) -> None:
    s, base = sink
    assert _post(base + ALERT_PATH, _trigger("inc-1")) == (202, {"status": "success", "message": "Event processed",
                                                                   "dedup_key": "inc-1"})
    assert _post(base + ALERT_PATH, _trigger("inc-1"))[0] == 202  # a repeat trigger updates the open alert
    assert [(p.dedup_key, p.resolved_at) for p in s.pages()] == [("inc-1", "")]
    status, _ = _post(base + ALERT_PATH, {"routing_key": KEY, "event_action": "resolve", "dedup_key": "inc-1"})
    assert status == 202
    assert s.pages()[0].resolved_at
    change = {"routing_key": KEY, "payload": {"summary": "migrate succeeded on h2/gpu3", "source": "ridethrough"}}
    assert _post(base + CHANGE_PATH, change)[0] == 202
    assert s.changes() == ["migrate succeeded on h2/gpu3"]
    lines = [json.loads(x) for x in s.record_file.read_text().splitlines()]
    assert [x["endpoint"] for x in lines] == ["alert", "alert", "alert", "change"]
    assert KEY not in s.record_file.read_text(), "the routing key is a secret: never recorded"


@pytest.mark.parametrize(("doc", "error"), [
    ({**_trigger("x"), "routing_key": "short"}, "'routing_key' must be a 32 character integration key"),
    ({**_trigger("x"), "event_action": "page"}, "'event_action' must be one of"),
    ({"routing_key": KEY, "event_action": "resolve"}, "'dedup_key' is missing"),
    (_trigger("x", severity="fatal"), "'payload.severity' must be one of"),
    (_trigger("x", summary="s" * 1025), "'payload.summary' is longer than 1024 characters"),
    (_trigger("x", timestamp="yesterday"), "'payload.timestamp' is not an ISO 8601 date-time"),
    ({"routing_key": KEY, "event_action": "trigger", "dedup_key": "x"}, "'payload' is missing"),
])
def test_sink_rejects_what_the_contract_forbids(sink, doc: dict[str, Any], error: str) -> None:
    s, base = sink
    status, answer = _post(base + ALERT_PATH, doc)
    assert status == 400 and answer["status"] == "invalid event"
    assert any(e.startswith(error) for e in answer["errors"]), answer["errors"]
    assert s.rejected == 1 and s.pages() == []


def test_mode_check_in_this_process_matches_the_lab_check() -> None:
    reason = netns.unavailable_reason()
    mode = detect_mode()
    assert mode.name == ("netns" if reason is None else "loopback")
    if reason is not None:
        assert reason in mode.message and "loopback" in mode.message


def _mode_as_nobody() -> tuple[str, str]:
    """`detect_mode` in a forked child that dropped root for the user nobody: (mode, message)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe and exits
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            mode = detect_mode()
            os.write(write, json.dumps([mode.name, mode.message]).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    name, message = json.loads(data)
    return name, message


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to an unprivileged user needs root")
def test_without_root_the_demo_says_so_and_takes_the_loopback_mode() -> None:
    # The real check, in a real unprivileged process (nobody), not a flag that pretends.
    name, message = _mode_as_nobody()
    assert name == "loopback"
    assert "need root" in message and "loopback mode" in message and "GPU and clock acts" in message


def test_down_without_a_demo_says_there_is_nothing(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "ridethrough", "demo", "--down", "--name", "nothere",
                          "--data-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "nothing to take down" in out.stdout


# -- the whole story, in a lab --------------------------------------------------------------------

DEMO_DURATION_S = 420
"""Long enough for every act's full time on a loaded 2-core machine (240 s also finishes, with shorter acts)."""


@pytest.fixture(scope="module")
def story(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One ``ridethrough demo --duration 420 --no-dashboard`` run: its output, run record and store."""
    reason = netns.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    pytest.importorskip("torch", reason="the torch extra is not installed")
    return run_demo(tmp_path_factory.mktemp("demo"), f"dm{os.getpid() % 100000}", duration_s=DEMO_DURATION_S)


def _honest(act: dict[str, Any]) -> None:
    """An act whose piece left nothing in the store says so in a ``missing`` line; it never claims it."""
    lines = act["lines"]
    if "incident" not in act["facts"]:  # the page act watches the sink, not an incident of its own
        return
    if act["facts"]["incident"] is None:
        assert any(s == "missing" and "incident" in t for s, t in lines), lines
        assert not any(s == "ok" and t.startswith("incident") for s, t in lines), lines
    if not act["facts"].get("actions"):
        assert not any(s == "ok" and t.startswith("action") for s, t in lines), lines


@pytest.mark.integration
@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(DEMO_DURATION_S + 480)
def test_demo_runs_every_act_and_cleans_up(story: dict[str, Any]) -> None:
    assert story["rc"] == 0, tail(story)
    rec = story["record"]
    assert rec["mode"] == "netns" and rec["job_ready"] is True, tail(story)
    assert [a["key"] for a in rec["acts"]] == ["spine", "cut", "gpu", "freeze", "page"]
    for record in rec["acts"]:
        assert record["lines"] and not any(t.startswith("skipped") for _, t in record["lines"]), record
        _honest(record)
    assert f"rt-{story['name']}-" not in story["leftover"], "the demo left namespaces behind"
    assert "goodput" in story["stdout"] and "checkpoint_restart" in story["stdout"]


@pytest.mark.integration
@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(DEMO_DURATION_S + 480)
def test_gpu_act_opens_the_right_incident_and_decides_a_migration(story: dict[str, Any]) -> None:
    rows = query(story, "SELECT IncidentId, Kind FROM incidents FINAL WHERE Entity = 'h4/gpu0' "
                         "AND Kind IN ('gpu_failing', 'gpu_failed')")
    assert rows, tail(story)
    ids = "', '".join(r["IncidentId"] for r in rows)
    actions = query(story, f"SELECT Plugin, Status, DryRun FROM actions FINAL WHERE IncidentId IN ('{ids}')")
    # Applied through h4's agent (signed job.migrate to the launchers) and verified with job.status.
    assert any(a["Plugin"] == "migrate" and not a["DryRun"] and a["Status"] == "succeeded" for a in actions), actions


@pytest.mark.integration
@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(DEMO_DURATION_S + 480)
def test_cut_and_freeze_acts_open_incidents_and_the_job_recovers(story: dict[str, Any]) -> None:
    cut = query(story, "SELECT Entity FROM incidents FINAL WHERE Kind IN ('link_down', 'link_flap') "
                        "AND Entity IN ('h4-leaf1r0', 'h4/mlx5_0', 'h4/nic0')")
    assert cut, tail(story)
    routed = query(story, "SELECT Status FROM actions FINAL WHERE Plugin = 'reroute' AND NOT DryRun "
                           "AND IncidentId IN (SELECT IncidentId FROM incidents FINAL WHERE Entity = 'h4-leaf1r0')")
    # the controller routed the affected hosts around the cut link, and the agents' probes confirmed it
    assert any(r["Status"] == "succeeded" for r in routed), (routed, tail(story))
    frozen = query(story, "SELECT Entity FROM incidents FINAL WHERE Kind = 'agent_silent' AND Entity = 'h5'")
    assert frozen, tail(story)
    job = act(story, "freeze")["facts"]["job"]  # a spare took the frozen host's rank, from a peer's state
    assert job["starts_after"] > job["starts_before"] and job["steps_after"] > job["steps_before"], job


@pytest.mark.integration
@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(DEMO_DURATION_S + 480)
def test_spine_act_predicts_the_lossy_link_and_drains_it(story: dict[str, Any]) -> None:
    # 10 % loss on leaf0r0-spine0 is not a failure: link_degrading (a prediction), never link_down
    seen = query(story, "SELECT Kind, Entity FROM incidents FINAL WHERE Entity = 'leaf0r0-spine0'")
    assert {"Kind": "link_degrading", "Entity": "leaf0r0-spine0"} in seen, (seen, tail(story))
    spine = act(story, "spine")
    assert spine["facts"]["incident"] is not None and spine["facts"]["localised"], spine
    # traffic moved off it: drained at the leaves, the probes of every pair that crossed it confirming
    assert spine["facts"]["drained"], spine


@pytest.mark.integration
@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(DEMO_DURATION_S + 480)
def test_pages_reach_the_sink_within_the_contract(story: dict[str, Any]) -> None:
    lines = [json.loads(x) for x in (story["data"] / "pagerduty-sink.jsonl").read_text().splitlines()]
    assert lines, tail(story)
    assert all(not x["errors"] for x in lines), [x["errors"] for x in lines if x["errors"]]
    triggers = {x["event"]["dedup_key"] for x in lines if x["event"].get("event_action") == "trigger"}
    resolves = {x["event"]["dedup_key"] for x in lines if x["event"].get("event_action") == "resolve"}
    assert triggers and triggers & resolves, (triggers, resolves)


@pytest.mark.integration
@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(DEMO_DURATION_S + 480)
def test_the_job_trained_through_the_fabric_faults(story: dict[str, Any]) -> None:
    done = steps_reported(story)
    assert len(done) > 20, tail(story)
    assert sorted(done) == list(range(min(done), max(done) + 1)), "a step no rank reported"
    for key in ("spine", "cut"):  # the fabric acts: the job must not notice
        job = act(story, key)["facts"]["job"]
        assert job["steps_after"] > job["steps_before"], (key, job)
    # TIGHTEN when the launcher fences a node it declared lost (a thawed host's rank must not rejoin
    # as a second copy of the rank its spare took): then no (rank, step) may be reported twice over the
    # whole run, and the freeze and GPU acts must advance too (facts["job"] of "gpu" and "freeze").
