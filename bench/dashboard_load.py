"""Dashboard page load: every page, all figures rendered, with a day of data from 64 hosts in the store.

The store is an embedded chDB owned by this process and served read-only over HTTP, as
`ridethrough server` serves it; the fleet is generated (`ridethrough.dashboards.fake_fleet`: the
agents' metrics at ``--interval`` seconds, jobs, incidents, actions and traces). The dashboard runs
as in production: the real command, under gunicorn, reading the store over HTTP, with its result
cache off (every load queries the store; ``--cache-s`` turns it on to measure repeat views). A
headless Debian chromium (Playwright) loads the first page once to fill its cache of scripts, then
every page ``--loads`` times; a load is timed from navigation until every figure is drawn with its data
(`ridethrough.dashboards.app.RENDERED_JS`).

Target (issue #9): p95 page load <= 1.5 s at 64 hosts x 24 h. Progress goes to stderr; the last line
on stdout is one JSON object. Run: ``.venv/bin/python bench/dashboard_load.py [--quick]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ridethrough.dashboards.app import FIGURE_POINTS_JS, RENDERED_JS
from ridethrough.dashboards.fake_fleet import FakeFleet, FleetSpec, fabric_map, generate
from ridethrough.dashboards.serve import wait_healthy
from ridethrough.exporters.store import Store
from ridethrough.exporters.store_http import StoreHttpEndpoint

CHROMIUM = "/usr/bin/chromium"
TARGET_P95_S = 1.5
ROOT = Path(__file__).resolve().parent.parent


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def pages(fleet: FakeFleet) -> dict[str, str]:
    """Name → path of every page (an incident page, and the trace path PagerDuty links to)."""
    return {"fleet": "/", "fabric": "/fabric", "gpus": "/gpus", "incidents": "/incidents",
            "incident": f"/incidents/{fleet.incidents['gpu_failed']}", "trace": f"/traces/{fleet.traces['link_down']}",
            "goodput": "/goodput"}


def start_dashboard(dsn: str, fabric: Path, work: Path, *, cache_s: float, window_s: float) -> tuple[Any, str]:
    """The real command under gunicorn; returns (process, base URL)."""
    ready = work / "dashboard.json"
    env = {**os.environ, "RIDETHROUGH_DASHBOARD_CACHE_S": str(cache_s), "RIDETHROUGH_DASHBOARD_REFRESH_S": "0",
           "RIDETHROUGH_DASHBOARD_WINDOW_S": str(window_s), "RIDETHROUGH_DASHBOARD_AGENT_STALE_S": "90"}
    command = [sys.executable, "-c", "import typer; from ridethrough.dashboards.dashboard_cli import dashboard; "
               "typer.run(dashboard)", "--store", dsn, "--listen", "127.0.0.1:0", "--server", "gunicorn",
               "--fabric-map-file", str(fabric), "--ready-file", str(ready)]
    proc = subprocess.Popen(command, env=env, stdout=(work / "dashboard.log").open("wb"), stderr=subprocess.STDOUT,
                            cwd=ROOT)
    deadline = time.monotonic() + 120
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"dashboard did not start:\n{(work / 'dashboard.log').read_text()[-2000:]}")
        time.sleep(0.1)
    url = json.loads(ready.read_text())["url"]
    if not wait_healthy(url, timeout_s=60):
        raise SystemExit("dashboard workers did not answer /healthz")
    return proc, url


def measure(url: str, paths: dict[str, str], loads: int) -> dict[str, list[float]]:
    """Seconds per load of each page, after one unmeasured load of the first (it fills the browser's cache
    of the scripts every page shares)."""
    from playwright.sync_api import sync_playwright

    times: dict[str, list[float]] = {name: [] for name in paths}
    with sync_playwright() as pw:
        args = ["--no-sandbox"] if os.geteuid() == 0 else []
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=args)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        warm_up = [next(iter(paths.items()))]
        for round_ in range(loads + 1):
            for name, path in paths.items() if round_ else warm_up:
                started = time.perf_counter()
                page.goto(url + path)
                page.wait_for_function(RENDERED_JS, timeout=120_000, polling=10)
                took = time.perf_counter() - started
                empty = [g for g in page.eval_on_selector_all(".rt-graph", "gs => gs.map(g => g.id)")
                         if page.evaluate(FIGURE_POINTS_JS, g) <= 0]
                if round_:
                    times[name].append(took)
                log(f"  {'warm-up' if not round_ else f'load {round_}'} {name}: {took:.2f} s"
                    + (f" (no data in {', '.join(empty)})" if empty else ""))
        browser.close()
    return times


def reuse(data: Path, spec: FleetSpec) -> FakeFleet | None:
    """The fleet a previous run generated in ``data``, if it has this size."""
    try:
        doc = json.loads((data / "fleet.json").read_text())
    except (OSError, ValueError):
        return None
    if doc.get("spec") != dataclasses.asdict(spec):
        raise SystemExit(f"{data} holds a fleet of another size; use another --data-dir")
    return FakeFleet(**{**doc, "spec": spec})


def upgrade(store: Store) -> None:
    """Bring a store an older version generated up to this schema (what a restarted gateway does), and wait
    for the projections it adds to be built, so that the measured loads read what a new store would."""
    started = time.perf_counter()
    store.init_schema()
    while True:
        _, pending = store.query("SELECT count() FROM system.mutations WHERE database = currentDatabase() "
                                 "AND NOT is_done")
        if not pending[0][0]:
            break
        time.sleep(1)
    log(f"  schema upgraded in {time.perf_counter() - started:.1f} s")


def p95(values: list[float]) -> float:
    """The nearest-rank 95th percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 hosts x 2 h, 1 load per page (under 60 s)")
    parser.add_argument("--hosts", type=int, default=64)
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--interval", type=float, default=60.0, help="seconds between an agent's points")
    parser.add_argument("--loads", type=int, default=5, help="measured loads of each page")
    parser.add_argument("--cache-s", type=float, default=0.0, help="the dashboard's result cache (0: off)")
    parser.add_argument("--data-dir", type=Path, help="keep the generated store here and reuse it on the next run "
                        "with the same size (to compare two versions of the dashboard on the same data)")
    parser.add_argument("--no-upgrade", action="store_true", help="read a reused store as the version that "
                        "generated it left it (the baseline of a comparison), not brought up to this schema")
    args = parser.parse_args()
    if args.quick:
        args.hosts, args.hours, args.loads = 16, 2.0, 1
    if not Path(CHROMIUM).exists():
        raise SystemExit(f"needs Debian chromium at {CHROMIUM} (apt-get install chromium)")
    spec = FleetSpec(hosts=args.hosts, racks=max(1, args.hosts // 8), hours=args.hours, interval_s=args.interval)
    with tempfile.TemporaryDirectory(prefix="rt-dashboard-load-") as tmp:
        work = Path(tmp)
        data = args.data_dir or work
        data.mkdir(parents=True, exist_ok=True)
        store = Store(f"chdb://{data / 'store'}")
        started = time.perf_counter()
        fleet = reuse(data, spec)
        reused = fleet is not None
        if fleet is None:
            log(f"generating {spec.hosts} hosts x {spec.hours:g} h at {spec.interval_s:g} s ...")
            fleet = generate(store, spec, end_ns=time.time_ns())
            (data / "fleet.json").write_text(json.dumps(dataclasses.asdict(fleet)))
        else:
            log(f"reusing the fleet generated {(time.time_ns() - fleet.end_ns) / 60e9:.0f} min ago in {data}")
            if not args.no_upgrade:
                upgrade(store)
        generate_s = time.perf_counter() - started
        log(f"  {fleet.rows:,} rows in {generate_s:.1f} s")
        fabric = work / "fabric.json"
        fabric.write_text(json.dumps(fabric_map(spec).to_json()))
        with StoreHttpEndpoint(client=store.client(), host="127.0.0.1", port=0, lock=store.lock) as endpoint:
            dsn = "http://{}:{}".format(*endpoint.address)
            proc, url = start_dashboard(dsn, fabric, work, cache_s=args.cache_s, window_s=3600)
            try:
                times = measure(url, pages(fleet), args.loads)
            finally:
                proc.terminate()
                proc.wait(30)
        store.close()
    every = [t for ts in times.values() for t in ts]
    result = {"bench": "dashboard_load", "p95_page_s": round(p95(every), 3),
              "p50_page_s": round(statistics.median(every), 3), "target_p95_s": TARGET_P95_S,
              "pages": {name: {"p50_s": round(statistics.median(ts), 3), "max_s": round(max(ts), 3)}
                        for name, ts in times.items()},
              "hosts": spec.hosts, "hours": spec.hours, "interval_s": spec.interval_s, "rows": fleet.rows,
              "generate_s": round(generate_s, 1), "reused_data": reused,
              "upgraded": reused and not args.no_upgrade,
              "loads_per_page": args.loads, "cache_s": args.cache_s,
              "server": "gunicorn", "load_average_1m": round(os.getloadavg()[0], 1), "quick": args.quick}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
