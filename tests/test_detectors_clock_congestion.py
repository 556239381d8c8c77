"""Known answers for the clock and congestion detectors, on synthetic rows in the detector tests' store.

Each test writes under its own ``ridethrough.cluster``. Clock rows are the clock service's
``ridethrough.clock.node.*`` points (one series per node against reference ``h0``); probe rows
are one prober's per-path points every 5 s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from ridethrough.detectors import clock, congestion, link
from ridethrough.detectors.clock import ClockJump, ClockUnsynced
from ridethrough.detectors.congestion import Congestion
from ridethrough.detectors.contract import Detector, EntityType, FindingKind
from ridethrough.detectors.tomography import RouteMap, Tomography
from ridethrough.exporters import schema
from ridethrough.exporters.store import Store
from ridethrough.lab.topology import Topology, TopologySpec
from tests import test_detectors as td

store = td.store  # the module-scoped chDB store of the detector tests
pytestmark = pytest.mark.integration

S, N, T0, END = td.S, td.N, td.T0, td.END
US = 1e-6
SUMS = {"ridethrough.probe.sent", "ridethrough.probe.lost"}


def write(store: Store, rows: Sequence[dict[str, Any]], *, twice: bool = False) -> None:
    for _ in range(2 if twice else 1):
        td.insert(store, schema.GAUGE, [r for r in rows if r["MetricName"] not in SUMS])
        td.insert(store, schema.SUM, [r for r in rows if r["MetricName"] in SUMS])


# -- clock --------------------------------------------------------------------------------

def offsets(c: str, node: str, values: Sequence[float], *, reference: str = "h0",
            metric: str = "ridethrough.clock.node.offset") -> list[dict[str, Any]]:
    return td.series(c, "clock-service", metric, {"clock.node": node, "clock.reference": reference}, values)


def drifting(ppm: float, *, step_at_s: float = math.inf, step_s: float = 0.0, seed: int = 0) -> list[float]:
    """An offset drifting at ``ppm`` with ±2 µs of noise, stepping by ``step_s`` from ``step_at_s``."""
    return [ppm * 1e-6 * 5 * i + 2 * US * math.sin(7 * i + seed) + (step_s if 5 * i >= step_at_s else 0.0)
            for i in range(N)]


def healthy_clocks(c: str) -> list[dict[str, Any]]:
    return (offsets(c, "h0", [0.0] * N)
            + [r for i, node in enumerate(("h1", "h2", "h3")) for r in offsets(c, node, drifting(10 * i, seed=i))]
            + [r for node in ("h0", "h1", "h2", "h3")
               for r in offsets(c, node, [5 * US] * N, metric="ridethrough.clock.node.uncertainty")])


def clock_detectors() -> list[Detector]:
    return clock.build(SimpleNamespace())


def test_clock_jump_of_one_node(store: Store) -> None:
    c = "clock-jump"
    rows = healthy_clocks(c) + offsets(c, "h4", drifting(20, step_at_s=250, step_s=500 * US))
    write(store, rows, twice=True)
    [f] = td.run(store, ClockJump(), c)
    assert (f.kind, f.entity_type, f.entity) == (FindingKind.CLOCK_JUMP, EntityType.CLOCK, "h4")
    assert f.evidence["step_s"] == pytest.approx(500 * US, abs=10 * US)
    assert f.evidence["step_at_ns"] == T0 + 250 * S
    assert f.evidence["drift_s_per_s"] == pytest.approx(20e-6, rel=0.05)


def test_clock_jump_of_the_reference_names_the_reference(store: Store) -> None:
    c = "clock-jump-reference"
    rows = offsets(c, "h0", [0.0] * N) + [
        r for i, node in enumerate(("h1", "h2", "h3"))
        for r in offsets(c, node, drifting(10 * i, seed=i, step_at_s=250, step_s=-300 * US))]
    write(store, rows)
    [f] = td.run(store, ClockJump(), c)
    assert f.entity == "h0" and f.evidence["nodes"] == ["h1", "h2", "h3"]
    assert f.evidence["step_s"] == pytest.approx(300 * US, abs=10 * US)


def _spike(c: str) -> list[dict[str, Any]]:
    values = drifting(10)
    values[55] += 500 * US  # one point off, the next back on the line: not a step
    return healthy_clocks(c) + offsets(c, "h4", values)


def _new_reference(c: str) -> list[dict[str, Any]]:
    # from 250 s the service solves against h1: every offset moves, but in new series
    before = [r for r in healthy_clocks(c) if r["TimeUnix"] < T0 + 250 * S]
    after = [r for node, off in (("h1", 0.0), ("h2", -0.01), ("h3", 0.02))
             for r in offsets(c, node, [off] * N, reference="h1") if r["TimeUnix"] >= T0 + 250 * S]
    return before + after


CLOCK_QUIET = {
    "healthy": healthy_clocks,
    "gap": lambda c: [r for r in healthy_clocks(c) if not T0 + 200 * S < r["TimeUnix"] < T0 + 265 * S],
    "collector_clock_jump": lambda c: td._jump(healthy_clocks(c), after=T0 + 250 * S),
    "spike": _spike,
    "new_reference": _new_reference,
}


@pytest.mark.parametrize("case", [*CLOCK_QUIET, "duplicated"])
def test_clock_quiet(store: Store, case: str) -> None:
    c = f"clock-quiet-{case}"
    write(store, CLOCK_QUIET.get(case, healthy_clocks)(c), twice=case == "duplicated")
    for det in clock_detectors():
        assert td.run(store, det, c) == [], det.name


def test_clock_unsynced(store: Store) -> None:
    c = "clock-unsynced"
    unc = "ridethrough.clock.node.uncertainty"
    high = [5 * US] * (N - 12) + [500 * US] * 12  # the last 60 s
    spike = [5 * US] * (N - 3) + [500 * US] * 2 + [5 * US]  # 10 s, then back
    lost = [5 * US] * (N - 12) + [math.inf] * 12  # the graph lost it
    noisy = [math.nan if i % 2 else 500 * US for i in range(N)]  # NaNs are no evidence either way
    rows = (healthy_clocks(c) + offsets(c, "h4", high, metric=unc) + offsets(c, "h5", spike, metric=unc)
            + offsets(c, "h6", lost, metric=unc) + offsets(c, "h7", noisy, metric=unc))
    write(store, rows, twice=True)
    found = {f.entity: f for f in td.run(store, ClockUnsynced(), c)}
    assert set(found) == {"h4", "h6", "h7"}
    assert found["h4"].kind is FindingKind.CLOCK_UNSYNCED and found["h4"].evidence["over_s"] == pytest.approx(55)
    assert found["h6"].evidence["uncertainty_s"] is None and "inf" in found["h6"].summary


# -- congestion ---------------------------------------------------------------------------

SPLIT = END - 30 * S


def path_rows(c: str, src: str, nic: str, dst: str, *, fwd: Sequence[float], rev: Sequence[float],
              rtt: Sequence[float], lost_per_step: int = 0, corrected: str = "true") -> list[dict[str, Any]]:
    a = {"probe.src.node": src, "probe.src.nic": nic, "probe.dst.node": dst, "probe.dst.nic": nic}
    owd = {"probe.quantile": "p50", "probe.clock.corrected": corrected, "probe.timestamp.kind": "kernel"}
    return (td.series(c, src, "ridethrough.probe.owd", {**a, **owd, "probe.direction": "forward"}, fwd)
            + td.series(c, src, "ridethrough.probe.owd", {**a, **owd, "probe.direction": "reverse"}, rev)
            + td.series(c, src, "ridethrough.probe.rtt", {**a, "probe.quantile": "p50"}, rtt)
            + td.series(c, src, "ridethrough.probe.sent", a, [20.0 * (i + 1) for i in range(N)])
            + td.series(c, src, "ridethrough.probe.lost", {**a, "probe.direction": "forward"},
                        [float(lost_per_step * (i + 1)) for i in range(N)])
            + td.series(c, src, "ridethrough.probe.lost", {**a, "probe.direction": "reverse"}, [0.0] * N)
            + td.series(c, src, "ridethrough.probe.path.suspended", a, [0.0] * N))


def late(base: float, extra: float, *, from_ns: int = SPLIT) -> list[float]:
    """``base`` (with a little jitter), plus ``extra`` from ``from_ns`` on."""
    return [base * (1 + 0.05 * math.sin(i)) + (extra if t >= from_ns else 0.0) for i, t in enumerate(td.TIMES)]


def queue(c: str, src: str = "h0", dst: str = "h5", nic: str = "nic0", *, forward: bool = True,
          **kw: Any) -> list[dict[str, Any]]:
    """A queue of 500 µs building in one direction over the last 30 s."""
    up, flat = late(20 * US, 500 * US), late(20 * US, 0.0)
    fwd, rev = (up, flat) if forward else (flat, up)
    return path_rows(c, src, nic, dst, fwd=fwd, rev=rev, rtt=late(40 * US, 500 * US), **kw)


def quiet_path(c: str) -> list[dict[str, Any]]:
    return path_rows(c, "h2", "nic1", "h3", fwd=late(20 * US, 0), rev=late(20 * US, 0), rtt=late(40 * US, 0))


def test_congestion_one_direction(store: Store) -> None:
    c = "congestion"
    write(store, queue(c) + queue(c, "h1", "h2", "nic1", forward=False) + quiet_path(c), twice=True)
    found = {f.entity: f for f in td.run(store, Congestion(), c)}
    assert set(found) == {"h0/nic0->h5/nic0", "h2/nic1->h1/nic1"}
    f = found["h0/nic0->h5/nic0"]
    assert (f.kind, f.entity_type) == (FindingKind.CONGESTION, EntityType.PATH)
    assert f.evidence["excess_s"] == pytest.approx(500 * US, rel=0.1) and f.evidence["loss_ratio"] == 0
    assert T0 <= f.observed_at_ns <= END


def _reset(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The path's counters restart at 280 s (it left the probed set and came back): ``sent`` from its
    count, ``lost`` from 37 (losses long before the window) to 0."""
    def value(r: dict[str, Any]) -> float:
        after = r["TimeUnix"] >= T0 + 280 * S
        if r["MetricName"] == "ridethrough.probe.sent":
            return float(r["Value"] - 20.0 * 57 if after else r["Value"])
        if r["MetricName"] == "ridethrough.probe.lost":
            return float(r["Value"] + (0 if after else 37))
        return float(r["Value"])
    return [{**r, "Value": value(r)} for r in rows]


def _clock_step(c: str) -> list[dict[str, Any]]:
    # h5's correction moved: forward reads 500 µs more, reverse 500 µs less, the RTT does not change
    return path_rows(c, "h0", "nic0", "h5", fwd=late(600 * US, 500 * US), rev=late(600 * US, -500 * US),
                     rtt=late(1200 * US, 0))


CONGESTION_QUIET = {
    "healthy": quiet_path,
    "gap": lambda c: [r for r in queue(c) if r["TimeUnix"] < T0 + 280 * S],
    "counter_reset": lambda c: _reset(quiet_path(c)),
    "collector_clock_jump": lambda c: td._jump(queue(c), after=SPLIT),
    "clock_correction_step": _clock_step,
    "both_directions": lambda c: path_rows(c, "h0", "nic0", "h5", fwd=late(20 * US, 500 * US),
                                           rev=late(20 * US, 500 * US), rtt=late(40 * US, 1000 * US)),
    "lossy": lambda c: queue(c, lost_per_step=2),
    "uncorrected": lambda c: queue(c, corrected="false"),
    "short_burst": lambda c: path_rows(c, "h0", "nic0", "h5", fwd=late(20 * US, 500 * US, from_ns=END - 5 * S),
                                       rev=late(20 * US, 0), rtt=late(40 * US, 500 * US, from_ns=END - 5 * S)),
}


@pytest.mark.parametrize("case", [*CONGESTION_QUIET, "duplicated"])
def test_congestion_quiet(store: Store, case: str) -> None:
    c = f"congestion-quiet-{case}"
    write(store, CONGESTION_QUIET.get(case, quiet_path)(c), twice=case == "duplicated")
    assert td.run(store, Congestion(), c) == []


def test_a_counter_reset_is_not_loss(store: Store) -> None:
    c = "congestion-reset"
    write(store, _reset(queue(c)))
    assert [f.entity for f in td.run(store, Congestion(), c)] == ["h0/nic0->h5/nic0"]


def test_congestion_is_not_breakage(store: Store) -> None:
    """The rows that make congestion fire make no link detector and no tomography finding."""
    c = "congestion-not-breakage"
    rows = queue(c) + queue(c, "h5", "h0") + queue(c, "h1", "h5") + queue(c, "h5", "h1")
    write(store, rows)
    assert len(td.run(store, Congestion(), c)) == 4
    routes = RouteMap.from_fabric(Topology(TopologySpec(hosts=8, racks=2, rails=2, spines=2)))
    for det in [*link.build(SimpleNamespace()), Tomography(routes=routes, min_probes=1)]:
        assert td.run(store, det, c) == [], det.name


def test_build() -> None:
    assert [d.name for d in clock.build(SimpleNamespace())] == ["clock_jump", "clock_unsynced"]
    [det] = congestion.build(SimpleNamespace(congestion_window_s=60.0, congestion_recent_s=15.0))
    assert det.name == "congestion" and det.window_s == 60.0
    with pytest.raises(ValueError, match="recent_s"):
        congestion.build(SimpleNamespace(congestion_window_s=10.0))


# -- clock: what the lab's clock service really writes ------------------------------------

def _late_samples(ppm: float) -> list[float]:
    """A clock drifting ``ppm`` whose solution runs 5 s behind its timestamps for a while: the clock
    service writes the offset at its newest pair estimate, so while an agent's estimates come late
    every point sits ``ppm x 5 s`` off the line, and then catches up (the lab's offsets under load)."""
    return [ppm * 1e-6 * (5 * i - (5.0 if 20 <= i <= 30 or i in (45, 46, 47) else 0.0)) + 2 * US * math.sin(7 * i)
            for i in range(N)]


def _converging(c: str, node: str) -> list[dict[str, Any]]:
    """The first minute after a start: the solution moves by milliseconds while its uncertainty is as large."""
    error = [3e-3 * 0.5**i if i < 12 else 0.0 for i in range(N)]
    values = [30e-6 * 5 * i + e for i, e in enumerate(error)]
    return (offsets(c, node, values)
            + offsets(c, node, [e + 3 * US for e in error], metric="ridethrough.clock.node.uncertainty"))


@pytest.mark.parametrize("case", ["late_samples", "converging"])
def test_clock_jump_quiet_on_real_service_output(store: Store, case: str) -> None:
    c = f"clock-service-{case}"
    if case == "late_samples":
        rows = healthy_clocks(c) + offsets(c, "h4", _late_samples(110)) + offsets(c, "h5", _late_samples(-60))
    else:
        rows = healthy_clocks(c) + _converging(c, "h4")
    write(store, rows)
    # the window ends early enough for the converging case to be in it
    end = T0 + 100 * S if case == "converging" else END
    assert td.run(store, ClockJump(), c, end_ns=end) == []
    # the control: without the drift-over-lag bound, or trusting unconverged points, the same rows fire
    naive = ClockJump(lag_s=0.0) if case == "late_samples" else ClockJump(lag_s=0.0, converged_max_s=1.0)
    assert {f.entity for f in td.run(store, naive, c, end_ns=end)} >= {"h4"}


def test_clock_jump_on_a_fast_drifting_clock_with_late_samples(store: Store) -> None:
    """A 2 ms step stands well above what 10 s of 110 ppm drift explains: found, late samples or not."""
    c = "clock-service-step"
    values = [v + (-2e-3 if 5 * i >= 250 else 0.0) for i, v in enumerate(_late_samples(110))]
    write(store, healthy_clocks(c) + offsets(c, "h6", values))
    [f] = td.run(store, ClockJump(), c)
    assert f.entity == "h6" and f.evidence["step_s"] == pytest.approx(-2e-3, abs=0.2e-3)
    assert f.evidence["threshold_s"] >= 100e-6 * 10  # the drift over lag_s sets the bar here


def test_clock_jump_ignores_points_before_convergence_but_not_after(store: Store) -> None:
    c = "clock-converged-then-step"
    rows = healthy_clocks(c) + [r for r in _converging(c, "h4")]
    rows = [({**r, "Value": r["Value"] + 500 * US} if r["MetricName"].endswith(".offset")
             and r["Attributes"]["clock.node"] == "h4" and r["TimeUnix"] >= T0 + 250 * S else r) for r in rows]
    write(store, rows)
    [f] = td.run(store, ClockJump(), c)
    assert f.entity == "h4" and f.evidence["step_s"] == pytest.approx(500 * US, abs=20 * US)


def test_clock_jump_rejects_bad_knobs() -> None:
    with pytest.raises(ValueError, match="lag_s"):
        ClockJump(lag_s=-1)
