"""The read-only ClickHouse HTTP endpoint over an owned chDB store.

One chDB store per test module: a process can host one store path at a time, so the module
fixture owns it and closes it at the end. The endpoint is served on port 0.
"""

from __future__ import annotations

import http.client
import json
import shutil
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import clickhouse_connect
import pytest
from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.exceptions import DatabaseError

from ridethrough.exporters.store_http import StoreHttpEndpoint

pytestmark = pytest.mark.integration

HOSTILE = "'; DROP TABLE t; --"
ROWS = [
    (1, "alpha", {"rack": "r1", "zone": "z1"}, datetime(2024, 5, 1, 12, 0, 0, 123456)),
    (2, HOSTILE, {}, datetime(2024, 5, 1, 12, 0, 1)),
    (3, "tab\there \\ back", {"rack": "r2"}, datetime(2024, 5, 1, 12, 0, 2, 5)),
]
COLUMNS = ["id", "name", "attrs", "ts"]


@pytest.fixture(scope="module")
def owner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Client]:
    """The one client that owns the store, as `ridethrough server` would hold it."""
    path = tmp_path_factory.mktemp("store_http") / "store"
    client = clickhouse_connect.get_client(dsn=f"chdb://{path}")
    client.command(
        "CREATE TABLE t (id UInt32, name String, attrs Map(LowCardinality(String), String),"
        " ts DateTime64(9)) ENGINE = MergeTree ORDER BY id"
    )
    client.insert("t", [list(row) for row in ROWS], column_names=COLUMNS)
    yield client
    client.close()


@pytest.fixture(scope="module")
def endpoint(owner: Client) -> Iterator[tuple[str, int]]:
    with StoreHttpEndpoint(client=owner, host="127.0.0.1", port=0) as served:
        yield served.address


@pytest.fixture(scope="module")
def reader(endpoint: tuple[str, int]) -> Iterator[Client]:
    """clickhouse-connect's HTTP client with default options, as another process would open it."""
    client = clickhouse_connect.get_client(host=endpoint[0], port=endpoint[1])
    yield client
    client.close()


def fetch(
    endpoint: tuple[str, int],
    query: str = "",
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    path: str = "/",
) -> tuple[int, bytes, dict[str, str]]:
    """One raw HTTP request; returns status, body and headers, for errors too."""
    url = f"http://{endpoint[0]}:{endpoint[1]}{path}" + (f"?{query}" if query else "")
    request = urllib.request.Request(url, data=body, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, error.read(), dict(error.headers)


def table_rows(owner: Client) -> list[tuple[object, ...]]:
    return [tuple(row) for row in owner.query("SELECT * FROM t ORDER BY id").result_rows]


# --- clickhouse-connect's HTTP client, default options ---------------------------------------


def test_reader_gets_rows_back(reader: Client, owner: Client) -> None:
    rows = reader.query("SELECT * FROM t ORDER BY id").result_rows
    assert [tuple(row) for row in rows] == ROWS
    assert rows == table_rows(owner)
    assert reader.command("SELECT 1") == 1
    assert reader.ping()
    assert reader.query("SELECT * FROM t LIMIT 0").column_names == tuple(COLUMNS)
    assert reader.command("SELECT count() FROM t") == len(ROWS)
    assert reader.query("SELECT toTypeName(attrs), toTypeName(ts) FROM t LIMIT 1").result_rows == [
        ("Map(LowCardinality(String), String)", "DateTime64(9)")
    ]


def test_datetime64_keeps_nanoseconds(reader: Client) -> None:
    sql = "SELECT toUnixTimestamp64Nano(ts) FROM t WHERE id = 3"
    assert reader.command(sql) == int(datetime(2024, 5, 1, 12, 0, 2).timestamp()) * 10**9 + 5000


@pytest.mark.parametrize("value", [row[1] for row in ROWS])
def test_bound_values_arrive_exactly(reader: Client, owner: Client, value: str) -> None:
    expected = [(row[0],) for row in ROWS if row[1] == value]
    server_side = reader.query("SELECT id FROM t WHERE name = {v:String}", parameters={"v": value})
    client_side = reader.query("SELECT id FROM t WHERE name = %(v)s", parameters={"v": value})
    assert server_side.result_rows == expected
    assert client_side.result_rows == expected
    assert owner.command("EXISTS TABLE t") == 1
    assert table_rows(owner) == [tuple(row) for row in ROWS]


def test_long_bindings_travel_as_form_fields(endpoint: tuple[str, int]) -> None:
    """Past 4 KiB of bindings clickhouse-connect switches to multipart/form-data."""
    names = [f"name-{i:05d}" for i in range(600)] + ["alpha"]
    client = clickhouse_connect.get_client(host=endpoint[0], port=endpoint[1])
    try:
        result = client.query("SELECT id FROM t WHERE has({n:Array(String)}, name)", parameters={"n": names})
        assert result.result_rows == [(1,)]
    finally:
        client.close()


def test_reader_sees_engine_errors(reader: Client) -> None:
    with pytest.raises(DatabaseError) as caught:
        reader.query("SELECT * FROM no_such_table")
    assert caught.value.code == 60
    assert "UNKNOWN_TABLE" in str(caught.value)


def test_concurrent_readers(endpoint: tuple[str, int]) -> None:
    def counts(_: int) -> list[object]:
        client = clickhouse_connect.get_client(host=endpoint[0], port=endpoint[1])
        try:
            return [client.query("SELECT count() FROM t").result_rows[0][0] for _ in range(5)]
        finally:
            client.close()

    with ThreadPoolExecutor(max_workers=6) as pool:
        assert list(pool.map(counts, range(6))) == [[len(ROWS)] * 5] * 6


# --- writes are refused ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "statement",
    [
        "DROP TABLE t",
        "CREATE TABLE u (a UInt8) ENGINE = Memory",
        "INSERT INTO t (id, name) VALUES (9, 'x')",
        "ALTER TABLE t DELETE WHERE 1",
        "TRUNCATE TABLE t",
        "OPTIMIZE TABLE t FINAL",
        "SYSTEM DROP MARK CACHE",
        "SET readonly = 0",
        "KILL QUERY WHERE 1",
        "/* a comment */ -- and another\n DROP TABLE t",
        "SELECT 1; DROP TABLE t",
        "SELECT 1; INSERT INTO t (id, name) VALUES (9, 'x')",
        "SELECT 'a;b' FORMAT TSV;\nDROP TABLE t",
        "/* /* nested */ SELECT */ DROP TABLE t",
    ],
)
def test_write_statements_are_refused(reader: Client, owner: Client, statement: str) -> None:
    with pytest.raises(DatabaseError, match=r"(?i)readonly") as caught:
        reader.command(statement)
    assert caught.value.code == 164
    assert table_rows(owner) == [tuple(row) for row in ROWS]


@pytest.mark.parametrize("compress", [True, False])
def test_insert_is_refused(endpoint: tuple[str, int], owner: Client, compress: bool) -> None:
    client = clickhouse_connect.get_client(host=endpoint[0], port=endpoint[1], compress=compress)
    try:
        with pytest.raises(DatabaseError, match=r"(?i)readonly"):
            client.insert("t", [[9, "x", {}, datetime(2024, 1, 1)]], column_names=COLUMNS)
    finally:
        client.close()
    assert table_rows(owner) == [tuple(row) for row in ROWS]


def test_select_into_outfile_is_refused(endpoint: tuple[str, int], tmp_path: Path) -> None:
    target = tmp_path / "leak.tsv"
    status, body, _ = fetch(endpoint, body=f"SELECT * FROM t INTO OUTFILE '{target}'".encode())
    assert status == 403 and b"READONLY" in body
    assert not target.exists()


def test_readonly_cannot_be_lifted(endpoint: tuple[str, int], owner: Client) -> None:
    for query in ("readonly=0", "readonly=2", "allow_ddl=1"):
        status, body, headers = fetch(endpoint, f"{query}&query=SELECT+1")
        assert (status, headers["X-ClickHouse-Exception-Code"]) == (403, "164"), body
    for sql in (
        b"SELECT getSetting('readonly') FORMAT TSV SETTINGS readonly = 0",
        b"SELECT getSetting('readonly') SETTINGS readonly = 0",
    ):
        status, body, _ = fetch(endpoint, body=sql)
        assert status == 403 and b"READONLY" in body, body
    status, body, _ = fetch(endpoint, "readonly=1", body=b"SELECT getSetting('readonly')")
    assert (status, body) == (200, b"1\n")
    # The owner's own session is untouched: the endpoint never SETs anything on it.
    assert owner.command("SELECT getSetting('readonly')") == 0
    owner.command("CREATE TABLE scratch (a UInt8) ENGINE = Memory")
    owner.command("DROP TABLE scratch")


# --- raw HTTP, as curl speaks it ------------------------------------------------------------


def test_ping_and_root(endpoint: tuple[str, int]) -> None:
    assert fetch(endpoint, path="/ping")[:2] == (200, b"Ok.\n")
    assert fetch(endpoint)[:2] == (200, b"Ok.\n")
    assert fetch(endpoint, path="/nowhere")[0] == 404


def test_get_query_with_headers(endpoint: tuple[str, int]) -> None:
    status, body, headers = fetch(endpoint, "query=SELECT+1&query_id=q-42")
    assert (status, body) == (200, b"1\n")
    assert headers["X-ClickHouse-Format"] == "TabSeparated"
    assert headers["X-ClickHouse-Query-Id"] == "q-42"
    assert headers["X-ClickHouse-Timezone"]
    assert headers["X-ClickHouse-Server-Display-Name"]
    assert "elapsed_ns" in json.loads(headers["X-ClickHouse-Summary"])
    assert headers["Content-Type"].startswith("text/tab-separated-values")


def test_post_formats(endpoint: tuple[str, int]) -> None:
    status, body, headers = fetch(endpoint, body=b"SELECT id, name FROM t ORDER BY id FORMAT JSON")
    assert status == 200 and headers["X-ClickHouse-Format"] == "JSON"
    assert [row["name"] for row in json.loads(body)["data"]] == [row[1] for row in ROWS]
    status, body, _ = fetch(endpoint, body=b"SELECT id FROM t ORDER BY id FORMAT CSV")
    assert (status, body) == (200, b"1\n2\n3\n")
    status, body, _ = fetch(endpoint, "default_format=JSONEachRow", body=b"SELECT id FROM t WHERE id = 1")
    assert (status, json.loads(body)) == (200, {"id": 1})
    status, body, _ = fetch(endpoint, "query=SELECT+id+FROM+t", body=b"WHERE id = 2 FORMAT TSV")
    assert (status, body) == (200, b"2\n")


@pytest.mark.parametrize(
    "fmt", ["TabSeparated", "CSVWithNames", "RowBinaryWithNamesAndTypes", "Native", "JSONEachRow", "Values"]
)
def test_bytes_match_what_the_owner_reads(endpoint: tuple[str, int], owner: Client, fmt: str) -> None:
    sql = "SELECT * FROM t ORDER BY id"
    status, body, headers = fetch(endpoint, body=f"{sql} FORMAT {fmt}".encode())
    assert (status, headers["X-ClickHouse-Format"]) == (200, fmt)
    assert body == owner.raw_query(sql, fmt=fmt)


def test_url_bindings_are_escaped_text(endpoint: tuple[str, int]) -> None:
    """`param_<name>` values are ClickHouse escaped text, handed to the engine unchanged."""
    query = urllib.parse.urlencode({"param_v": "tab\\there \\\\ back", "param_n": "\\N"})
    sql = b"SELECT id, isNull({n:Nullable(String)}) FROM t WHERE name = {v:String} FORMAT CSV"
    assert fetch(endpoint, query, body=sql)[:2] == (200, b"3,1\n")


def test_url_settings_apply_to_the_query(endpoint: tuple[str, int]) -> None:
    status, body, headers = fetch(
        endpoint,
        "max_threads=3&session_timezone=Asia%2FTokyo",
        body=b"SELECT getSetting('max_threads'), timezone() FORMAT CSV",
    )
    assert (status, body) == (200, b'3,"Asia/Tokyo"\n')
    assert headers["X-ClickHouse-Timezone"] == "Asia/Tokyo"


def test_oversized_body_is_413(endpoint: tuple[str, int]) -> None:
    body = b"SELECT 1 /*" + b"x" * (2 << 20) + b"*/"
    status, text, _ = fetch(endpoint, body=body)
    assert status == 413 and b"QUERY_IS_TOO_LARGE" in text
    assert fetch(endpoint, path="/ping")[:2] == (200, b"Ok.\n")


@pytest.mark.parametrize(
    "body",
    [b"\x00\xff\xfe garbage \x80\x81", b"SELECT '\xff\xfe'", b"", b"SELECT (", b"   ", b"SELECT 1 /* open"],
)
def test_malformed_queries_get_an_error_and_serving_goes_on(endpoint: tuple[str, int], body: bytes) -> None:
    status, text, headers = fetch(endpoint, body=body, headers={"Content-Type": "application/octet-stream"})
    assert 400 <= status < 600 and text.startswith(b"Code: ")
    assert "X-ClickHouse-Exception-Code" in headers
    assert fetch(endpoint, "query=SELECT+2")[:2] == (200, b"2\n")


def test_malformed_http_does_not_stop_the_server(endpoint: tuple[str, int]) -> None:
    connection = http.client.HTTPConnection(*endpoint, timeout=30)
    connection.putrequest("POST", "/")
    connection.putheader("Content-Length", "not-a-number")
    connection.endheaders()
    assert connection.getresponse().status == 400
    connection.close()
    chunked = http.client.HTTPConnection(*endpoint, timeout=30)
    chunked.request("POST", "/?default_format=CSV", body=iter([b"SELECT ", b"40 + 2"]), encode_chunked=True)
    response = chunked.getresponse()
    assert (response.status, response.read()) == (200, b"42\n")
    chunked.close()
    assert fetch(endpoint, path="/ping")[:2] == (200, b"Ok.\n")


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl(endpoint: tuple[str, int]) -> None:
    base = f"http://{endpoint[0]}:{endpoint[1]}"
    got = subprocess.run(["curl", "-sS", f"{base}/?query=SELECT+1"], capture_output=True, timeout=30, check=True)
    assert got.stdout == b"1\n"
    sql = b"SELECT id, name FROM t WHERE id = 1 FORMAT JSON"
    got = subprocess.run(
        ["curl", "-sS", "--data-binary", "@-", base], input=sql, capture_output=True, timeout=30, check=True
    )
    assert json.loads(got.stdout)["data"] == [{"id": 1, "name": "alpha"}]


# --- the point of it all: another process reads the store this one owns --------------------

READER_SCRIPT = """
import json, sys
import clickhouse_connect
client = clickhouse_connect.get_client(host=sys.argv[1], port=int(sys.argv[2]))
rows = client.query("SELECT id, name, attrs FROM t ORDER BY id").result_rows
print(json.dumps([list(row) for row in rows]))
"""


def test_another_process_reads_the_owned_store(endpoint: tuple[str, int]) -> None:
    done = subprocess.run(
        [sys.executable, "-c", READER_SCRIPT, endpoint[0], str(endpoint[1])],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [[row[0], row[1], row[2]] for row in ROWS]


def test_stop_closes_the_port(owner: Client) -> None:
    with StoreHttpEndpoint(client=owner, host="127.0.0.1", port=0) as served:
        address = served.address
        assert fetch(address, path="/ping")[0] == 200
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://{address[0]}:{address[1]}/ping", timeout=5)
