"""``ridethrough audit``: the fleet acceptance audit from the command line (see `ridethrough.audit`).

Mounted by the main CLI with ``app.command("audit")(audit)``. Two ways to name the fleet:

* ``--lab NAME``: a running lab: its topology is the expected inventory, its server's store
  holds the agents' telemetry, and the audit drives traffic inside its namespaces;
* ``--inventory FILE``: real hosts with agents (`ridethrough.audit_model.Expected` describes the
  file); the store is found as every command finds it (``--store`` > env > config > default).
  Nothing can run traffic on real hosts yet, so the load phases say they were not covered.

It writes ``audit-<id>.json`` and ``audit-<id>.html`` under ``--out`` and records the audit where the
dashboard finds it (Audits page):

* ``--record-store DSN``: into that store's ``audits`` table, directly;
* ``--record-gateway HOST:PORT``, the default for ``--lab`` (its gateway): as an OTLP log record sent
  to the gateway, which stores it in ``otel_logs`` (`ridethrough.audit_events`). A lab's store has one
  writer, its server, and its store endpoint is read-only: the gateway is how anything else records;
* otherwise into ``--store``'s ``audits`` table.

Exit status: 0 pass, 1 anomalies found, 3 partial (nothing failed, something not covered: an
unreachable host, a name the inventory does not know), 2 bad input. A record that fails is said
plainly on stderr; the files still hold the result.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ridethrough.config import ConfigError
from ridethrough.settings import load_component

if TYPE_CHECKING:
    from ridethrough.audit_contract import Driver
    from ridethrough.audit_model import AuditResult, Expected

EXIT = {"pass": 0, "fail": 1, "partial": 3}


def _fail(message: str, code: int = 2) -> typer.Exit:
    typer.echo(f"ridethrough audit: {message}", err=True)
    return typer.Exit(code)


class RichProgress:
    """The audit's phases as rich progress bars on stderr."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = Console(stderr=True)
        self.bars = Progress(TextColumn("{task.description:<10}"), BarColumn(), TextColumn("{task.completed}/"
                             "{task.total}"), TimeElapsedColumn(), console=self.console)
        self.tasks: dict[str, Any] = {}

    def __enter__(self) -> RichProgress:
        self.bars.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bars.stop()

    def start(self, phase: str, total: int) -> None:
        """A bar for the phase."""
        self.tasks[phase] = self.bars.add_task(phase, total=max(total, 1))

    def advance(self, phase: str, steps: int = 1) -> None:
        """Move the phase's bar."""
        if phase in self.tasks:
            self.bars.advance(self.tasks[phase], steps)

    def note(self, text: str) -> None:
        """A line above the bars."""
        self.bars.console.print(text)


def _hosts_filter(expected: Expected, hosts: str) -> tuple[Expected, list[str]]:
    """The inventory restricted to ``hosts`` (comma-separated; empty: all), and the names it does not know."""
    if not hosts.strip():
        return expected, []
    wanted = [h.strip() for h in hosts.split(",") if h.strip()]
    known = {h.name for h in expected.hosts}
    return expected.only([h for h in wanted if h in known]), [h for h in wanted if h not in known]


def _lab_target(name: str) -> tuple[Expected, Any, Driver | None, str, str]:
    from ridethrough.audit_lab import LabDriver
    from ridethrough.exporters.store import Store
    from ridethrough.lab.control import LabError
    from ridethrough.lab.fabric import Lab, attach
    from ridethrough.lab.topology import Topology, TopologySpec

    try:
        lab = attach(name)
    except (LabError, ValueError, OSError) as exc:
        raise _fail(f"--lab {name}: {exc}") from exc
    address = lab.server.get("store_http")
    if not address:
        raise _fail(f"lab {name} has no server (brought up without agents?): the audit reads the agents' telemetry")
    gateway = lab.server.get("otlp", "")
    if isinstance(lab, Lab):
        driver = LabDriver(lab)
        return driver.expected(), Store(address), driver, name, gateway
    from ridethrough.audit_model import Expected

    spec = TopologySpec(**lab.info["spec"])
    expected = Expected.from_topology(Topology(spec, name=name), rails=spec.rails, gpus=spec.gpus)
    return expected, Store(address), None, name, gateway  # the loopback mode has no fabric to load


def _real_target(inventory: Path, store: str | None, config: Path | None) -> tuple[Expected, Any]:
    from ridethrough.audit_model import Expected
    from ridethrough.exporters.store import Store

    try:
        expected = Expected.load(inventory)
        cfg = load_component("gateway", file=config, env=os.environ, flags={"store": store}).config
    except (ValueError, ConfigError) as exc:
        raise _fail(str(exc)) from exc
    return expected, Store(cfg.store, timeout_s=cfg.store_timeout_s)


def _record(target: Any, result: AuditResult, page: str) -> None:
    from ridethrough.audit_store import write_audit
    from ridethrough.exporters.store import StoreError, StoreUnavailable

    try:
        write_audit(target, result, page)
        typer.echo(f"audit recorded in {target.dsn} (audits table)", err=True)
    except (StoreError, StoreUnavailable) as exc:  # the files hold the result; say plainly it is not stored
        typer.echo(f"ridethrough audit: the audit was NOT recorded in the store: {exc}", err=True)


def _record_via_gateway(endpoint: str, result: AuditResult, token_file: Path | None) -> None:
    from ridethrough.audit_events import RecordError, send_audit
    from ridethrough.exporters.ingest_auth import bearer_metadata
    from ridethrough.wiring import read_token

    try:
        headers = bearer_metadata(read_token(str(token_file))) if token_file else ()
        send_audit(endpoint, result, headers=headers)
        typer.echo(f"audit recorded through the gateway {endpoint} (otel_logs, event audit.completed)", err=True)
    except (RecordError, ValueError) as exc:  # the files hold the result; say plainly it is not stored
        typer.echo(f"ridethrough audit: the audit was NOT recorded: {exc}", err=True)


def audit(
    lab: Annotated[str, typer.Option("--lab", help="Audit this running lab.")] = "",
    inventory: Annotated[Path | None, typer.Option("--inventory", help="Expected inventory of real hosts "
                                                   "(JSON or YAML).")] = None,
    hosts: Annotated[str, typer.Option("--hosts", help="Only these hosts, comma-separated.")] = "",
    budget: Annotated[str, typer.Option("--budget", help="Time budget: 10m, 300s, 90.")] = "10m",
    out: Annotated[Path, typer.Option("--out", help="Folder for audit-<id>.json and .html.")] = Path("."),
    load_mbit: Annotated[float, typer.Option("--load-mbit", min=0.1, help="Load per direction of a link.")] = 50.0,
    load_s: Annotated[float, typer.Option("--load-s", min=0.2, help="Seconds of load per round.")] = 2.0,
    parallel: Annotated[int, typer.Option("--parallel", min=1, help="Links loaded at once.")] = 4,
    store: Annotated[str | None, typer.Option("--store", help="Store DSN to read telemetry from.")] = None,
    record_store: Annotated[str | None, typer.Option("--record-store", help="Store DSN to record the audit in "
                                                     "(default: --store).")] = None,
    record_gateway: Annotated[str, typer.Option("--record-gateway", help="OTLP gateway (HOST:PORT) to record the "
                                                "audit through (default for --lab: the lab's).")] = "",
    ingest_token_file: Annotated[Path | None, typer.Option("--ingest-token-file", help="Bearer token for a "
                                                           "gateway that requires one.")] = None,
    cluster: Annotated[str, typer.Option("--cluster", help="Only telemetry of this cluster.")] = "",
    config: Annotated[Path | None, typer.Option("--config", help="YAML config file.")] = None,
) -> None:
    """Validate every host, link, NIC and GPU under load before a cluster goes to a customer."""
    from ridethrough.audit import Audit, AuditConfig, store_query
    from ridethrough.audit_report import render_html
    from ridethrough.lab.fault_params import parse_duration

    if bool(lab) == bool(inventory):
        raise _fail("name the fleet with exactly one of --lab NAME or --inventory FILE")
    try:
        budget_s = parse_duration(budget)
    except ValueError as exc:
        raise _fail(f"--budget: {exc}") from exc
    if lab:
        expected, reader, driver, cluster, lab_gateway = _lab_target(lab)
        record_gateway = record_gateway or lab_gateway
    else:
        assert inventory is not None
        (expected, reader), driver = _real_target(inventory, store, config), None
    expected, unknown = _hosts_filter(expected, hosts)
    cfg = AuditConfig(budget_s=budget_s, load_mbit=load_mbit, load_s=load_s, parallel=parallel, cluster=cluster)
    with RichProgress() as progress:
        result = Audit(expected, store_query(reader), driver=driver, config=cfg, progress=progress,
                       unknown_hosts=unknown).run()
    page = render_html(result)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"audit-{result.audit_id}.json").write_text(result.dumps(), encoding="utf-8")
        (out / f"audit-{result.audit_id}.html").write_text(page, encoding="utf-8")
    except OSError as exc:
        raise _fail(f"cannot write the report under {out}: {exc}", 1) from exc
    from ridethrough.exporters.store import Store

    if record_store:
        _record(Store(record_store), result, page)
    elif record_gateway:
        _record_via_gateway(record_gateway, result, ingest_token_file)
    elif lab:
        typer.echo("ridethrough audit: not recorded: the lab has no gateway address (pass --record-gateway or "
                   "--record-store)", err=True)
    else:
        _record(reader, result, page)
    from ridethrough.audit_store import summary

    typer.echo(summary(result))
    for a in result.anomalies:
        typer.echo(f"  {a.entity}: {a.kind.replace('_', ' ')} - {a.summary}")
    typer.echo(f"report: {out / f'audit-{result.audit_id}.html'}")
    raise typer.Exit(EXIT[result.status.value])


app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
app.command()(audit)
"""The command on its own (tests run it; the main CLI mounts `audit` itself)."""
