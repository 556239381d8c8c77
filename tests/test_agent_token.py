"""An agent with an ingest token is stored under its tenant; one without is refused by a gateway that
requires tokens; the token never shows in either process's output."""

from __future__ import annotations

from pathlib import Path

import clickhouse_connect
import pytest

from ridethrough.exporters.ingest_auth import TENANT_ATTRIBUTE
from ridethrough.wiring import read_token
from tests.conftest import FIXTURES, read_ready, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.e2e]

TOKEN = "acme-token-0123456789abcdef0123456789abcdef"


def test_a_tokened_agent_lands_under_its_tenant_and_a_tokenless_one_is_refused(spawn, tmp_path: Path) -> None:
    ready = tmp_path / "server.json"
    server = spawn("server", "--store", f"chdb://{tmp_path}/store", "--spool", str(tmp_path / "spool"),
                   "--otlp-listen", "127.0.0.1:0", "--store-http-listen", "127.0.0.1:0", "--ready-file", str(ready),
                   env={"RIDETHROUGH_GATEWAY_REQUIRE_TOKEN": "true", "RIDETHROUGH_INGEST_TOKENS": f"acme={TOKEN}",
                        "RIDETHROUGH_CONTROLLER_ENABLED": "false"}, name="server")
    addresses = read_ready(ready, server)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    sysfs = str(FIXTURES / "sysfs" / "ib_host")
    common = ("agent", "--gateway", addresses["otlp"], "--sysfs-root", sysfs, "--interval", "0.2",
              "--export-interval", "0.3")
    with_token = spawn(*common, "--node-id", "tokened", env={"RIDETHROUGH_AGENT_INGEST_TOKEN_FILE": str(token_file)},
                       name="tokened")
    without = spawn(*common, "--node-id", "tokenless", name="tokenless")
    host, port = addresses["store_http"].removeprefix("http://").rsplit(":", 1)
    db = clickhouse_connect.get_client(host=host, port=int(port))

    def nodes() -> dict[str, str]:
        rows = db.query("SELECT ResourceAttributes['ridethrough.node.id'], any(ResourceAttributes[{t:String}]) "
                        "FROM otel_metrics_sum GROUP BY 1", parameters={"t": TENANT_ATTRIBUTE}).result_rows
        return dict(rows) or {}

    wait_for(lambda: nodes() or None, timeout_s=60, what="the tokened agent's rows")
    wait_for(lambda: "unauthenticated" in without.output().lower() or None, timeout_s=60,
             what="the tokenless agent told it is refused")
    landed = nodes()
    assert landed == {"tokened": "acme"}
    for proc in (server, with_token, without):
        assert TOKEN not in proc.output()


def test_a_token_file_must_hold_one_token(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("  secret-token \n")
    assert read_token(str(path)) == "secret-token"
    path.write_text("two tokens\n")
    with pytest.raises(ValueError, match="one token") as err:
        read_token(str(path))
    assert "two" not in str(err.value)
    with pytest.raises(ValueError, match="cannot read"):
        read_token(str(tmp_path / "missing"))
