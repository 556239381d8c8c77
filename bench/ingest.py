"""Ingest benchmark: OTLP metric exports through a real gateway into chDB, against a ceiling.

Phases run alternately to spread machine noise over both sides: ceiling, gateway, ceiling.

* **gateway**: ``python -m ridethrough gateway`` on an embedded chDB store. Client
  processes pre-serialise their requests (``--points-per-request`` realistic GPU/NIC
  points each, see `_otlp_load`), send one warm-up request each, then, on one signal,
  keep ``--inflight`` raw-bytes Export calls in flight until their share of ``--requests``
  is acknowledged. Every call must be answered OK with no rejected points. The gateway's
  CPU time (all threads, from /proc) is read around the timed window; afterwards it is
  stopped with SIGTERM and a fresh process counts the rows in its store.
* **ceiling**: a fresh process converts the same requests with the gateway's own
  converter, joins them into batches of the gateway's batch size (all outside the
  clock), then times only `Store.insert_columns` of those batches into a fresh store.

Human-readable progress goes to stderr; the last line on stdout is one JSON object.
Run: ``.venv/bin/python bench/ingest.py [--quick]``.
"""


from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing.context import SpawnContext
from pathlib import Path
from typing import Any, TypeVar

from _ingest_ceiling import CeilingRun, ceiling_main, stored_points
from _ingest_clients import RPC_TIMEOUT_S, STARTUP_TIMEOUT_S, ClientResult, Clients, Plan
from _procs import cpu_by_thread, machine_busy_cpu_s, poll, proc_cpu_s, scrape, thread_cpu_s

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("ceiling", "gateway", "ceiling")
TARGET_PER_CORE = 100_000.0
TARGET_CEILING_RATIO = 0.40
T = TypeVar("T")


def log(message: str) -> None:
    """One progress line on stderr."""
    print(f"[ingest {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> Plan:
    """The run's `Plan` from the command line; sizes left out follow ``--quick``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="A smaller run that finishes in under a minute.")
    ap.add_argument("--points-per-request", type=int, default=1000)
    ap.add_argument("--requests", type=int, help="Timed requests in all (default 400, --quick; 2000).")
    ap.add_argument("--clients", type=int, default=2, help="Client processes.")
    ap.add_argument("--inflight", type=int, default=50, help=(
        "Calls each client keeps in flight (a fleet gateway serves thousands of agents at once; 2 x 50 "
        "in flight fills the default 50,000-row batch)."))
    ap.add_argument("--pool", type=int, default=32, help="Distinct pre-serialised requests per client.")
    ap.add_argument("--batch-max-rows", type=int,
                    help="Gateway batch size (default: half the points in flight, so one batch fills while "
                         "the previous one inserts).")
    ap.add_argument("--batch-max-age-s", type=float, default=0.2)
    args = ap.parse_args(argv)
    in_flight = args.clients * args.inflight
    requests = args.requests or (400 if args.quick else 2000)
    if min(args.points_per_request, requests, args.clients, args.inflight, args.pool) < 1:
        ap.error("--points-per-request, --requests, --clients, --inflight and --pool must be positive")
    batch = args.batch_max_rows or max(args.points_per_request, in_flight * args.points_per_request // 2)
    return Plan(points_per_request=args.points_per_request, requests=requests, clients=args.clients,
                inflight=args.inflight, pool=args.pool, batch_max_rows=batch,
                batch_max_age_s=args.batch_max_age_s, workers=max(16, in_flight), quick=args.quick)


# -- the gateway process -------------------------------------------------------------------


class GatewayProcess:
    """``python -m ridethrough gateway`` on ``workdir``; stopped on exit, whatever happens."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.store_dsn = f"chdb://{workdir / 'store'}"
        self._ready = workdir / "ready.json"
        self._log_path = workdir / "gateway.log"
        self._env = {**{k: v for k, v in os.environ.items() if not k.startswith("RIDETHROUGH_")}, **env}
        self._workdir = workdir
        self._popen: subprocess.Popen[bytes] | None = None
        self.addresses: dict[str, str] = {}

    def __enter__(self) -> GatewayProcess:
        args = [sys.executable, "-m", "ridethrough", "gateway", "--store", self.store_dsn,
                "--spool", str(self._workdir / "spool"), "--otlp-listen", "127.0.0.1:0",
                "--metrics-listen", "127.0.0.1:0", "--ready-file", str(self._ready)]
        with open(self._log_path, "wb") as log_file:
            self._popen = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, env=self._env, cwd=ROOT)
        try:
            self.addresses = poll(self._read_ready, timeout_s=STARTUP_TIMEOUT_S, what="the gateway's ready file")
        except BaseException:  # __exit__ does not run when __enter__ fails
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        """The gateway's process id."""
        assert self._popen is not None, "gateway not started"
        return self._popen.pid

    def _read_ready(self) -> dict[str, str] | None:
        if self._popen is not None and self._popen.poll() is not None:
            raise RuntimeError(f"gateway exited with {self._popen.returncode}:\n{self.log_tail()}")
        return json.loads(self._ready.read_text()) if self._ready.exists() else None

    def metrics(self) -> dict[str, float]:
        """The gateway's own Prometheus metrics now."""
        return scrape(f"http://{self.addresses['metrics']}/metrics")

    def log_tail(self, lines: int = 30) -> str:
        """The last lines the gateway wrote."""
        text = self._log_path.read_text(errors="replace") if self._log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM (the gateway flushes and exits), SIGKILL if it will not; the exit status."""
        if self._popen is None:
            return None
        if self._popen.poll() is None:
            self._popen.send_signal(signal.SIGTERM)
            try:
                self._popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log("gateway ignored SIGTERM; killing it")
                self._popen.kill()
                self._popen.wait(10)
        return self._popen.returncode


# -- gateway phase -------------------------------------------------------------------------


@dataclass(slots=True)
class GatewayRun:
    """The end-to-end measurement."""

    wall_s: float
    cpu_s: float
    client_cpu_s: float
    acked_points: int
    ok_requests: int
    rejected_points: int
    errors: dict[str, int]
    warmup_points: int
    stored_rows: int
    batches: float
    insert_s: float
    exit_code: int | None
    cpu_s_by_thread: dict[str, float] = field(default_factory=dict)
    other_cpu_s: float = 0.0


def run_gateway_phase(ctx: SpawnContext, plan: Plan, workdir: Path) -> GatewayRun:
    """Start a gateway, drive it with the clients, stop it, count what it stored."""
    with GatewayProcess(workdir, plan.gateway_env()) as gw:
        log(f"gateway pid {gw.pid} on {gw.addresses['otlp']}; starting {plan.clients} clients")
        with Clients(ctx, plan, gw.addresses["otlp"]) as clients:
            clients.collect("ready", STARTUP_TIMEOUT_S)
            before, threads0 = gw.metrics(), thread_cpu_s(gw.pid)
            busy0, cpu0, t0 = machine_busy_cpu_s(), proc_cpu_s(gw.pid), time.perf_counter()
            clients.go.set()
            results: list[ClientResult] = clients.collect("done", RPC_TIMEOUT_S + plan.requests)
            wall_s, cpu_s = time.perf_counter() - t0, proc_cpu_s(gw.pid) - cpu0
            busy_s = machine_busy_cpu_s() - busy0
            threads, after = cpu_by_thread(threads0, thread_cpu_s(gw.pid), cpu_s), gw.metrics()
        exit_code = gw.stop()
        if exit_code != 0:
            log(f"gateway exited with {exit_code}:\n{gw.log_tail()}")
    run = summarise(results, wall_s=wall_s, cpu_s=cpu_s, before=before, after=after, exit_code=exit_code)
    run.cpu_s_by_thread = threads
    run.other_cpu_s = max(0.0, busy_s - cpu_s - run.client_cpu_s)
    run.stored_rows = in_fresh_process(ctx, count_rows, gw.store_dsn)
    return run


def summarise(results: list[ClientResult], *, wall_s: float, cpu_s: float, before: dict[str, float],
              after: dict[str, float], exit_code: int | None) -> GatewayRun:
    """Add up the clients' tallies and the gateway's metric deltas."""
    errors: Counter[str] = Counter()
    for r in results:
        errors.update(r.tally.errors)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    return GatewayRun(
        wall_s=wall_s, cpu_s=cpu_s, client_cpu_s=sum(r.cpu_s for r in results),
        acked_points=sum(r.tally.ok_points for r in results), ok_requests=sum(r.tally.ok_requests for r in results),
        rejected_points=sum(r.tally.rejected_points for r in results), errors=dict(errors),
        warmup_points=sum(r.warmup_points for r in results), stored_rows=-1,
        batches=delta("ridethrough_gateway_batch_insert_seconds_count"),
        insert_s=delta("ridethrough_gateway_batch_insert_seconds_sum"), exit_code=exit_code)


def count_rows(dsn: str) -> int:
    """Rows in the gauge and sum tables of the store at ``dsn`` (run in a fresh process)."""
    from ridethrough.exporters.store import Store

    store = Store(dsn)
    try:
        return stored_points(store)
    finally:
        store.close()


def in_fresh_process(ctx: SpawnContext, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a new process (chDB opens one store path per process, once)."""
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(fn, *args).result()


# -- the report ----------------------------------------------------------------------------


def is_valid(plan: Plan, gw: GatewayRun, ceilings: list[CeilingRun]) -> bool:
    """Every request OK, nothing rejected, and every acknowledged point (and no other) in the stores."""
    return (not gw.errors and gw.rejected_points == 0 and gw.ok_requests == plan.requests
            and gw.acked_points == plan.datapoints and gw.stored_rows == gw.acked_points + gw.warmup_points
            and all(c.stored_rows == c.rows for c in ceilings))


def headline(gw: GatewayRun, ceilings: list[CeilingRun]) -> dict[str, Any]:
    """The figures the benchmark exists for, and whether they meet their targets."""
    rate = gw.acked_points / gw.wall_s
    ceiling = statistics.mean(c.datapoints_per_s for c in ceilings)
    per_core = gw.acked_points / gw.cpu_s if gw.cpu_s else math.inf
    ceiling_cpu = sum(c.cpu_s for c in ceilings) / sum(c.rows for c in ceilings)
    return {
        "bench": "ingest", "datapoints_per_s": round(rate), "per_core": round(per_core),
        "ceiling_ratio": round(rate / ceiling, 3),
        "gateway_cpu_s_per_million": round(gw.cpu_s / gw.acked_points * 1e6, 2),
        "ceiling_datapoints_per_s": round(ceiling),
        "ceiling_runs_datapoints_per_s": [round(c.datapoints_per_s) for c in ceilings],
        "ceiling_cpu_s_per_million": round(ceiling_cpu * 1e6, 2),
        "targets": {"per_core": {"target": TARGET_PER_CORE, "pass": per_core >= TARGET_PER_CORE},
                    "ceiling_ratio": {"target": TARGET_CEILING_RATIO, "pass": rate / ceiling >= TARGET_CEILING_RATIO}},
    }


def details(plan: Plan, gw: GatewayRun) -> dict[str, Any]:
    """What was sent and stored, how the gateway spent its time, and the settings it ran under."""
    return {
        "requests": gw.ok_requests, "datapoints": gw.acked_points, "stored_rows": gw.stored_rows - gw.warmup_points,
        "warmup_rows": gw.warmup_points, "rejected_points": gw.rejected_points, "errors": gw.errors,
        "wall_s": round(gw.wall_s, 3), "gateway_cpu_s": round(gw.cpu_s, 3), "gateway_exit_code": gw.exit_code,
        "gateway_cpu_s_by_thread": gw.cpu_s_by_thread, "client_cpu_s": round(gw.client_cpu_s, 3),
        "other_processes_cpu_s": round(gw.other_cpu_s, 2),
        "gateway_batches": int(gw.batches), "gateway_mean_batch_rows": mean_batch_rows(gw),
        "gateway_insert_s": round(gw.insert_s, 3), "ceiling_batch_rows": plan.batch_requests * plan.points_per_request,
        "gateway_settings": plan.gateway_env(), "phase_order": list(PHASES), "clients": plan.clients,
        "inflight_per_client": plan.inflight, "points_per_request": plan.points_per_request,
        "distinct_requests": plan.pool * plan.clients, "cpu_count": os.cpu_count(), "quick": plan.quick,
    }


def mean_batch_rows(gw: GatewayRun) -> int | None:
    """Rows per batch the gateway actually inserted in the timed window."""
    return round(gw.acked_points / gw.batches) if gw.batches else None


def report(plan: Plan, gw: GatewayRun, ceilings: list[CeilingRun]) -> dict[str, Any]:
    """The JSON object printed last; no target passes on an invalid run."""
    out = {**headline(gw, ceilings), "valid": is_valid(plan, gw, ceilings), **details(plan, gw)}
    for target in out["targets"].values():
        target["pass"] = target["pass"] and out["valid"]
    return out


def check_batching(plan: Plan, gw: GatewayRun) -> None:
    """Warn when the gateway's real batches are far from the ceiling's, which makes the ratio unfair."""
    actual, ceiling = mean_batch_rows(gw), plan.batch_requests * plan.points_per_request
    if actual is not None and abs(actual - ceiling) > 0.25 * ceiling:
        log(f"WARNING: gateway batches averaged {actual:,} rows but the ceiling inserts {ceiling:,}; "
            "adjust --batch-max-rows or --inflight so they match")


def run(plan: Plan) -> dict[str, Any]:
    """Every phase in `PHASES` order, each in its own directory under one temporary one."""
    ctx = mp.get_context("spawn")
    ceilings: list[CeilingRun] = []
    gateway: GatewayRun | None = None
    with tempfile.TemporaryDirectory(prefix="rt-bench-ingest-") as tmp:
        for i, phase in enumerate(PHASES):
            workdir = Path(tmp) / f"{i}-{phase}"
            workdir.mkdir()
            started = time.perf_counter()
            if phase == "ceiling":
                ceilings.append(in_fresh_process(ctx, ceiling_main, plan, str(workdir / "store")))
                log(f"ceiling: {ceilings[-1].datapoints_per_s:,.0f} points/s ({ceilings[-1].batches} batches)")
            else:
                gateway = run_gateway_phase(ctx, plan, workdir)
                check_batching(plan, gateway)
                log(f"gateway: {gateway.acked_points / gateway.wall_s:,.0f} points/s, "
                    f"{gateway.cpu_s:.2f} CPU s, stored {gateway.stored_rows:,} rows")
            log(f"phase {phase} took {time.perf_counter() - started:.1f} s")
    assert gateway is not None
    return report(plan, gateway, ceilings)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit 1 when the run is invalid (an error, a rejection, a missing row)."""
    plan = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the gateway, the clients and the temporary files go too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    log(f"plan: {asdict(plan)}")
    result = run(plan)
    log("targets: " + ", ".join(f"{k} {'PASS' if v['pass'] else 'MISS'}" for k, v in result["targets"].items()))
    print(json.dumps(result), flush=True)
    return 0 if result["valid"] else 1


if __name__ == "__main__":
    sys.exit(main())
