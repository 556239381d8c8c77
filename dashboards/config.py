"""The dashboard's config model, and where its basic-auth password comes from.

The password is a secret, so the config never holds it: ``basic_auth_password`` names where it
is (``env:VAR`` or ``file:PATH``), as PagerDuty integration keys do, and `read_password` reads it
once, at start.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ridethrough.config import Loaded, load

SERVERS = ("gunicorn", "dash")
_REF_KINDS = ("env:", "file:")


def _help(text: str, **checks: Any) -> dict[str, Any]:
    return {"help": text, **checks}


# ridethrough.settings registers this model, so its checks are imported when they run, not at import.
def check_listen(text: str) -> None:
    """``HOST:PORT`` (IPv6 in brackets; port 0 picks a free port)."""
    from ridethrough.settings import parse_hostport

    parse_hostport(text)


def check_store(dsn: str) -> None:
    """Empty (the gateway's store) or a store DSN."""
    from ridethrough.settings import check_store_dsn

    if dsn:
        check_store_dsn(dsn)


def check_secret_ref(ref: str) -> None:
    """Empty, ``env:VAR`` or ``file:PATH`` (the value is never echoed: it may be a pasted password)."""
    if ref and (not ref.startswith(_REF_KINDS) or not ref.partition(":")[2]):
        raise ValueError("expected env:VAR or file:PATH naming where the password is (the password itself "
                         "never goes in the config)")


@dataclass(frozen=True, slots=True, kw_only=True)
class DashboardConfig:
    """The dashboard: fleet, fabric, GPU, incident and goodput pages over the store (Dash + Plotly)."""

    listen: str = field(default="127.0.0.1:8050", metadata=_help(
        "Where the dashboard serves HTTP, HOST:PORT (port 0 picks a free port).", check=check_listen))
    store: str = field(default="", metadata=_help(
        "ClickHouse DSN the pages read: usually the server's read-only endpoint http://HOST:PORT; "
        "empty: gateway.store. An embedded chdb:// store opens in one process only.", check=check_store, dsn=True))
    store_timeout_s: float = field(default=10.0, metadata=_help(
        "Timeout of one store request, in seconds.", min=0.01))
    cluster: str = field(default="", metadata=_help("Fleet cluster the pages show; empty: every cluster."))
    fabric_map_file: str = field(default="", metadata=_help(
        "JSON fabric map (ridethrough.detectors.fabric_map; the lab writes fabric.json) for the Fabric page's "
        "topology graph and per-link rows; empty: no graph, errors per NIC."))
    window_s: float = field(default=3600.0, metadata=_help(
        "Default time range of the charts, in seconds (each page has a selector).", min=60, max=30 * 86400))
    refresh_s: float = field(default=15.0, metadata=_help(
        "Seconds between automatic refreshes of the figures (no page reload); 0 turns it off.", min=0))
    agent_stale_s: float = field(default=30.0, metadata=_help(
        "An agent whose newest report is older than this is stale (amber on the Fleet page); three times this: "
        "red.", min=1))
    cache_s: float = field(default=10.0, metadata=_help(
        "Seconds a query's result is reused for every viewer and page that asks the same (figures are at most "
        "this old); 0 turns the cache off.", min=0, max=3600))
    max_points: int = field(default=240, metadata=_help(
        "Points per series a chart gets at most; the store downsamples longer series in SQL.", min=10, max=5000))
    server: str = field(default="gunicorn", metadata=_help(
        "HTTP server: gunicorn (production WSGI) or dash (Dash's own development server, for demos).",
        choices=SERVERS))
    workers: int = field(default=2, metadata=_help(
        "gunicorn worker processes (1 with an embedded chdb:// store, which one process owns).", min=1, max=64))
    threads: int = field(default=4, metadata=_help("Threads per gunicorn worker.", min=1, max=64))
    basic_auth_user: str = field(default="", metadata=_help(
        "HTTP basic-auth user every request must give; empty turns authentication off."))
    basic_auth_password: str = field(default="", metadata=_help(
        "Where the basic-auth password is: env:VAR or file:PATH (never the password itself).",
        check=check_secret_ref))

    def __post_init__(self) -> None:
        if self.server not in SERVERS:
            raise ValueError(f"server must be one of {', '.join(SERVERS)}, got {self.server!r}")
        if bool(self.basic_auth_user) != bool(self.basic_auth_password):
            raise ValueError("basic_auth_user and basic_auth_password go together: set both, or neither")


def load_dashboard_config(*, file: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None,
                          flags: Mapping[str, object] | None = None) -> Loaded[DashboardConfig]:
    """The dashboard's config: flag > env (``RIDETHROUGH_DASHBOARD_*``) > the file's ``dashboard`` section >
    default. A config file may hold the sections of every component."""
    from ridethrough.settings import COMPONENTS

    return load(DashboardConfig, component="dashboard", file=file, env=env, flags=flags,
                known_sections=[*COMPONENTS, "dashboard"])


class SecretError(ValueError):
    """A secret reference that cannot be read; the message never holds the secret."""


def read_password(ref: str, env: Mapping[str, str] | None = None) -> str:
    """The password ``ref`` names: ``env:VAR`` (the variable) or ``file:PATH`` (the file's text, stripped)."""
    kind, _, where = ref.partition(":")
    source = os.environ if env is None else env
    if kind == "env":
        value = source.get(where)
        if value is None:
            raise SecretError(f"basic-auth password {ref}: environment variable {where} is not set")
    elif kind == "file":
        try:
            value = Path(where).read_text()
        except OSError as exc:
            raise SecretError(f"basic-auth password {ref}: cannot read the file ({exc.strerror})") from None
    else:
        raise SecretError("basic-auth password reference must be env:VAR or file:PATH")
    value = value.strip()
    if not value:
        raise SecretError(f"basic-auth password {ref} is empty")
    return value
