"""The config model of each component, and the checks their fields share.

Every field carries ``help`` in its metadata: the same text feeds ``config show``, the JSON
Schema and the generated Helm values. Host names and other facts about the machine are not
looked up here; the composition root fills in empty fields such as ``AgentConfig.node_id``.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ridethrough.config import ConfigError, FrozenMap, Loaded, load
from ridethrough.dashboards.config import DashboardConfig
from ridethrough.exporters.pagerduty_config import PagerDutyConfig

_MiB = 1024 * 1024
_GiB = 1024 * _MiB
_STORE_SCHEMES = ("chdb", "http", "https")


def parse_hostport(text: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` (IPv6 as ``[::1]:4317``) into host and port; port 0 means any free port.

    Raises ValueError naming what is wrong.
    """
    host, sep, port = text.rpartition(":")
    if not sep or not host or any(c.isspace() for c in text):
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    if host.startswith("[") and host.endswith("]") and host[1:-1] and not set("[]") & set(host[1:-1]):
        host = host[1:-1]
    elif ":" in host or "[" in host or "]" in host:
        raise ValueError(f"expected HOST:PORT, IPv6 hosts in brackets like '[::1]:4317', got {text!r}")
    if not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise ValueError(f"expected a port from 0 to 65535 in {text!r}, got {port!r}")
    return host, int(port)


def check_listen(text: str) -> None:
    """An optional listen address: empty (off) or ``HOST:PORT``."""
    if text:
        parse_hostport(text)


def check_store_dsn(dsn: str) -> None:
    """A store DSN is ``chdb://PATH`` or ``http(s)://[USER:PASSWORD@]HOST:PORT/DB``."""
    scheme, sep, rest = dsn.partition("://")
    if not sep or scheme not in _STORE_SCHEMES or not rest:
        raise ValueError(f"expected chdb://PATH or http(s)://[USER:PASSWORD@]HOST:PORT/DB, got {dsn!r}")


def _help(text: str, **checks: Any) -> dict[str, Any]:
    return {"help": text, **checks}


@dataclass(frozen=True, slots=True, kw_only=True)
class IngestSecurity:
    """Who may send telemetry to a gateway: bearer tokens (tenant stamped from the token) and TLS.

    `GatewayConfig` carries these fields; `ridethrough.exporters.ingest_auth` enforces them.
    """

    tokens_file: str = field(default="", metadata=_help(
        "File of ingest bearer tokens, TENANT[/CLUSTER]=TOKEN lines (a mounted Secret works); re-read when it "
        "changes. Empty: none."))
    tokens_env: str = field(default="RIDETHROUGH_INGEST_TOKENS", metadata=_help(
        "Environment variable that may hold more tokens, TENANT[/CLUSTER]=TOKEN,...; empty: none."))
    require_token: bool = field(default=False, metadata=_help(
        "Refuse OTLP exports without a valid bearer token (UNAUTHENTICATED); off: a request without one is "
        "accepted unstamped (a wrong token is refused either way)."))
    tokens_reload_s: float = field(default=1.0, metadata=_help(
        "How often the tokens file is checked for changes, in seconds.", min=0.01))
    tls_cert_file: str = field(default="", metadata=_help("OTLP server certificate (PEM); empty: plaintext gRPC."))
    tls_key_file: str = field(default="", metadata=_help("OTLP server private key (PEM), with tls_cert_file."))
    tls_client_ca_file: str = field(default="", metadata=_help(
        "CA bundle (PEM) client certificates must chain to; set: mutual TLS is required."))

    def __post_init__(self) -> None:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file go together: set both or neither")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError("tls_client_ca_file (mutual TLS) needs tls_cert_file and tls_key_file")
        if self.tokens_reload_s <= 0:
            raise ValueError(f"tokens_reload_s must be positive, got {self.tokens_reload_s}")


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewayConfig(IngestSecurity):
    """The OTLP gateway: receives telemetry, batches it into the store, spools when the store is away."""

    otlp_listen: str = field(default="127.0.0.1:4317", metadata=_help(
        "OTLP/gRPC listen address, HOST:PORT (port 0 picks a free port).", check=parse_hostport))
    store: str = field(default="chdb://.ridethrough/store", metadata=_help(
        "ClickHouse DSN: chdb://PATH (embedded) or http(s)://USER:PASSWORD@HOST:8123/DB.",
        check=check_store_dsn, dsn=True))
    spool: str = field(default=".ridethrough/spool", metadata=_help(
        "Directory where batches wait while the store is unreachable."))
    metrics_listen: str = field(default="", metadata=_help(
        "Prometheus /metrics listen address, HOST:PORT; empty turns it off.", check=check_listen))
    ready_file: str = field(default="", metadata=_help(
        "File written with the bound addresses once the gateway serves; empty writes none."))
    cluster: str = field(default="", metadata=_help(
        "ClickHouse cluster name; non-empty makes table DDL run ON CLUSTER."))
    max_message_bytes: int = field(default=16 * _MiB, metadata=_help(
        "Largest accepted OTLP request, in bytes.", min=1024))
    max_attributes: int = field(default=128, metadata=_help(
        "Most attributes a point, span or log record may carry; one with more is rejected (partial success).", min=1))
    max_attribute_value_bytes: int = field(default=4096, metadata=_help(
        "Longest attribute value, in bytes; an item with a longer one is rejected (partial success).", min=1))
    batch_max_rows: int = field(default=50_000, metadata=_help(
        "Rows per insert batch before it is flushed.", min=1))
    batch_max_age_s: float = field(default=0.2, metadata=_help(
        "Longest a row waits in a batch before it is flushed, in seconds.", min=0))
    spool_max_bytes: int = field(default=1 * _GiB, metadata=_help(
        "Largest total size of the on-disk spool, in bytes.", min=0))
    replay_initial_backoff_s: float = field(default=0.5, metadata=_help(
        "First wait before replaying the spool to a store that failed, in seconds.", min=0))
    replay_max_backoff_s: float = field(default=30.0, metadata=_help(
        "Longest wait between spool replay attempts, in seconds.", min=0))
    store_timeout_s: float = field(default=10.0, metadata=_help(
        "Timeout of one store request, in seconds.", min=0.01))
    workers: int = field(default=16, metadata=_help("gRPC handler threads.", min=1))

    def __post_init__(self) -> None:
        IngestSecurity.__post_init__(self)  # (zero-argument super() breaks in slotted dataclasses)
        if self.replay_initial_backoff_s > self.replay_max_backoff_s:
            raise ValueError(
                f"replay_initial_backoff_s ({self.replay_initial_backoff_s}) must not exceed "
                f"replay_max_backoff_s ({self.replay_max_backoff_s})")


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    """The all-in-one process: owns an embedded store and hosts the gateway and more around it."""

    store_http_listen: str = field(default="127.0.0.1:0", metadata=_help(
        "Read-only ClickHouse-compatible HTTP endpoint over the owned store, HOST:PORT; empty turns it off.",
        check=check_listen))
    store_http_ready_file: str = field(default="", metadata=_help(
        "File written with the store HTTP address once it serves; empty writes none."))
    clock_service: bool = field(default=True, metadata=_help(
        "Run the clock service: solve the agents' pairwise clock estimates into per-node corrections."))
    clock_window_s: float = field(default=2.0, metadata=_help(
        "How often the clock service solves and publishes, in seconds (the agents' estimate window).", min=0.1))
    clock_reference: str = field(default="", metadata=_help(
        "Node whose clock the corrections are relative to; empty: the lexicographically first node seen."))
    clock_listen: str = field(default="127.0.0.1:0", metadata=_help(
        "Where the clock service answers GET /clock/corrections, HOST:PORT; empty turns the endpoint off.",
        check=check_listen))


@dataclass(frozen=True, slots=True, kw_only=True)
class ControllerConfig:
    """The controller: runs the detectors on their schedules against the store and tracks incidents."""

    enabled: bool = field(default=True, metadata=_help(
        "Run the controller inside `ridethrough server` (the standalone `controller` command always runs it)."))
    interval_floor_s: float = field(default=1.0, metadata=_help(
        "Shortest interval any detector runs at, in seconds (a detector asking for less gets this).", min=0.05))
    quiet_s: float = field(default=30.0, metadata=_help(
        "Seconds without a finding before an incident resolves.", min=0))
    reopen_hysteresis_s: float = field(default=120.0, metadata=_help(
        "A key found again within this many seconds of resolving reopens the same incident.", min=0))
    metrics_listen: str = field(default="", metadata=_help(
        "The standalone controller's /metrics HOST:PORT; empty turns it off (in the server, its metrics "
        "are on the gateway's /metrics).", check=check_listen))
    cluster: str = field(default="", metadata=_help(
        "Fleet cluster whose data the detectors read and whose incidents this controller owns; empty: all."))
    fabric_map_file: str = field(default="", metadata=_help(
        "JSON fabric map: the links each probed path may cross and the link each NIC is cabled to "
        "(ridethrough.detectors.fabric_map); re-read when it changes. Empty: findings name NICs, and "
        "tomography is off."))


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentConfig:
    """The node agent: samples its sources and exports them to a gateway."""

    gateway: str = field(default="127.0.0.1:4317", metadata=_help(
        "Gateway OTLP/gRPC address, HOST:PORT.", check=parse_hostport))
    ingest_token_file: str = field(default="", metadata=_help(
        "File holding this node's ingest bearer token (a mounted Secret), read once at start and sent "
        "with every export; empty: none."))
    node_id: str = field(default="", metadata=_help("This node's identity; empty means the host name."))
    cluster: str = field(default="default", metadata=_help("Cluster this node belongs to."))
    rack: str = field(default="", metadata=_help("Rack of this node; empty if unknown."))
    pod: str = field(default="", metadata=_help(
        "Pod (network pod or Kubernetes pod) of this node; empty if unknown."))
    labels: Mapping[str, str] = field(default=FrozenMap(), metadata=_help(
        "Extra resource attributes, KEY=VALUE,... in env and flags."))
    sysfs_root: str = field(default="/sys", metadata=_help(
        "Where sysfs is mounted; point it at a captured tree to replay one."))
    sources: tuple[str, ...] = field(default=("netdev", "infiniband", "ethtool", "gpu", "job", "probe"), metadata=_help(
        "Sources to sample, comma-separated in env and flags (a source with nothing to read stays idle)."))
    interval_s: float = field(default=1.0, metadata=_help("Sampling interval, in seconds.", min=0.01))
    link_events: bool = field(default=True, metadata=_help(
        "Also read and export link state the moment the kernel reports a link change (rtnetlink), "
        "not only every interval."))
    clock_script: str = field(default="", metadata=_help(
        "A lab host's clock file (offset, drift, steps); empty reads the system clock."))
    clock_corrections_url: str = field(default="", metadata=_help(
        "The clock service's GET /clock/corrections URL, polled for per-node clock corrections that turn probe "
        "timestamps into one-way delays; empty: one-way delays are half the RTT."))
    gpu_script: str = field(default="", metadata=_help(
        "A lab host's fake-GPU script (gpus.json); empty reads real GPUs through NVML."))
    job_socket: str = field(default="/run/ridethrough/job.sock", metadata=_help(
        "Unix socket where training processes report step events (source `job`)."))
    prometheus_listen: str = field(default="", metadata=_help(
        "Also serve the agent's metrics at /metrics on HOST:PORT; empty turns it off.", check=check_listen))
    probe_peers_file: str = field(default="", metadata=_help(
        "Probe mesh peers, JSON {node: {nic: \"ip[:port]\"}} (re-read when it changes); empty: no probing."))
    probe_port: int = field(default=7447, metadata=_help("UDP port the probe responder answers on.",
                                                         min=1, max=65535))
    probe_k: int = field(default=10, metadata=_help("Random peers probed (re-drawn slowly).", min=0))
    probe_pinned: tuple[str, ...] = field(default=(), metadata=_help(
        "Peers always probed, e.g. the nodes of this node's jobs."))
    probe_interval_s: float = field(default=0.5, metadata=_help(
        "Seconds between rounds of coded probe pairs on every path.", min=0.01))
    probe_pair_gap_us: float = field(default=20.0, metadata=_help(
        "Gap between the two probes of a coded pair, in microseconds.", min=1.0))
    probe_timeout_s: float = field(default=1.0, metadata=_help(
        "Wait for a reply before a probe counts as lost (or, if the peer was stalled, late), in seconds.",
        min=0.01))
    probe_late_s: float = field(default=10.0, metadata=_help(
        "How long past its timeout a probe whose peer has answered nothing since may still be answered late "
        "(a stalled peer) before it is judged, in seconds.", min=0.0))
    max_series: int = field(default=100_000, metadata=_help(
        "Most distinct attribute combinations the agent keeps; new ones beyond are dropped and counted.",
        min=1))
    export_interval_s: float = field(default=1.0, metadata=_help(
        "Interval between exports to the gateway, in seconds.", min=0.01))
    # OpenTelemetry's own default (OTEL_EXPORTER_OTLP_TIMEOUT): the gateway answers once the batch is stored,
    # and behind a busy store that took more than 5 s; a call given up is sent again, which costs twice.
    export_timeout_s: float = field(default=10.0, metadata=_help(
        "Timeout of one export to the gateway, in seconds.", min=0.01))
    buffer_max_batches: int = field(default=300, metadata=_help(
        "Batches kept while the gateway is away (metrics and events each); the oldest are dropped beyond this.", min=1))
    # The reflex rewrites this host's routing table (it needs CAP_NET_ADMIN, the probe responder
    # on every peer and a multi-rail host whose stable addresses it may override), so turning it
    # on is a deployment decision: off by default, on in the lab (`ridethrough.lab.supervisor`).
    reflex: bool = field(default=False, metadata=_help(
        "Run the link reflex: move a peer's traffic off a rail whose probes fail, within ~100 ms, and back "
        "after the hold-down (needs CAP_NET_ADMIN, probe_peers_file and reflex_peers_file)."))
    reflex_peers_file: str = field(default="", metadata=_help(
        "Each peer's stable address (what its jobs bind to), JSON {node: \"ip\"}; re-read when it changes."))
    reflex_watch: str = field(default="active", metadata=_help(
        "Peers the reflex probes: 'active' (those this host has TCP connections to, for a minute after) or "
        "'all'.", choices=("active", "all")))
    reflex_interval_ms: float = field(default=10.0, metadata=_help(
        "Milliseconds between liveness probes on each rail to each watched peer.", min=1.0, max=1000.0))
    reflex_max_probes_per_s: float = field(default=500.0, metadata=_help(
        "Most liveness probes a second in all: with many watched rails and peers, each is probed less often "
        "than reflex_interval_ms (and failures are noticed later) rather than the cost growing.", min=10.0))
    reflex_timeout_ms: float = field(default=30.0, metadata=_help(
        "Shortest wait, in ms, for a liveness probe's reply before it counts as lost; the wait follows the round "
        "trips seen (srtt + 4 x rttvar, as TCP's RTO), up to 250 ms.", min=1.0, max=250.0))
    reflex_losses: int = field(default=2, metadata=_help(
        "Bad probes in a row on one source port (lost or slower than reflex_delay_ms) that take a rail down; "
        "the second is sent as soon as the first fails.", min=1, max=100))
    reflex_delay_ms: float = field(default=10.0, metadata=_help(
        "Network round trip (the responder's turnaround left out) above which a probe counts as bad.", min=0.01))
    reflex_holddown_s: float = field(default=2.0, metadata=_help(
        "Seconds a failed rail must answer without a bad probe before traffic returns to it.", min=0.01))
    reflex_holddown_max_s: float = field(default=60.0, metadata=_help(
        "A rail failing again within this many seconds of its return waits twice as long next time, up to "
        "this (flap damping; equal to reflex_holddown_s turns damping off).", min=0.01))
    reflex_flows: int = field(default=16, metadata=_help(
        "Source ports each NIC probes from, in turn, so every spine behind a rail is hashed to.", min=1, max=256))
    reflex_rto_min_ms: int = field(default=50, metadata=_help(
        "TCP's minimum retransmission timeout locked on rerouted routes, in ms (0: the kernel's 200 ms).",
        min=0, max=10_000))
    # The control plane runs signed commands from the controller (`ridethrough.actuators.control_agent`):
    # on only where a key file is given, since without keys no command could be checked.
    control_listen: str = field(default="0.0.0.0:7450", metadata=_help(
        "Control-plane gRPC listen address, HOST:PORT (route and job commands from the controller); it runs "
        "when control_keys_file is set; empty turns it off.", check=check_listen))
    control_keys_file: str = field(default="", metadata=_help(
        "File of HMAC keys that the controller's commands must be signed with, KEY_ID=HEX lines (a mounted "
        "Secret; `openssl rand -hex 32` makes a key); empty: no control plane."))
    control_key_ids: tuple[str, ...] = field(default=(), metadata=_help(
        "Key ids accepted (rotation: list the old and the new); empty accepts every key in the file."))
    control_tls_cert_file: str = field(default="", metadata=_help(
        "Control-plane server certificate (PEM); empty serves without TLS (commands are still signed)."))
    control_tls_key_file: str = field(default="", metadata=_help(
        "Control-plane server private key (PEM), with control_tls_cert_file."))
    control_tls_client_ca_file: str = field(default="", metadata=_help(
        "CA bundle (PEM) the controller's client certificate must chain to; set: mutual TLS is required."))
    job_run_dir: str = field(default="", metadata=_help(
        "Directory of the job launchers' control sockets, for job.migrate and job.status; empty: the "
        "launcher's default ($XDG_RUNTIME_DIR/ridethrough, else a per-user one under the temp dir)."))

    def __post_init__(self) -> None:
        # direct construction may pass a plain dict; keep the config immutable and hashable
        object.__setattr__(self, "labels", FrozenMap(self.labels))
        if bool(self.control_tls_cert_file) != bool(self.control_tls_key_file):
            raise ValueError("control_tls_cert_file and control_tls_key_file go together: set both or neither")
        if self.control_tls_client_ca_file and not self.control_tls_cert_file:
            raise ValueError("control_tls_client_ca_file (mutual TLS) needs control_tls_cert_file and "
                             "control_tls_key_file")
        if self.reflex_holddown_max_s < self.reflex_holddown_s:
            raise ValueError(f"reflex_holddown_max_s ({self.reflex_holddown_max_s}) must not be below "
                             f"reflex_holddown_s ({self.reflex_holddown_s})")


@dataclass(frozen=True, slots=True, kw_only=True)
class ActuatorConfig:
    """The actuator runner inside the controller: which incidents it acts on, and how cautiously
    (mirrors `ridethrough.actuators.policy.RunnerPolicy`, which checks the values again)."""

    enabled: bool = field(default=False, metadata=_help(
        "Run the actuator runner in the controller (plugins from the ridethrough.actuators entry points)."))
    dry_run: bool = field(default=True, metadata=_help(
        "Decide and record every action, apply none (acting is opted into)."))
    max_concurrent: int = field(default=2, metadata=_help("Actions in flight at once, awaiting approval included.",
                                                          min=1))
    max_drained_hosts: int = field(default=1, metadata=_help(
        "Hosts out of service at once, already drained ones included.", min=0))
    max_path_share: float = field(default=0.5, metadata=_help(
        "Largest share (0..1) of one host's or one switch's paths an action may remove.", min=0, max=1))
    cooldown_s: float = field(default=300.0, metadata=_help(
        "Seconds after an action on an entity ends before another may act on it.", min=0))
    hysteresis_s: float = field(default=10.0, metadata=_help(
        "Seconds an incident must have been open before it is acted on.", min=0))
    require_approval: bool = field(default=False, metadata=_help("Every plan waits for a human's approval."))
    approval_timeout_s: float = field(default=600.0, metadata=_help(
        "Seconds a plan waits for approval before it is refused.", min=0.001))
    plan_timeout_s: float = field(default=5.0, metadata=_help("Deadline of a plugin's plan step, seconds.", min=0.001))
    apply_timeout_s: float = field(default=60.0, metadata=_help("Deadline of the apply step, seconds.", min=0.001))
    verify_timeout_s: float = field(default=60.0, metadata=_help("Deadline of the verify step, seconds.", min=0.001))
    rollback_timeout_s: float = field(default=60.0, metadata=_help("Deadline of a rollback, seconds.", min=0.001))


COMPONENTS: Mapping[str, type] = MappingProxyType({
    "agent": AgentConfig,
    "gateway": GatewayConfig,
    "server": ServerConfig,
    "controller": ControllerConfig,
    "actuators": ActuatorConfig,
    "pagerduty": PagerDutyConfig,
    "dashboard": DashboardConfig,
})


def load_component(
    component: str,
    *,
    file: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, object] | None = None,
) -> Loaded[Any]:
    """Load one component's config; the file may hold sections for any of :data:`COMPONENTS`."""
    model = COMPONENTS.get(component)
    if model is None:
        match = difflib.get_close_matches(component, list(COMPONENTS), n=1)
        hint = f" (did you mean {match[0]!r}?)" if match else ""
        raise ConfigError(f"unknown component {component!r}; known: {', '.join(COMPONENTS)}{hint}")
    return load(model, component=component, file=file, env=env, flags=flags, known_sections=COMPONENTS)
