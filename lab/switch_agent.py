"""The lab's switch agent: ``python -m ridethrough.lab.switch_agent STATE_FILE``.

A lab's leaves are namespaces that only forward: no process runs in them. This one process, in
the root namespace (so it reaches the server's OTLP gateway on the management bridge), gives
every leaf the control plane a host agent has (`ridethrough.actuators.control_plane`): ``ping``
and ``route.set`` / ``route.restore`` / ``route.get``, node id = the leaf's name, commands signed
with the lab's key (``control/keys``). A leaf's routes are changed inside its namespace over
netlink (`NetlinkRouteOps` with ``netns``: only routes of protocol 115 are touched, never the
leaf's own ECMP routes), and its command spans go to the lab's gateway from a tracer provider of
its own, whose resource names the leaf (as an agent's names its host).

Leaf ``i`` of `Topology.leaves` listens on the lab's server address at port
``SWITCH_CONTROL_PORT_BASE + i`` (`switch_port`); each lab has its own server address, so ports
never clash between labs. The supervisor starts this process once the server is ready, lists the
leaves in ``control/targets.json`` (`switch_targets`) and writes `switch_map` to ``switches.json``
for the controller's drain (`ridethrough.actuators.switch_map`).

It also exports every switch's (leaves' and spines') port counters to the gateway
(`ridethrough.lab.switch_counters`: the frames each port's cable lost, and the wait of a congested
egress, as an IB switch port counts them), and every port's state and MTU once a second and at once
when a port changes state (`ridethrough.lab.switch_ports`), so the detectors read switch ports as
they read host NICs.

SIGTERM (or SIGINT) stops the servers, flushes the spans and counters and exits 0. Logs go to stdout.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ridethrough.lab import netns
from ridethrough.lab.control import LabError
from ridethrough.lab.routing import plan
from ridethrough.lab.state import State, StateFile
from ridethrough.lab.topology import Topology, TopologySpec

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from ridethrough.actuators.control_plane import ControlPlaneServer
    from ridethrough.actuators.reroute_netlink import NetlinkRouteOps

log = logging.getLogger("ridethrough.lab.switch_agent")
SWITCH_CONTROL_PORT_BASE = 7460
SWITCHES_FILE = "switches.json"
"""In the lab's directory: the leaves' prefixes and uplink ports (`switch_map`)."""
EXPORT_TIMEOUT_S = 5.0
"""One span export to the gateway (an agent's default ``export_timeout_s``)."""
STOP_GRACE_S = 1.0


def lab_topology(state: State) -> Topology:
    """The topology of a namespace lab from its state (LabError for a loopback lab: it has no switches)."""
    if state.get("mode") != "netns":
        raise LabError(f"lab {state.get('name')!r} is a {state.get('mode')} lab: it has no switches")
    return Topology(TopologySpec(**state["spec"]), name=state["name"], mgmt_subnet=state["mgmt_subnet"])


def switch_port(topo: Topology, leaf: str) -> int:
    """The control port of ``leaf`` on the lab's server address."""
    return SWITCH_CONTROL_PORT_BASE + int(topo.leaves.index(leaf))


def switch_targets(topo: Topology) -> dict[str, str]:
    """Every leaf's control address, ``{"leaf0r0": "198.18.x.1:7460", ...}`` (for ``control/targets.json``)."""
    return {leaf: f"{topo.server_ip}:{switch_port(topo, leaf)}" for leaf in topo.leaves}


def switch_map(topo: Topology) -> dict[str, dict[str, Any]]:
    """Per leaf, the prefixes behind it and its uplinks (link name → interface in the leaf's namespace).

    The prefixes are those the spines route down to the leaf (`ridethrough.lab.routing`: its rack's
    stable /24, then its rail's NIC block of that rack), so the map follows the lab's routing.
    """
    spine_routes = {spine: plan(topo, spine).routes for spine in topo.spines}
    out: dict[str, dict[str, Any]] = {}
    for leaf in topo.leaves:
        uplinks = [topo.link(f"{leaf}-{spine}") for spine in topo.spines]
        behind = dict.fromkeys(r.dst for up in uplinks for r in spine_routes[up.upper] if r.via(up.upper_if))
        out[leaf] = {"prefixes": list(behind), "ports": {up.name: up.lower_if for up in uplinks}}
    return out


@dataclass(frozen=True, slots=True)
class LeafPlane:
    """One leaf's control-plane server, the provider its spans leave through, and its routes' socket."""

    leaf: str
    server: ControlPlaneServer
    provider: TracerProvider
    routes: NetlinkRouteOps

    def stop(self) -> None:
        """Stop serving, flush the spans, close the netlink socket."""
        self.server.stop(STOP_GRACE_S)
        self.provider.shutdown()
        self.routes.close()


def open_routes(topo: Topology, leaf: str) -> NetlinkRouteOps:
    """The controller's routes in ``leaf``'s namespace, its socket open; OSError if the namespace is not there."""
    from ridethrough.actuators.reroute_netlink import NetlinkRouteOps

    ns = topo.namespace(leaf)
    if not netns.ns_path(ns).exists():  # (lab.netns also lengthens pyroute2's 2 s wait for its namespace helper)
        raise OSError(f"namespace {ns} of {leaf} does not exist (is the lab up?)")
    routes = NetlinkRouteOps(netns=ns)
    routes.open()
    return routes


def build_leaf(topo: Topology, leaf: str, *, routes: NetlinkRouteOps, keys: Path, gateway: str) -> LeafPlane:
    """``leaf``'s control plane over ``routes`` (not started); ValueError for bad keys."""
    from ridethrough.actuators.commands import builtin_registry
    from ridethrough.actuators.control_plane import (
        SCOPE,
        ControlPlaneConfig,
        agent_tracer_provider,
        build_control_plane,
    )
    from ridethrough.collector.identity import AgentIdentity

    rack, _ = topo.leaf_position(leaf)
    identity = AgentIdentity(node_id=leaf, host_name=leaf, cluster=topo.name, rack=f"rack{rack}")
    provider = agent_tracer_provider(resource=identity.resource(), gateway=gateway, timeout_s=EXPORT_TIMEOUT_S)
    try:
        cfg = ControlPlaneConfig(listen=f"{topo.server_ip}:{switch_port(topo, leaf)}", secret_file=str(keys),
                                 secret_env="")
        registry = builtin_registry(node_id=leaf, clock=time.time_ns, route_ops=routes)
        server = build_control_plane(cfg, node_id=leaf, registry=registry, tracer=provider.get_tracer(SCOPE),
                                     environ={}, clock=time.time_ns)
    except BaseException:
        provider.shutdown()
        raise
    return LeafPlane(leaf, server, provider, routes)


def gateway_of(state: State) -> str:
    """The lab server's OTLP address, where spans and counters go."""
    return f"{state['server_ip']}:{state['otlp_port']}"


def serve(state: State, *, keys: Path) -> list[LeafPlane]:
    """Every leaf's control plane, serving; if one cannot start, what was started is stopped and it raises."""
    topo, gateway = lab_topology(state), gateway_of(state)
    routes: list[NetlinkRouteOps] = []
    planes: list[LeafPlane] = []
    try:
        # Every socket first: opening one forks a helper into the namespace, which is best done before
        # gRPC and the span exporters run threads (gRPC skips its fork handlers then, and says so).
        for leaf in topo.leaves:
            routes.append(open_routes(topo, leaf))
        for leaf, ops in zip(topo.leaves, routes, strict=True):
            plane = build_leaf(topo, leaf, routes=ops, keys=keys, gateway=gateway)
            planes.append(plane)
            address = plane.server.start()
            log.info("%s: control plane on %s, routes in namespace %s", leaf, address, topo.namespace(leaf))
    except BaseException:
        stop_all(planes)
        for ops in routes[len(planes):]:
            ops.close()
        raise
    return planes


def stop_all(planes: list[LeafPlane]) -> None:
    """Stop every leaf's plane; one that fails to stop is logged and the rest still stop."""
    for plane in planes:
        try:
            plane.stop()
        except Exception:
            log.exception("%s: stopping its control plane failed", plane.leaf)


def main(argv: list[str] | None = None) -> int:
    """Entry point: the lab's state file is the only argument."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m ridethrough.lab.switch_agent STATE_FILE", file=sys.stderr)
        return 2
    # The port counters run `nft` in the switches' namespaces (a fork with a preexec_fn that enters one, then
    # exec): gRPC's fork handlers have nothing to protect there, and would log each fork they skip.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    path = Path(args[0])
    sf = StateFile(path.parent, path.stem)
    from ridethrough.lab import switch_counters, switch_ports

    reader: switch_ports.NetlinkReader | None = None
    try:
        state = sf.read()
        from ridethrough.lab.supervisor import controller_env  # lazily: the supervisor imports this module

        keys = Path(controller_env(Path(state["dir"]))["RIDETHROUGH_CONTROL_KEYS_FILE"])
        topo = lab_topology(state)
        reader = switch_ports.NetlinkReader(topo.namespace(n) for n in (*topo.leaves, *topo.spines))
        reader.open()
        planes = serve(state, keys=keys)
    except (LabError, OSError, ValueError, KeyError) as exc:
        log.error("switch agent cannot start: %s", exc)
        if reader is not None:
            reader.close()
        return 1
    ports = switch_ports.KernelPorts(topo, reader)
    errors, xmit_wait = switch_counters.lab_counters(topo, sf)
    meters = switch_counters.meter_providers(errors, gateway=gateway_of(state), cluster=state["name"],
                                             xmit_wait=xmit_wait, dropped=ports.rx_dropped)
    states = switch_ports.meter_providers(ports, gateway=gateway_of(state), cluster=state["name"])
    meters += states.values()
    watcher = threading.Thread(target=switch_ports.watch, args=(ports, states, stopping), name="port-watch",
                               daemon=True)
    watcher.start()
    log.info("serving %d leaves, exporting %d switches' ports; SIGTERM stops", len(planes), len(ports.switches))
    while not stopping.wait(1.0):  # a timed wait: the signal handler runs between waits
        pass
    watcher.join(timeout=5.0)
    stop_all(planes)
    for meter in meters:
        meter.shutdown(timeout_millis=5_000)
    reader.close()
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
