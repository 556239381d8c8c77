"""The ingest benchmark's plan and its client processes: pre-serialised OTLP exports, sent raw.

Each client process builds its requests, sends one warm-up, reports ``ready``, waits for the
shared ``go`` event, keeps ``inflight`` Export calls in flight until its share is answered,
and reports ``done`` with its tally (or ``error``).
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.context import SpawnContext
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from typing import Any

from _otlp_load import make_request

METRICS_EXPORT = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"
BASE_TIME_NS = 1_767_225_600 * 10**9  # 2026-01-01T00:00:00Z: every run writes the same partition
STARTUP_TIMEOUT_S = 60.0
RPC_TIMEOUT_S = 60.0


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
