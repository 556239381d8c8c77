"""The gateway under bad input, a store that is away, and SIGKILL: clear errors, nothing lost."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2

from tests.conftest import ROOT, read_ready, wait_for
from tests.otlp_util import gauge_request, grpc_export

pytestmark = pytest.mark.integration


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def gateway(spawn, tmp_path: Path):
    ready = tmp_path / "gw.json"
    proc = spawn("gateway", "--store", f"chdb://{tmp_path}/store", "--spool", str(tmp_path / "spool"),
                 "--otlp-listen", "127.0.0.1:0", "--ready-file", str(ready), name="gateway",
                 env={"RIDETHROUGH_GATEWAY_MAX_MESSAGE_BYTES": str(4 << 20)})
    return read_ready(ready, proc)["otlp"], proc


def test_bad_input_gets_documented_codes_and_gateway_keeps_serving(gateway) -> None:
    target, proc = gateway
    assert grpc_export(target, b"\xff\xff\xff\x0f garbage")[0] == "INVALID_ARGUMENT"
    assert grpc_export(target, b"")[0] == "OK"  # an empty request is a valid, empty export

    status, response = grpc_export(target, gauge_request(3, attrs_per_point=10_000))
    assert status == "OK"
    assert response.partial_success.rejected_data_points == 3
    assert "attributes" in response.partial_success.error_message

    status, response = grpc_export(target, gauge_request(4, values=[1.0, float("nan"), float("inf"), 2.0]))
    assert status == "OK"
    assert response.partial_success.rejected_data_points == 2
    assert "non-finite" in response.partial_success.error_message

    big = gauge_request(1)
    big.resource_metrics[0].resource.attributes.add(key="blob").value.string_value = "x" * (5 << 20)
    assert grpc_export(target, big)[0] == "RESOURCE_EXHAUSTED"

    status, response = grpc_export(target, gauge_request(10), compression=grpc.Compression.Gzip)
    assert status == "OK" and response.partial_success.rejected_data_points == 0
    assert proc.alive()


def _write_config(path: Path, store: str) -> None:
    path.write_text(f"gateway:\n  store: \"{store}\"\n  replay_initial_backoff_s: 0.2\n"
                    "  replay_max_backoff_s: 1.0\n  store_timeout_s: 2.0\n")


def _count_rows(store_path: Path, service: str) -> tuple[int, int]:
    """(rows, distinct seq) for one service, read in a fresh process that opens the store."""
    code = (
        "import clickhouse_connect,sys;"
        f"c=clickhouse_connect.get_client(dsn='chdb://{store_path}');"
        "r=c.query(\"SELECT count(), uniqExact(Attributes['seq']) FROM otel_metrics_gauge "
        f"WHERE ServiceName='{service}'\").result_rows[0];print(r[0],r[1])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    rows, distinct = out.stdout.split()
    return int(rows), int(distinct)


class Sender:
    """Sends ``batches`` requests of ``size`` points, retrying each until it is acknowledged."""

    def __init__(self, target: str, *, service: str, batches: int, size: int) -> None:
        self.target, self.service, self.batches, self.size = target, service, batches, size
        self.acked = 0
        self.retries = 0
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        for b in range(self.batches):
            req = gauge_request(self.size, service=self.service, start_seq=b * self.size)
            while grpc_export(self.target, req, timeout_s=10)[0] != "OK":
                self.retries += 1
            self.acked += 1


def test_store_outage_spools_then_replays_exactly_once(spawn, tmp_path: Path) -> None:
    config = tmp_path / "gw.yaml"
    _write_config(config, f"http://127.0.0.1:{_closed_port()}")
    ready = tmp_path / "gw.json"
    spool = tmp_path / "spool"
    proc = spawn("gateway", "--config", str(config), "--spool", str(spool), "--otlp-listen", "127.0.0.1:0",
                 "--ready-file", str(ready), name="gateway")
    target = read_ready(ready, proc)["otlp"]
    for b in range(20):
        status, _ = grpc_export(target, gauge_request(50, service="outage", start_seq=b * 50))
        assert status == "OK", "acknowledged only once durable in the spool"
    assert list(spool.glob("*.spool")), "batches wait in the spool"

    store_path = tmp_path / "store"
    _write_config(config, f"chdb://{store_path}")
    proc.popen.send_signal(signal.SIGHUP)
    wait_for(lambda: not list(spool.glob("*.spool")), timeout_s=60, what="spool drained")
    assert proc.stop() == 0
    assert _count_rows(store_path, "outage") == (1000, 1000)


def test_a_bad_config_on_sighup_keeps_the_running_store(spawn, tmp_path: Path) -> None:
    config = tmp_path / "gw.yaml"
    store_path = tmp_path / "store"
    _write_config(config, f"chdb://{store_path}")
    ready = tmp_path / "gw.json"
    proc = spawn("gateway", "--config", str(config), "--spool", str(tmp_path / "spool"), "--otlp-listen",
                 "127.0.0.1:0", "--ready-file", str(ready), name="gateway")
    target = read_ready(ready, proc)["otlp"]
    config.write_text("gateway:\n  store: [not, a, dsn]\n  batch_max_rows: -3\n")
    proc.popen.send_signal(signal.SIGHUP)
    wait_for(lambda: "config not reloaded" in proc.output(), timeout_s=30, what="the reload refused")
    assert proc.alive(), "a bad edit does not stop the gateway"
    status, _ = grpc_export(target, gauge_request(50, service="kept"))
    assert status == "OK"
    assert proc.stop() == 0
    assert _count_rows(store_path, "kept") == (50, 50), "written to the store it had"


def test_sigkill_mid_stream_then_restart_on_same_spool_loses_and_duplicates_nothing(spawn, tmp_path: Path) -> None:
    config = tmp_path / "gw.yaml"
    _write_config(config, f"http://127.0.0.1:{_closed_port()}")
    spool = tmp_path / "spool"
    ready = tmp_path / "gw.json"
    first = spawn("gateway", "--config", str(config), "--spool", str(spool), "--otlp-listen", "127.0.0.1:0",
                  "--ready-file", str(ready), name="gateway")
    target = read_ready(ready, first)["otlp"]
    sender = Sender(target, service="killed", batches=60, size=20)
    sender.thread.start()
    wait_for(lambda: sender.acked >= 15, what="some batches acknowledged")
    first.kill()
    ready.unlink()

    store_path = tmp_path / "store"
    _write_config(config, f"chdb://{store_path}")  # the restarted gateway finds its store back
    second = spawn("gateway", "--config", str(config), "--spool", str(spool), "--otlp-listen", target,
                   "--ready-file", str(ready), name="gateway")
    read_ready(ready, second)
    sender.thread.join(120)
    assert sender.acked == 60 and sender.retries > 0
    wait_for(lambda: not list(spool.glob("*.spool")), timeout_s=60, what="spool drained")
    assert second.stop() == 0
    assert _count_rows(store_path, "killed") == (1200, 1200)


def test_backpressure_when_store_away_and_spool_full(spawn, tmp_path: Path) -> None:
    ready = tmp_path / "gw.json"
    proc = spawn("gateway", "--store", f"http://127.0.0.1:{_closed_port()}", "--spool", str(tmp_path / "spool"),
                 "--otlp-listen", "127.0.0.1:0", "--ready-file", str(ready), name="gateway",
                 env={"RIDETHROUGH_GATEWAY_SPOOL_MAX_BYTES": "20000", "RIDETHROUGH_GATEWAY_STORE_TIMEOUT_S": "1"})
    target = read_ready(ready, proc)["otlp"]
    codes = [grpc_export(target, gauge_request(100, start_seq=i * 100))[0] for i in range(12)]
    assert "UNAVAILABLE" in codes and codes[0] == "OK"
    status, (details, trailers) = grpc_export(target, gauge_request(100))
    assert status == "UNAVAILABLE" and "spool" in details
    info = error_details_pb2.RetryInfo.FromString(dict(trailers)["google.rpc.retryinfo-bin"])
    assert info.retry_delay.seconds >= 1
    assert proc.alive()
