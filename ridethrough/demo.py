"""``ridethrough demo``: the main job, shown live.

Today: a server (gateway + read-only store endpoint) on an embedded store, one agent
sampling this host, and a live table of what lands in the store. The lab, the
controller and the scripted story join it as they land.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from ridethrough.collector.agent import Agent
from ridethrough.exporters.store import Store
from ridethrough.settings import AgentConfig, GatewayConfig, ServerConfig
from ridethrough.wiring import ServerRuntime, build_agent

_COUNTS = """
SELECT 'metrics (sum)' AS what, count() AS rows, uniqExact(MetricName) AS series, max(TimeUnix) AS latest
FROM otel_metrics_sum
UNION ALL SELECT 'metrics (gauge)', count(), uniqExact(MetricName), max(TimeUnix) FROM otel_metrics_gauge
UNION ALL SELECT 'logs (events)', count(), uniqExact(EventName), max(Timestamp) FROM
  (SELECT LogAttributes['event.name'] AS EventName, Timestamp FROM otel_logs)
"""


def _table(store: Store, started: float) -> Table:
    _, rows = store.query(_COUNTS)
    table = Table(title=f"ridethrough demo: data landing in the store ({time.monotonic() - started:.0f} s)")
    for col in ("signal", "rows", "distinct names", "latest timestamp"):
        table.add_column(col)
    for what, count, series, latest in sorted(rows):
        table.add_row(what, f"{count:,}", str(series), str(latest) if count else "-")
    return table


def run(*, data_dir: Path, duration_s: float | None) -> int:
    """Run the demo until Ctrl-C or ``duration_s``; returns the exit status."""
    console = Console(stderr=False)
    data_dir.mkdir(parents=True, exist_ok=True)
    gcfg = GatewayConfig(otlp_listen="127.0.0.1:0", store=f"chdb://{data_dir / 'store'}",
                         spool=str(data_dir / "spool"))
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with ServerRuntime(gateway_cfg=gcfg, server_cfg=ServerConfig()) as server:
        console.print(f"[bold]gateway[/] OTLP on {server.addresses['otlp']}, store {gcfg.store}")
        console.print(f"[bold]store[/] read-only SQL at {server.addresses.get('store_http', '-')} "
                      "(try: ridethrough query --store URL 'SELECT ...')")
        node: Agent = build_agent(AgentConfig(gateway=server.addresses["otlp"], cluster="demo",
                                              export_interval_s=1.0))
        node.start()
        started = time.monotonic()
        try:
            with Live(_table(server.store, started), console=console, refresh_per_second=2) as live:
                while not stop.wait(1.0):
                    live.update(_table(server.store, started))
                    if duration_s is not None and time.monotonic() - started >= duration_s:
                        break
        finally:
            node.stop()
    console.print("demo stopped; data kept in", str(data_dir))
    return 0
