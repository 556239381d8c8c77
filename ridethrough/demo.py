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


def _table(console: Console, store: Store, started: float, first: list[float]) -> Table:
    _, rows = store.query(_COUNTS)
    elapsed = time.monotonic() - started
    if not first and any(count for _, count, _, _ in rows):
        first.append(elapsed)
        console.print(f"first rows landed {elapsed:.1f} s after start", soft_wrap=True)
    table = Table(title=f"ridethrough demo: what landed in the store after {elapsed:.0f} s")
    for col in ("signal", "rows", "distinct names", "latest timestamp"):
        table.add_column(col)
    for what, count, series, latest in sorted(rows):
        table.add_row(what, f"{count:,}", str(series), str(latest) if count else "-")
    return table


def _watch(console: Console, store: Store, started: float, first: list[float], stop: threading.Event,
           duration_s: float | None) -> None:
    """A live table on a terminal; one printed table every 5 s otherwise (logs, CI)."""
    def due() -> bool:
        return duration_s is not None and time.monotonic() - started >= duration_s
    if console.is_terminal:
        with Live(_table(console, store, started, first), console=console, refresh_per_second=2) as live:
            while not stop.wait(1.0) and not due():
                live.update(_table(console, store, started, first))
        return
    ticks = 0
    while not stop.wait(1.0) and not due():
        ticks += 1
        table = _table(console, store, started, first)
        if ticks % 5 == 0:
            console.print(table)
    console.print(_table(console, store, started, first))


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
        url = server.addresses.get("store_http", "")
        console.print(f"[bold]store[/] read-only SQL at {url}; in another shell try:")
        console.print(f"  ridethrough query --store {url} "
                      "\"SELECT MetricName, count() FROM otel_metrics_sum GROUP BY MetricName\"", soft_wrap=True)
        node: Agent = build_agent(AgentConfig(gateway=server.addresses["otlp"], cluster="demo",
                                              export_interval_s=1.0, job_socket=str(data_dir / "job.sock")))
        node.start()
        started = time.monotonic()
        first: list[float] = []
        try:
            _watch(console, server.store, started, first, stop, duration_s)
        finally:
            node.stop()
    console.print(f"\ndemo stopped; data kept in {data_dir}")
    return 0
