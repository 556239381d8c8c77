"""The store: ClickHouse through clickhouse-connect, embedded (chDB) or a server, one code path.

``chdb://PATH`` opens an embedded ClickHouse in this process (a path opens in one process
only); ``http(s)://user:pass@host:8123/db`` talks to a server or a cluster. Everything
above this module sees one `Store` and never asks which.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import clickhouse_connect
from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.exceptions import ClickHouseError, OperationalError

from ridethrough.exporters import schema, schema_cluster
from ridethrough.exporters.store_lock import TurnLock

log = logging.getLogger(__name__)


class StoreUnavailable(Exception):
    """The store could not be reached; the operation may succeed later."""


class StoreError(Exception):
    """The store answered with an error that retrying will not fix."""


def normalise_dsn(dsn: str) -> str:
    """``chdb://rel/path`` → ``chdb:///abs/rel/path``; other DSNs unchanged.

    clickhouse-connect reads ``chdb://name/db`` as an in-memory location, so a relative
    on-disk path has to be made absolute before it is handed over.
    """
    scheme = dsn.split("://", 1)[0].lower() if "://" in dsn else ""
    if scheme != "chdb":
        if scheme not in ("http", "https"):
            raise ValueError(f"store DSN must start with chdb://, http:// or https://, got {redact_dsn(dsn)!r}")
        return dsn
    path = dsn[len("chdb://"):]
    if not path or path == "memory" or path.startswith("memory/"):
        return dsn
    return "chdb://" + os.path.abspath(path)


def redact_dsn(dsn: str) -> str:
    """The DSN with any password replaced by ``***`` (safe for logs and errors)."""
    parts = urlsplit(dsn)
    if parts.password is None:
        return dsn
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return parts._replace(netloc=netloc).geturl()


def is_embedded(dsn: str) -> bool:
    """True for a chDB (in-process) DSN."""
    return dsn.lower().startswith("chdb:")


class Store:
    """One store client, shared by every component of a process.

    The client is opened lazily and reopened after a connection failure, so a store
    that is away at start-up (or goes away later) costs retries, not a crash.
    """

    def __init__(self, dsn: str, *, cluster: str = "", timeout_s: float = 10.0) -> None:
        self._dsn = normalise_dsn(dsn)
        self.cluster = cluster
        self._timeout_s = timeout_s
        self._client: Client | None = None
        # The chDB client is one in-process engine; serialise calls into it, inserts and
        # queries taking turns.
        self._lock = TurnLock()

    @property
    def dsn(self) -> str:
        """The DSN, password redacted."""
        return redact_dsn(self._dsn)

    @property
    def lock(self) -> TurnLock:
        """The lock every call into the client takes (share it with other users of `client`)."""
        return self._lock

    @property
    def embedded(self) -> bool:
        """True when this process owns an embedded chDB store."""
        return is_embedded(self._dsn)

    def client(self) -> Client:
        """The underlying clickhouse-connect client, connecting if needed."""
        with self._lock:
            if self._client is None:
                self._client = self._connect()
            return self._client

    def _connect(self) -> Client:
        try:
            if self.embedded:
                return clickhouse_connect.get_client(dsn=self._dsn)
            return clickhouse_connect.get_client(
                # clickhouse-connect takes whole seconds for the connect timeout (a fraction raises)
                dsn=self._dsn, connect_timeout=max(1, math.ceil(self._timeout_s)), send_receive_timeout=self._timeout_s,
                autogenerate_session_id=False,
            )
        except OperationalError as exc:
            raise StoreUnavailable(f"store {self.dsn} unreachable: {_first_line(exc)}") from exc
        except ClickHouseError as exc:
            raise StoreError(f"store {self.dsn}: {_first_line(exc)}") from exc

    def init_schema(self) -> int:
        """Create every table and view if missing; returns the number of statements run."""
        statements = list(schema.ddl(cluster=self.cluster))
        if self.cluster:
            # 1-minute rollups for dashboards and slow detectors at fleet scale; an embedded or single
            # server store skips them, since their views make every insert about 2.5x the work
            statements += schema_cluster.rollup_ddl(cluster=self.cluster)
        for statement in statements:
            self.command(statement)
        return len(statements) + self._add_projections()

    def _add_projections(self) -> int:
        """Give tables that an older version created the projections they lack; returns the statements run."""
        run = 0
        for table in schema.TABLES:
            if not table.projections:
                continue
            local = f"{table.name}_local" if self.cluster else table.name
            # the table's own statement names its projections on every server version (system.projections
            # is recent)
            _, found = self.query("SELECT create_table_query FROM system.tables WHERE database = currentDatabase() "
                                  "AND name = {t:String}", parameters={"t": local})
            text = found[0][0] if found else ""
            for projection in table.projections:
                if f"PROJECTION {projection.name} " in text or f"PROJECTION {schema.quote(projection.name)} " in text:
                    continue
                for statement in schema.add_projection_sql(table, projection, cluster=self.cluster):
                    self.command(statement)
                    run += 1
        return run

    def ensure_table(self, table: schema.Table) -> None:
        """Create one of the project's own tables if it is missing, or add the columns an older version's
        table lacks (idempotent; ``ON CLUSTER`` when clustered)."""
        for statement in schema.domain_ddl(table, cluster=self.cluster):
            self.command(statement)
        local = f"{table.name}_local" if self.cluster else table.name
        _, rows = self.query("SELECT name FROM system.columns "
                             "WHERE database = currentDatabase() AND table = {t:String}", parameters={"t": local})
        for statement in schema.add_columns_sql(table, (r[0] for r in rows), cluster=self.cluster):
            self.command(statement)

    def command(self, sql: str) -> Any:
        """Run one statement that returns no rows (DDL)."""
        return self._call(lambda c: c.command(sql))

    def query(self, sql: str, *, parameters: dict[str, Any] | None = None,
              settings: dict[str, Any] | None = None) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Run a query; returns (column names, rows)."""
        result = self._call(lambda c: c.query(sql, parameters=parameters, settings=settings))
        return list(result.column_names), list(result.result_rows)

    def insert_columns(self, table: schema.Table, columns: Sequence[Sequence[Any]], *, token: str) -> None:
        """Insert column-oriented rows; ``token`` makes a retried insert a no-op."""
        names = table.insert_columns
        types = [c.type for c in table.columns if c.insert]
        settings = {"insert_deduplication_token": token}
        self._call(lambda c: c.insert(
            table.name, list(columns), column_names=names, column_type_names=types,
            column_oriented=True, settings=settings,
        ), write=True)

    def _call(self, fn: Any, *, write: bool = False) -> Any:
        with self._lock.hold(write=write):
            client = self.client()
            try:
                return fn(client)
            except OperationalError as exc:
                self._drop_client()
                raise StoreUnavailable(f"store {self.dsn} unreachable: {_first_line(exc)}") from exc
            except ClickHouseError as exc:
                raise StoreError(f"store {self.dsn}: {_first_line(exc)}") from exc

    def _drop_client(self) -> None:
        if self._client is not None and not self.embedded:
            try:
                self._client.close()
            except Exception:  # closing a broken connection may fail too; it is gone either way
                log.debug("closing a failed store client raised", exc_info=True)
            self._client = None

    def close(self) -> None:
        """Close the client; an embedded store is released when the process ends."""
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
