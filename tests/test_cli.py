"""The command line: config errors stop at start with one precise line; config show; query."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, read_ready
from tests.otlp_util import gauge_request, grpc_export


def _run(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ridethrough", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})})


def test_unknown_key_in_file_stops_with_suggestion(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("gateway:\n  otlp_listn: 127.0.0.1:0\n")
    out = _run("gateway", "--config", str(cfg))
    assert out.returncode == 2
    assert "unknown key 'otlp_listn'" in out.stderr and "did you mean 'otlp_listen'" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_wrong_type_from_env_names_key_and_origin() -> None:
    out = _run("gateway", env={"RIDETHROUGH_GATEWAY_WORKERS": "many"})
    assert out.returncode == 2
    assert "gateway.workers" in out.stderr and "RIDETHROUGH_GATEWAY_WORKERS" in out.stderr


def test_precedence_flag_over_env_over_file(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("agent:\n  cluster: from-file\n  rack: file-rack\n  pod: file-pod\n")
    out = _run("config", "show", "agent", "--config", str(cfg),
               env={"RIDETHROUGH_AGENT_RACK": "env-rack", "RIDETHROUGH_AGENT_POD": "env-pod"})
    assert out.returncode == 0, out.stderr
    lines = {line.split()[0]: line for line in out.stdout.splitlines() if line and not line.startswith("#")}
    assert "from-file" in lines["cluster"] and f"file:{cfg}" in lines["cluster"]
    assert "env-rack" in lines["rack"] and "env:RIDETHROUGH_AGENT_RACK" in lines["rack"]
    assert "default" in lines["gateway"]


def test_config_show_never_prints_a_store_password() -> None:
    out = _run("config", "show", "gateway", env={"RIDETHROUGH_GATEWAY_STORE": "http://u:s3cret@db:8123/x"})
    assert out.returncode == 0 and "s3cret" not in out.stdout and "u:***@db" in out.stdout


@pytest.mark.integration
def test_query_reads_a_running_embedded_store_through_the_server(spawn, tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    proc = spawn("server", "--store", f"chdb://{tmp_path}/store", "--spool", str(tmp_path / "spool"),
                 "--otlp-listen", "127.0.0.1:0", "--store-http-listen", "127.0.0.1:0", "--ready-file", str(ready))
    addr = read_ready(ready, proc)
    assert grpc_export(addr["otlp"], gauge_request(3, service="q"))[0] == "OK"
    sql = "SELECT Attributes['seq'] AS seq, Value FROM otel_metrics_gauge WHERE ServiceName = 'q' ORDER BY seq"
    out = _run("query", sql, "--store", addr["store_http"], "--format", "csv")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["seq,Value", "0,0.0", "1,1.0", "2,2.0"]
    refused = _run("query", "DROP TABLE otel_metrics_gauge", "--store", addr["store_http"])
    assert refused.returncode == 2 and "only SELECT" in refused.stderr
    again = _run("query", "SELECT count() FROM otel_metrics_gauge", "--store", addr["store_http"], "--format", "json")
    assert '"count()": 3' in again.stdout
