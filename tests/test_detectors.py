"""Known-answer tests for the detectors, on synthetic rows in one embedded store.

Each test writes its rows under its own ``ridethrough.cluster`` and reads with
``Window(cluster=...)``, so tests never see each other's rows.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ridethrough.detectors import gpu, link, silent, straggler
from ridethrough.detectors.contract import Detector, EntityType, Finding, FindingKind, Window
from ridethrough.exporters import schema
from ridethrough.exporters.store import Store

pytestmark = pytest.mark.integration

S = 10**9
T0 = 1_700_000_000 * S
END = T0 + 300 * S
STEP_S = 5
TIMES = [T0 + i * STEP_S * S for i in range(300 // STEP_S + 1)]
_tokens = itertools.count()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    path: Path = tmp_path_factory.mktemp("detectors") / "store"
    st = Store(f"chdb://{path}")
    st.init_schema()
    yield st
    st.close()


def _default(typ: str) -> Any:
    if typ.startswith(("Map", "Array")):
        return {} if typ.startswith("Map") else []
    if "String" in typ:
        return ""
    return 0.0 if typ == "Float64" else 0


def insert(store: Store, table: schema.Table, rows: Sequence[dict[str, Any]], *, token: str = "") -> None:
    """Insert rows (dicts of the columns they set; the rest default) as convert_* would."""
    cols = [c for c in table.columns if c.insert]
    columns = [[row.get(c.name, _default(c.type)) for row in rows] for c in cols]
    store.insert_columns(table, columns, token=token or f"t{next(_tokens)}")


def point(cluster: str, node: str, metric: str, attrs: dict[str, str], t_ns: int, value: float) -> dict[str, Any]:
    """One data point row of ``node``'s agent."""
    res = {"ridethrough.node.id": node, "host.name": node, "ridethrough.cluster": cluster, "service.name": "agent"}
    return {"ResourceAttributes": res, "ServiceName": "agent", "MetricName": metric, "Attributes": attrs,
            "StartTimeUnix": T0 - 3600 * S, "TimeUnix": t_ns, "Value": float(value),
            "AggregationTemporality": 2, "IsMonotonic": True}


def series(cluster: str, node: str, metric: str, attrs: dict[str, str], values: Sequence[float],
           times: Sequence[int] = TIMES) -> list[dict[str, Any]]:
    return [point(cluster, node, metric, attrs, t, v) for t, v in zip(times, values, strict=False)]


def xid_log(cluster: str, node: str, index: str, xid: str, xid_class: str, t_ns: int) -> dict[str, Any]:
    res = {"ridethrough.node.id": node, "host.name": node, "ridethrough.cluster": cluster}
    attrs = {"event.name": "gpu.xid", "gpu.index": index, "hw.id": f"GPU-{node}-{index}", "gpu.xid": xid,
             "gpu.xid.class": xid_class}
    return {"Timestamp": t_ns, "ResourceAttributes": res, "LogAttributes": attrs, "Body": f"XID {xid}"}


def run(store: Store, det: Detector, cluster: str, end_ns: int = END) -> list[Finding]:
    def query(sql: str, params: Any) -> tuple[list[str], list[tuple[Any, ...]]]:
        return store.query(sql, parameters=dict(params))
    return det.detect(Window(start_ns=end_ns - int(det.window_s * S), end_ns=end_ns, query=query, cluster=cluster))


N = len(TIMES)
IB = {"ib.device": "mlx5_0", "ib.port": "1"}
STATE = "ridethrough.ib.port.state"
ERR = "ridethrough.ib.port.errors"


def _jump(rows: list[dict[str, Any]], *, after: int = T0 + 150 * S, by_s: int = 3600) -> list[dict[str, Any]]:
    """The host's clock stepped forward ``by_s`` seconds at ``after``."""
    return [{**r, "TimeUnix": r["TimeUnix"] + by_s * S} if r["TimeUnix"] >= after else r for r in rows]


def _cumulative(rates: Sequence[float]) -> list[float]:
    return list(itertools.accumulate(r * STEP_S for r in rates))


def _healthy_link(c: str) -> list[dict[str, Any]]:
    return (series(c, "h1", STATE, {**IB, "ib.link_layer": "InfiniBand"}, [4] * N)
            + series(c, "h1", ERR, {**IB, "ib.counter": "link_downed"}, [2] * N)
            + series(c, "h1", ERR, {**IB, "ib.counter": "symbol_error"}, _cumulative([5.0] * N))
            + series(c, "h1", "ridethrough.nic.up", {"network.interface.name": "nic0"}, [1] * N)
            + series(c, "h1", "ridethrough.nic.carrier_changes", {"network.interface.name": "nic0"}, [4] * N))


def _reset(c: str) -> list[dict[str, Any]]:
    half = N // 2
    return (series(c, "h1", ERR, {**IB, "ib.counter": "link_downed"}, [7] * half + [0] * (N - half))
            + series(c, "h1", ERR, {**IB, "ib.counter": "symbol_error"},
                     _cumulative([5.0] * half) + _cumulative([5.0] * (N - half)))
            + series(c, "h1", "ridethrough.nic.carrier_changes", {"network.interface.name": "nic0"},
                     [9] * half + [0] * (N - half))
            + series(c, "h1", "hw.errors", {"gpu.index": "0", "hw.id": "GPU-a", "error.type": "corrected"},
                     [5000] * half + [0] * (N - half))
            + [r for rank in range(4) for r in _job_counters(c, rank, 0.010, restart_at=half if rank == 2 else None)])


def _gap(c: str) -> list[dict[str, Any]]:
    return [r for r in _healthy_link(c) + _healthy_gpu(c) + _healthy_job(c) if r["TimeUnix"] < T0 + 100 * S]


def _healthy_gpu(c: str) -> list[dict[str, Any]]:
    g = {"gpu.index": "0", "hw.id": "GPU-a"}
    return (series(c, "h1", "hw.status", {**g, "hw.state": "failed"}, [0] * N)
            + series(c, "h1", "hw.status", {**g, "hw.state": "ok"}, [1] * N)
            + series(c, "h1", "ridethrough.gpu.recovery_action", {**g, "gpu.recovery_action": "none"}, [1] * N)
            + series(c, "h1", "hw.errors", {**g, "error.type": "corrected"}, [3] * N)
            + series(c, "h1", "ridethrough.gpu.memory.remap_pending", g, [0] * N)
            + series(c, "h1", "hw.temperature", g, [60.0] * N)
            + series(c, "h1", "ridethrough.gpu.clock_event_reason",
                     {**g, "gpu.clock_event_reason": "HwThermalSlowdown"}, [1] * N))


def _job_counters(c: str, rank: int, compute_per_step: float, *, restart_at: int | None = None,
                  ) -> list[dict[str, Any]]:
    """A rank's ``job.steps`` and ``job.phase.time{compute}`` counters at one step a second; with
    ``restart_at`` the rank restarts there (its counters begin again at 0)."""
    attrs = {"job.id": "j1", "job.rank": str(rank), "job.customer": "acme"}
    steps = [float(i * STEP_S) for i in range(N)]
    if restart_at is not None:
        steps = steps[:restart_at] + [float(i * STEP_S) for i in range(N - restart_at)]
    return (series(c, f"h{rank}", "ridethrough.job.steps", attrs, steps)
            + series(c, f"h{rank}", "ridethrough.job.phase.time", {**attrs, "job.phase": "compute"},
                     [n * compute_per_step for n in steps]))


def _healthy_job(c: str) -> list[dict[str, Any]]:
    durations = [r for rank in range(4) for r in series(
        c, f"h{rank}", "ridethrough.job.step.duration", {"job.id": "j1", "job.rank": str(rank)},
        [1.0 + 0.01 * ((i + rank) % 3) for i in range(N)])]
    return durations + [r for rank in range(4) for r in _job_counters(c, rank, 0.010 + 0.001 * (rank % 2))]


def _healthy(c: str) -> list[dict[str, Any]]:
    return _healthy_link(c) + _healthy_gpu(c) + _healthy_job(c)


def _all_detectors() -> list[Detector]:
    cfg = SimpleNamespace(straggler_min_runs=1)  # judged on each window alone (confirmation: tested on its own)
    return [d for m in (link, gpu, straggler, silent) for d in m.build(cfg)]


def _write(store: Store, c: str, rows: list[dict[str, Any]], *, twice: bool = False) -> None:
    for _ in range(2 if twice else 1):
        insert(store, schema.GAUGE, [r for r in rows if r["MetricName"] not in _SUMS])
        insert(store, schema.SUM, [r for r in rows if r["MetricName"] in _SUMS])


_SUMS = {ERR, "ridethrough.nic.carrier_changes", "hw.errors", "ridethrough.job.steps", "ridethrough.job.phase.time"}
_QUIET_CASES: dict[str, Callable[[str], list[dict[str, Any]]]] = {
    "healthy": _healthy,
    "flat_nonzero_errors_and_counter_reset": _reset,
    "clock_jump": lambda c: _jump(_healthy(c)),
}


@pytest.mark.parametrize("case", [*_QUIET_CASES, "duplicated", "gap"])
def test_no_fault_no_finding(store: Store, case: str) -> None:
    c = f"quiet-{case}"
    if case == "duplicated":
        _write(store, c, _healthy(c), twice=True)
    elif case == "gap":
        _write(store, c, _gap(c))
    else:
        _write(store, c, _QUIET_CASES[case](c))
    for det in _all_detectors():
        if case == "gap" and det.name == "agent_silent":
            continue  # the one finding a gap may create (tested below)
        assert run(store, det, c) == [], det.name


def _one(findings: list[Finding], kind: FindingKind, entity: str) -> Finding:
    assert [(f.kind, f.entity) for f in findings] == [(kind, entity)]
    f = findings[0]
    assert f.evidence
    assert T0 <= f.observed_at_ns <= END
    return f


@pytest.mark.parametrize("twice", [False, True])
def test_link_down_ib_state(store: Store, twice: bool) -> None:
    c = f"down-state-{twice}"
    _write(store, c, series(c, "h3", STATE, {**IB, "ib.link_layer": "InfiniBand"}, [4] * (N - 3) + [1] * 3),
           twice=twice)
    f = _one(run(store, link.LinkDown(), c), FindingKind.LINK_DOWN, "h3/mlx5_0")
    assert f.evidence["state"] == 1 and f.evidence["host"] == "h3" and f.entity_type is EntityType.NIC


def test_link_down_counter_and_netdev(store: Store) -> None:
    c = "down-counter"
    _write(store, c, series(c, "h1", ERR, {**IB, "ib.counter": "link_downed"}, [0] * 50 + [1] * (N - 50))
           + series(c, "h2", "ridethrough.nic.up", {"network.interface.name": "nic1"}, [1] * (N - 2) + [0, 0]))
    found = {f.entity: f for f in run(store, link.LinkDown(), c)}
    assert set(found) == {"h1/mlx5_0", "h2/nic1"}
    assert found["h1/mlx5_0"].evidence["query"] == "ib_link_downed"


def test_link_down_for_one_sample_is_reported_while_recent(store: Store) -> None:
    c = "down-blip"
    nic = {"network.interface.name": "nic1"}
    blip_recent = [1] * (N - 3) + [0, 1, 1]                     # down 10 s before the window's end
    blip_old = [1] * (N - 10) + [0] + [1] * 9                   # down 45 s before: past recent_s
    down_at_start = [0] * 5 + [1] * (N - 5)                     # never up before it was down: a port coming up
    state = {**IB, "ib.link_layer": "InfiniBand"}
    _write(store, c, series(c, "h1", "ridethrough.nic.up", nic, blip_recent)
           + series(c, "h2", "ridethrough.nic.up", nic, blip_old)
           + series(c, "h3", "ridethrough.nic.up", nic, down_at_start)
           + series(c, "h4", STATE, state, [4] * (N - 2) + [1, 4]))
    found = {f.entity: f for f in run(store, link.LinkDown(recent_s=15), c)}
    assert set(found) == {"h1/nic1", "h4/mlx5_0"}
    assert "was down" in found["h1/nic1"].summary and found["h1/nic1"].evidence["up"] == 1.0


def test_link_flap(store: Store) -> None:
    c = "flap"
    _write(store, c, series(c, "h1", STATE, IB, [4, 1] * (N // 2) + [4])
           + series(c, "h2", "ridethrough.nic.carrier_changes", {"network.interface.name": "nic0"},
                    [0] * 55 + [1, 2, 3, 4, 5, 6]), twice=True)
    found = {f.entity: f for f in run(store, link.LinkFlap(), c)}
    assert set(found) == {"h1/mlx5_0", "h2/nic0"}
    assert found["h2/nic0"].evidence["transitions"] == 6


def test_link_degrading(store: Store) -> None:
    c = "degrading"
    rising = _cumulative([0.1 * i for i in range(N)])
    _write(store, c, series(c, "h1", ERR, {**IB, "ib.counter": "symbol_error"}, rising), twice=True)
    f = _one(run(store, link.LinkDegrading(), c), FindingKind.LINK_DEGRADING, "h1/mlx5_0")
    assert f.evidence["rate_second_per_s"] > 1.5 * f.evidence["rate_first_per_s"]
    assert f.time_to_failure_s is not None and f.time_to_failure_s > 0


def test_gpu_failed(store: Store) -> None:
    c = "gpu-failed"
    g = {"gpu.index": "1", "hw.id": "GPU-b"}
    _write(store, c, series(c, "h1", "hw.status", {**g, "hw.state": "failed"}, [0] * (N - 1) + [1])
           + series(c, "h2", "ridethrough.gpu.recovery_action", {**g, "gpu.recovery_action": "node_reboot"}, [1] * N))
    logs = [xid_log(c, "h3", "2", "79", "gpu_reset", T0 + 280 * S), xid_log(c, "h4", "0", "13", "application_error",
                                                                           T0 + 280 * S)]
    insert(store, schema.LOGS, logs)
    insert(store, schema.LOGS, logs)
    found = {f.entity: f for f in run(store, gpu.GpuFailed(), c)}
    assert set(found) == {"h1/gpu1", "h2/gpu1", "h3/gpu2"}
    assert found["h1/gpu1"].evidence["uuid"] == "GPU-b"
    assert found["h3/gpu2"].evidence["xid_fatal"]["count"] == 1


def test_gpu_failing(store: Store) -> None:
    c = "gpu-failing"

    def g(i: str) -> dict[str, str]:
        return {"gpu.index": i, "hw.id": f"GPU-{i}"}
    _write(store, c, series(c, "h1", "hw.errors", {**g("0"), "error.type": "corrected"}, _cumulative([1.0] * N))
           + series(c, "h1", "ridethrough.gpu.memory.remap_pending", g("1"), [0] * 10 + [1] * (N - 10))
           + series(c, "h1", "ridethrough.gpu.clock_event_reason",
                    {**g("3"), "gpu.clock_event_reason": "SwThermalSlowdown"}, [1] * N)
           + series(c, "h1", "hw.temperature", g("3"), [60 + 0.5 * i for i in range(N)]), twice=True)
    insert(store, schema.LOGS, [xid_log(c, "h1", "2", "94", "precursor", T0 + 50 * S)])
    found = {f.entity: f for f in run(store, gpu.GpuFailing(), c)}
    assert set(found) == {"h1/gpu0", "h1/gpu1", "h1/gpu2", "h1/gpu3"}
    assert "ecc_corrected_rate" in found["h1/gpu0"].evidence
    assert "thermal" in found["h1/gpu3"].evidence


def test_straggler(store: Store) -> None:
    c = "straggler"
    slow = series(c, "h9", "ridethrough.job.step.duration", {"job.id": "j1", "job.rank": "7"}, [2.0] * N)
    _write(store, c, _healthy_job(c) + slow, twice=True)
    f = _one(run(store, straggler.Straggler(min_runs=1), c), FindingKind.STRAGGLER, "j1/rank7")
    assert f.entity_type is EntityType.RANK and f.evidence["host"] == "h9"


def test_straggler_is_reported_once_it_stood_out_in_two_runs_in_a_row(store: Store) -> None:
    """One window's outlier is a suspect; the next run's window confirms it (and counts on), a run that clears
    it starts the count again, and so does a window that goes back in time."""
    c = "straggler-confirm"
    slow = series(c, "h9", "ridethrough.job.step.duration", {"job.id": "j1", "job.rank": "7"}, [2.0] * N)
    _write(store, c, _healthy_job(c) + slow)
    det = straggler.Straggler()
    assert det.min_runs == 2
    assert run(store, det, c, end_ns=END - 20 * S) == []  # a suspect, not yet a finding
    f = _one(run(store, det, c, end_ns=END - 10 * S), FindingKind.STRAGGLER, "j1/rank7")
    assert f.evidence["runs"] == 2 and f.evidence["host"] == "h9"
    assert _one(run(store, det, c, end_ns=END), FindingKind.STRAGGLER, "j1/rank7").evidence["runs"] == 3
    assert run(store, det, c, end_ns=END) == []  # the same window again is no new evidence: the count starts over
    assert run(store, det, c, end_ns=T0 - 600 * S) == []  # no data: cleared
    assert run(store, det, c, end_ns=END - 10 * S) == []  # the first run after clearing is a suspect again
    assert run(store, det, c, end_ns=END) != []


def test_straggler_by_compute_time_in_a_lockstep_job(store: Store) -> None:
    """Every rank's step takes the same time (they wait for each other); rank 3 computes 4x longer."""
    c = "straggler-compute"
    rows = [r for r in _healthy_job(c) if not (r["MetricName"] != "ridethrough.job.step.duration"
                                                and r["Attributes"]["job.rank"] == "3")]
    _write(store, c, rows + _job_counters(c, 3, 0.040), twice=True)
    f = _one(run(store, straggler.Straggler(min_runs=1), c), FindingKind.STRAGGLER, "j1/rank3")
    assert f.evidence["query"] == "rank_compute_per_step" and f.evidence["host"] == "h3"
    assert f.evidence["rank_s"] == pytest.approx(0.040) and f.evidence["ranks"] == 4


def test_straggler_by_compute_time_ignores_a_job_that_stopped_stepping(store: Store) -> None:
    """The job ended 30 s before the window's end, its counters re-reported flat since (as the agent does until
    it forgets a rank); rank 3 was computing when it stopped, so its compute per step looks 4x the others'."""
    c = "straggler-ended"
    stop = N - 6  # 30 s before END
    rows = [r for r in _healthy_job(c) if r["MetricName"] != "ridethrough.job.step.duration"
            and r["Attributes"]["job.rank"] != "3"] + _job_counters(c, 3, 0.040)
    ended = [{**r, "Value": next(x["Value"] for x in rows if x["MetricName"] == r["MetricName"]
                                 and x["Attributes"] == r["Attributes"] and x["TimeUnix"] == TIMES[stop])}
             if r["TimeUnix"] > TIMES[stop] else r for r in rows]
    _write(store, c, ended)
    assert run(store, straggler.Straggler(min_runs=1), c) == []
    control = straggler.Straggler(min_runs=1, stale_s=1e9)
    assert [f.entity for f in run(store, control, c)] == ["j1/rank3"], "the control"


def test_straggler_within_a_wide_scatter_is_noise_and_far_outside_it_is_found(store: Store) -> None:
    """32 ranks sharing few cores compute between 50 and 150 ms a step; rank 31 at 160 ms is 1.6x the median
    but inside the scatter (robust z about 1.6); rank 30 at 600 ms stands far outside it."""
    c = "straggler-scatter"
    scatter = {rank: 0.05 + 0.1 * ((rank * 7) % 30) / 29 for rank in range(30)}
    rows = [r for rank, v in {**scatter, 31: 0.160}.items() for r in _job_counters(c, rank, v)]
    _write(store, c, rows)
    assert run(store, straggler.Straggler(min_runs=1), c) == []
    assert [f.entity for f in run(store, straggler.Straggler(min_runs=1, min_z=0.0), c)] == ["j1/rank31"], "the control"
    _write(store, c, _job_counters(c, 30, 0.600))
    assert [f.entity for f in run(store, straggler.Straggler(min_runs=1), c)] == ["j1/rank30"]


def test_straggler_by_step_time_within_a_wide_scatter_is_noise(store: Store) -> None:
    """The same by median step time, for ranks that report no phases (the job's median and MAD in SQL):
    30 ranks step in 0.5 to 1.5 s; rank 31 at 1.6 s is inside the scatter; rank 30 at 6 s is not."""
    c = "straggler-step-scatter"

    def steps(rank: int, seconds: float) -> list[dict[str, Any]]:
        return series(c, f"h{rank}", "ridethrough.job.step.duration", {"job.id": "j1", "job.rank": str(rank)},
                      [seconds] * N)

    _write(store, c, [r for rank in range(30) for r in steps(rank, 0.5 + ((rank * 7) % 30) / 29)] + steps(31, 1.6))
    assert run(store, straggler.Straggler(min_runs=1), c) == []
    found = run(store, straggler.Straggler(min_runs=1, min_z=0.0), c)
    assert [f.entity for f in found] == ["j1/rank31"], "the control"
    assert found[0].evidence["query"] == "rank_step_medians"
    _write(store, c, steps(30, 6.0))
    assert [f.entity for f in run(store, straggler.Straggler(min_runs=1), c)] == ["j1/rank30"]


def test_straggler_needs_enough_steps(store: Store) -> None:
    c = "straggler-few"
    slow = series(c, "h9", "ridethrough.job.step.duration", {"job.id": "j1", "job.rank": "7"}, [2.0] * 3)
    _write(store, c, _healthy_job(c) + slow)
    assert run(store, straggler.Straggler(min_runs=1), c) == []


def test_agent_silent(store: Store) -> None:
    c = "silent"
    rows = (series(c, "alive", "ridethrough.nic.up", {"network.interface.name": "nic0"}, [1] * N)
            + series(c, "gone", "ridethrough.nic.up", {"network.interface.name": "nic0"}, [1] * 30)
            + _jump(series(c, "ahead", "ridethrough.nic.up", {"network.interface.name": "nic0"}, [1] * N))
            + [point(c, "long-gone", "ridethrough.nic.up", {}, T0 - 7200 * S, 1)])
    _write(store, c, rows, twice=True)
    f = _one(run(store, silent.AgentSilent(), c), FindingKind.AGENT_SILENT, "gone")
    assert f.entity_type is EntityType.HOST and f.evidence["silent_s"] > 30


def test_every_detector_honours_the_contract(store: Store) -> None:
    detectors = _all_detectors()
    assert {d.name for d in detectors} == {"link_down", "link_flap", "link_degrading", "gpu_failed", "gpu_failing",
                                           "straggler", "agent_silent"}
    for det in detectors:
        assert isinstance(det, Detector)
        assert 2 <= det.interval_s <= 10 and det.window_s >= 30
        for f in run(store, det, ""):  # every cluster written so far
            assert isinstance(f.kind, FindingKind) and f.detector == det.name
            assert f.observed_at_ns > 0 and f.evidence and 0 <= f.confidence <= 1


def test_straggler_ignores_a_rank_that_stopped_stepping(store: Store) -> None:
    """The agent re-reports a rank's last step at every collection until it forgets the rank: a rank that
    ended (or hangs) after one slow step is not a straggler; the control, whose steps advance, is."""
    c = "straggler-stale"
    attrs = {"job.id": "j1", "job.rank": "7"}
    stale = (series(c, "h9", "ridethrough.job.step.duration", attrs, [2.0] * N)
             + series(c, "h9", "ridethrough.job.step.last", attrs, [42.0] * N))
    _write(store, c, _healthy_job(c) + stale, twice=True)
    assert run(store, straggler.Straggler(min_runs=1), c) == []
    c = "straggler-advancing"
    moving = (series(c, "h9", "ridethrough.job.step.duration", attrs, [2.0] * N)
              + series(c, "h9", "ridethrough.job.step.last", attrs, [float(i) for i in range(N)]))
    _write(store, c, _healthy_job(c) + moving)
    _one(run(store, straggler.Straggler(min_runs=1), c), FindingKind.STRAGGLER, "j1/rank7")


def test_straggler_by_compute_time_waits_for_ranks_in_step(store: Store) -> None:
    """Rank 3 computes 4x longer but has done half the others' steps lately (it is still joining, or its
    reports lag): the job's ranks are not in step, so compute per step is not compared."""
    c = "straggler-out-of-step"
    rows = [r for r in _healthy_job(c) if r["Attributes"]["job.rank"] != "3"]
    attrs = {"job.id": "j1", "job.rank": "3", "job.customer": "acme"}
    steps = [float(i * STEP_S // 2) for i in range(N)]
    rows += (series(c, "h3", "ridethrough.job.steps", attrs, steps)
             + series(c, "h3", "ridethrough.job.phase.time", {**attrs, "job.phase": "compute"},
                      [n * 0.040 for n in steps]))
    _write(store, c, rows)
    assert run(store, straggler.Straggler(min_runs=1), c) == []
    # the control: judged anyway, it is blamed
    assert run(store, straggler.Straggler(min_runs=1, max_step_spread=10.0), c)


def test_agent_silent_reads_on_from_its_last_window(store: Store) -> None:
    """One detector run window after window (as the controller runs it) finds what a fresh one finds,
    forgets a node older than its window, and reads in full again after time went back."""
    c = "silent-incremental"
    rows = (series(c, "alive", "ridethrough.nic.up", {"network.interface.name": "nic0"}, [1] * N)
            + series(c, "gone", "ridethrough.nic.up", {"network.interface.name": "nic0"}, [1] * 30))
    _write(store, c, rows)
    det = silent.AgentSilent(window_s=200.0)
    for end in range(T0 + 100 * S, END + 1, 25 * S):
        fresh = silent.AgentSilent(window_s=200.0)
        expected = [f.entity for f in run(store, fresh, c, end_ns=end)]
        assert [f.entity for f in run(store, det, c, end_ns=end)] == expected
    assert [f.entity for f in run(store, det, c, end_ns=END)] == ["gone"]
    # 200 s after its last point "gone" leaves the window, and the finding with it; "alive", the freshest
    # node left, is silent against no one
    assert run(store, det, c, end_ns=T0 + 145 * S + 200 * S + 5 * S) == []
    assert [f.entity for f in run(store, det, c, end_ns=END)] == ["gone"]  # back in time: read in full


def test_agent_silent_is_relative_to_the_freshest_node(store: Store) -> None:
    """The store stopped receiving from every agent 60 s ago (an ingest stall, not 4 dead hosts): no one is
    silent; one host that stopped 40 s before the others is."""
    c = "silent-stall"
    rows = [r for n in ("a", "b", "c") for r in series(c, n, "ridethrough.nic.up", {"network.interface.name": "nic0"},
                                                         [1] * (N - 12))]
    rows += series(c, "d", "ridethrough.nic.up", {"network.interface.name": "nic0"}, [1] * (N - 20))
    _write(store, c, rows)
    f = _one(run(store, silent.AgentSilent(), c), FindingKind.AGENT_SILENT, "d")
    assert f.evidence["silent_s"] == pytest.approx(40)


def test_straggler_step_time_noise_of_a_phased_rank_is_not_a_straggler(store: Store) -> None:
    """Rank 2's sampled step times run long (a loaded host's sampling), but it computes like the others: a
    rank that reports its compute phase is judged by that, so nothing is found."""
    c = "straggler-phased-noise"
    rows = [r for r in _healthy_job(c) if not (r["MetricName"] == "ridethrough.job.step.duration"
                                                and r["Attributes"]["job.rank"] == "2")]
    rows += series(c, "h2", "ridethrough.job.step.duration", {"job.id": "j1", "job.rank": "2"}, [2.0] * N)
    _write(store, c, rows)
    assert run(store, straggler.Straggler(min_runs=1), c) == []
