"""The goodput simulator: calibration against the Llama 3 table, hand-checked replays, policy sanity,
bad input, and ``goodput simulate``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ridethrough.dashboards import goodput_sim as sim
from ridethrough.dashboards.goodput_cli import app

LLAMA3_UNEXPECTED = 419


def test_packaged_table_is_the_llama3_one() -> None:
    table = sim.load_rates()
    assert len(table.rates) == 18 and sum(r.count for r in table.rates) == LLAMA3_UNEXPECTED
    assert table.rates[0] == sim.Rate("Faulty GPU", "GPU", 148)
    assert table.expected(gpus=16_384, days=54).sum() == pytest.approx(LLAMA3_UNEXPECTED)
    assert table.expected(gpus=8_192, days=27).sum() == pytest.approx(LLAMA3_UNEXPECTED / 4)


def test_reproduces_the_source_interruption_count_within_5_percent() -> None:
    result = sim.simulate(sim.load_rates(), replications=20, seed=7)
    assert abs(result["interruptions"] - LLAMA3_UNEXPECTED) / LLAMA3_UNEXPECTED < 0.05
    lo, hi = result["interruptions_ci95"]
    assert lo < result["interruptions"] < hi
    half = sim.simulate(sim.load_rates(), gpus=8_192, days=27, replications=50, seed=7)
    assert abs(half["interruptions"] - LLAMA3_UNEXPECTED / 4) / (LLAMA3_UNEXPECTED / 4) < 0.05


def test_ridethrough_loses_less_than_checkpoint_restart() -> None:
    result = sim.simulate(sim.load_rates(), replications=10, seed=1)
    cr, rt = result["policies"]["checkpoint_restart"], result["policies"]["ridethrough"]
    assert 0 < rt["goodput_loss"] < cr["goodput_loss"] < 1
    assert cr["goodput_loss_ci95"][0] <= cr["goodput_loss"] <= cr["goodput_loss_ci95"][1]
    assert result["goodput_loss_saved"]["ci95"][0] > 0
    assert sum(cr["badput"].values()) == pytest.approx(cr["goodput_loss"])
    assert cr["badput"]["migration_pause"] == 0 and rt["badput"]["restart"] == 0
    assert rt["badput"]["migration_pause"] > 0 and rt["badput"]["snapshot_restore"] > 0


def test_costlier_recovery_loses_more_and_the_same_seed_repeats() -> None:
    base = sim.simulate(sim.load_rates(), replications=5, seed=3)
    again = sim.simulate(sim.load_rates(), replications=5, seed=3)
    slow = sim.simulate(sim.load_rates(), replications=5, seed=3, checkpoint=sim.CheckpointRestart(reload_s=5400))
    assert again == base
    loss = {run: r["policies"]["checkpoint_restart"]["goodput_loss"] for run, r in (("base", base), ("slow", slow))}
    assert loss["slow"] > loss["base"]
    assert slow["policies"]["ridethrough"] == base["policies"]["ridethrough"]  # same histories, same policy
    assert sim.simulate(sim.load_rates(), replications=5, seed=4)["interruptions"] != base["interruptions"]


def _plan(n: int, *, pause: list[float], loses: list[bool], interval: float = 1000.0, stall: float = 100.0) -> sim.Plan:
    return sim.Plan(interval, stall, np.zeros((1, n), dtype=np.int64), np.array([pause]), np.array([loses]))


@pytest.mark.parametrize(("times", "pause", "loses", "expected"), [
    # [0, 2500): 2 cycles committed (2000), 300 computed and lost, 200 stalled; 500 recovering;
    # [3000, 10000): 6 cycles (6000, 600 stalled) and 400 in progress at the end (kept)
    ([2500.0], [500.0], [True], {"productive": 8400, "checkpoint_stall": 800, "recomputation": 300, "restart": 500}),
    # the same pause, losing nothing: the 300 s carried over is committed by the next checkpoint
    ([2500.0], [500.0], [False], {"productive": 8700, "checkpoint_stall": 800, "recomputation": 0, "restart": 500}),
    # a second failure 200 s into the recovery starts it again
    ([2500.0, 2700.0], [500.0, 500.0], [True, True],
     {"productive": 8200, "checkpoint_stall": 800, "recomputation": 300, "restart": 700}),
    # a failure after the window is not one
    ([20000.0], [500.0], [True], {"productive": 9100, "checkpoint_stall": 900, "recomputation": 0, "restart": 0}),
])
def test_replay_known_answers(times: list[float], pause: list[float], loses: list[bool],
                              expected: dict[str, float]) -> None:
    used = sim.replay(np.array([times]), _plan(len(times), pause=pause, loses=loses), 10_000.0)
    assert {k: float(used[k][0]) for k in expected} == pytest.approx(expected)
    assert sum(float(v[0]) for v in used.values()) == pytest.approx(10_000.0)


def test_no_failures_costs_only_the_checkpoint_stalls() -> None:
    table = sim.RateTable((sim.Rate("GPU", "GPU", 0),))
    result = sim.simulate(table, days=1, replications=3)
    assert result["interruptions"] == 0
    # 86400 s = 94 cycles of 910 s (900 computing, 10 stalled) + 860 s computing
    assert result["policies"]["checkpoint_restart"]["goodput_loss"] == pytest.approx(94 * 10 / 86400)


def test_network_faults_are_rerouted() -> None:
    table = sim.parse_rates("component,category,count\nswitch,Network,100\n")
    rt = sim.simulate(table, replications=3)["policies"]["ridethrough"]["badput"]
    assert rt["reroute_pause"] > 0 and rt["snapshot_restore"] == rt["migration_pause"] == rt["recomputation"] == 0


def test_mean_ci_uses_student_t() -> None:
    mean, _, hi = sim.mean_ci(np.array([1.0, 2.0, 3.0, 4.0, 5.0]))
    assert mean == 3 and (hi - mean) == pytest.approx(2.776 * np.sqrt(2.5) / np.sqrt(5), rel=3e-3)
    assert sim.mean_ci(np.array([2.0])) == (2.0, 2.0, 2.0)


@pytest.mark.parametrize(("text", "message"), [
    ("", "header"),
    ("comp,cat,count\nx,y,1\n", "header"),
    ("component,category,count\n", "no rows"),
    ("# a comment\ncomponent,category,count\nGPU,GPU,-3\n", ":3: count must be a non-negative integer"),
    ("component,category,count\nGPU,GPU,2.5\n", ":2: count"),
    ("component,category,count\nGPU,GPU\n", ":2: expected 3 fields"),
    ("component,category,count\n,GPU,2\n", "must not be empty"),
])
def test_bad_rate_tables_are_refused_with_the_line(text: str, message: str) -> None:
    with pytest.raises(sim.SimulationError, match=message):
        sim.parse_rates(text)


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(sim.SimulationError, match="reload_s"):
        sim.CheckpointRestart(reload_s=-1.0)
    with pytest.raises(sim.SimulationError, match="checkpoint_interval_s"):
        sim.CheckpointRestart(checkpoint_interval_s=0.0)
    with pytest.raises(sim.SimulationError, match="predicted_fraction"):
        sim.Ridethrough(predicted_fraction=1.5)
    with pytest.raises(sim.SimulationError, match="restore_s"):
        sim.Ridethrough(restore_s=float("nan"))
    with pytest.raises(sim.SimulationError, match="replications"):
        sim.simulate(sim.load_rates(), replications=0)
    with pytest.raises(sim.SimulationError, match="cannot read"):
        sim.load_rates(Path("/nonexistent/rates.csv"))


def test_cli_simulate_json() -> None:
    result = CliRunner().invoke(app, ["simulate", "--replications", "5", "--seed", "2", "--format", "json",
                                      "--reroute-pause", "1", "--checkpoint-interval", "1800"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert abs(doc["interruptions"] - LLAMA3_UNEXPECTED) / LLAMA3_UNEXPECTED < 0.05
    for policy in ("checkpoint_restart", "ridethrough"):
        assert 0 < doc["policies"][policy]["goodput_loss"] < 1
    assert doc["policies"]["ridethrough"]["parameters"]["reroute_pause_s"] == 1.0
    assert doc["policies"]["checkpoint_restart"]["parameters"]["checkpoint_interval_s"] == 1800.0


def test_cli_simulate_table_with_a_rate_file(tmp_path: Path) -> None:
    rates = tmp_path / "rates.csv"
    rates.write_text("component,category,count\nGPU,GPU,10\n")
    result = CliRunner().invoke(app, ["simulate", "--replications", "4", "--rates", str(rates),
                                      "--rates-gpus", "1024", "--rates-days", "10", "--gpus", "1024", "--days", "10"])
    assert result.exit_code == 0, result.output
    assert "expected 10.0" in result.stdout and "checkpoint_restart" in result.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--replications", "0"], "--replications"),
    (["--format", "html"], "--format"),
    (["--predicted-fraction", "2"], "--predicted-fraction"),
    (["--rates", "/nonexistent.csv"], "cannot read"),
])
def test_cli_simulate_bad_input(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["simulate", *args])
    assert result.exit_code == 2 and message in result.output


def test_cli_shows_the_policies_own_defaults() -> None:
    import typer.core
    import typer.main

    group = typer.main.get_command(app)
    assert isinstance(group, typer.core.TyperGroup)
    shown = {p.name: p.show_default for p in group.commands["simulate"].params}
    cr, rt = sim.CheckpointRestart(), sim.Ridethrough()
    defaults = {"checkpoint_interval": cr.checkpoint_interval_s, "checkpoint_stall": cr.checkpoint_stall_s,
                "detect": cr.detect_s, "restart": cr.restart_s, "reload": cr.reload_s,
                "reroute_pause": rt.reroute_pause_s, "migrate_predicted": rt.migrate_predicted_s,
                "migrate_failed": rt.migrate_failed_s, "predicted_fraction": rt.predicted_fraction,
                "snapshot_interval": rt.snapshot_interval_s, "snapshot_stall": rt.snapshot_stall_s,
                "rt_detect": rt.detect_s, "rt_restart": rt.restart_s, "restore": rt.restore_s,
                "gpus": sim.SOURCE_GPUS, "days": sim.SOURCE_DAYS, "rates_gpus": sim.SOURCE_GPUS,
                "rates_days": sim.SOURCE_DAYS}
    assert {name: shown[name] for name in defaults} == {name: f"{v:g}" for name, v in defaults.items()}
