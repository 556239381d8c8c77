"""Nothing lost, nothing done twice: a steady, counted stream through a gateway that is killed, loses its store
for 60 s, or runs out of spool disk.

The stream sends numbered requests at a steady pace, each retried until acknowledged (as an OTLP
exporter does), and keeps the books: per series, how many points and the sum of their values. After
each fault the gateway recovers, drains its spool, and a fresh process reads the store: every
series must hold exactly the acknowledged points (count, sum, distinct sequence numbers), and every
refusal the sender met must be one the gateway counted.

The store is cut by pointing a running gateway at a closed port (SIGHUP reloads the store DSN) and
back: the real connection-refused path, as no ClickHouse server is at hand to cut a network to. The
spool disk is a 256 KiB tmpfs where mounting one works (root), else the spool's own byte cap.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

from ridethrough.exporters.rows import kv
from tests.conftest import ROOT, Proc, read_ready, wait_for
from tests.otlp_util import METRICS_EXPORT

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SERIES = 5
POINTS = 40  # per request, spread over the series
OUTAGE_S = 60.0
T0 = 1_767_225_600 * 10**9


class Stream:
    """Numbered requests at a steady pace, each retried until acknowledged; the books by series."""

    def __init__(self, target: str, *, service: str, interval_s: float = 0.02) -> None:
        self.target, self.service, self.interval_s = target, service, interval_s
        self.acked = 0
        self.codes: Counter[str] = Counter()  # every non-OK answer, by status
        self.expected = {f"s{i}": [0, 0.0] for i in range(SERIES)}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-stream", daemon=True)
        self._channel = grpc.insecure_channel(target)
        self._call = self._channel.unary_unary(METRICS_EXPORT, request_serializer=None, response_deserializer=None)

    def request(self, n: int) -> bytes:
        req = ExportMetricsServiceRequest()
        rm = req.resource_metrics.add()
        rm.resource.attributes.extend([kv("service.name", self.service), kv("host.name", "chaos")])
        metric = rm.scope_metrics.add().metrics.add(name="chaos.counted", unit="1")
        for i in range(POINTS):
            seq = n * POINTS + i
            p = metric.gauge.data_points.add(time_unix_nano=T0 + seq, as_double=float(seq))
            p.attributes.extend([kv("series", f"s{i % SERIES}"), kv("seq", str(seq))])
        return req.SerializeToString()

    def _send(self, raw: bytes) -> None:
        while True:
            try:
                self._call(raw, timeout=30)
                return
            except grpc.RpcError as err:
                self.codes[err.code().name] += 1
                delay = 0.2
                retry = dict(err.trailing_metadata() or ()).get("google.rpc.retryinfo-bin")
                if retry:
                    d = error_details_pb2.RetryInfo.FromString(retry).retry_delay
                    delay = min(1.0, d.seconds + d.nanos / 1e9)
                time.sleep(delay)

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            self._send(self.request(n))
            for i in range(POINTS):
                books = self.expected[f"s{i % SERIES}"]
                books[0] += 1
                books[1] += float(n * POINTS + i)
            self.acked += 1
            n += 1
            time.sleep(self.interval_s)

    def __enter__(self) -> Stream:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(120)
        self._channel.close()
        assert not self._thread.is_alive(), "the last request was never acknowledged"

    def waits_for(self, more: int, *, timeout_s: float = 60) -> None:
        """Block until ``more`` further requests are acknowledged."""
        goal = self.acked + more
        wait_for(lambda: self.acked >= goal, timeout_s=timeout_s, what=f"{more} more requests acknowledged")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(path: Path, store: str, **extra: object) -> None:
    lines = [f'  store: "{store}"', "  replay_initial_backoff_s: 0.2", "  replay_max_backoff_s: 2.0",
             "  store_timeout_s: 2.0", *(f"  {k}: {v}" for k, v in extra.items())]
    path.write_text("gateway:\n" + "\n".join(lines) + "\n")


class Gateway:
    """``ridethrough gateway`` processes on one config, spool and OTLP port (restarts keep the port)."""

    def __init__(self, spawn: Callable[..., Proc], tmp_path: Path, store: str, spool: Path, **extra: object) -> None:
        self.spawn, self.tmp, self.spool = spawn, tmp_path, spool
        self.config = tmp_path / "gw.yaml"
        self.store_path = tmp_path / "store"
        self.extra = extra
        self.set_store(store)
        self.listen = "127.0.0.1:0"
        self.proc: Proc | None = None
        self.addresses: dict[str, str] = {}

    def set_store(self, store: str) -> None:
        _config(self.config, store, **self.extra)

    def start(self) -> dict[str, str]:
        ready = self.tmp / "ready.json"
        ready.unlink(missing_ok=True)
        self.proc = self.spawn("gateway", "--config", str(self.config), "--spool", str(self.spool),
                               "--otlp-listen", self.listen, "--metrics-listen", "127.0.0.1:0",
                               "--ready-file", str(ready), name="gateway")
        self.addresses = read_ready(ready, self.proc)
        self.listen = self.addresses["otlp"]  # a restart serves the senders' address
        return self.addresses

    def reload(self, store: str) -> None:
        assert self.proc is not None
        self.set_store(store)
        self.proc.popen.send_signal(signal.SIGHUP)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        with urllib.request.urlopen(f"http://{self.addresses['metrics']}/metrics", timeout=10) as resp:
            for line in resp.read().decode().splitlines():
                if line and not line.startswith("#"):
                    sample, _, value = line.rpartition(" ")
                    out[sample] = float(value)
        return out

    def spool_empty(self) -> bool:
        return not list(self.spool.glob("*.spool"))

    def books(self, service: str) -> dict[str, list[float]]:
        """Per series [points, sum of values, distinct seq], read by a fresh process from the store."""
        assert self.proc is not None and self.proc.stop() == 0, "the gateway exits cleanly"
        code = (
            "import clickhouse_connect,json;"
            f"c=clickhouse_connect.get_client(dsn='chdb://{self.store_path}');"
            "r=c.query(\"SELECT Attributes['series'], count(), sum(Value), uniqExact(Attributes['seq']) "
            f"FROM otel_metrics_gauge WHERE ServiceName='{service}' GROUP BY 1\").result_rows;"
            "print(json.dumps({s: [n, v, u] for s, n, v, u in r}))"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        return {k: [float(x) for x in v] for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def assert_exactly_once(stream: Stream, books: dict[str, list[float]]) -> None:
    expected = {s: [float(n), total, float(n)] for s, (n, total) in stream.expected.items()}
    assert books == expected, "per series (points, sum, distinct seq): stored == acknowledged"


def test_sigkill_mid_stream_then_restart_loses_and_duplicates_nothing(spawn, tmp_path: Path) -> None:
    gw = Gateway(spawn, tmp_path, f"chdb://{tmp_path / 'store'}", tmp_path / "spool")
    addresses = gw.start()
    with Stream(addresses["otlp"], service="killed") as stream:
        stream.waits_for(50)
        assert gw.proc is not None
        gw.proc.kill()
        time.sleep(1.0)  # the stream meets a dead gateway
        gw.start()
        stream.waits_for(50)
    assert sum(stream.codes.values()) > 0, "the kill was felt"
    wait_for(gw.spool_empty, timeout_s=30, what="spool drained")
    assert_exactly_once(stream, gw.books("killed"))


def test_store_unreachable_for_60_s_spools_then_replays_exactly_once(spawn, tmp_path: Path) -> None:
    store = f"chdb://{tmp_path / 'store'}"
    gw = Gateway(spawn, tmp_path, store, tmp_path / "spool")
    addresses = gw.start()
    with Stream(addresses["otlp"], service="outage") as stream:
        stream.waits_for(30)
        gw.reload(f"http://127.0.0.1:{_closed_port()}/")
        wait_for(lambda: gw.metrics().get("ridethrough_gateway_spooled_batches_total", 0) > 0, timeout_s=90,
                 what="batches spooled")
        during = stream.acked
        time.sleep(OUTAGE_S)
        assert stream.acked - during > 100, "acknowledged from the spool throughout the outage"
        gw.reload(store)
        wait_for(gw.spool_empty, timeout_s=60, what="spool replayed")
        stream.waits_for(30)
    page = gw.metrics()
    assert page["ridethrough_gateway_replayed_batches_total"] == page["ridethrough_gateway_spooled_batches_total"]
    assert page.get("ridethrough_gateway_quarantined_batches_total", 0) == 0
    assert_exactly_once(stream, gw.books("outage"))


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[tuple[Path, bool]]:
    """A 256 KiB tmpfs for the spool (True) or, where mounting is not allowed, a plain folder (False)."""
    where = tmp_path / "spool"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)],
                             capture_output=True).returncode == 0
    yield where, mounted
    if mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_a_full_spool_disk_means_backpressure_then_recovery_with_nothing_lost(
        spawn, tmp_path: Path, small_disk: tuple[Path, bool]) -> None:
    spool, mounted = small_disk
    # On the tmpfs the disk fills first (ENOSPC); on a plain folder, the spool's byte cap does.
    cap = (1 << 30) if mounted else 256 << 10
    store = f"chdb://{tmp_path / 'store'}"
    gw = Gateway(spawn, tmp_path, f"http://127.0.0.1:{_closed_port()}/", spool, spool_max_bytes=cap)
    addresses = gw.start()
    with Stream(addresses["otlp"], service="diskfull", interval_s=0.005) as stream:
        wait_for(lambda: stream.codes["UNAVAILABLE"] >= 5, timeout_s=120, what="the gateway refusing")
        stuck = stream.acked
        time.sleep(3.0)
        assert stream.acked == stuck, "nothing acknowledged while the spool is full"
        refused = gw.metrics()['ridethrough_gateway_requests_total{code="UNAVAILABLE",signal="metrics"}']
        assert refused >= stream.codes["UNAVAILABLE"], "every refusal the sender met is counted by the gateway"
        gw.reload(store)
        wait_for(gw.spool_empty, timeout_s=60, what="spool replayed")
        stream.waits_for(50)
    assert not list(spool.glob(".tmp-*")), "a write that failed for want of space leaves nothing behind"
    assert gw.metrics().get("ridethrough_gateway_quarantined_batches_total", 0) == 0
    assert_exactly_once(stream, gw.books("diskfull"))
