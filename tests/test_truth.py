"""``lab_truth`` in a real chDB store: idempotent DDL, the expected rows, no duplicates on a rewrite,
hostile strings stored verbatim; and its cluster DDL.

One chDB store per test module: a process can host one store path at a time, so the module
fixture owns it and closes it at the end.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest

from ridethrough.exporters.store import Store
from ridethrough.lab.runner import RunResult
from ridethrough.lab.scenario import Scenario
from ridethrough.lab.truth import TRUTH, ensure_truth_table, run_scenario, truth_ddl, write_truth
from tests.test_scenario import WALL0_NS, RecordingLab, run, scenario

HOSTILE = "x'); DROP TABLE lab_truth; --\\ \"q\" \t\n☃"
S = 10**9


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    s = Store(f"chdb://{tmp_path_factory.mktemp('truth') / 'store'}")
    yield s
    s.close()


def ran(sc: Scenario) -> RunResult:
    return run(sc, RecordingLab())


def rows(store: Store, run_id: str) -> list[dict[str, object]]:
    names, data = store.query(
        "SELECT *, toUnixTimestamp64Nano(StartedAt) AS s, toUnixTimestamp64Nano(EndedAt) AS e, "
        "toUnixTimestamp64Nano(PrecursorAt) AS p, toUnixTimestamp64Nano(FailureAt) AS f "
        "FROM lab_truth WHERE RunId = {run:String} ORDER BY FaultIndex", parameters={"run": run_id})
    return [dict(zip(names, row, strict=True)) for row in data]


def test_cluster_ddl_is_replicated_behind_a_distributed_table() -> None:
    local, distributed = truth_ddl(cluster="c1")
    assert "CREATE TABLE IF NOT EXISTS `lab_truth_local` ON CLUSTER `c1`" in local
    assert "ReplicatedMergeTree('/clickhouse/tables/{shard}/{database}/lab_truth_local', '{replica}')" in local
    assert "ORDER BY (Lab, RunId, FaultIndex)" in local and "non_replicated_deduplication_window" not in local
    assert "ENGINE = Distributed(`c1`, currentDatabase(), `lab_truth_local`, cityHash64(RunId))" in distributed
    (single,) = truth_ddl()
    assert "ENGINE = MergeTree" in single and "non_replicated_deduplication_window" in single


@pytest.mark.integration
def test_ensure_truth_table_is_idempotent(store: Store) -> None:
    ensure_truth_table(store)
    ensure_truth_table(store)
    _, data = store.query("SELECT name, type FROM system.columns WHERE table = 'lab_truth' ORDER BY position")
    assert [(n, t) for n, t in data] == [(c.name, c.type) for c in TRUTH.columns]


@pytest.mark.integration
def test_write_truth_writes_one_row_per_fault_with_wall_clock_truth(store: Store) -> None:
    ensure_truth_table(store)
    sc = scenario("""\
        timeline:
          - {at: 10s, for: 40s, fault: nic-ramp, target: h3, rate_per_s: 50, link_down_after_s: 30s}
          - {at: 5s, fault: gpu, target: h2, gpu: 3, gpu_fault: ecc_sbe_rising, rate_per_s: 2.5}
          - {at: 20s, fault: link-down, target: leaf0r0-spine1}
        """)
    lab = RecordingLab(fail={"set_link": "loopback mode"})
    result = run(sc, lab)
    assert write_truth(store, lab="lab1", scenario=sc, run_id="run-a", result=result) == 3
    ramp, gpu, down = rows(store, "run-a")
    assert (ramp["Lab"], ramp["Scenario"], ramp["Fault"], ramp["Kind"], ramp["Effect"]) == \
        ("lab1", "t", "nic-ramp", "link_errors", "failure")
    assert (ramp["Entity"], ramp["EntityType"], ramp["Target"]) == ("h3-leaf0r0", "link", "h3")
    assert ramp["Params"] == {"nic": "nic0", "counter": "symbol_error", "rate_per_s": "50",
                              "link_down_after_s": "30"}
    assert (ramp["s"], ramp["e"], ramp["p"], ramp["f"]) == \
        (WALL0_NS + 10 * S, WALL0_NS + 50 * S, WALL0_NS + 10 * S, WALL0_NS + 40 * S)
    assert (ramp["AtSeconds"], ramp["ForSeconds"], ramp["Applied"]) == (10.0, 40.0, True)
    assert ramp["Error"] == "loopback mode"  # its undo's set_link failed; clear_nic went through
    assert (gpu["Entity"], gpu["EntityType"], gpu["Effect"], gpu["Params"]["rate_per_s"]) == \
        ("h2/gpu3", "gpu", "precursor", "2.5")
    assert (gpu["p"], gpu["f"], gpu["e"], gpu["ForSeconds"]) == (WALL0_NS + 5 * S, None, WALL0_NS + 60 * S, None)
    assert (down["Applied"], down["Error"], down["f"], down["e"]) == (False, "loopback mode", None, None)
    assert down["FaultIndex"] == 2 and down["RunStartedAt"] is not None


@pytest.mark.integration
def test_writing_the_same_run_twice_does_not_duplicate(store: Store) -> None:
    ensure_truth_table(store)
    sc = scenario("timeline:\n  - {at: 1s, fault: freeze, target: h1}\n", duration="5s")
    result = ran(sc)
    for _ in range(2):
        write_truth(store, lab="lab1", scenario=sc, run_id="run-dup", result=result)
    assert len(rows(store, "run-dup")) == 1
    write_truth(store, lab="lab1", scenario=sc, run_id="run-other", result=result)
    assert len(rows(store, "run-other")) == 1


@pytest.mark.integration
def test_hostile_strings_are_stored_verbatim(store: Store) -> None:
    ensure_truth_table(store)
    sc = scenario("timeline:\n  - {at: 1s, fault: freeze, target: h1}\n", duration="5s")
    fault = sc.timeline[0]
    hostile = replace(sc, name=HOSTILE, timeline=(replace(fault, params={HOSTILE: HOSTILE},
                                                          truth=replace(fault.truth, kind=HOSTILE)),))
    result = ran(sc)
    write_truth(store, lab=HOSTILE, scenario=hostile, run_id=HOSTILE, result=result)
    (row,) = rows(store, HOSTILE)
    assert (row["Lab"], row["Scenario"], row["RunId"], row["Kind"], row["Params"]) == \
        (HOSTILE, HOSTILE, HOSTILE, HOSTILE, {HOSTILE: HOSTILE})
    _, count = store.query("SELECT count() FROM lab_truth")
    assert count[0][0] >= 1  # the table is still there


@pytest.mark.integration
def test_run_scenario_creates_the_table_runs_writes_and_prints(store: Store) -> None:
    sc = scenario("timeline:\n  - {at: 0s, for: 100ms, fault: straggle, target: h4}\n", duration="200ms")
    out: list[str] = []
    result = run_scenario(sc, lab=RecordingLab(), store=store, print_fn=out.append, run_id="run-live")
    assert result.outcomes[0].applied and not result.stopped
    (row,) = rows(store, "run-live")
    assert (row["Kind"], row["Effect"], row["Entity"]) == ("straggler", "degradation", "h4")
    assert out[0].startswith("scenario t on lab testlab: 1 faults over 0.2s (run run-live)")
    assert any("straggle h4: ok" in line for line in out)
    assert out[-1].startswith("1 truth rows written to lab_truth in chdb://")
