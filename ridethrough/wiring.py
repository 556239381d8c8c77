"""The composition root: build components from their config and hand them their parts.

Nothing else in the package opens a store, binds a port or reads the host name; the
commands in `ridethrough.cli` call these builders and own the objects' lifetimes.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from prometheus_client import start_http_server

from ridethrough import catalogue
from ridethrough.collector.agent import Agent
from ridethrough.collector.clock import Clock, ScriptedClock
from ridethrough.collector.identity import AgentIdentity
from ridethrough.collector.registry import build_sources
from ridethrough.collector.timestamps import HostTime
from ridethrough.controller_wiring import ControllerParts, build_controller
from ridethrough.detectors.controller import Controller, ControllerMetrics
from ridethrough.detectors.live import LiveFeed
from ridethrough.exporters.clock_http import ClockEndpoint
from ridethrough.exporters.clock_service import ClockService
from ridethrough.exporters.gateway import OtlpReceiver, ServerOptions, build_server
from ridethrough.exporters.gateway_metrics import GatewayMetrics
from ridethrough.exporters.ingest_auth import IngestAuth, bearer_metadata, server_credentials
from ridethrough.exporters.pagerduty_config import PagerDutyConfig
from ridethrough.exporters.pipeline import BatchPolicy, Pipeline
from ridethrough.exporters.rows import Limits, Rows
from ridethrough.exporters.spool import Spool
from ridethrough.exporters.store import Store, StoreError, StoreUnavailable
from ridethrough.exporters.store_http import StoreHttpEndpoint
from ridethrough.settings import (
    ActuatorConfig,
    AgentConfig,
    ControllerConfig,
    GatewayConfig,
    ServerConfig,
    parse_hostport,
)

if TYPE_CHECKING:
    from ridethrough.actuators.reflex import Reflex

log = logging.getLogger(__name__)


def write_ready_file(path: str, info: dict[str, Any]) -> None:
    """Atomically write ``info`` as JSON, so a reader never sees half a file."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".ready-")
    with os.fdopen(fd, "w") as f:
        json.dump(info, f)
    os.replace(tmp, target)


def tune_gc_for_ingest() -> None:
    """Fewer, later garbage collections for a process that converts telemetry all day.

    Ingest allocates millions of short-lived, acyclic objects; the default generation-0
    threshold (700) runs collections that cost more than the conversion itself. Objects
    alive after start-up are frozen out of every later collection.
    """
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


def open_store(cfg: GatewayConfig) -> Store:
    """The one store client of a server-side process."""
    return Store(cfg.store, cluster=cfg.cluster, timeout_s=cfg.store_timeout_s)


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass
class GatewayRuntime:
    """A running gateway: OTLP server, pipeline, spool and its /metrics endpoint."""

    cfg: GatewayConfig
    store: Store
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics.create)
    addresses: dict[str, str] = field(default_factory=dict)
    _server: grpc.Server | None = None
    _pipeline: Pipeline | None = None
    _http: Any = None

    def start(self) -> dict[str, str]:
        """Initialise the schema (if the store is there), replay the spool, then serve.

        Raises `IngestAuthError` (a ValueError) for an unusable tokens file or TLS setting, before anything starts.
        """
        auth = IngestAuth.from_config(self.cfg, environ=os.environ, metrics=self.metrics)
        credentials = server_credentials(self.cfg)
        self._init_schema()
        limits = Limits(max_attributes=self.cfg.max_attributes,
                        max_attribute_value_bytes=self.cfg.max_attribute_value_bytes)
        policy = BatchPolicy(max_rows=self.cfg.batch_max_rows, max_age_s=self.cfg.batch_max_age_s,
                             max_pending_rows=max(self.cfg.batch_max_rows * 4, 10_000),
                             replay_initial_backoff_s=self.cfg.replay_initial_backoff_s,
                             replay_max_backoff_s=self.cfg.replay_max_backoff_s)
        spool = Spool(self.cfg.spool, max_bytes=self.cfg.spool_max_bytes)
        self._pipeline = Pipeline(store=self.store, spool=spool, limits=limits, policy=policy,
                                  metrics=self.metrics)
        if spool.pending():
            log.info("replaying %d spooled batch(es) before serving", len(spool.pending()))
            self._pipeline.replay_once()
        self._pipeline.start()
        receiver = OtlpReceiver(pipeline=self._pipeline, limits=limits, metrics=self.metrics,
                                ack_timeout_s=self.cfg.store_timeout_s * 3, auth=auth)
        host, _ = parse_hostport(self.cfg.otlp_listen)
        options = ServerOptions(max_message_bytes=self.cfg.max_message_bytes, workers=self.cfg.workers)
        self._server, port = build_server(receiver, listen=self.cfg.otlp_listen, options=options,
                                          credentials=credentials)
        self.addresses["otlp"] = _address(host, port)
        self._start_metrics_http()
        log.info("gateway serving OTLP on %s, store %s", self.addresses["otlp"], self.store.dsn)
        return self.addresses

    def _init_schema(self) -> None:
        try:
            self.store.init_schema()
        except (StoreUnavailable, StoreError) as exc:
            # Not fatal: batches spool until the store is back (the schema is made then).
            log.warning("store not ready at start, will spool: %s", exc)

    def _start_metrics_http(self) -> None:
        if not self.cfg.metrics_listen:
            return
        host, port = parse_hostport(self.cfg.metrics_listen)
        self._http, _ = start_http_server(port, addr=host, registry=self.metrics.registry)
        self.addresses["metrics"] = _address(host, self._http.server_port)

    def observe(self, observer: Callable[[Rows], None]) -> None:
        """Watch every batch once it is written (the live feed; call before `start`'s first batch)."""
        if self._pipeline is None:
            raise RuntimeError("the gateway is not started")
        self._pipeline.observe(observer)

    def swap_store(self, store: Store) -> None:
        """Point the gateway at another store (config reload); spooled batches follow."""
        old, self.store = self.store, store
        self._init_schema()
        if self._pipeline is not None:
            old = self._pipeline.swap_store(store)  # once no batch is being written to the old one
        old.close()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop taking requests, flush what is queued, and close."""
        if self._server is not None:
            self._server.stop(grace=min(2.0, timeout_s)).wait(timeout_s)
        if self._pipeline is not None:
            self._pipeline.shutdown(timeout_s)
        if self._http is not None:
            self._http.shutdown()


def build_agent(cfg: AgentConfig) -> Agent:
    """An agent for this host from its config (the host name is read here, and only here)."""
    host_name = socket.gethostname()
    cfg = dataclasses.replace(cfg, node_id=cfg.node_id or host_name)  # sources see the resolved id
    identity = AgentIdentity(node_id=cfg.node_id, host_name=host_name, cluster=cfg.cluster,
                             rack=cfg.rack, pod=cfg.pod, labels=dict(cfg.labels))
    clock: Clock = ScriptedClock(cfg.clock_script) if cfg.clock_script else time.time_ns
    headers = bearer_metadata(read_token(cfg.ingest_token_file)) if cfg.ingest_token_file else ()
    sources = build_sources(cfg)
    if cfg.reflex:  # a background part of the agent: started, stopped and given the event sink with the sources
        sources.append(build_reflex(cfg, identity=identity, clock=clock, headers=headers))
    control = None
    if cfg.control_keys_file and cfg.control_listen:  # signed route and job commands from the controller
        from ridethrough.actuators.control_agent import build_agent_control

        control = build_agent_control(cfg, identity=identity, headers=headers)
    return Agent(identity=identity, sources=sources, gateway=cfg.gateway,
                 export_interval_s=cfg.export_interval_s, export_timeout_s=cfg.export_timeout_s,
                 buffer_max_batches=cfg.buffer_max_batches, clock=clock, max_series=cfg.max_series,
                 prometheus_listen=cfg.prometheus_listen,
                 descriptions={m.name: m.description for m in catalogue.metrics()}, headers=headers,
                 services={"control": control} if control is not None else None,
                 on_link_change=("netdev",) if cfg.link_events else ())


def read_token(path: str) -> str:
    """The one token in ``path`` (surrounding whitespace dropped); ValueError naming the file, never the token."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"ingest_token_file {path}: cannot read it ({type(exc).__name__})") from None
    if not token or any(c.isspace() for c in token):
        raise ValueError(f"ingest_token_file {path}: expected one token on one line")
    return token


def build_reflex(cfg: AgentConfig, *, identity: AgentIdentity, clock: Clock,
                 headers: Sequence[tuple[str, str]] = ()) -> Reflex:
    """The agent's link reflex; its spans go to the gateway over OTLP, like the agent's events."""
    # Only an agent with the reflex pays for netlink's and the tracing SDK's imports.
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from ridethrough.actuators.reflex import from_config as reflex_from_config

    provider = TracerProvider(resource=identity.resource())
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(
        endpoint=cfg.gateway, insecure=True, timeout=cfg.export_timeout_s, headers=dict(headers))))
    host_time = HostTime(clock) if cfg.clock_script else None  # probe times on the host's (lab) clock
    return reflex_from_config(cfg, host_time=host_time, clock=clock, tracer_provider=provider)


@dataclass
class ControllerRuntime:
    """The controller alone (``ridethrough controller``), with its own /metrics."""

    cfg: ControllerConfig
    store: Store
    actuators: ActuatorConfig | None = None
    pager: PagerDutyConfig | None = None
    addresses: dict[str, str] = field(default_factory=dict)
    parts: ControllerParts | None = None
    _http: Any = None

    @property
    def controller(self) -> Controller | None:
        """The controller, once started."""
        return None if self.parts is None else self.parts.controller

    def start(self) -> dict[str, str]:
        """Load the detectors, start ticking, serve /metrics."""
        metrics = ControllerMetrics.create()
        self.parts = build_controller(self.cfg, store=self.store, metrics=metrics,
                                      event_metrics=GatewayMetrics.create(), actuators=self.actuators,
                                      pager=self.pager)
        self.parts.start()
        if self.cfg.metrics_listen:
            host, port = parse_hostport(self.cfg.metrics_listen)
            self._http, _ = start_http_server(port, addr=host, registry=metrics.registry)
            self.addresses["metrics"] = _address(host, self._http.server_port)
        return self.addresses

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop ticking and serving."""
        if self.parts is not None:
            self.parts.stop(timeout_s)
        if self._http is not None:
            self._http.shutdown()


class ServerRuntime:
    """The all-in-one server: one store client shared by the gateway, the store endpoint, the clock service
    and the controller."""

    def __init__(self, *, gateway_cfg: GatewayConfig, server_cfg: ServerConfig,
                 controller_cfg: ControllerConfig | None = None, actuator_cfg: ActuatorConfig | None = None,
                 pager_cfg: PagerDutyConfig | None = None) -> None:
        self.store = open_store(gateway_cfg)
        self._controller_cfg = controller_cfg if controller_cfg is not None else ControllerConfig()
        self._actuator_cfg = actuator_cfg
        self._pager_cfg = pager_cfg
        self.parts: ControllerParts | None = None
        self.gateway = GatewayRuntime(cfg=gateway_cfg, store=self.store)
        self._server_cfg = server_cfg
        self._endpoint: StoreHttpEndpoint | None = None
        self.clock: ClockService | None = None
        self._clock_http: ClockEndpoint | None = None
        self.addresses: dict[str, str] = {}

    def start(self) -> dict[str, str]:
        """Start the gateway, the read-only store endpoint, the clock service; write the ready file."""
        self.addresses.update(self.gateway.start())
        if self._server_cfg.store_http_listen:
            host, port = parse_hostport(self._server_cfg.store_http_listen)
            self._endpoint = StoreHttpEndpoint(client=self.store.client(), host=host, port=port,
                                               lock=self.store.lock)
            bound_host, bound_port = self._endpoint.start()
            self.addresses["store_http"] = f"http://{_address(bound_host, bound_port)}"
        self._start_clock()
        self._start_controller()
        if self.gateway.cfg.ready_file:
            write_ready_file(self.gateway.cfg.ready_file, self.addresses)
        return self.addresses

    def _start_clock(self) -> None:
        cfg = self._server_cfg
        if not cfg.clock_service:
            return
        self.clock = ClockService(store=self.store, metrics=self.gateway.metrics, window_s=cfg.clock_window_s,
                                  reference=cfg.clock_reference)
        self.clock.start()
        if cfg.clock_listen:
            host, port = parse_hostport(cfg.clock_listen)
            self._clock_http = ClockEndpoint(snapshot=self.clock.snapshot, host=host, port=port)
            bound_host, bound_port = self._clock_http.start()
            self.addresses["clock"] = f"http://{_address(bound_host, bound_port)}"

    def _start_controller(self) -> None:
        if not self._controller_cfg.enabled:
            return
        # Its metrics join the gateway's registry: one /metrics for the whole server.
        metrics = ControllerMetrics.create(self.gateway.metrics.registry)
        self.parts = build_controller(self._controller_cfg, store=self.store, metrics=metrics,
                                      event_metrics=self.gateway.metrics, actuators=self._actuator_cfg,
                                      pager=self._pager_cfg)
        controller = self.parts.controller
        # Fast detectors run as soon as their evidence is written, not on their next turn.
        self.gateway.observe(LiveFeed(controller.detectors, wake=controller.wake))
        self.parts.start()

    @property
    def controller(self) -> Controller | None:
        """The controller, once started (None when the config turns it off)."""
        return None if self.parts is None else self.parts.controller

    def stop(self) -> None:
        """Stop the controller, the clock service, the endpoints and the gateway."""
        if self.parts is not None:
            self.parts.stop()
        if self._clock_http is not None:
            self._clock_http.stop()
        if self.clock is not None:
            self.clock.stop()
        if self._endpoint is not None:
            self._endpoint.stop()
        self.gateway.stop()

    def __enter__(self) -> ServerRuntime:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
