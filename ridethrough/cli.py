"""The ``ridethrough`` command line.

Every command loads its component's config (flag > env > file > default), builds its
objects through `ridethrough.wiring`, and owns their lifetime. Config errors stop the
program at start with one precise line.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Annotated, Any

import typer

from ridethrough.actions_cli import actions_app
from ridethrough.actuators.run_cli import register as register_job_commands
from ridethrough.audit_cli import audit as audit_command
from ridethrough.certs import certs_command
from ridethrough.config import ConfigError, Loaded, render
from ridethrough.dashboards.dashboard_cli import dashboard as dashboard_command
from ridethrough.dashboards.goodput_cli import app as goodput_app
from ridethrough.lab.cli import lab_app
from ridethrough.settings import load_component
from ridethrough.signals import wait_for_stop

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Keep GPU jobs running through fabric faults.")
store_app = typer.Typer(no_args_is_help=True, help="Manage the ClickHouse store.")
config_app = typer.Typer(no_args_is_help=True, help="Inspect configuration.")
app.add_typer(store_app, name="store")
app.add_typer(config_app, name="config")
app.add_typer(lab_app, name="lab")
app.add_typer(goodput_app, name="goodput")
app.add_typer(actions_app, name="actions")
app.command("certs")(certs_command)
app.command("audit")(audit_command)
app.command("dashboard")(dashboard_command)
register_job_commands(app)  # run, snapshot, migrate, job-status

ConfigOpt = Annotated[Path | None, typer.Option("--config", help="YAML file with one section per component.")]
StoreOpt = Annotated[str | None, typer.Option("--store", help="ClickHouse DSN: chdb://PATH or http(s)://...")]


def _load(component: str, config: Path | None, **flags: Any) -> Any:
    try:
        loaded: Loaded[Any] = load_component(component, file=config, env=os.environ, flags=flags)
    except ConfigError as exc:
        typer.echo(f"ridethrough: config error: {exc}", err=True)
        raise typer.Exit(2) from exc
    return loaded.config


def _logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def _on_signals(on_hup: Any = None) -> threading.Event:
    """Handle SIGINT/SIGTERM (the returned event is set) and SIGHUP (calls ``on_hup``) from now on."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    if on_hup is not None:
        signal.signal(signal.SIGHUP, lambda *_: on_hup())
    return stop


def _wait_for_signal(duration_s: float | None) -> None:
    """Block until SIGINT/SIGTERM (or ``duration_s``)."""
    wait_for_stop(_on_signals(), duration_s)


Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")]
Duration = Annotated[float | None, typer.Option("--duration", help="Stop after this many seconds.")]


@app.command()
def gateway(
    config: ConfigOpt = None,
    otlp_listen: Annotated[str | None, typer.Option(help="OTLP/gRPC HOST:PORT (port 0: any).")] = None,
    store: StoreOpt = None,
    spool: Annotated[str | None, typer.Option(help="Spool directory.")] = None,
    metrics_listen: Annotated[str | None, typer.Option(help="Prometheus /metrics HOST:PORT.")] = None,
    ready_file: Annotated[str | None, typer.Option(help="Write bound addresses here as JSON.")] = None,
    duration: Duration = None,
    verbose: Verbose = False,
) -> None:
    """Run the OTLP gateway alone (at scale, against a ClickHouse server)."""
    from ridethrough import wiring

    _logging(verbose)
    cfg = _load("gateway", config, otlp_listen=otlp_listen, store=store, spool=spool,
                metrics_listen=metrics_listen, ready_file=ready_file)
    runtime = wiring.GatewayRuntime(cfg=cfg, store=wiring.open_store(cfg))
    try:
        addresses = runtime.start()
    except ValueError as exc:  # tokens file or TLS files unusable
        typer.echo(f"ridethrough: config error: {exc}", err=True)
        raise typer.Exit(2) from exc
    wiring.tune_gc_for_ingest()

    def reload() -> None:
        try:
            new = load_component("gateway", file=config, env=os.environ, flags={"store": store}).config
            if new.store == runtime.cfg.store:
                return
            opened = wiring.open_store(new)
        except (ConfigError, ValueError) as exc:  # a bad edit keeps the running store: log it, keep serving
            logging.getLogger("ridethrough").error("SIGHUP: config not reloaded: %s", exc)
            return
        logging.getLogger("ridethrough").info("SIGHUP: switching store")
        runtime.swap_store(opened)
        runtime.cfg = dataclasses.replace(runtime.cfg, store=new.store)  # so switching back is a change too

    stop = _on_signals(on_hup=reload)  # before the ready file: a SIGHUP right after it must not kill the gateway
    if cfg.ready_file:
        wiring.write_ready_file(cfg.ready_file, addresses)
    typer.echo(f"gateway: OTLP on {addresses['otlp']}", err=True)
    try:
        wait_for_stop(stop, duration)
    finally:
        runtime.stop()


@app.command()
def server(
    config: ConfigOpt = None,
    otlp_listen: Annotated[str | None, typer.Option(help="OTLP/gRPC HOST:PORT (port 0: any).")] = None,
    store: StoreOpt = None,
    spool: Annotated[str | None, typer.Option(help="Spool directory.")] = None,
    metrics_listen: Annotated[str | None, typer.Option(help="Prometheus /metrics HOST:PORT.")] = None,
    store_http_listen: Annotated[str | None, typer.Option(
        help="Read-only ClickHouse HTTP endpoint over the store, HOST:PORT.")] = None,
    clock_listen: Annotated[str | None, typer.Option(
        help="Clock service's GET /clock/corrections endpoint, HOST:PORT.")] = None,
    ready_file: Annotated[str | None, typer.Option(help="Write bound addresses here as JSON.")] = None,
    duration: Duration = None,
    verbose: Verbose = False,
) -> None:
    """Run the server-side components in one process around one store (the all-in-one)."""
    from ridethrough import wiring

    _logging(verbose)
    gcfg = _load("gateway", config, otlp_listen=otlp_listen, store=store, spool=spool,
                 metrics_listen=metrics_listen, ready_file=ready_file)
    scfg = _load("server", config, store_http_listen=store_http_listen, clock_listen=clock_listen)
    ccfg = _load("controller", config)
    runtime = wiring.ServerRuntime(gateway_cfg=gcfg, server_cfg=scfg, controller_cfg=ccfg,
                                   actuator_cfg=_load("actuators", config), pager_cfg=_load("pagerduty", config))
    try:
        runtime.start()
    except ValueError as exc:  # ingest tokens, TLS files, fabric map, PagerDuty keys or a plugin unusable
        runtime.stop()
        typer.echo(f"ridethrough: config error: {exc}", err=True)
        raise typer.Exit(2) from exc
    try:
        wiring.tune_gc_for_ingest()
        typer.echo(f"server: {runtime.addresses}", err=True)
        _wait_for_signal(duration)
    finally:
        runtime.stop()


@app.command()
def controller(
    config: ConfigOpt = None,
    store: StoreOpt = None,
    metrics_listen: Annotated[str | None, typer.Option(help="Prometheus /metrics HOST:PORT.")] = None,
    cluster: Annotated[str | None, typer.Option(help="Fleet cluster to watch (empty: all).")] = None,
    ready_file: Annotated[str | None, typer.Option(help="Write bound addresses here as JSON.")] = None,
    duration: Duration = None,
    verbose: Verbose = False,
) -> None:
    """Run the controller alone: detectors on a schedule against the store, incidents tracked there."""
    from ridethrough import wiring
    from ridethrough.detectors.controller import PluginError

    _logging(verbose)
    gcfg = _load("gateway", config, store=store)
    cfg = _load("controller", config, metrics_listen=metrics_listen, cluster=cluster)
    runtime = wiring.ControllerRuntime(cfg=cfg, store=wiring.open_store(gcfg), actuators=_load("actuators", config),
                                       pager=_load("pagerduty", config))
    try:
        addresses = runtime.start()
    except (PluginError, ValueError) as exc:  # a bad detector or actuator plugin, fabric map or PagerDuty key
        typer.echo(f"ridethrough: {exc}", err=True)
        raise typer.Exit(2) from exc
    if ready_file:
        wiring.write_ready_file(ready_file, addresses)
    typer.echo(f"controller: store {runtime.store.dsn}, {addresses}", err=True)
    try:
        _wait_for_signal(duration)
    finally:
        runtime.stop()


@app.command()
def agent(
    config: ConfigOpt = None,
    gateway: Annotated[str | None, typer.Option(help="Gateway OTLP/gRPC HOST:PORT.")] = None,
    node_id: Annotated[str | None, typer.Option(help="Node identity (default: host name).")] = None,
    cluster: Annotated[str | None, typer.Option(help="Cluster name.")] = None,
    rack: Annotated[str | None, typer.Option(help="Rack label.")] = None,
    sysfs_root: Annotated[str | None, typer.Option(help="Where sysfs is mounted.")] = None,
    interval_s: Annotated[float | None, typer.Option("--interval", help="Sampling interval, seconds.")] = None,
    export_interval_s: Annotated[float | None, typer.Option(
        "--export-interval", help="Export interval, seconds.")] = None,
    clock_script: Annotated[str | None, typer.Option(help="A lab host's clock file.")] = None,
    prometheus_listen: Annotated[str | None, typer.Option(
        help="Also serve the metrics at /metrics on HOST:PORT (port 0: any).")] = None,
    ready_file: Annotated[str | None, typer.Option(help="Write bound addresses here as JSON.")] = None,
    duration: Duration = None,
    verbose: Verbose = False,
) -> None:
    """Run the node agent: sample this host and export to a gateway."""
    from ridethrough import wiring

    _logging(verbose)
    cfg = _load("agent", config, gateway=gateway, node_id=node_id, cluster=cluster, rack=rack,
                sysfs_root=sysfs_root, interval_s=interval_s, export_interval_s=export_interval_s,
                clock_script=clock_script, prometheus_listen=prometheus_listen)
    try:
        node = wiring.build_agent(cfg)
    except ValueError as exc:
        typer.echo(f"ridethrough: config error: {exc}", err=True)
        raise typer.Exit(2) from exc
    try:
        node.start()
    except OSError as exc:  # /metrics could not bind: a start-up error, said in one line
        typer.echo(f"ridethrough: cannot serve /metrics on {cfg.prometheus_listen}: {exc}", err=True)
        raise typer.Exit(1) from exc
    wiring.tune_gc_for_ingest()  # the agent, too, makes thousands of short-lived acyclic objects a second
    if ready_file:
        wiring.write_ready_file(ready_file, node.addresses)
    typer.echo(f"agent: exporting to {cfg.gateway}", err=True)
    if "prometheus" in node.addresses:
        typer.echo(f"agent: Prometheus /metrics on {node.addresses['prometheus']}", err=True)
    try:
        _wait_for_signal(duration)
    finally:
        node.stop()


@app.command()
def query(
    sql: Annotated[str, typer.Argument(help="A SELECT, SHOW, DESCRIBE, EXPLAIN or WITH statement.")],
    store: StoreOpt = None,
    config: ConfigOpt = None,
    fmt: Annotated[str, typer.Option("--format", help="table, json or csv.")] = "table",
) -> None:
    """Run a read-only query against the store and print the result."""
    from ridethrough import query as q

    cfg = _load("gateway", config, store=store)
    try:
        q.check_read_only(sql)
        typer.echo(q.run(cfg.store, sql, fmt=fmt), nl=False)
    except q.QueryRefused as exc:
        typer.echo(f"ridethrough: {exc}", err=True)
        raise typer.Exit(2) from exc
    except q.QueryFailed as exc:
        typer.echo(f"ridethrough: {exc}", err=True)
        raise typer.Exit(1) from exc


@store_app.command("init")
def store_init(store: StoreOpt = None, config: ConfigOpt = None,
               cluster: Annotated[str | None, typer.Option(help="ClickHouse cluster name.")] = None,
               print_sql: Annotated[bool, typer.Option("--print-sql", help="Print the DDL, run nothing.")] = False,
               ) -> None:
    """Create every table and view, idempotently."""
    from ridethrough import wiring
    from ridethrough.actuators.actions import actions_ddl, ensure_actions_table
    from ridethrough.actuators.approvals_table import approvals_ddl, ensure_approvals_table
    from ridethrough.detectors.incidents import ensure_incidents_table, incidents_ddl
    from ridethrough.exporters import schema, schema_cluster
    from ridethrough.exporters.store import StoreError, StoreUnavailable
    from ridethrough.lab.truth import ensure_truth_table, truth_ddl

    cfg = _load("gateway", config, store=store, cluster=cluster)
    if print_sql:
        rollups = schema_cluster.rollup_ddl(cluster=cfg.cluster) if cfg.cluster else ()
        statements = [*schema.ddl(cluster=cfg.cluster), *rollups, *truth_ddl(cluster=cfg.cluster),
                      *incidents_ddl(cluster=cfg.cluster), *actions_ddl(cluster=cfg.cluster),
                      *approvals_ddl(cluster=cfg.cluster)]
        typer.echo(";\n\n".join(statements) + ";")
        return
    try:
        target = wiring.open_store(cfg)
        n = target.init_schema()
        ensure_truth_table(target)  # domain tables sit beside the OTel ones
        ensure_incidents_table(target)
        ensure_actions_table(target)
        ensure_approvals_table(target)
    except (StoreUnavailable, StoreError) as exc:
        typer.echo(f"ridethrough: {exc}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(f"store ready: {n} statements applied")


@app.command()
def trace(
    incident_id: Annotated[str, typer.Argument(help="The incident's id (IncidentId in the incidents table).")],
    store: StoreOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Print an incident's trace as a tree: detection, decisions, actions and their steps."""
    from ridethrough.actuators.trace_view import trace_command

    trace_command(incident_id, store, config)


@config_app.command("show")
def config_show(component: Annotated[str, typer.Argument(
                    help="agent, gateway, server, controller, actuators, pagerduty or dashboard.")],
                config: ConfigOpt = None) -> None:
    """Print the effective config of a component and where each value came from."""
    try:
        loaded = load_component(component, file=config, env=os.environ)
    except ConfigError as exc:
        typer.echo(f"ridethrough: config error: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(render(loaded, component=component))


@app.command()
def demo(
    duration: Duration = None,
    no_dashboard: Annotated[bool, typer.Option("--no-dashboard", help="Do not start the dashboard.")] = False,
    down: Annotated[bool, typer.Option("--down", help="Take a running demo down (namespaces, processes) "
                                                      "and exit.")] = False,
    name: Annotated[str, typer.Option("--name", help="The demo lab's name (prefix of its namespaces).")] = "demo",
    data_dir: Annotated[Path, typer.Option(help="Where the demo keeps its labs, store and run record.")] = Path(
        ".ridethrough"),
    loopback: Annotated[bool, typer.Option("--loopback", help="The short story without namespaces (GPU and "
                                                              "clock acts), as a user without root gets.")] = False,
    verbose: Verbose = False,
) -> None:
    """The whole loop in five acts on an emulated cluster: faults, detection, actions, pages, goodput."""
    from ridethrough import demo as demo_mod

    _logging(verbose)
    if down:
        raise typer.Exit(demo_mod.down(name=name, data_dir=data_dir))
    raise typer.Exit(demo_mod.run(name=name, data_dir=data_dir, duration_s=duration, dashboard=not no_dashboard,
                                  loopback=loopback))


def main() -> None:
    """Console entry point."""
    app()
