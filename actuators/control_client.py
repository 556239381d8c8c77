"""Calling an agent's control plane: signed, traced, idempotent commands, for the runner's plugins.

    client = build_control_client(cfg, environ=os.environ)
    reply = client.call(target="h3:7450", node="h3", command="route.set",
                        args={"destination": "10.0.2.0/24", "dev": "eth1"}, key=f"{plan.idempotency_key}:h3")
    return reply.to_result()

Inside an action (a plugin's apply, verify or rollback under the runner) every call is a step
span, ``control <command> on <node>``, and sends that step's ``traceparent``, so the agent's span
hangs under it in the incident's trace. Each call signs a fresh command (new nonce, issued now);
resending the same ``key`` is safe: the agent answers a key that already ran from its stored
reply, so an error whose `ControlCallError.retryable` is true may simply be retried. Calls wait
for the channel to connect (``wait_for_ready``) until their timeout, so an agent that is
restarting is reached when it is back, within the deadline.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from ridethrough.actuators.command_auth import (
    KEY_ID_HEADER,
    SIGNATURE_HEADER,
    Command,
    KeyRing,
    KeyRingError,
    Scalar,
    load_keyring,
)
from ridethrough.actuators.contract import Result
from ridethrough.actuators.control_plane import PATH, REFUSAL_HEADER
from ridethrough.actuators.tracing import current_traceparent, step
from ridethrough.settings import parse_hostport

_RETRYABLE = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED", "RESOURCE_EXHAUSTED"})
_REPLY_FIELDS = frozenset({"v", "key", "node", "command", "ok", "outcome", "detail", "data", "duplicate"})


def _help(text: str, **checks: Any) -> dict[str, Any]:
    return {"help": text, **checks}


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlClientConfig:
    """How the controller signs and sends commands to agents."""

    secret_file: str = field(default="", metadata=_help("File of HMAC keys, KEY_ID=HEX lines (as the agents')."))
    secret_env: str = field(default="RIDETHROUGH_CONTROL_KEYS", metadata=_help(
        "Environment variable that may hold more keys, KEY_ID=HEX,...; empty: none."))
    key_id: str = field(default="", metadata=_help("Key id to sign with; empty: the only key loaded."))
    command_lifetime_s: float = field(default=30.0, metadata=_help(
        "How long a sent command stays valid, in seconds (at most the agents' replay_window_s).", min=0.001))
    tls_ca_file: str = field(default="", metadata=_help("CA bundle (PEM) the agents' certificates chain to; "
                                                        "empty: plaintext gRPC (commands are still signed)."))
    tls_cert_file: str = field(default="", metadata=_help("Client certificate (PEM) for mutual TLS."))
    tls_key_file: str = field(default="", metadata=_help("Client private key (PEM), with tls_cert_file."))
    tls_server_name: str = field(default="", metadata=_help(
        "Name to check the agents' certificates against instead of the target host; empty: the host."))

    def __post_init__(self) -> None:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file go together: set both or neither")
        if (self.tls_cert_file or self.tls_server_name) and not self.tls_ca_file:
            raise ValueError("tls_cert_file and tls_server_name need tls_ca_file (TLS to the agents)")
        if self.command_lifetime_s <= 0:
            raise ValueError(f"command_lifetime_s must be positive, got {self.command_lifetime_s}")


    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> ControlClientConfig:
        """The config an actuator plugin builds from its process's environment (`ENVIRON`; unset: default)."""
        values: dict[str, Any] = {name: environ[var] for name, var in ENVIRON.items() if environ.get(var)}
        if "command_lifetime_s" in values:
            try:
                values["command_lifetime_s"] = float(values["command_lifetime_s"])
            except ValueError:
                raise ValueError(f"{ENVIRON['command_lifetime_s']} must be a number of seconds") from None
        return cls(**values)


ENVIRON: Mapping[str, str] = {
    "secret_file": "RIDETHROUGH_CONTROL_KEYS_FILE", "key_id": "RIDETHROUGH_CONTROL_KEY_ID",
    "command_lifetime_s": "RIDETHROUGH_CONTROL_COMMAND_LIFETIME_S", "tls_ca_file": "RIDETHROUGH_CONTROL_TLS_CA_FILE",
    "tls_cert_file": "RIDETHROUGH_CONTROL_TLS_CERT_FILE", "tls_key_file": "RIDETHROUGH_CONTROL_TLS_KEY_FILE",
    "tls_server_name": "RIDETHROUGH_CONTROL_TLS_SERVER_NAME"}
"""`ControlClientConfig` field → the environment variable `ControlClientConfig.from_environ` reads it from
(keys themselves may also be in ``RIDETHROUGH_CONTROL_KEYS``, see ``secret_env``)."""
TARGETS_FILE_ENV = "RIDETHROUGH_CONTROL_TARGETS_FILE"
"""JSON ``{node: "HOST:PORT"}``: where each node's agent control plane is (the lab writes one)."""


class AgentTargets:
    """Where a node's agent listens: its entry in a targets file, else ``template`` with ``{node}`` filled in.

    The file (JSON ``{node: "HOST:PORT"}``) is re-read when it changes, so nodes can be added while
    the controller runs; a node it does not list falls back to the template (``{node}:7450``:
    the node name resolved by DNS).
    """

    def __init__(self, *, template: str = "{node}:7450", file: str = "") -> None:
        if "{node}" not in template:
            raise ValueError(f"agent target {template!r} must contain {{node}}")
        self.template = template
        self.file = file
        self._seen: tuple[int, dict[str, str]] = (-1, {})
        self._lock = threading.Lock()
        if file:
            self._table()  # a missing or malformed file fails at start, not at the first incident

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], *, template_var: str) -> AgentTargets:
        """Template from ``template_var`` (default ``{node}:7450``), table from `TARGETS_FILE_ENV`."""
        return cls(template=environ.get(template_var) or "{node}:7450", file=environ.get(TARGETS_FILE_ENV, ""))

    def __call__(self, node: str) -> str:
        """The ``HOST:PORT`` of ``node``'s agent."""
        return self._table().get(node) or self.template.format(node=node)

    def _table(self) -> dict[str, str]:
        if not self.file:
            return {}
        with self._lock:
            try:
                mtime = os.stat(self.file).st_mtime_ns
                if mtime != self._seen[0]:
                    self._seen = (mtime, _parse_targets(self.file))
            except (OSError, ValueError) as exc:
                if self._seen[0] == -1:
                    raise ValueError(f"agent targets file {self.file}: {exc}") from None
            return self._seen[1]


def _parse_targets(path: str) -> dict[str, str]:
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in doc.items()):
        raise ValueError('expected JSON {"node": "HOST:PORT"}')
    for target in doc.values():
        parse_hostport(target)
    return dict(doc)


@dataclass(frozen=True, slots=True)
class Reply:
    """An agent's answer to a command that it ran (or had run: ``duplicate``)."""

    key: str
    node: str
    command: str
    ok: bool
    outcome: str
    """``ok``, ``failed`` (the handler said no) or ``error`` (the handler broke)."""
    detail: str
    data: Mapping[str, Scalar]
    duplicate: bool

    def to_result(self) -> Result:
        """The reply as an actuator `Result`."""
        detail = f"{self.node}: {self.detail}"
        return Result.success(detail) if self.ok else Result.failure(detail)


class ControlCallError(Exception):
    """A call that got no reply: a refusal (``reason`` set), a transport error, or a reply that did not parse."""

    def __init__(self, *, target: str, code: str, reason: str, detail: str) -> None:
        super().__init__(f"{target}: {code}{f' ({reason})' if reason else ''}: {detail}")
        self.target = target
        self.code = code
        """The gRPC status name, or ``BAD_REPLY``."""
        self.reason = reason
        """The agent's refusal reason (`command_auth.Reason` values), '' if it did not refuse."""
        self.detail = detail

    @property
    def retryable(self) -> bool:
        """True when sending the same key again may succeed (it cannot run twice)."""
        return self.code in _RETRYABLE


class ControlClient:
    """Sends signed commands to agents, one cached channel per target."""

    def __init__(self, *, keys: KeyRing, key_id: str, credentials: grpc.ChannelCredentials | None = None,
                 server_name: str = "", lifetime_s: float = 30.0, clock: Callable[[], int] = time.time_ns) -> None:
        keys.sign(key_id, b"")  # an unknown key id fails here, not at the first incident
        self._keys = keys
        self._key_id = key_id
        self._credentials = credentials
        # An agent that restarts is back within seconds: retry its connection at least every 2 s, not
        # gRPC's default of up to 120 s, so a call waiting for it (wait_for_ready) sees it soon.
        self._options: list[tuple[str, Any]] = [("grpc.initial_reconnect_backoff_ms", 250),
                                                ("grpc.max_reconnect_backoff_ms", 2000)]
        if server_name:
            self._options.append(("grpc.ssl_target_name_override", server_name))
        self._lifetime_s = lifetime_s
        self._clock = clock
        self._channels: dict[str, Any] = {}
        self._lock = threading.Lock()

    def call(self, *, target: str, node: str, command: str, key: str, args: Mapping[str, Scalar] | None = None,
             timeout_s: float = 5.0, traceparent: str | None = None) -> Reply:
        """Run ``command`` on ``node`` at ``target`` (``HOST:PORT``); `ControlCallError` if there is no reply.

        ``traceparent`` overrides the current step's; without either, the agent starts a new trace.
        """
        if traceparent is not None:
            return self._call(target, node, command, key, args or {}, timeout_s, traceparent)
        attributes = {"command.name": command, "command.key": key, "control.node": node}
        with step(f"control {command} on {node}", attributes):
            return self._call(target, node, command, key, args or {}, timeout_s, current_traceparent())

    def _call(self, target: str, node: str, command: str, key: str, args: Mapping[str, Scalar], timeout_s: float,
              traceparent: str | None) -> Reply:
        cmd = Command.new(key=key, node=node, command=command, args=args, now_ns=self._clock(),
                          lifetime_s=self._lifetime_s)
        payload = cmd.encode()
        metadata = [(KEY_ID_HEADER, self._key_id), (SIGNATURE_HEADER, self._keys.sign(self._key_id, payload))]
        if traceparent:
            metadata.append(("traceparent", traceparent))
        try:
            raw = self._stub(target)(payload, timeout=timeout_s, metadata=metadata, wait_for_ready=True)
        except grpc.RpcError as err:
            trailing = {k: v for k, v in (err.trailing_metadata() or ())}
            raise ControlCallError(target=target, code=err.code().name, reason=str(trailing.get(REFUSAL_HEADER, "")),
                                   detail=err.details() or "") from None
        try:
            return _decode_reply(raw, cmd)
        except ValueError as exc:
            raise ControlCallError(target=target, code="BAD_REPLY", reason="", detail=str(exc)) from None

    def _stub(self, target: str) -> Any:
        with self._lock:
            channel = self._channels.get(target)
            if channel is None:
                channel = (grpc.secure_channel(target, self._credentials, options=self._options)
                           if self._credentials is not None else grpc.insecure_channel(target, options=self._options))
                self._channels[target] = channel
            return channel.unary_unary(PATH, request_serializer=None, response_deserializer=None)

    def close(self) -> None:
        """Close every channel."""
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _decode_reply(raw: bytes, cmd: Command) -> Reply:
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"reply is not JSON: {exc}") from None
    if not isinstance(doc, dict) or set(doc) != _REPLY_FIELDS or doc["v"] != 1:
        raise ValueError(f"reply is not a version-1 reply: {raw[:200]!r}")
    if (doc["key"], doc["node"], doc["command"]) != (cmd.key, cmd.node, cmd.command):
        raise ValueError(f"reply is for {doc['command']} key={doc['key']} on {doc['node']}, "
                         f"not {cmd.command} key={cmd.key} on {cmd.node}")
    data = doc["data"]
    if not (isinstance(doc["ok"], bool) and isinstance(doc["duplicate"], bool) and isinstance(doc["detail"], str)
            and doc["outcome"] in ("ok", "failed", "error") and isinstance(data, dict)
            and all(isinstance(v, str | int | float) for v in data.values())):
        raise ValueError(f"reply fields have the wrong types: {raw[:200]!r}")
    return Reply(doc["key"], doc["node"], doc["command"], doc["ok"], doc["outcome"], doc["detail"], doc["data"],
                 doc["duplicate"])


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def build_control_client(cfg: ControlClientConfig, *, environ: Mapping[str, str],
                         clock: Callable[[], int] = time.time_ns) -> ControlClient:
    """A client from config (keys and certificates are read here: a bad file stops the start)."""
    keys = load_keyring(file=cfg.secret_file, env_var=cfg.secret_env, environ=environ)
    if not cfg.key_id and len(keys.ids) != 1:
        raise KeyRingError(f"several control keys are loaded ({list(keys.ids)}); set key_id to the one to sign with")
    credentials = None
    if cfg.tls_ca_file:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=_read(cfg.tls_ca_file),
            private_key=_read(cfg.tls_key_file) if cfg.tls_key_file else None,
            certificate_chain=_read(cfg.tls_cert_file) if cfg.tls_cert_file else None)
    return ControlClient(keys=keys, key_id=cfg.key_id or keys.ids[0], credentials=credentials,
                         server_name=cfg.tls_server_name, lifetime_s=cfg.command_lifetime_s, clock=clock)
