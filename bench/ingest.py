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
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing.context import SpawnContext
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any, TypeVar

from _otlp_load import make_request

ROOT = Path(__file__).resolve().parents[1]
METRICS_EXPORT = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"
BASE_TIME_NS = 1_767_225_600 * 10**9  # 2026-01-01T00:00:00Z: every run writes the same partition
PHASES = ("ceiling", "gateway", "ceiling")
TARGET_PER_CORE = 100_000.0
TARGET_CEILING_RATIO = 0.40
STARTUP_TIMEOUT_S = 60.0
RPC_TIMEOUT_S = 60.0
COUNT_SQL = "SELECT (SELECT count() FROM otel_metrics_gauge) + (SELECT count() FROM otel_metrics_sum)"
T = TypeVar("T")


def log(message: str) -> None:
    """One progress line on stderr."""
    print(f"[ingest {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- the plan ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Plan:
    """What one benchmark run sends, and the gateway settings it runs under."""

    points_per_request: int
    requests: int
    clients: int
    inflight: int
    pool: int
    batch_max_rows: int
    batch_max_age_s: float
    workers: int
    quick: bool

    @property
    def datapoints(self) -> int:
        """Points sent in the timed window (warm-up requests excluded)."""
        return self.requests * self.points_per_request

    @property
    def batch_requests(self) -> int:
        """Requests per insert batch: the fewest whose points reach ``batch_max_rows``."""
        return max(1, math.ceil(self.batch_max_rows / self.points_per_request))

    def requests_of(self, client: int) -> int:
        """Client ``client``'s share of the timed requests."""
        share, extra = divmod(self.requests, self.clients)
        return share + (1 if client < extra else 0)

    def gateway_env(self) -> dict[str, str]:
        """The gateway settings this run uses, as the environment variables it reads."""
        return {"RIDETHROUGH_GATEWAY_BATCH_MAX_ROWS": str(self.batch_max_rows),
                "RIDETHROUGH_GATEWAY_BATCH_MAX_AGE_S": str(self.batch_max_age_s),
                "RIDETHROUGH_GATEWAY_WORKERS": str(self.workers)}


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


def client_pool(plan: Plan, client: int) -> list[bytes]:
    """Client ``client``'s distinct requests, serialised; every process builds the same ones."""
    out = []
    for j in range(plan.pool):
        node = client * plan.pool + j
        req = make_request(node=node, points=plan.points_per_request, t_ns=BASE_TIME_NS + node * 10**6, seed=node)
        out.append(req.SerializeToString())
    return out


def send_order(plan: Plan) -> Iterator[tuple[int, int]]:
    """(client, pool index) of every timed request, clients taking turns as they do when racing."""
    for i in range(max(plan.requests_of(c) for c in range(plan.clients))):
        for c in range(plan.clients):
            if i < plan.requests_of(c):
                yield c, i % plan.pool


# -- gateway side: the process, its CPU time and its metrics -------------------------------


def stat_cpu_s(stat_path: Path) -> float:
    """User + system CPU seconds from a /proc ``stat`` file (a process's counts all its threads)."""
    stat = stat_path.read_text()
    fields = stat[stat.rindex(")") + 2:].split()  # fields from 3 (state) on; comm may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of every thread of ``pid`` so far."""
    return stat_cpu_s(Path(f"/proc/{pid}/stat"))


def machine_busy_cpu_s() -> float:
    """CPU seconds every process on this machine has used since boot (all of /proc/stat's busy time)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = (
        int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds so far of ``pid``'s live threads, summed by thread name (Python's are all 'python')."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            out[name] = out.get(name, 0.0) + stat_cpu_s(task / "stat")
        except OSError:  # the thread ended between listing and reading
            continue
    return out


def cpu_by_thread(before: dict[str, float], after: dict[str, float], total_s: float) -> dict[str, float]:
    """Where the window's CPU went, by thread name; 'ended threads' is what live threads do not explain."""
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    shown = {name: round(v, 2) for name, v in sorted(delta.items(), key=lambda kv: -kv[1]) if v >= 0.01}
    shown["ended threads"] = round(max(0.0, total_s - sum(delta.values())), 2)
    return shown


def scrape(url: str) -> dict[str, float]:
    """Unlabelled samples and per-label sums of a Prometheus text page, by metric name."""
    out: dict[str, float] = {}
    with urllib.request.urlopen(url, timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line and not line.startswith("#"):
                sample, _, value = line.rpartition(" ")
                name = sample.split("{", 1)[0]
                out[name] = out.get(name, 0.0) + float(value)
    return out


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


def poll(predicate: Callable[[], T | None], *, timeout_s: float, what: str, interval_s: float = 0.05) -> T:
    """The first truthy result of ``predicate``, polled until ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


# -- client processes ----------------------------------------------------------------------


@dataclass(slots=True)
class Tally:
    """What one client's calls came back with."""

    ok_requests: int = 0
    ok_points: int = 0
    rejected_points: int = 0
    errors: Counter[str] = field(default_factory=Counter)


@dataclass(slots=True)
class ClientResult:
    """One client's timed window: its tally, its CPU time and its warm-up points."""

    client: int
    tally: Tally
    cpu_s: float
    warmup_points: int


def send_all(call: Any, pool: list[bytes], n: int, *, inflight: int, points: int) -> Tally:
    """Send ``n`` requests cycling through ``pool``, ``inflight`` at a time; wait for every answer."""
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceResponse

    tally, lock, slots = Tally(), threading.Lock(), threading.Semaphore(inflight)

    def done(future: Any) -> None:
        try:
            rejected = ExportMetricsServiceResponse.FromString(future.result()).partial_success.rejected_data_points
            with lock:
                tally.ok_requests += 1
                tally.ok_points += points - rejected
                tally.rejected_points += rejected
        except Exception as exc:  # an RpcError (or a bad response): counted, the run is then invalid
            code = exc.code().name if hasattr(exc, "code") else type(exc).__name__
            with lock:
                tally.errors[code] += 1
        finally:
            slots.release()

    for i in range(n):
        slots.acquire()
        call.future(pool[i % len(pool)], timeout=RPC_TIMEOUT_S).add_done_callback(done)
    for _ in range(inflight):
        slots.acquire()
    return tally


def client_main(plan: Plan, client: int, target: str, go: Event, out: Queue[tuple[str, Any]]) -> None:
    """A client process: build its requests, warm up, report ready, send on ``go``, report."""
    try:
        import grpc

        pool = client_pool(plan, client)
        with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
            grpc.channel_ready_future(channel).result(timeout=STARTUP_TIMEOUT_S)
            call = channel.unary_unary(METRICS_EXPORT, request_serializer=None, response_deserializer=None)
            warmup = send_all(call, pool[:1], 1, inflight=1, points=plan.points_per_request)
            if warmup.errors or warmup.rejected_points:
                raise RuntimeError(f"warm-up request failed: {warmup}")
            out.put(("ready", client))
            go.wait()
            cpu0 = time.process_time()
            tally = send_all(call, pool, plan.requests_of(client), inflight=plan.inflight,
                             points=plan.points_per_request)
            out.put(("done", ClientResult(client, tally, time.process_time() - cpu0, warmup.ok_points)))
    except BaseException as exc:  # the parent must hear of any failure, or it waits for nothing
        out.put(("error", f"client {client}: {exc!r}"))
        raise


class Clients:
    """The client processes of one gateway phase; terminated on exit if still running."""

    def __init__(self, ctx: SpawnContext, plan: Plan, target: str) -> None:
        self._plan = plan
        self._out: Queue[tuple[str, Any]] = ctx.Queue()
        self.go = ctx.Event()
        self._procs: list[BaseProcess] = [
            ctx.Process(target=client_main, args=(plan, c, target, self.go, self._out), name=f"ingest-client-{c}")
            for c in range(plan.clients)]

    def __enter__(self) -> Clients:
        for p in self._procs:
            p.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self._procs:
            if p.is_alive():
                p.terminate()
            p.join(10)

    def collect(self, kind: str, timeout_s: float) -> list[Any]:
        """One ``kind`` message from every client; raises on a client's error, death or the deadline."""
        deadline = time.monotonic() + timeout_s
        got: list[Any] = []
        while len(got) < self._plan.clients:
            try:
                tag, payload = self._out.get(timeout=0.5)
            except queue.Empty:
                self._check(kind, deadline)
                continue
            if tag == "error":
                raise RuntimeError(payload)
            if tag == kind:
                got.append(payload)
        return got

    def _check(self, kind: str, deadline: float) -> None:
        dead = [p.name for p in self._procs if p.exitcode not in (None, 0)]
        if dead:
            raise RuntimeError(f"client process(es) {dead} died before reporting {kind!r}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for every client to report {kind!r}")


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


def stored_points(store: Any) -> int:
    """Rows in the tables the benchmark's gauge and sum points go to."""
    _, rows = store.query(COUNT_SQL)
    return int(rows[0][0])


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


# -- ceiling phase -------------------------------------------------------------------------


@dataclass(slots=True)
class CeilingRun:
    """Direct columnar inserts of the same rows, in the same batch size."""

    rows: int
    batches: int
    elapsed_s: float
    cpu_s: float
    stored_rows: int

    @property
    def datapoints_per_s(self) -> float:
        """Rows inserted per second of `Store.insert_columns`."""
        return self.rows / self.elapsed_s


def ceiling_batches(plan: Plan) -> list[Any]:
    """The timed requests as converted `Rows` batches, in send order; equal batches are one object."""
    from ridethrough.exporters.rows import Limits, Rejections, Rows
    from ridethrough.exporters.signals import Signal

    pools = [client_pool(plan, c) for c in range(plan.clients)]
    converted: dict[tuple[int, int], Any] = {}
    for c, pool in enumerate(pools):
        for j, raw in enumerate(pool):
            rows, rej = Rows(), Rejections()
            Signal.METRICS.convert(raw, Limits(), rows, rej)
            if rej.count:
                raise RuntimeError(f"the converter rejected {rej.count} points: {rej.message()}")
            converted[c, j] = rows
    order = list(send_order(plan))
    merged: dict[tuple[tuple[int, int], ...], Any] = {}
    batches = []
    for i in range(0, len(order), plan.batch_requests):
        key = tuple(order[i:i + plan.batch_requests])
        if key not in merged:
            merged[key] = Rows()
            for item in key:
                merged[key].extend(converted[item])
        batches.append(merged[key])
    return batches


def insert_batch(store: Any, rows: Any) -> None:
    """Insert one batch table by table, each with its own token, as the gateway does."""
    from ridethrough.exporters.schema import TABLES_BY_NAME

    token = uuid.uuid4().hex
    for name, count in rows.counts.items():
        if count:
            table = TABLES_BY_NAME[name]
            store.insert_columns(table, rows.ordered(table), token=f"{token}:{name}")


def ceiling_main(plan: Plan, store_path: str) -> CeilingRun:
    """A ceiling run (in a fresh process): prepare outside the clock, time only the inserts."""
    from ridethrough.exporters.store import Store

    batches = ceiling_batches(plan)
    store = Store(f"chdb://{store_path}")
    store.init_schema()
    insert_batch(store, batches[0])  # warm-up: the first insert loads the serialisation code paths
    warmup_rows = batches[0].total
    cpu0, t0 = time.process_time(), time.perf_counter()
    for rows in batches:
        insert_batch(store, rows)
    elapsed_s, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    return CeilingRun(rows=sum(b.total for b in batches), batches=len(batches), elapsed_s=elapsed_s, cpu_s=cpu_s,
                      stored_rows=stored_points(store) - warmup_rows)


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
