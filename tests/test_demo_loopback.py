"""``ridethrough demo --loopback``: the story a user without root gets, end to end (GPU, clock and page acts)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.demo_run import act, query, run_demo, steps_reported, tail

DURATION_S = 480
"""Job start (up to 300 s; over 3 minutes in CI when the other test worker loaded the machine), the three
acts' full times (150 s) and the summary: the acts' shares of what is left are not cut short by a slow
start. A run that finishes its acts sooner ends sooner."""


@pytest.fixture(scope="module")
def story(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One ``ridethrough demo --loopback --duration 420 --no-dashboard`` run."""
    pytest.importorskip("torch", reason="the torch extra is not installed")
    return run_demo(tmp_path_factory.mktemp("demo-lo"), f"dl{os.getpid() % 100000}", duration_s=DURATION_S,
                    extra=("--loopback",))


@pytest.mark.integration
@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(DURATION_S + 480)
def test_loopback_story_plays_its_three_acts(story: dict[str, Any]) -> None:
    assert story["rc"] == 0, tail(story)
    rec = story["record"]
    assert rec["mode"] == "loopback" and "--loopback" in rec["mode_message"], rec.get("mode_message")
    assert [a["key"] for a in rec["acts"]] == ["gpu", "clock", "page"], tail(story)
    assert rec["job_ready"] is True, tail(story)


@pytest.mark.integration
@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(DURATION_S + 480)
def test_loopback_gpu_act_migrates_the_rank_and_the_clock_act_is_localised(story: dict[str, Any]) -> None:
    gpu = query(story, "SELECT IncidentId FROM incidents FINAL WHERE Entity = 'h4/gpu0' AND Kind = 'gpu_failing'")
    assert gpu, tail(story)
    ids = "', '".join(r["IncidentId"] for r in gpu)
    actions = query(story, f"SELECT Plugin, Status FROM actions FINAL WHERE IncidentId IN ('{ids}') AND NOT DryRun")
    assert {"Plugin": "migrate", "Status": "succeeded"} in actions, actions
    clock = query(story, "SELECT Entity FROM incidents FINAL WHERE Kind IN ('clock_jump', 'clock_unsynced')")
    assert {"Entity": "h3"} in clock, (clock, tail(story))
    assert act(story, "clock")["facts"]["incident"] is not None, act(story, "clock")


@pytest.mark.integration
@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(DURATION_S + 480)
def test_loopback_job_lost_no_step(story: dict[str, Any]) -> None:
    done = steps_reported(story)
    assert len(done) > 20, tail(story)
    assert sorted(done) == list(range(min(done), max(done) + 1)), "a step no rank reported"
    job = act(story, "gpu")["facts"]["job"]
    assert job["steps_after"] > job["steps_before"], job
