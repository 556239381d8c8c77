"""The demo's job-progress check: an event stored twice is not a step redone; a step run again is."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ridethrough.dashboards.goodput import JobRecord
from ridethrough.demo_checks import job_progress
from ridethrough.exporters import schema
from ridethrough.exporters.store import Store
from tests.test_goodput import ev, insert, job_logs, run

# one rank, steps 1-4, a restart after step 4 from the checkpoint after step 2: steps 3 and 4 run twice
REDONE = JobRecord("acme", "redone", 1, runs=[
    run(0, 1, 0, 10), run(0, 2, 10, 20), run(0, 3, 20, 30), run(0, 4, 30, 40), run(0, 3, 60, 70),
    run(0, 4, 70, 80)], events=[ev(0, "start", 0), ev(0, "end", 45, "failed"), ev(0, "start", 50)])
# two ranks stepping 1-5 with no fault
STEADY = JobRecord("acme", "steady", 2, runs=[run(r, n, 10 * n, 10 * n + 10) for r in (0, 1) for n in range(1, 6)],
                   events=[ev(r, "start", 0) for r in (0, 1)])


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    st = Store(f"chdb://{tmp_path / 'store'}")
    st.init_schema()
    yield st
    st.close()


def test_a_steady_job_is_continuous(store: Store) -> None:
    insert(store, schema.LOGS, job_logs(STEADY, cluster="c", nodes={0: "n0", 1: "n1"}))
    p = job_progress(store, "steady")
    assert (p.ranks, p.last_step, p.gaps, p.repeats, p.starts, p.failed_ends) == (2, 5, (), 0, 2, 0)
    assert p.continuous


def test_events_delivered_twice_are_neither_repeats_nor_extra_starts(store: Store) -> None:
    # an agent's retry resends a batch the gateway had stored: every row arrives twice, in two inserts
    rows = job_logs(STEADY, cluster="c", nodes={0: "n0", 1: "n1"})
    insert(store, schema.LOGS, rows)
    insert(store, schema.LOGS, rows)
    p = job_progress(store, "steady")
    assert (p.repeats, p.starts) == (0, 2)
    assert p.continuous


def test_steps_run_again_after_a_restart_are_repeats(store: Store) -> None:
    rows = job_logs(REDONE, cluster="c", nodes={0: "n0"})
    insert(store, schema.LOGS, rows)
    insert(store, schema.LOGS, rows[:3])  # and some delivered twice: still two steps redone, not more
    p = job_progress(store, "redone")
    assert (p.last_step, p.repeats, p.starts, p.failed_ends) == (4, 2, 2, 1)
    assert not p.continuous
