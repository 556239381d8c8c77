"""``ridethrough dashboard``: serve the dashboard (mounted by the main CLI with ``app.command()(dashboard)``).

The store is ``--store`` > ``RIDETHROUGH_DASHBOARD_STORE`` > the config file's ``dashboard.store``
> the gateway's store. An embedded ``chdb://`` store opens in one process only: point the
dashboard at ``ridethrough server``'s read-only endpoint (``http://HOST:PORT``) while a server
owns the store.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from ridethrough.config import ConfigError


def dashboard(
    config: Annotated[Path | None, typer.Option("--config", help="YAML file with one section per component.")] = None,
    store: Annotated[str | None, typer.Option(
        "--store", help="ClickHouse DSN: http(s)://... (a server's read-only endpoint) or chdb://PATH.")] = None,
    listen: Annotated[str | None, typer.Option(help="HTTP HOST:PORT (port 0: any).")] = None,
    server: Annotated[str | None, typer.Option(help="gunicorn (production) or dash (development server).")] = None,
    fabric_map_file: Annotated[str | None, typer.Option(help="JSON fabric map for the topology graph.")] = None,
    cluster: Annotated[str | None, typer.Option(help="Fleet cluster to show (empty: all).")] = None,
    workers: Annotated[int | None, typer.Option(help="gunicorn worker processes.")] = None,
    refresh_s: Annotated[float | None, typer.Option("--refresh", help="Seconds between figure refreshes.")] = None,
    ready_file: Annotated[str | None, typer.Option(help="Write {\"url\": ...} here once serving.")] = None,
    duration: Annotated[float | None, typer.Option("--duration", help="Stop after this many seconds.")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False,
) -> None:
    """Serve the dashboard: fleet, fabric, GPUs, incidents (with traces) and goodput, from the store."""
    import logging
    import sys

    from ridethrough.dashboards.config import load_dashboard_config
    from ridethrough.dashboards.serve import serve, store_dsn

    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    flags = {"store": store, "listen": listen, "server": server, "fabric_map_file": fabric_map_file,
             "cluster": cluster, "workers": workers, "refresh_s": refresh_s}
    try:
        cfg = load_dashboard_config(file=config, env=os.environ, flags=flags).config
        dsn = store_dsn(cfg, config_file=config, env=os.environ)
    except ConfigError as exc:
        typer.echo(f"ridethrough: config error: {exc}", err=True)
        raise typer.Exit(2) from exc

    def ready(url: str) -> None:
        typer.echo(f"dashboard: serving on {url} ({cfg.server}), store {_redacted(dsn)}", err=True)
        if ready_file:
            from ridethrough.wiring import write_ready_file

            write_ready_file(ready_file, {"url": url})

    try:
        serve(cfg, dsn=dsn, on_ready=ready, duration_s=duration)
    except (ValueError, OSError) as exc:  # a bad fabric map or secret, a port in use: said in one line
        typer.echo(f"ridethrough: {exc}", err=True)
        raise typer.Exit(2 if isinstance(exc, ValueError) else 1) from exc


def _redacted(dsn: str) -> str:
    from ridethrough.exporters.store import redact_dsn

    return redact_dsn(dsn)
