"""``ridethrough goodput``: report a customer's goodput from the store, or simulate policies.

Mounted by the main CLI with ``app.add_typer(goodput_app, name="goodput")``. The store is found
as every other command finds it: ``--store`` > ``RIDETHROUGH_GATEWAY_STORE`` > the config file's
``gateway.store`` > the default. The store client, numpy and the report code load when a command
runs, not when the CLI starts: every other command stays as quick to start as before.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ridethrough.config import ConfigError
from ridethrough.dashboards.goodput import NS_PER_S, JobGoodput, total
from ridethrough.settings import load_component

if TYPE_CHECKING:
    from ridethrough.dashboards.goodput_report import Report
    from ridethrough.dashboards.goodput_sql import Period

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Goodput: where allocated GPU time went, and what other policies would have saved.")

ConfigOpt = Annotated[Path | None, typer.Option("--config", help="YAML file with one section per component.")]
StoreOpt = Annotated[str | None, typer.Option("--store", help="ClickHouse DSN: chdb://PATH or http(s)://...")]
Cost = float | None
"""A policy cost in seconds; None keeps the policy's default."""


def _cost(default: float, what: str) -> Any:
    """A policy-cost option: unset keeps the policy's own default, shown here (a test holds them equal)."""
    return typer.Option(min=0.0, show_default=f"{default:g}", help=what)


def _fail(message: str, code: int = 2) -> typer.Exit:
    typer.echo(f"ridethrough: {message}", err=True)
    return typer.Exit(code)


def parse_time(text: str, flag: str) -> int:
    """ISO 8601 (UTC when it names no offset) or Unix seconds → ns since the epoch; `typer.Exit` if neither."""
    try:
        ns = round(float(text) * NS_PER_S) if text.replace(".", "", 1).isdigit() else _iso_ns(text)
    except ValueError:
        raise _fail(f"{flag}: expected an ISO 8601 time such as 2024-06-10T06:13:20Z, or Unix seconds; "
                    f"got {text!r}") from None
    if not 0 <= ns < 1 << 63:
        raise _fail(f"{flag}: {text!r} is outside 1970 to 2262")
    return ns


def _iso_ns(text: str) -> int:
    when = dt.datetime.fromisoformat(text)
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    delta = when - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
    return (delta.days * 86400 + delta.seconds) * NS_PER_S + delta.microseconds * 1000


@app.command()
def report(
    customer: Annotated[str, typer.Option("--customer", help="The customer (job.customer) to report on.")],
    start: Annotated[str, typer.Option("--from", help="Period start: ISO 8601 (UTC unless it says) or Unix s.")],
    end: Annotated[str, typer.Option("--to", help="Period end (exclusive), same forms as --from.")],
    fmt: Annotated[str, typer.Option("--format", help="table, csv, json or html.")] = "table",
    job: Annotated[str, typer.Option("--job", help="Only this job (default: every job of the customer).")] = "",
    timeline: Annotated[int, typer.Option("--buckets", min=1, max=1000,
                                          help="Timeline buckets over the period (json and html).")] = 24,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write here, not to stdout.")] = None,
    lookback_s: Annotated[float | None, typer.Option(
        "--lookback", min=0.0, show_default="7 days", help="Seconds before --from to read events from.")] = None,
    store: StoreOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Goodput of one customer's jobs over a period, by job and by cause of badput."""
    from ridethrough.dashboards import goodput_report
    from ridethrough.dashboards.goodput_sql import Period, buckets

    if not customer:
        raise _fail("--customer must not be empty")
    if fmt not in goodput_report.FORMATS:
        raise _fail(f"--format must be one of {', '.join(goodput_report.FORMATS)}, got {fmt!r}")
    start_ns, end_ns = parse_time(start, "--from"), parse_time(end, "--to")
    if end_ns <= start_ns:
        raise _fail(f"--from ({start}) must be before --to ({end})")
    whole = Period(start_ns, end_ns)
    parts = buckets(whole, timeline) if fmt in ("json", "html") else []
    rows = _fetch(config, store, customer=customer, periods=[whole, *parts], job=job, lookback_s=lookback_s)
    text = goodput_report.render(_report(customer, whole, parts, rows), fmt)
    if output is None:
        typer.echo(text, nl=False)
        return
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise _fail(f"cannot write {output}: {exc}", 1) from exc
    typer.echo(f"goodput report written to {output}", err=True)


def _fetch(config: Path | None, store: str | None, *, customer: str, periods: list[Period], job: str,
           lookback_s: float | None) -> list[JobGoodput]:
    """Per (period, job) goodput from the store the config names; `typer.Exit` on any failure."""
    from ridethrough.dashboards.goodput_sql import DEFAULT_LOOKBACK_S, GoodputError, job_goodput
    from ridethrough.exporters.store import Store, StoreError, StoreUnavailable

    try:
        cfg = load_component("gateway", file=config, env=os.environ, flags={"store": store}).config
    except ConfigError as exc:
        raise _fail(f"config error: {exc}") from exc
    target = Store(cfg.store, timeout_s=cfg.store_timeout_s)
    try:
        return job_goodput(target, customer=customer, periods=periods, job=job,
                           lookback_s=DEFAULT_LOOKBACK_S if lookback_s is None else lookback_s)
    except GoodputError as exc:
        raise _fail(str(exc)) from exc
    except (StoreUnavailable, StoreError) as exc:
        raise _fail(str(exc), 1) from exc
    finally:
        target.close()


def _report(customer: str, whole: Period, parts: list[Period], rows: list[JobGoodput]) -> Report:
    from ridethrough.dashboards import goodput_report

    jobs = [r for r in rows if (r.start_ns, r.end_ns) == (whole.start_ns, whole.end_ns)]
    points = []
    for p in parts:
        in_part = [r for r in rows if (r.start_ns, r.end_ns) == (p.start_ns, p.end_ns)]
        points.append(total(in_part, customer=customer, start_ns=p.start_ns, end_ns=p.end_ns))
    return goodput_report.Report(customer, whole.start_ns, whole.end_ns, jobs, points)


@app.command()
def simulate(
    replications: Annotated[int, typer.Option(min=1, max=100_000, help="Failure histories drawn.")] = 200,
    seed: Annotated[int, typer.Option(help="Random seed: the same seed draws the same histories.")] = 0,
    gpus: Annotated[int | None, typer.Option(min=1, show_default="16384", help="GPUs in the simulated run.")] = None,
    days: Annotated[float | None, typer.Option(min=0.001, show_default="54", help="Days the run lasts.")] = None,
    rates: Annotated[Path | None, typer.Option(show_default="the Llama 3 table",
                                               help="Rate table CSV: component,category,count.")] = None,
    rates_gpus: Annotated[int | None, typer.Option(min=1, show_default="16384",
                                                   help="GPUs the rate table was observed on.")] = None,
    rates_days: Annotated[float | None, typer.Option(min=0.001, show_default="54",
                                                     help="Days the rate table was observed over.")] = None,
    checkpoint_interval: Annotated[Cost, _cost(900, "Checkpoint-restart: compute between checkpoints.")] = None,
    checkpoint_stall: Annotated[Cost, _cost(10, "Checkpoint-restart: training blocked per checkpoint.")] = None,
    detect: Annotated[Cost, _cost(60, "Checkpoint-restart: failure until the job is known dead.")] = None,
    restart: Annotated[Cost, _cost(180, "Checkpoint-restart: reschedule and start every process.")] = None,
    reload: Annotated[Cost, _cost(180, "Checkpoint-restart: read the checkpoint back.")] = None,
    reroute_pause: Annotated[Cost, _cost(5, "Ridethrough: pause to reroute a network fault.")] = None,
    migrate_predicted: Annotated[Cost, _cost(30, "Ridethrough: live migration of a predicted GPU.")] = None,
    migrate_failed: Annotated[Cost, _cost(120, "Ridethrough: a failed GPU's rank to a hot spare.")] = None,
    predicted_fraction: Annotated[float | None, typer.Option(
        min=0.0, max=1.0, show_default="0.3", help="Ridethrough: share of GPU failures predicted in time.")] = None,
    snapshot_interval: Annotated[Cost, _cost(300, "Ridethrough: compute between in-memory snapshots.")] = None,
    snapshot_stall: Annotated[Cost, _cost(2, "Ridethrough: training blocked per snapshot.")] = None,
    rt_detect: Annotated[Cost, _cost(10, "Ridethrough: failure until it is known.")] = None,
    rt_restart: Annotated[Cost, _cost(180, "Ridethrough: restart for a snapshot restore.")] = None,
    restore: Annotated[Cost, _cost(60, "Ridethrough: load the snapshot from memory or peers.")] = None,
    fmt: Annotated[str, typer.Option("--format", help="table or json.")] = "table",
) -> None:
    """Compare checkpoint-restart with ridethrough on failures drawn from a rate table (times in seconds;
    unset policy costs take the defaults in docs/goodput.md)."""
    from ridethrough.dashboards import goodput_sim

    if fmt not in ("table", "json"):
        raise _fail(f"--format must be table or json, got {fmt!r}")
    cr = _given(checkpoint_interval_s=checkpoint_interval, checkpoint_stall_s=checkpoint_stall, detect_s=detect,
                restart_s=restart, reload_s=reload)
    rt = _given(reroute_pause_s=reroute_pause, migrate_predicted_s=migrate_predicted,
                migrate_failed_s=migrate_failed, predicted_fraction=predicted_fraction,
                snapshot_interval_s=snapshot_interval, snapshot_stall_s=snapshot_stall, detect_s=rt_detect,
                restart_s=rt_restart, restore_s=restore)
    try:
        table = goodput_sim.load_rates(rates, gpus=rates_gpus or goodput_sim.SOURCE_GPUS,
                                       days=rates_days or goodput_sim.SOURCE_DAYS)
        result = goodput_sim.simulate(table, gpus=gpus or goodput_sim.SOURCE_GPUS,
                                      days=days or goodput_sim.SOURCE_DAYS, replications=replications, seed=seed,
                                      checkpoint=goodput_sim.CheckpointRestart(**cr),
                                      ridethrough=goodput_sim.Ridethrough(**rt))
    except goodput_sim.SimulationError as exc:
        raise _fail(str(exc)) from exc
    typer.echo(json.dumps(result, indent=1) if fmt == "json" else _sim_table(result))


def _given(**values: float | None) -> dict[str, Any]:
    # Any: the policies also have non-float fields, and only the floats set here are passed on
    return {k: v for k, v in values.items() if v is not None}


def _sim_table(result: dict[str, Any]) -> str:
    lo, hi = result["interruptions_ci95"]
    lines = [f"{result['gpus']} GPUs, {result['days']:g} days, {result['replications']} replications "
             f"(seed {result['seed']}): {result['interruptions']:.1f} interruptions [{lo:.1f}, {hi:.1f}] "
             f"(expected {result['expected_interruptions']:.1f})", ""]
    causes = list(next(iter(result["policies"].values()))["badput"])
    lines.append(f"{'policy':<20}{'goodput loss [95% CI]':<28}{'GPU-hours lost':>16}  "
                 + "  ".join(f"{c:>16}" for c in causes))
    for name, p in result["policies"].items():
        a, b = p["goodput_loss_ci95"]
        loss = f"{100 * p['goodput_loss']:.2f}% [{100 * a:.2f}, {100 * b:.2f}]"
        lines.append(f"{name:<20}{loss:<28}"
                     f"{p['gpu_hours_lost']:>16,.0f}  " + "  ".join(f"{100 * p['badput'][c]:>15.2f}%" for c in causes))
    saved = result["goodput_loss_saved"]
    lines.append(f"\nridethrough saves {100 * saved['mean']:.2f} points of goodput "
                 f"[{100 * saved['ci95'][0]:.2f}, {100 * saved['ci95'][1]:.2f}]")
    return "\n".join(lines)
