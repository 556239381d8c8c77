"""The agent's control plane: a gRPC service that runs signed, idempotent commands from the controller.

One unary method, ``/ridethrough.control.v1.ControlPlane/Execute``, takes a signed JSON command
(`ridethrough.actuators.command_auth`) as raw bytes and answers with a JSON reply::

    {"command":"route.set","data":{...},"detail":"...","duplicate":false,"key":"...","node":"h3",
     "ok":true,"outcome":"ok","v":1}

A command that may not run is refused with a gRPC status (UNAUTHENTICATED, PERMISSION_DENIED,
INVALID_ARGUMENT, ...), the reason in the trailing metadata ``x-ridethrough-refusal``; each
refusal is logged (never with a secret) and counted by reason.

Idempotency: the reply of every command that ran is kept by its key (bounded LRU); the same key
again returns that reply, marked ``duplicate``, without running anything. The cache lives as
long as the agent: across agent restarts, the runner's ``actions`` table is what keeps a key
from being spent twice.

Tracing: the caller's W3C ``traceparent`` (gRPC metadata) is the parent of the span
``agent.<command>`` (kind server; attributes ``command.name``, ``command.key``,
``command.outcome``, ``ridethrough.node.id``), made with the injected OpenTelemetry tracer;
in the agent that tracer exports OTLP to the gateway (`agent_tracer_provider`). Calls that were
not authentic make no span: an unauthenticated caller must not write into anyone's trace.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CollectorRegistry, Counter

from ridethrough.actuators.command_auth import Authenticator, Command, Reason, Refused, Scalar, load_keyring
from ridethrough.actuators.commands import BadArgs, CommandRegistry, CommandSpec, Outcome
from ridethrough.settings import check_listen, parse_hostport

log = logging.getLogger(__name__)

SERVICE = "ridethrough.control.v1.ControlPlane"
METHOD = "Execute"
PATH = f"/{SERVICE}/{METHOD}"
REFUSAL_HEADER = "x-ridethrough-refusal"
SCOPE = "ridethrough.actuators.control_plane"
_MAX_MESSAGE_BYTES = 64 << 10  # commands are a few hundred bytes; anything near this is not one
_BY_CODE = {grpc.StatusCode.UNAUTHENTICATED: (Reason.MISSING_SIGNATURE, Reason.UNKNOWN_KEY, Reason.BAD_SIGNATURE),
            grpc.StatusCode.INVALID_ARGUMENT: (Reason.MALFORMED, Reason.LIFETIME_TOO_LONG, Reason.UNKNOWN_COMMAND,
                                               Reason.BAD_ARGS),
            grpc.StatusCode.PERMISSION_DENIED: (Reason.WRONG_NODE, Reason.EXPIRED, Reason.NOT_YET_VALID,
                                                Reason.REPLAYED),
            grpc.StatusCode.RESOURCE_EXHAUSTED: (Reason.REPLAY_CACHE_FULL,),
            grpc.StatusCode.ALREADY_EXISTS: (Reason.KEY_CONFLICT,), grpc.StatusCode.ABORTED: (Reason.IN_PROGRESS,)}
CODES: Mapping[Reason, grpc.StatusCode] = {reason: code for code, reasons in _BY_CODE.items() for reason in reasons}
"""The gRPC status of each refusal."""


def _help(text: str, **checks: Any) -> dict[str, Any]:
    return {"help": text, **checks}


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlPlaneConfig:
    """The agent's control-plane server (see the module docstring)."""

    listen: str = field(default="", metadata=_help(
        "Control-plane gRPC listen address, HOST:PORT (port 0 picks one); empty turns it off.", check=check_listen))
    secret_file: str = field(default="", metadata=_help(
        "File of HMAC keys for signed commands, KEY_ID=HEX lines (`openssl rand -hex 32` makes a secret)."))
    secret_env: str = field(default="RIDETHROUGH_CONTROL_KEYS", metadata=_help(
        "Environment variable that may hold more keys, KEY_ID=HEX,...; empty: none."))
    key_ids: tuple[str, ...] = field(default=(), metadata=_help(
        "Key ids accepted (rotation: list the old and the new); empty accepts every key loaded."))
    max_clock_skew_s: float = field(default=5.0, metadata=_help(
        "Clock difference allowed between controller and agent when checking a command's times, in seconds.",
        min=0))
    replay_window_s: float = field(default=120.0, metadata=_help(
        "Longest lifetime a command may have (its nonce is remembered that long plus the skew), in seconds.",
        min=0.001))
    replay_cache_size: int = field(default=100_000, metadata=_help(
        "Most unexpired nonces remembered; when full, new commands are refused until some expire.", min=1))
    results_cache_size: int = field(default=10_000, metadata=_help(
        "Most command replies kept by idempotency key (least recently used dropped).", min=1))
    tls_cert_file: str = field(default="", metadata=_help("Server certificate (PEM); empty serves without TLS."))
    tls_key_file: str = field(default="", metadata=_help("Server private key (PEM), with tls_cert_file."))
    tls_client_ca_file: str = field(default="", metadata=_help(
        "CA bundle (PEM) that client certificates must chain to; set: mutual TLS is required."))
    workers: int = field(default=4, metadata=_help("gRPC handler threads.", min=1))

    def __post_init__(self) -> None:
        check_listen(self.listen)
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file go together: set both or neither")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError("tls_client_ca_file (mutual TLS) needs tls_cert_file and tls_key_file")
        for name in ("replay_window_s", "replay_cache_size", "results_cache_size", "workers"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_clock_skew_s < 0:
            raise ValueError(f"max_clock_skew_s must not be negative, got {self.max_clock_skew_s}")


@dataclass(frozen=True)
class ControlPlaneMetrics:
    """Refusals by reason and commands by outcome, for the agent's /metrics."""

    registry: CollectorRegistry
    refusals: Counter
    commands: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> ControlPlaneMetrics:
        """Metrics in ``registry`` (a fresh one by default: no global state)."""
        reg = registry if registry is not None else CollectorRegistry()
        return cls(reg, Counter("ridethrough_control_refusals", "Control commands refused, by reason",
                                ["reason"], registry=reg),
                   Counter("ridethrough_control_commands", "Control commands answered, by command and outcome "
                           "(duplicates included)", ["command", "outcome"], registry=reg))


class ReplyCache:
    """Replies by idempotency key (LRU, ``capacity``); a key being run makes its duplicates wait."""

    def __init__(self, *, capacity: int) -> None:
        self._capacity = capacity
        self._done: OrderedDict[str, tuple[str, dict[str, Any]]] = OrderedDict()
        self._running: dict[str, tuple[str, threading.Event]] = {}
        self._lock = threading.Lock()

    def begin(self, cmd: Command, *, timeout_s: float) -> dict[str, Any] | None:
        """The stored reply for ``cmd.key``, or None: then the caller runs it and must call `finish`."""
        fingerprint, deadline = cmd.fingerprint(), time.monotonic() + timeout_s
        while True:
            with self._lock:
                done = self._done.get(cmd.key)
                running = self._running.get(cmd.key)
                if done is None and running is None:
                    self._running[cmd.key] = (fingerprint, threading.Event())
                    return None
                entry = done if done is not None else running
                assert entry is not None
                if entry[0] != fingerprint:
                    raise Refused(Reason.KEY_CONFLICT, f"key {cmd.key!r} was used for a different command", cmd)
                if done is not None:
                    self._done.move_to_end(cmd.key)
                    return done[1]
            assert running is not None
            if not running[1].wait(max(0.0, deadline - time.monotonic())):
                raise Refused(Reason.IN_PROGRESS, f"key {cmd.key!r} is still running; retry later", cmd)

    def finish(self, cmd: Command, reply: dict[str, Any] | None) -> None:
        """Store ``reply`` for ``cmd.key`` (None: nothing ran to completion) and wake its duplicates."""
        with self._lock:
            _, event = self._running.pop(cmd.key)
            if reply is not None:
                self._done[cmd.key] = (cmd.fingerprint(), reply)
                while len(self._done) > self._capacity:
                    self._done.popitem(last=False)
        event.set()


def _parent(metadata: Mapping[str, str]) -> Context:
    # An absent or malformed traceparent yields an empty context: the span starts a new trace.
    carrier = {"traceparent": metadata["traceparent"]} if "traceparent" in metadata else {}
    return TraceContextTextMapPropagator().extract(carrier)


@dataclass(frozen=True, slots=True)
class Answer:
    """What `ControlPlane.handle` answers: a gRPC status, and a reply or the refusal's reason and message."""

    code: grpc.StatusCode
    body: bytes = b""
    reason: str = ""
    message: str = ""


class ControlPlane:
    """Checks, runs and traces commands (transport-free core of the gRPC service)."""

    def __init__(self, *, node_id: str, auth: Authenticator, registry: CommandRegistry, tracer: trace.Tracer,
                 metrics: ControlPlaneMetrics, results_cache_size: int = 10_000) -> None:
        self.node_id = node_id
        self._auth = auth
        self._registry = registry
        self._tracer = tracer
        self.metrics = metrics
        self._replies = ReplyCache(capacity=results_cache_size)

    def handle(self, raw: bytes, metadata: Mapping[str, str], *, peer: str = "", timeout_s: float = 30.0) -> Answer:
        """Answer one call; never raises."""
        start_ns, span = time.time_ns(), None
        try:
            cmd = self._auth.check(raw, metadata)
            spec, args = self._bind(cmd)
            span = self._span(f"agent.{cmd.command}", cmd, metadata, start_ns)
            with trace.use_span(span, end_on_exit=False):  # the handler's own spans nest under it
                reply = self._run_once(cmd, spec, args, timeout_s)
            span.set_attributes({"command.outcome": reply["outcome"], "command.duplicate": reply["duplicate"]})
            span.set_status(Status(StatusCode.OK) if reply["ok"] else Status(StatusCode.ERROR, reply["detail"]))
            self.metrics.commands.labels(command=cmd.command, outcome=reply["outcome"]).inc()
            return Answer(grpc.StatusCode.OK, json.dumps(reply, sort_keys=True, separators=(",", ":")).encode())
        except Refused as refusal:
            if span is None and refusal.command is not None:  # authentic: the refusal belongs in its trace
                known = self._registry.get(refusal.command.command) is not None
                name = f"agent.{refusal.command.command}" if known else "agent.refused"
                span = self._span(name, refusal.command, metadata, start_ns)
            if span is not None:
                span.set_attributes({"command.outcome": "refused", "refusal.reason": refusal.reason.value})
                span.set_status(Status(StatusCode.ERROR, str(refusal)))
            return self._refuse(refusal, peer)
        except Exception as exc:  # a bug here must cost one call, not the agent
            log.exception("control plane: unexpected error")
            if span is not None:
                span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            return Answer(grpc.StatusCode.INTERNAL, message="internal error; see the agent log")
        finally:
            if span is not None:
                span.end()

    def _bind(self, cmd: Command) -> tuple[CommandSpec, dict[str, Scalar]]:
        try:
            return self._registry.bind(cmd.command, cmd.args)
        except KeyError as exc:
            raise Refused(Reason.UNKNOWN_COMMAND, str(exc.args[0]), cmd) from None
        except BadArgs as exc:
            raise Refused(Reason.BAD_ARGS, str(exc), cmd) from None

    def _span(self, name: str, cmd: Command, metadata: Mapping[str, str], start_ns: int) -> trace.Span:
        return self._tracer.start_span(name, context=_parent(metadata), kind=SpanKind.SERVER, start_time=start_ns,
                                       attributes={"command.name": cmd.command, "command.key": cmd.key,
                                                   "ridethrough.node.id": self.node_id})

    def _run_once(self, cmd: Command, spec: CommandSpec, args: dict[str, Scalar], timeout_s: float) -> dict[str, Any]:
        stored = self._replies.begin(cmd, timeout_s=timeout_s)
        if stored is not None:
            return {**stored, "duplicate": True}
        reply: dict[str, Any] | None = None
        try:
            outcome, kind = _call(spec, args)
            reply = {"v": 1, "key": cmd.key, "node": self.node_id, "command": cmd.command, "ok": outcome.ok,
                     "outcome": kind, "detail": outcome.detail, "data": dict(outcome.data), "duplicate": False}
            return reply
        finally:
            self._replies.finish(cmd, reply)

    def _refuse(self, refusal: Refused, peer: str) -> Answer:
        cmd = refusal.command
        what = f"{cmd.command} key={cmd.key}" if cmd is not None else "a command"
        log.warning("control plane refused %s from %s: %s", what, peer or "?", refusal)
        self.metrics.refusals.labels(reason=refusal.reason.value).inc()
        return Answer(CODES[refusal.reason], reason=refusal.reason.value, message=str(refusal))


def _call(spec: CommandSpec, args: dict[str, Scalar]) -> tuple[Outcome, str]:
    """The handler's outcome and its kind (ok, failed, error); a raise or a bad value is an error outcome."""
    try:
        out = spec.handler(args)
    except Exception as exc:
        log.exception("command %s failed", spec.name)
        return Outcome(False, f"{spec.name} raised {type(exc).__name__}: {exc}"), "error"
    if not isinstance(out, Outcome) or not all(isinstance(v, str | int | float) for v in out.data.values()):
        log.error("command %s returned %r, not an Outcome with scalar data", spec.name, out)
        return Outcome(False, f"{spec.name} returned a malformed outcome (see the agent log)"), "error"
    return out, "ok" if out.ok else "failed"


class ControlPlaneServer:
    """The gRPC server around a `ControlPlane`; `start` returns the bound ``HOST:PORT``."""

    def __init__(self, plane: ControlPlane, cfg: ControlPlaneConfig) -> None:
        self.plane = plane
        self._cfg = cfg
        self._server: Any = None

    def _execute(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        metadata = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
        remaining = context.time_remaining()
        answer = self.plane.handle(raw, metadata, peer=context.peer(),
                                   timeout_s=30.0 if remaining is None else max(0.0, remaining))
        if answer.code is not grpc.StatusCode.OK:
            if answer.reason:
                context.set_trailing_metadata(((REFUSAL_HEADER, answer.reason),))
            context.set_code(answer.code)
            context.set_details(answer.message)
        return answer.body

    def start(self) -> str:
        """Serve on ``cfg.listen``; returns the bound address."""
        cfg = self._cfg
        host, _ = parse_hostport(cfg.listen)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=cfg.workers, thread_name_prefix="rt-control"),
                             options=[("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
                                      ("grpc.so_reuseport", 0)],
                             maximum_concurrent_rpcs=cfg.workers * 4)
        handler = grpc.unary_unary_rpc_method_handler(self._execute, request_deserializer=None,
                                                      response_serializer=None)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {METHOD: handler}),))
        if cfg.tls_cert_file:
            port = server.add_secure_port(cfg.listen, _server_credentials(cfg))
        else:
            port = server.add_insecure_port(cfg.listen)
        if port == 0:
            raise OSError(f"control plane cannot listen on {cfg.listen}")
        server.start()
        self._server = server
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        log.info("control plane serving on %s (%s)", address, "mutual TLS" if cfg.tls_client_ca_file else
                 "TLS" if cfg.tls_cert_file else "no TLS: signed commands only")
        return address

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop taking calls; wait up to ``timeout_s`` for those in flight."""
        if self._server is not None:
            self._server.stop(timeout_s).wait(timeout_s)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _server_credentials(cfg: ControlPlaneConfig) -> grpc.ServerCredentials:
    ca = _read(cfg.tls_client_ca_file) if cfg.tls_client_ca_file else None
    return grpc.ssl_server_credentials([(_read(cfg.tls_key_file), _read(cfg.tls_cert_file))],
                                       root_certificates=ca, require_client_auth=ca is not None)


def build_control_plane(cfg: ControlPlaneConfig, *, node_id: str, registry: CommandRegistry, tracer: trace.Tracer,
                        environ: Mapping[str, str], metrics: ControlPlaneMetrics | None = None,
                        clock: Callable[[], int] = time.time_ns) -> ControlPlaneServer:
    """The control-plane server from config (keys are loaded here: a bad key file stops the start)."""
    keys = load_keyring(file=cfg.secret_file, env_var=cfg.secret_env, environ=environ)
    if cfg.key_ids:
        keys = keys.only(cfg.key_ids)
    auth = Authenticator(keys=keys, node_id=node_id, max_clock_skew_s=cfg.max_clock_skew_s,
                         max_lifetime_s=cfg.replay_window_s, replay_capacity=cfg.replay_cache_size, clock=clock)
    plane = ControlPlane(node_id=node_id, auth=auth, registry=registry, tracer=tracer,
                         metrics=metrics or ControlPlaneMetrics.create(), results_cache_size=cfg.results_cache_size)
    return ControlPlaneServer(plane, cfg)


def agent_tracer_provider(*, resource: Resource, gateway: str, timeout_s: float,
                          headers: Sequence[tuple[str, str]] = ()) -> TracerProvider:
    """The agent's tracer provider: spans batched to the gateway over OTLP/gRPC (shut it down to flush);
    ``headers``: call metadata for every export, e.g. the agent's ingest bearer token."""
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=gateway, insecure=True,
                                                                    timeout=timeout_s, headers=dict(headers))))
    return provider
