"""The agent's control plane, built from the agent's config: signed route and job commands.

`build_agent_control` is what `ridethrough.wiring.build_agent` calls: when the agent's config
names a key file (``control_keys_file``), the agent serves `ridethrough.actuators.control_plane`
on ``control_listen`` (default ``0.0.0.0:7450``) with

* ``ping``;
* ``route.set``, ``route.restore`` and ``route.get`` over this host's routing table
  (`ridethrough.actuators.reroute_netlink`: only the routes the controller set are touched);
* ``job.migrate`` and ``job.status`` for the job launchers whose sockets are in ``job_run_dir``
  (`ridethrough.actuators.job_commands`).

Keys come from the file only (never from the command line or a log line); TLS, and mutual TLS
when a client CA is given, from the ``control_tls_*`` files. The agent's command spans go to
the gateway over OTLP, with the agent's ingest token, as children of the controller's steps.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ridethrough.actuators.commands import builtin_registry
from ridethrough.actuators.control_plane import (
    SCOPE,
    ControlPlaneConfig,
    ControlPlaneServer,
    agent_tracer_provider,
    build_control_plane,
)

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from ridethrough.collector.identity import AgentIdentity
    from ridethrough.settings import AgentConfig


class AgentControl:
    """The control-plane server and the tracer provider its spans leave through (an agent `Service`)."""

    def __init__(self, server: ControlPlaneServer, provider: TracerProvider) -> None:
        self.server = server
        self._provider = provider

    def start(self) -> str:
        """Serve; returns the bound address."""
        return self.server.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving, then flush the command spans."""
        self.server.stop(timeout_s)
        self._provider.shutdown()


def control_config(cfg: AgentConfig) -> ControlPlaneConfig:
    """The control-plane settings in the agent's config (keys from ``control_keys_file`` only)."""
    return ControlPlaneConfig(listen=cfg.control_listen, secret_file=cfg.control_keys_file, secret_env="",
                              key_ids=cfg.control_key_ids, tls_cert_file=cfg.control_tls_cert_file,
                              tls_key_file=cfg.control_tls_key_file,
                              tls_client_ca_file=cfg.control_tls_client_ca_file)


def build_agent_control(cfg: AgentConfig, *, identity: AgentIdentity,
                        headers: Sequence[tuple[str, str]] = ()) -> AgentControl | None:
    """The agent's control plane, or None when the config turns it off (no key file, or no listen address).

    A key file that cannot be read or holds no usable key is a ValueError here, at start.
    """
    if not cfg.control_keys_file or not cfg.control_listen:
        return None
    from ridethrough.actuators.job_commands import register_job_commands
    from ridethrough.actuators.reroute_netlink import NetlinkRouteOps
    from ridethrough.actuators.run_cli import default_run_dir

    plane_cfg = control_config(cfg)
    registry = builtin_registry(node_id=cfg.node_id, clock=time.time_ns, route_ops=NetlinkRouteOps())
    register_job_commands(registry, run_dir=cfg.job_run_dir or default_run_dir())
    provider = agent_tracer_provider(resource=identity.resource(), gateway=cfg.gateway,
                                     timeout_s=cfg.export_timeout_s, headers=headers)
    try:
        # The real clock, not a lab host's scripted one: command times are the controller's wall clock.
        server = build_control_plane(plane_cfg, node_id=cfg.node_id, registry=registry,
                                     tracer=provider.get_tracer(SCOPE), environ={}, clock=time.time_ns)
    except ValueError:
        provider.shutdown()
        raise
    return AgentControl(server, provider)
