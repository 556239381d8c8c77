"""The ``reroute`` actuator plugin: take every path off a bad link, from the controller, through the agents.

    incident link_down leaf0r1-spine0  ->  plan: with a switch map, drain it at the leaves: each ingress
                                           leaf routes the prefixes behind the far leaf off that uplink
                                           (`ridethrough.actuators.reroute_drain`: the pairs keep their
                                           rail); else, or for a host link, on each host whose traffic may
                                           cross it, route each affected peer's stable address (/32) out of
                                           the other NICs (`ridethrough.actuators.reroute_plan`); never
                                           the last path
    apply    ->  per host (a step span), per destination: the agent's signed ``route.get`` (the host's
                 own route beneath, with its gateways) then ``route.set`` of that route less the NICs
                 (or uplinks) to avoid, at metric `CENTRAL_METRIC`; each call is a child step carrying
                 ``traceparent``. A leaf is called like a host: it runs the same control plane
    verify   ->  ``route.get`` again: our route is there, the kernel sends the peer's traffic out of
                 at least one NIC and out of none that reaches the link; then, with the controller's
                 store (`use_store`), the agents' probes since the apply: every pair gets through on
                 each rail it now uses, and none of those rails crosses the link; for a drain, every
                 probed direction that crossed the link gets through again over the routes left
                 (`ridethrough.actuators.reroute_verify`)
    rollback ->  ``route.restore`` with the route ``route.set`` replaced, passed back explicitly (so an
                 agent restarted meanwhile still restores it; after a controller restart, the agent's
                 own record of it)

It acts on incidents about a link (``entity_type`` ``link``) of the kinds in `KINDS`. The agents'
reflex keeps working on top: the controller's /32 is the base its overrides copy.

Registered under the entry-point group ``ridethrough.actuators`` as ``reroute``; `build` reads its
settings from the environment (`RerouteConfig.from_environ`), the control client (keys, TLS:
`ControlClientConfig.from_environ`) is built at first use, so a controller without keys still starts.
The controller hands it its store (`use_store`); without one the route readback alone verifies.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ridethrough.actuators.commands import format_hops, parse_hops
from ridethrough.actuators.contract import Deadline, FleetState, Plan, Result
from ridethrough.actuators.control_client import ControlCallError, Reply
from ridethrough.actuators.reroute_drain import decode_flows, encode_flows, flow_rails, plan_drain
from ridethrough.actuators.reroute_plan import (
    AddressFile,
    HostChange,
    by_host,
    decode_changes,
    describe,
    encode_changes,
    plan_avoid,
)
from ridethrough.actuators.reroute_verify import PairRails, ProbeVerifier, ProbeVerifyConfig, route_problems, used_nics
from ridethrough.actuators.switch_map import SwitchFile, SwitchMap
from ridethrough.actuators.tracing import step
from ridethrough.detectors.controller import read_only_query
from ridethrough.detectors.fabric_map import RouteFile, RouteMap
from ridethrough.detectors.incidents import Incident

if TYPE_CHECKING:
    from ridethrough.exporters.store import Store

log = logging.getLogger(__name__)
NAME = "reroute"
KINDS = frozenset({"link_down", "link_degrading", "link_flap"})
"""Incident kinds about a link that this plugin routes around."""
CENTRAL_METRIC = 100
"""Metric of the controller's routes: above the reflex's overrides (0), so those win while they last."""
_RETRY_S = 0.25


class Client(Protocol):
    """What the plugin needs of a control client (`ridethrough.actuators.control_client.ControlClient`)."""

    def call(self, *, target: str, node: str, command: str, key: str, args: Mapping[str, Any] | None = None,
             timeout_s: float = 5.0, traceparent: str | None = None) -> Reply:
        """Run one command on one agent; `ControlCallError` when there is no reply."""
        ...


@dataclass(frozen=True, slots=True)
class RerouteConfig:
    """Where the plugin finds the fabric, the hosts' stable addresses and their agents."""

    fabric_map_file: str = ""
    """The fabric map (`RouteMap` JSON); empty: the plugin plans nothing."""
    addresses_file: str = ""
    """Each host's stable address, JSON ``{node: "ip"}`` (the agents' reflex peers file)."""
    switches_file: str = ""
    """The leaves' prefixes and uplink ports (`ridethrough.actuators.switch_map`); empty: hosts only."""
    agent_target: str = "{node}:7450"
    targets_file: str = ""
    """JSON ``{node: "HOST:PORT"}`` of the agents (`control_client.AgentTargets`); else ``agent_target``."""
    call_timeout_s: float = 10.0
    probes: ProbeVerifyConfig = field(default_factory=ProbeVerifyConfig)
    """How verify reads the probes (when the plugin has a store)."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> RerouteConfig:
        """``RIDETHROUGH_REROUTE_FABRIC_MAP_FILE`` (else the controller's ``..._CONTROLLER_FABRIC_MAP_FILE``),
        ``RIDETHROUGH_REROUTE_ADDRESSES_FILE``, ``RIDETHROUGH_REROUTE_SWITCHES_FILE``,
        ``RIDETHROUGH_REROUTE_AGENT_TARGET``,
        ``RIDETHROUGH_CONTROL_TARGETS_FILE`` and the ``RIDETHROUGH_REROUTE_PROBE_*`` of `ProbeVerifyConfig`."""
        return cls(fabric_map_file=environ.get("RIDETHROUGH_REROUTE_FABRIC_MAP_FILE")
                   or environ.get("RIDETHROUGH_CONTROLLER_FABRIC_MAP_FILE", ""),
                   addresses_file=environ.get("RIDETHROUGH_REROUTE_ADDRESSES_FILE", ""),
                   switches_file=environ.get("RIDETHROUGH_REROUTE_SWITCHES_FILE", ""),
                   agent_target=environ.get("RIDETHROUGH_REROUTE_AGENT_TARGET") or "{node}:7450",
                   targets_file=environ.get("RIDETHROUGH_CONTROL_TARGETS_FILE", ""),
                   probes=ProbeVerifyConfig.from_environ(environ))


class ReroutePlugin:
    """The ``reroute`` actuator (see the module docstring)."""

    name = NAME

    def __init__(self, client: Client | None = None, *, config: RerouteConfig | None = None,
                 target: Callable[[str], str] | None = None,
                 build_client: Callable[[RerouteConfig], tuple[Client, Callable[[str], str]]] | None = None,
                 fabric: Callable[[], RouteMap] | None = None,
                 addresses: Callable[[], Mapping[str, str]] | None = None, probes: ProbeVerifier | None = None,
                 switches: Callable[[], SwitchMap | None] | None = None) -> None:
        self._config = config or RerouteConfig()
        self._client = client
        self._target = target or (lambda node: self._config.agent_target.format(node=node))
        self._build = build_client or _agent_client
        self._fabric = fabric
        self._addresses = addresses or (AddressFile(self._config.addresses_file) if self._config.addresses_file
                                        else dict)
        self._switches = switches or (SwitchFile(self._config.switches_file) if self._config.switches_file
                                      else lambda: None)
        self._set: dict[tuple[str, str, str], dict[str, Any]] = {}  # (plan, host, destination) -> route.set data
        self._applied_ns: dict[str, int] = {}  # plan -> wall clock when its routes were all set
        self._probes = probes
        self._explained: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._reads = itertools.count()

    def use_store(self, store: Store) -> None:
        """Verify with the probes in ``store`` too (the controller's; unless the config turns probe checks off)."""
        if self._config.probes.enabled and self._probes is None:
            self._probes = ProbeVerifier(read_only_query(store), config=self._config.probes)

    # -- planning --------------------------------------------------------------------------

    def plan(self, incident: Incident, fleet_state: FleetState) -> Plan | None:
        if incident.entity_type != "link" or incident.kind not in KINDS:
            return None
        fmap = self._route_map()
        if fmap is None:
            self._explain(incident, "no fabric map (RIDETHROUGH_REROUTE_FABRIC_MAP_FILE): cannot tell which "
                                    "hosts' traffic crosses the link")
            return None
        switches, drain_refusal = self._switches(), ""
        if switches is not None and switches.leaf_of(incident.entity) is not None:
            drain = plan_drain(fmap, incident.entity, switches)
            if not drain.refusal:
                return Plan.for_incident(
                    NAME, incident,
                    steps=(*describe(drain.changes), "read every route back; check every crossing pair gets through"),
                    summary=f"drain {incident.entity} ({incident.kind}) at the leaves: {len(drain.changes)} prefixes "
                            f"on {len(by_host(drain.changes))} leaves",
                    params={"link": incident.entity, "at": "leaves", "changes": encode_changes(drain.changes),
                            "flows": encode_flows(drain.flows), "baseline_until_ns": self._baseline_until(incident)},
                    removes_paths=drain.removed_paths)
            drain_refusal = f"leaves: {drain.refusal}; hosts: "
        avoid = plan_avoid(fmap, incident.entity, self._addresses())
        if avoid.refusal:
            self._explain(incident, drain_refusal + avoid.refusal)
            return None
        return Plan.for_incident(
            NAME, incident, steps=(*describe(avoid.changes), "read every route back; check every pair keeps a path"),
            summary=f"route traffic off {incident.entity} ({incident.kind}): {len(avoid.changes)} destinations "
                    f"on {len(by_host(avoid.changes))} hosts",
            params={"link": incident.entity, "changes": encode_changes(avoid.changes),
                    "baseline_until_ns": self._baseline_until(incident)},
            removes_paths=avoid.removed_paths)

    def _baseline_until(self, incident: Incident) -> str:
        """Where the rails' history before the fault ends: the probes' baseline for verify (a plan param)."""
        return str(max(0, incident.opened_at_ns - round(self._config.probes.fault_lead_s * 1e9)))

    def _route_map(self) -> RouteMap | None:
        if self._fabric is None and self._config.fabric_map_file:
            try:
                self._fabric = RouteFile(self._config.fabric_map_file)
            except ValueError as exc:
                log.warning("reroute: %s", exc)
        return self._fabric() if self._fabric is not None else None

    def _explain(self, incident: Incident, why: str) -> None:
        if (incident.incident_id, why) not in self._explained:  # once per incident and reason, not every round
            self._explained.add((incident.incident_id, why))
            log.warning("reroute: no plan for %s %s (incident %s): %s", incident.kind, incident.entity,
                        incident.incident_id, why)

    # -- acting ----------------------------------------------------------------------------

    def apply(self, plan: Plan, deadline: Deadline) -> Result:
        client = self._client_or_failure()
        if isinstance(client, Result):
            return client
        link, changes, t0 = plan.params["link"], decode_changes(plan.params["changes"]), time.monotonic()
        for host, group in by_host(changes).items():
            with step(f"reroute {host}", {"reroute.host": host, "reroute.link": link,
                                          "reroute.destinations": len(group)}):
                for c in group:
                    done = self._set_one(client, plan, c, deadline)
                    if not done.ok:
                        return done
        with self._lock:
            self._applied_ns[plan.idempotency_key] = time.time_ns()  # probes older than this say nothing of it
        nodes = "leaves" if plan.params.get("at") == "leaves" else "hosts"
        return Result.success(f"{len(changes)} routes on {len(by_host(changes))} {nodes} now avoid {link}",
                              routes_s=time.monotonic() - t0)

    def _set_one(self, client: Client, plan: Plan, c: HostChange, deadline: Deadline) -> Result:
        key = plan.idempotency_key
        base = self._call(client, c.host, "route.get", {"destination": c.destination}, f"{key}:base:{c.destination}",
                          deadline)
        if isinstance(base, Result):
            return base
        hops = tuple(h for h in parse_hops(str(base.data.get("base", ""))) if h[0] not in c.avoid)
        if not hops:
            return Result.failure(f"{c.host}: its own route to {c.peer} ({c.destination}) has no nexthop besides "
                                  f"{', '.join(c.avoid)} ({base.data.get('base') or 'none'}); not removing the "
                                  "last path")
        args = {"destination": c.destination, "dev": hops[0][0], "via": hops[0][1], "more": format_hops(hops[1:]),
                "metric": CENTRAL_METRIC}
        reply = self._call(client, c.host, "route.set", args, f"{key}:set:{c.destination}", deadline)
        if isinstance(reply, Result):
            return reply
        if not reply.ok:
            return reply.to_result()
        with self._lock:
            self._set[(key, c.host, c.destination)] = dict(reply.data)
        return Result.success()

    def verify(self, plan: Plan, deadline: Deadline) -> Result:
        client = self._client_or_failure()
        if isinstance(client, Result):
            return client
        with self._lock:  # after a runner restart (no apply here): only probes from now on count
            since_ns = self._applied_ns.pop(plan.idempotency_key, 0) or time.time_ns()  # one verify per apply
        since_ns += round(self._config.probes.settle_s * 1e9)
        changes, problems, rails = decode_changes(plan.params["changes"]), [], []
        for c in changes:
            got = self._call(client, c.host, "route.get", {"destination": c.destination},
                             f"{plan.idempotency_key}:read{next(self._reads)}:{c.destination}", deadline)
            if isinstance(got, Result):
                return got
            problems += route_problems(c, got.data)
            rails.append(PairRails(c.host, c.peer, used_nics(got.data)))
        link, drained = plan.params["link"], plan.params.get("at") == "leaves"
        if problems:
            return Result.failure(f"{len(problems)} of {len(changes)} routes wrong: {'; '.join(problems[:5])}")
        routes = f"{len(changes)} routes read back: none leaves through {link}'s {'uplinks' if drained else 'NICs'}"
        if self._probes is None:
            return Result.success(f"{routes}, every pair keeps a path")
        fmap = self._route_map()
        if fmap is None:  # a plan taken over after a restart whose map is gone: the probes' paths are unknown
            return Result.failure(f"{routes}; probes: no fabric map to tell which rails cross {link}")
        if drained:  # the pairs keep their rails; what must change is which routes those rails may take
            rails, fmap = flow_rails(decode_flows(plan.params["flows"])), fmap.without(link)
        probed = self._probes.verify(link=link, pairs=rails, routes=fmap, since_ns=since_ns, cluster=plan.cluster,
                                     deadline=deadline, baseline_until_ns=int(plan.params.get("baseline_until_ns", 0)))
        return dataclasses.replace(probed, detail=f"{routes}; {probed.detail}")

    def rollback(self, plan: Plan, deadline: Deadline) -> Result:
        client = self._client_or_failure()
        if isinstance(client, Result):
            return client
        key, failed, undone = plan.idempotency_key, [], 0
        for host, group in by_host(decode_changes(plan.params["changes"])).items():
            with step(f"restore {host}", {"reroute.host": host, "reroute.destinations": len(group)}):
                for c in group:
                    with self._lock:
                        before = self._set.get((key, host, c.destination))
                    # What route.set replaced, passed back (an agent restarted since has forgotten it); a
                    # controller restarted since has forgotten it instead: then the agent's own record.
                    args = {"destination": c.destination, **(before or {})}
                    reply = self._call(client, host, "route.restore", args, f"{key}:restore:{c.destination}",
                                       deadline)
                    if isinstance(reply, Result):
                        failed.append(reply.detail)
                    elif reply.ok:
                        undone += 1
                    elif before is not None:
                        failed.append(f"{host}: {reply.detail}")
                    # else: neither side has a record, so this plan never set it (apply stopped earlier)
        if failed:
            return Result.failure(f"{len(failed)} routes not restored: {'; '.join(failed[:5])}")
        return Result.success(f"{undone} routes restored")

    # -- calls -----------------------------------------------------------------------------

    def _call(self, client: Client, node: str, command: str, args: Mapping[str, Any], key: str,
              deadline: Deadline) -> Reply | Result:
        """One command, retried while the error is retryable and time is left (the same key never runs twice)."""
        while True:
            try:
                return client.call(target=self._target(node), node=node, command=command, key=key, args=args,
                                   timeout_s=max(0.001, min(self._config.call_timeout_s, deadline.remaining_s())))
            except ControlCallError as exc:
                if not exc.retryable or deadline.remaining_s() <= 2 * _RETRY_S:
                    return Result.failure(f"{node}: {command}: {exc}")
                time.sleep(_RETRY_S)

    def _client_or_failure(self) -> Client | Result:
        if self._client is None:
            try:
                self._client, self._target = self._build(self._config)
            except (ValueError, OSError) as exc:  # no control keys, unreadable certificates
                return Result.failure(f"cannot reach agents: {exc}")
        return self._client


def _agent_client(cfg: RerouteConfig) -> tuple[Client, Callable[[str], str]]:
    from ridethrough.actuators.control_client import AgentTargets, ControlClientConfig, build_control_client

    targets = AgentTargets(template=cfg.agent_target, file=cfg.targets_file)
    return build_control_client(ControlClientConfig.from_environ(os.environ), environ=os.environ), targets


def build() -> ReroutePlugin:
    """The entry point's factory: configured from the environment (see `RerouteConfig.from_environ`)."""
    return ReroutePlugin(config=RerouteConfig.from_environ(os.environ))
