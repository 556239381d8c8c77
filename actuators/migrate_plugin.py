"""The ``migrate`` actuator plugin: move training ranks off a GPU or host the detectors say is failing.

    incident gpu_failing h2/gpu3  ->  plan: on h2, move the rank on GPU 3 of every job to a hot spare
    apply   ->  the h2 agent's signed ``job.migrate {gpu: 3}`` (traced: a step span, traceparent sent);
                the agent asks each job's launcher on h2 (`ridethrough.actuators.job_commands`),
                which asks its coordinator: the rank moves at its next step boundary, nothing is redone
    verify  ->  ``job.status``: no rank on GPU 3 is still its original process
    rollback -> nothing to undo: a rank on a healthy spare stays there

Host incidents (``host`` entities) plan the same for every GPU of the host. A host that cannot be
reached (its agent silent, frozen) fails apply with the reason: the job's own launchers notice a
silent node by its heartbeat and recover its ranks reactively without the controller.

Registered under the entry-point group ``ridethrough.actuators`` as ``migrate``; the entry point
builds it from the environment (`MigrateConfig.from_environ`), the control client at first use,
so a controller without control keys still starts (and an apply then says what is missing).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ridethrough.actuators.contract import Deadline, FleetState, Plan, Result
from ridethrough.actuators.tracing import step
from ridethrough.detectors.incidents import Incident

KINDS = frozenset({"gpu_failing", "gpu_failed"})
"""GPU incident kinds this plugin acts on (besides any incident about a host)."""
NAME = "migrate"


_TARGET = "{node}:7450"


@dataclass(frozen=True, slots=True)
class MigrateConfig:
    """Where the plugin finds a node's agent."""

    agent_target: str = _TARGET
    """The agent control-plane address of a node (``{node}`` is replaced)."""

    def __post_init__(self) -> None:
        if "{node}" not in self.agent_target:
            raise ValueError(f"agent target {self.agent_target!r} must contain {{node}}")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> MigrateConfig:
        """``RIDETHROUGH_MIGRATE_AGENT_TARGET``, else the default (``{node}:7450``)."""
        return cls(environ.get("RIDETHROUGH_MIGRATE_AGENT_TARGET", _TARGET))


class JobControl(Protocol):
    """How the plugin reaches the jobs on a node (real: the node agent's control plane)."""

    def migrate(self, *, node: str, gpu: int, reason: str, key: str, timeout_s: float) -> Result:
        """Move the ranks on ``gpu`` of ``node`` (-1: all of its GPUs) to spares."""
        ...

    def remaining(self, *, node: str, gpu: int, key: str, timeout_s: float) -> Result:
        """Ok if no original rank process is left on ``gpu`` of ``node``."""
        ...


class AgentJobControl:
    """`JobControl` through agents' signed commands ``job.migrate`` and ``job.status``."""

    def __init__(self, client: Any, *, target: Callable[[str], str]) -> None:
        self._client = client
        self._target = target

    def migrate(self, *, node: str, gpu: int, reason: str, key: str, timeout_s: float) -> Result:
        return self._call(node, "job.migrate", {"gpu": gpu, "reason": reason[:200]}, key, timeout_s)

    def remaining(self, *, node: str, gpu: int, key: str, timeout_s: float) -> Result:
        return self._call(node, "job.status", {"gpu": gpu}, key, timeout_s)

    def _call(self, node: str, command: str, args: dict[str, Any], key: str, timeout_s: float) -> Result:
        from ridethrough.actuators.control_client import ControlCallError

        try:
            reply = self._client.call(target=self._target(node), node=node, command=command, args=args, key=key,
                                      timeout_s=timeout_s)
        except ControlCallError as exc:
            return Result.failure(f"{node}: {exc}; if the node is gone, its jobs' launchers recover its ranks "
                                  "when its heartbeat stops")
        return reply.to_result()  # type: ignore[no-any-return]  # a Reply


def target_of(incident: Incident) -> tuple[str, int] | None:
    """(node, GPU index or -1 for the whole host) the incident is about, or None if not this plugin's."""
    if incident.entity_type == "gpu" and incident.kind in KINDS:
        node, _, gpu = incident.entity.partition("/")
        digits = gpu.removeprefix("gpu")
        return (node, int(digits)) if node and digits.isdigit() else None
    if incident.entity_type == "host" and incident.entity:
        return incident.entity, -1
    return None


class MigratePlugin:
    """The ``migrate`` actuator (see the module docstring)."""

    name = NAME

    def __init__(self, control: JobControl | None = None, *, config: MigrateConfig | None = None,
                 build_control: Callable[[MigrateConfig], JobControl] | None = None) -> None:
        self._control = control
        self._config = config or MigrateConfig()
        self._build = build_control or _agent_control

    def plan(self, incident: Incident, fleet_state: FleetState) -> Plan | None:
        where = target_of(incident)
        if where is None:
            return None
        node, gpu = where
        what = f"GPU {gpu} of {node}" if gpu >= 0 else f"every GPU of {node}"
        return Plan.for_incident(
            NAME, incident, summary=f"move the training ranks on {what} to hot spares ({incident.kind})",
            steps=(f"ask {node}'s job launchers to move their ranks on {what} at the next step boundary",
                   f"check that no original rank is left on {what}"),
            params={"node": node, "gpu": str(gpu), "reason": f"{incident.kind} {incident.entity}"},
            drains_hosts=frozenset({node}) if gpu < 0 else frozenset())

    def apply(self, plan: Plan, deadline: Deadline) -> Result:
        control = self._control_or_none()
        if isinstance(control, Result):
            return control
        node, gpu = plan.params["node"], int(plan.params["gpu"])
        with step("migrate ranks", {"migrate.node": node, "migrate.gpu": gpu}):
            return control.migrate(node=node, gpu=gpu, reason=plan.params["reason"],
                                   key=f"{plan.idempotency_key}:migrate", timeout_s=deadline.remaining_s())

    def verify(self, plan: Plan, deadline: Deadline) -> Result:
        control = self._control_or_none()
        if isinstance(control, Result):
            return control
        return control.remaining(node=plan.params["node"], gpu=int(plan.params["gpu"]),
                                 key=f"{plan.idempotency_key}:verify", timeout_s=deadline.remaining_s())

    def rollback(self, plan: Plan, deadline: Deadline) -> Result:
        return Result.success("nothing to undo: a moved rank stays on its spare (the failing GPU is left idle)")

    def _control_or_none(self) -> JobControl | Result:
        if self._control is None:
            try:
                self._control = self._build(self._config)
            except (ValueError, OSError) as exc:  # no control keys, unreadable certificates
                return Result.failure(f"cannot reach agents: {exc}")
        return self._control


def _agent_control(cfg: MigrateConfig) -> JobControl:
    from ridethrough.actuators.control_client import (
        TARGETS_FILE_ENV,
        AgentTargets,
        ControlClientConfig,
        build_control_client,
    )

    client = build_control_client(ControlClientConfig.from_environ(os.environ), environ=os.environ)
    return AgentJobControl(client, target=AgentTargets(template=cfg.agent_target,
                                                       file=os.environ.get(TARGETS_FILE_ENV, "")))


def build() -> MigratePlugin:
    """The entry point's factory: configured from the environment (see `MigrateConfig.from_environ`)."""
    return MigratePlugin(config=MigrateConfig.from_environ(os.environ))
