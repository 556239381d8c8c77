"""Who may write to the gateway: bearer tokens per tenant (and cluster), optional mutual TLS, tenant stamping.

An OTLP client sends ``authorization: Bearer <token>`` as gRPC metadata (the OpenTelemetry SDK
exporters' ``headers=``, the Collector's ``bearertokenauth`` extension, `bearer_metadata` here).
Tokens come from a file (a mounted Kubernetes Secret works: it is re-read when it changes) and
an environment variable, one ``TENANT[/CLUSTER]=TOKEN`` entry per line or comma-separated::

    # tenant/cluster = token (at least 32 characters; `openssl rand -hex 32` makes one)
    acme/lab-a=4f9c...e1
    globex=8a2d...07        # any cluster: the sender's own ridethrough.cluster is kept

The gateway *stamps* every accepted request: resource attribute ``ridethrough.tenant`` is set
to the token's tenant, and ``ridethrough.cluster`` to its cluster when the token names one;
whatever the sender wrote under those keys is dropped first. So a tenant can neither write
rows that look like another tenant's nor (with a cluster token) another cluster's. With tokens
configured but not required, a request without a token is accepted anonymously and loses any
``ridethrough.tenant`` it claims; a wrong token is refused either way.

The stamp rewrites the request bytes before conversion (`otlp_stamp`), so spooled batches keep
it. Tokens are held as SHA-256 digests and never logged, repr'd or echoed.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import grpc
from google.protobuf.message import Message
from opentelemetry.proto.common.v1.common_pb2 import KeyValue

from ridethrough.exporters.gateway_metrics import GatewayMetrics
from ridethrough.exporters.otlp_stamp import stamp_request
from ridethrough.settings import IngestSecurity as IngestAuthConfig

log = logging.getLogger(__name__)

TENANT_ATTRIBUTE = "ridethrough.tenant"
CLUSTER_ATTRIBUTE = "ridethrough.cluster"
MIN_TOKEN_CHARS = 32
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_TOKEN = re.compile(r"[A-Za-z0-9._~+/-]+=*")  # RFC 6750 b64token
_AUTH_KEY = "authorization"
_FORCED_GAP_S = 0.1


class IngestAuthError(ValueError):
    """A token entry, tokens file or certificate that cannot be used; the message never holds a token."""


class AuthFailure(enum.StrEnum):
    """Why a request was refused (the ``reason`` label of ``ridethrough_gateway_auth_failures``)."""

    MISSING = "missing"
    MALFORMED = "malformed"
    UNKNOWN = "unknown"


class Unauthenticated(Exception):
    """The request carries no valid token; ``reason`` is an `AuthFailure`."""

    def __init__(self, reason: AuthFailure) -> None:
        super().__init__(f"missing or invalid bearer token ({reason})")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a token speaks for: a tenant, and the one cluster it may write as ('' for any)."""

    tenant: str
    cluster: str = ""


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """gRPC call metadata carrying ``token`` (an agent passes it with each Export; empty: none)."""
    return ((_AUTH_KEY, f"Bearer {token}"),) if token else ()


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def parse_tokens(text: str, *, source: str) -> dict[bytes, Principal]:
    """``TENANT[/CLUSTER]=TOKEN`` entries (lines or commas; ``#`` starts a comment), keyed by token digest."""
    table: dict[bytes, Principal] = {}
    for n, line in enumerate(text.splitlines(), 1):
        for entry in line.split("#", 1)[0].split(","):
            if not entry.strip():
                continue
            who, sep, token = (part.strip() for part in entry.partition("="))
            where = f"{source} line {n}"
            tenant, slash, cluster = who.partition("/")
            if not sep or not _NAME.fullmatch(tenant) or (slash and not _NAME.fullmatch(cluster)):
                raise IngestAuthError(f"{where}: expected TENANT[/CLUSTER]=TOKEN with names matching {_NAME.pattern}")
            # Nothing of a bad line is echoed: a token pasted in the wrong place would be.
            if len(token) < MIN_TOKEN_CHARS or not _TOKEN.fullmatch(token):
                raise IngestAuthError(f"{where}: the token must be at least {MIN_TOKEN_CHARS} characters "
                                      "of A-Z a-z 0-9 . _ ~ + / - (make one with `openssl rand -hex 32`)")
            digest = _digest(token)
            if digest in table:
                raise IngestAuthError(f"{where}: this token is already given to another entry")
            table[digest] = Principal(tenant, cluster)
    return table


class IngestAuth:
    """Checks bearer tokens and stamps tenants; the tokens file is re-read when it changes."""

    def __init__(self, *, tokens_file: str = "", extra_tokens: Mapping[bytes, Principal] | None = None,
                 require_token: bool = True, reload_s: float = 1.0, metrics: GatewayMetrics | None = None,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        """Raises `IngestAuthError` if the file cannot be read or parsed (a start-up error)."""
        self.require_token = require_token
        self._file = tokens_file
        self._extra = dict(extra_tokens or {})
        self._reload_s = reload_s
        self._metrics = metrics
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._stamp_of: dict[Principal, tuple[KeyValue, ...]] = {}
        self._file_id: tuple[int, int, int] | None = None
        self._checked = monotonic()
        self._table = {**self._read_file(), **self._extra}
        if require_token and not self._table:
            raise IngestAuthError("require_token is set but no ingest token is configured (tokens_file, tokens_env)")

    @classmethod
    def from_config(cls, cfg: IngestAuthConfig, *, environ: Mapping[str, str],
                    metrics: GatewayMetrics | None = None) -> IngestAuth | None:
        """The checker ``cfg`` asks for; None when no token is configured or required (auth off)."""
        extra: dict[bytes, Principal] = {}
        if cfg.tokens_env and environ.get(cfg.tokens_env):
            extra = parse_tokens(environ[cfg.tokens_env], source=f"${cfg.tokens_env}")
        if not (cfg.tokens_file or extra or cfg.require_token):
            return None
        return cls(tokens_file=cfg.tokens_file, extra_tokens=extra, require_token=cfg.require_token,
                   reload_s=cfg.tokens_reload_s, metrics=metrics)

    def __repr__(self) -> str:
        return f"IngestAuth(tokens={self.token_count}, file={self._file!r}, require_token={self.require_token})"

    @property
    def token_count(self) -> int:
        """Tokens accepted now."""
        return len(self._table)

    def _read_file(self) -> dict[bytes, Principal]:
        if not self._file:
            return {}
        try:
            ident, text = _file_ident(self._file), _read(self._file).decode()
        except (OSError, UnicodeDecodeError) as exc:
            raise IngestAuthError(f"cannot read ingest tokens from {self._file}: {_why(exc)}") from None
        table = parse_tokens(text, source=self._file)
        self._file_id = ident
        return table

    def reload_if_changed(self, *, force: bool = False) -> bool:
        """Re-read the tokens file if it changed; True when the table was replaced.

        Checked every ``reload_s`` (``force``: every 0.1 s at most). A file that is gone or malformed
        keeps the tokens in use (a bad rotation must not lock every agent out); it is logged at ERROR,
        without its content, and counted once per change of the file.
        """
        if not self._file:
            return False
        with self._lock:
            now = self._monotonic()
            if now - self._checked < (min(_FORCED_GAP_S, self._reload_s) if force else self._reload_s):
                return False
            self._checked = now
            try:
                ident: tuple[int, int, int] | None = _file_ident(self._file)
            except OSError:
                ident = None
            if ident == self._file_id:
                return False
            self._file_id = ident  # a broken file is not retried (nor logged) again until it changes
            try:
                if ident is None:
                    raise IngestAuthError(f"{self._file} is gone")
                table = self._read_file()
            except IngestAuthError as exc:
                log.error("ingest tokens not reloaded, keeping the %d in use: %s", len(self._table), exc)
                if self._metrics is not None:
                    self._metrics.auth_reload_failures.inc()
                return False
            self._table = {**table, **self._extra}
        log.info("ingest tokens reloaded from %s: %d tokens", self._file, len(self._table))
        return True

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]]) -> Principal | None:
        """The caller's `Principal` (None: anonymous, allowed when tokens are optional); `Unauthenticated`."""
        values = [v for k, v in metadata if k.lower() == _AUTH_KEY]
        if not values:
            if self.require_token:
                raise Unauthenticated(AuthFailure.MISSING)
            return None
        scheme, _, token = values[0].partition(" ") if isinstance(values[0], str) else ("", "", "")
        if len(values) > 1 or scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated(AuthFailure.MALFORMED)
        digest = _digest(token.strip())
        self.reload_if_changed()
        principal = self._table.get(digest)
        if principal is None and self.reload_if_changed(force=True):  # a token issued since the last check
            principal = self._table.get(digest)
        if principal is None:
            raise Unauthenticated(AuthFailure.UNKNOWN)
        return principal

    def stamp(self, raw: bytes, principal: Principal | None, *, request_type: type[Message]) -> bytes:
        """``raw`` (an Export request of ``request_type``) with every resource stamped for ``principal``.

        Raises `DecodeError` for bytes that are not a protobuf message.
        """
        strip = {TENANT_ATTRIBUTE, CLUSTER_ATTRIBUTE} if principal is not None and principal.cluster \
            else {TENANT_ATTRIBUTE}
        add = self._stamp_attributes(principal)
        return stamp_request(raw, strip=frozenset(strip), add=add, request_type=request_type)

    def _stamp_attributes(self, principal: Principal | None) -> tuple[KeyValue, ...]:
        if principal is None:
            return ()
        kvs = self._stamp_of.get(principal)
        if kvs is None:  # handler threads may race here; both build the same tuple, either is kept
            made = [KeyValue(key=TENANT_ATTRIBUTE)]
            made[0].value.string_value = principal.tenant
            if principal.cluster:
                made.append(KeyValue(key=CLUSTER_ATTRIBUTE))
                made[1].value.string_value = principal.cluster
            kvs = self._stamp_of[principal] = tuple(made)
        return kvs


# -- TLS ----------------------------------------------------------------------------------------------------------


def server_credentials(cfg: IngestAuthConfig) -> grpc.ServerCredentials | None:
    """TLS (and, with a client CA, mutual TLS) for the OTLP listener; None for plaintext."""
    if not cfg.tls_cert_file:
        return None
    ca = _read_pem(cfg.tls_client_ca_file) if cfg.tls_client_ca_file else None
    return grpc.ssl_server_credentials([(_read_pem(cfg.tls_key_file), _read_pem(cfg.tls_cert_file))],
                                       root_certificates=ca, require_client_auth=ca is not None)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _read_pem(path: str) -> bytes:
    try:
        return _read(path)
    except OSError as exc:
        raise IngestAuthError(f"cannot read {path}: {exc.strerror}") from None


def _file_ident(path: str) -> tuple[int, int, int]:
    # stat follows a Secret volume's ..data symlink: the atomic swap of a rotation changes the inode
    info = os.stat(path)
    return info.st_ino, info.st_mtime_ns, info.st_size


def _why(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or type(exc).__name__
