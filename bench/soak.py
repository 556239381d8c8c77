"""Soak: one gateway under a steady load of twice the per-core design rate, for ten minutes.

Client processes send pre-serialised OTLP metric exports (realistic GPU/NIC points, `_otlp_load`)
on a fixed schedule (open loop: request i of a client is due at t0 + i / rate, whether or not
earlier ones were answered), keeping at most ``--inflight`` calls in flight each. A refused or
failed call is retried after the gateway's RetryInfo delay (or 0.5 s) until acknowledged, as an
OTLP exporter does. An export's latency runs from its scheduled time to its acknowledgement, so
queueing in the client counts too (no coordinated omission); its deadline is ``--deadline-s`` (5 s,
stricter than the agent's export timeout of 10 s). Meanwhile the gateway's RSS is sampled every half
second.

Afterwards a fresh process counts the rows in the gateway's store. Figures: lost points
(acknowledged but not stored), unacknowledged points (sent, but refused or unanswered until the
drain ended: the sender knows), points stored beyond those acknowledged (a call that timed out or
was cancelled in the client but landed: stored twice once retried), peak RSS (the kernel's
high-water mark), RSS growth after warm-up, and the export latency percentiles. The ``lost``
target passes only with nothing lost, nothing unacknowledged and nothing stored twice.

Run: ``.venv/bin/python bench/soak.py [--quick] [--duration-s S] [--rate R]``; progress on
stderr, one JSON object last on stdout: ``{"bench": "soak", "lost": …, "peak_rss_mb": …,
"p99_export_ms": …, …}``.
"""

from __future__ import annotations

import argparse
import heapq
import json
import multiprocessing as mp
import queue
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.context import SpawnContext
from pathlib import Path
from typing import Any

from _ingest_clients import BASE_TIME_NS, METRICS_EXPORT, STARTUP_TIMEOUT_S
from _otlp_load import make_request
from ingest import TARGET_PER_CORE, GatewayProcess, count_rows, in_fresh_process

RETRYABLE = frozenset({"UNAVAILABLE", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "ABORTED"})
RSS_GROWTH_LIMIT_MB = 64.0  # after warm-up, a bounded gateway's RSS wanders by far less


def log(message: str) -> None:
    """One progress line on stderr."""
    print(f"[soak {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class SoakPlan:
    """What the run offers the gateway."""

    rate: float  # data points per second, all clients together
    duration_s: float
    points_per_request: int
    clients: int
    inflight: int
    deadline_s: float
    drain_s: float = 60.0  # how long past the schedule unanswered calls may still be retried
    pool: int = 16

    @property
    def requests_per_client(self) -> int:
        return round(self.rate * self.duration_s / self.points_per_request / self.clients)

    @property
    def interval_s(self) -> float:
        """Seconds between one client's scheduled requests."""
        return self.points_per_request * self.clients / self.rate


@dataclass(slots=True)
class ClientTally:
    """One client's books."""

    acked_points: int = 0
    sent_points: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    retries: int = 0
    late_starts: int = 0  # requests sent after their time because the in-flight limit was reached
    unsent_points: int = 0  # scheduled but never sent (the gateway could not keep up at all)


def client_main(plan: SoakPlan, client: int, target: str, go: Any, out: Any) -> None:
    """A client process: build its pool, warm up, wait for ``go``, send on schedule, report its tally."""
    try:
        import grpc

        pool = [make_request(node=client * plan.pool + j, points=plan.points_per_request,
                             t_ns=BASE_TIME_NS + (client * plan.pool + j) * 10**6, seed=j).SerializeToString()
                for j in range(plan.pool)]
        with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
            grpc.channel_ready_future(channel).result(timeout=STARTUP_TIMEOUT_S)
            call = channel.unary_unary(METRICS_EXPORT, request_serializer=None, response_deserializer=None)
            call(pool[0], timeout=30)  # warm-up: its points are counted as such
            out.put(("ready", client))
            go.wait()
            out.put(("done", (client, Sender(plan, call, pool).run())))
    except BaseException as exc:  # the parent must hear of any failure
        out.put(("error", f"client {client}: {exc!r}"))
        raise


class Sender:
    """The open-loop schedule of one client, with retries and an in-flight limit."""

    def __init__(self, plan: SoakPlan, call: Any, pool: list[bytes]) -> None:
        self.plan, self.call, self.pool = plan, call, pool
        self.tally = ClientTally()
        # re-entrant: a future that is already done runs its callback inside add_done_callback
        self.wake = threading.Condition(threading.RLock())
        self.inflight = 0
        self.pending = plan.requests_per_client  # not yet acknowledged (or given up)
        self.retries: list[tuple[float, int, float]] = []  # (due, request, scheduled), a heap

    def _send(self, i: int, scheduled: float) -> None:
        self.inflight += 1
        future = self.call.future(self.pool[i % len(self.pool)], timeout=self.plan.deadline_s)
        future.add_done_callback(lambda f: self._done(f, i, scheduled))

    def _done(self, future: Any, i: int, scheduled: float) -> None:
        with self.wake:
            self.inflight -= 1
            exc = future.exception()
            if exc is None:
                self.tally.acked_points += self.plan.points_per_request
                self.tally.latencies_ms.append((time.monotonic() - scheduled) * 1000)
                self.pending -= 1
            else:
                code = exc.code().name if hasattr(exc, "code") else type(exc).__name__
                self.tally.errors[code] += 1
                if code in RETRYABLE:
                    self.tally.retries += 1
                    heapq.heappush(self.retries, (time.monotonic() + _retry_delay_s(exc), i, scheduled))
                else:
                    self.pending -= 1  # not retryable: these points are lost, and counted so
            self.wake.notify()

    def run(self) -> ClientTally:
        """Send every scheduled request and wait for all answers (at most ``drain_s`` past the schedule)."""
        plan, t0, i = self.plan, time.monotonic(), 0
        n = plan.requests_per_client
        with self.wake:
            while self.pending and time.monotonic() < t0 + plan.duration_s + plan.drain_s:
                now = time.monotonic()
                due = t0 + i * plan.interval_s
                if self.inflight >= plan.inflight:
                    self.wake.wait(0.05)
                elif self.retries and self.retries[0][0] <= now:
                    _, request, scheduled = heapq.heappop(self.retries)
                    self._send(request, scheduled)
                elif i < n and due <= now:
                    if now - due > plan.interval_s:
                        self.tally.late_starts += 1
                    self.tally.sent_points += plan.points_per_request
                    self._send(i, due)
                    i += 1
                else:
                    times = ([due] if i < n else []) + [r[0] for r in self.retries[:1]]
                    self.wake.wait(min(0.05, max(0.0, min(times, default=now + 0.05) - now)))
        self.tally.unsent_points = (n - i) * plan.points_per_request
        return self.tally


def _retry_delay_s(exc: Any) -> float:
    from google.rpc import error_details_pb2

    try:
        raw = dict(exc.trailing_metadata() or ()).get("google.rpc.retryinfo-bin")
        if raw:
            d = error_details_pb2.RetryInfo.FromString(raw).retry_delay
            return min(5.0, d.seconds + d.nanos / 1e9)
    except Exception:  # no trailers on a transport error
        pass
    return 0.5


# -- the parent --------------------------------------------------------------------------------------------------


class RssSampler:
    """The gateway's resident set every ``interval_s``, on a thread."""

    def __init__(self, pid: int, interval_s: float = 0.5) -> None:
        self.pid, self.interval_s = pid, interval_s
        self.samples: list[tuple[float, float]] = []  # (seconds since start, MB)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def status_mb(self, key: str) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
        return 0.0

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._stop.wait(self.interval_s):
            try:
                self.samples.append((time.monotonic() - t0, self.status_mb("VmRSS")))
            except OSError:
                return

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def by_fifth_mb(self) -> list[float]:
        """Mean RSS over each fifth of the run: a bounded gateway levels off."""
        values = [mb for _, mb in self.samples]
        n = len(values)
        return [round(statistics.mean(values[i * n // 5:(i + 1) * n // 5]), 1) for i in range(5)] if n >= 5 else []

    def growth_mb(self) -> float:
        """Mean RSS of the last fifth of the run minus that of the second fifth (after warm-up)."""
        n = len(self.samples)
        if n < 10:
            return 0.0
        values = [mb for _, mb in self.samples]
        return statistics.mean(values[-n // 5:]) - statistics.mean(values[n // 5: 2 * n // 5])


def collect(out: Any, kind: str, n: int, timeout_s: float) -> list[Any]:
    """``n`` messages of ``kind`` from the clients; raises on an error report or at the deadline."""
    got: list[Any] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n:
        try:
            tag, payload = out.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(f"timed out waiting for every client to report {kind!r}") from None
        if tag == "error":
            raise RuntimeError(payload)
        if tag == kind:
            got.append(payload)
    return got


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))] if ordered else float("nan")


def run(plan: SoakPlan) -> dict[str, Any]:
    """Start the gateway and the clients, soak, stop, count."""
    ctx: SpawnContext = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="rt-bench-soak-") as tmp:
        with GatewayProcess(Path(tmp), {}) as gw:  # the gateway's defaults: what a deployment runs
            log(f"gateway pid {gw.pid} on {gw.addresses['otlp']}; {plan.clients} clients at {plan.rate:,.0f} points/s")
            out, go = ctx.Queue(), ctx.Event()
            procs = [ctx.Process(target=client_main, args=(plan, c, gw.addresses["otlp"], go, out))
                     for c in range(plan.clients)]
            for p in procs:
                p.start()
            try:
                collect(out, "ready", plan.clients, STARTUP_TIMEOUT_S)
                with RssSampler(gw.pid) as rss:
                    started = time.monotonic()
                    go.set()
                    results = collect(out, "done", plan.clients, plan.duration_s + plan.drain_s + 30)
                    wall_s = time.monotonic() - started
                    peak_mb = rss.status_mb("VmHWM")
                metrics = gw.metrics()
            finally:
                for p in procs:
                    p.join(10)
                    if p.is_alive():
                        p.terminate()
            exit_code = gw.stop()
        stored = in_fresh_process(ctx, count_rows, gw.store_dsn) - plan.clients * plan.points_per_request
    out = report(plan, [t for _, t in results], stored=stored, wall_s=wall_s, peak_mb=peak_mb,
                 growth_mb=rss.growth_mb(), metrics=metrics, exit_code=exit_code)
    out["rss_mb_by_fifth"] = rss.by_fifth_mb()
    return out


def report(plan: SoakPlan, tallies: list[ClientTally], *, stored: int, wall_s: float, peak_mb: float,
           growth_mb: float, metrics: dict[str, float], exit_code: int | None) -> dict[str, Any]:
    """The JSON object printed last."""
    latencies = [x for t in tallies for x in t.latencies_ms]
    sent, acked = sum(t.sent_points for t in tallies), sum(t.acked_points for t in tallies)
    errors: Counter[str] = Counter()
    for t in tallies:
        errors.update(t.errors)
    p99 = percentile(latencies, 0.99)
    lost = max(0, acked - stored)  # acknowledged, yet not in the store: the one thing that must never happen
    unacked = sent - acked  # sent but never acknowledged within the drain: refused (counted), not lost silently
    targets = {"lost": {"target": 0, "pass": lost == 0 and stored == acked and unacked == 0},
               "p99_export_ms": {"target": plan.deadline_s * 1000, "pass": p99 < plan.deadline_s * 1000},
               "rss_growth_mb": {"target": RSS_GROWTH_LIMIT_MB, "pass": growth_mb < RSS_GROWTH_LIMIT_MB}}
    return {
        "bench": "soak", "lost": lost, "peak_rss_mb": round(peak_mb, 1), "p99_export_ms": round(p99, 1),
        "unacked_points": unacked, "stored_beyond_acked": max(0, stored - acked), "rss_growth_mb": round(growth_mb, 1),
        "p50_export_ms": round(percentile(latencies, 0.5), 1), "max_export_ms": round(max(latencies, default=0), 1),
        "deadline_ms": plan.deadline_s * 1000, "rate_target": plan.rate,
        "rate_achieved": round(acked / wall_s), "sent_points": sent, "acked_points": acked, "stored_points": stored,
        "errors": dict(errors), "retries": sum(t.retries for t in tallies),
        "late_starts": sum(t.late_starts for t in tallies), "unsent_points": sum(t.unsent_points for t in tallies),
        "gateway_backpressure": metrics.get("ridethrough_gateway_backpressure_total", 0.0),
        "gateway_spooled_batches": metrics.get("ridethrough_gateway_spooled_batches_total", 0.0),
        "gateway_exit_code": exit_code, "duration_s": plan.duration_s, "wall_s": round(wall_s, 1),
        "clients": plan.clients, "inflight_per_client": plan.inflight, "points_per_request": plan.points_per_request,
        "targets": targets,
    }


def parse_args(argv: list[str] | None = None) -> SoakPlan:
    """The plan from the command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="25 s instead of 10 minutes (finishes in under a minute).")
    ap.add_argument("--duration-s", type=float, help="Length of the load (default 600; --quick: 25).")
    ap.add_argument("--rate", type=float, default=2 * TARGET_PER_CORE,
                    help="Data points per second offered (default: twice the ingest bench's per-core design rate).")
    ap.add_argument("--points-per-request", type=int, default=1000)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--inflight", type=int, default=50, help="Most calls in flight per client.")
    ap.add_argument("--deadline-s", type=float, default=5.0, help="Export deadline, s (an agent waits 10).")
    args = ap.parse_args(argv)
    duration = args.duration_s or (25.0 if args.quick else 600.0)
    if min(duration, args.rate, args.points_per_request, args.clients, args.inflight, args.deadline_s) <= 0:
        ap.error("every size must be positive")
    return SoakPlan(rate=args.rate, duration_s=duration, points_per_request=args.points_per_request,
                    clients=args.clients, inflight=args.inflight, deadline_s=args.deadline_s,
                    drain_s=10.0 if args.quick else 60.0)


def main(argv: list[str] | None = None) -> int:
    """Run the soak; exit 1 when a target is missed."""
    plan = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    result = run(plan)
    log("targets: " + ", ".join(f"{k} {'PASS' if v['pass'] else 'MISS'}" for k, v in result["targets"].items()))
    print(json.dumps(result), flush=True)
    return 0 if all(v["pass"] for v in result["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
