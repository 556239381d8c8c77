"""The central ``reroute`` plugin against fake agents: each runs the real route commands over an in-memory table.

The fabric is the lab's design (`Topology` → `RouteMap.from_fabric`), so the plans are the ones the
controller makes for the lab; the agents are `builtin_registry` over `FakeRoutes`, reached through
a fake control client that honours the real client's contract (replies by idempotency key,
`ControlCallError` for an agent that is away).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import pytest

from ridethrough.actuators.commands import CommandRegistry, Route, builtin_registry
from ridethrough.actuators.contract import Deadline, FleetState, Plan
from ridethrough.actuators.control_client import AgentTargets, ControlCallError, ControlClientConfig, Reply
from ridethrough.actuators.plugins import validate
from ridethrough.actuators.reroute_plan import decode_changes, plan_avoid
from ridethrough.actuators.reroute_plugin import CENTRAL_METRIC, RerouteConfig, ReroutePlugin
from ridethrough.actuators.tracing import ActionTrace, SpanData, activate, current_traceparent
from ridethrough.detectors.contract import Severity
from ridethrough.detectors.fabric_map import RouteMap
from ridethrough.detectors.incidents import Incident, State
from ridethrough.lab.topology import STABLE_NET, Topology, TopologySpec
from tests.test_control_plane import FakeRoutes

TRACE = "ab" * 16
FLEET = FleetState(taken_at_ns=1)


def incident(entity: str, kind: str = "link_down", entity_type: str = "link") -> Incident:
    return Incident("inc1", f"{kind}:{entity}", kind, entity_type, entity, "lab", "link_down", Severity.ERROR,
                    State.OPEN, 1, 1, 0, 1, 1, 0, "", "{}", TRACE, 1)


class FakeAgents:
    """Control client for a lab-shaped fleet of fake agents (see the module docstring)."""

    def __init__(self, topo: Topology) -> None:
        self.tables: dict[str, FakeRoutes] = {}
        self.registries: dict[str, CommandRegistry] = {}
        for host in topo.hosts:
            nics = [topo.nic_link(host, f"nic{r}") for r in range(topo.spec.rails)]
            hops = tuple((n.lower_if, n.upper_ip) for n in nics)
            table = FakeRoutes(Route(str(STABLE_NET), hops[0][0], hops[0][1], more=hops[1:]))
            self.tables[host] = table
            self.registries[host] = builtin_registry(node_id=host, clock=time.time_ns, route_ops=table)
        self.calls: list[tuple[str, str, str | None]] = []
        self.away: set[str] = set()
        self._replies: dict[tuple[str, str], Reply] = {}

    def call(self, *, target: str, node: str, command: str, key: str, args: Mapping[str, Any] | None = None,
             timeout_s: float = 5.0, traceparent: str | None = None) -> Reply:
        assert target == f"{node}.mgmt:7450"
        self.calls.append((node, command, current_traceparent()))
        if node in self.away:
            raise ControlCallError(target=target, code="INVALID_ARGUMENT", reason="", detail="refused for the test")
        if (node, key) in self._replies:
            old = self._replies[(node, key)]
            return Reply(old.key, old.node, old.command, old.ok, old.outcome, old.detail, old.data, True)
        spec, bound = self.registries[node].bind(command, args or {})
        out = spec.handler(bound)
        reply = Reply(key, node, command, out.ok, "ok" if out.ok else "failed", out.detail, dict(out.data), False)
        self._replies[(node, key)] = reply
        return reply

    def overrides(self, host: str) -> dict[str, tuple[str, ...]]:
        return {d: r.devs for (d, _), r in self.tables[host].table.items() if d != str(STABLE_NET)}


@pytest.fixture
def lab4() -> tuple[Topology, RouteMap, dict[str, str]]:
    topo = Topology(TopologySpec(hosts=4, racks=2, rails=2, spines=2, gpus=0))
    return topo, RouteMap.from_fabric(topo), {h: topo.stable_ip(h) for h in topo.hosts}


def plugin_for(lab: tuple[Topology, RouteMap, dict[str, str]], agents: FakeAgents) -> ReroutePlugin:
    _, fmap, addresses = lab
    return ReroutePlugin(agents, target=lambda node: f"{node}.mgmt:7450", fabric=lambda: fmap,
                         addresses=lambda: addresses)


def in_action(call: Any) -> tuple[Any, list[SpanData]]:
    """Run ``call`` inside an action phase, as the runner does; returns its value and the step spans."""
    trace = ActionTrace(trace_id=TRACE, action_id="a1", clock=time.time_ns)
    phase, sink = trace.start("action.apply"), []
    with activate(trace, phase, sink):
        return call(), sink


def test_a_spine_link_moves_every_cross_rack_pair_off_its_rail_and_leaves_same_rack_traffic(lab4) -> None:
    topo, fmap, addresses = lab4
    avoid = plan_avoid(fmap, "leaf0r1-spine0", addresses)
    assert not avoid.refusal
    cross = {(a, b) for a in topo.hosts for b in topo.hosts if topo.rack_of(a) != topo.rack_of(b)}
    assert {(c.host, c.peer) for c in avoid.changes} == cross
    assert all(c.avoid == ("nic1",) and c.keep == ("nic0",) for c in avoid.changes)
    assert {c.destination for c in avoid.changes} == {f"{addresses[h]}/32" for h in topo.hosts}
    # every route of a moved path goes, the one over the other spine too: the host leaves the whole rail
    assert {"h0/nic1->h2/nic1:forward#0", "h0/nic1->h2/nic1:forward#1", "h2/nic1->h0/nic1:reverse#1"} <= \
        avoid.removed_paths
    assert not any("nic0" in p for p in avoid.removed_paths)


def test_a_host_link_moves_its_host_off_that_nic_and_every_peer_off_that_rail_towards_it(lab4) -> None:
    topo, fmap, addresses = lab4
    avoid = plan_avoid(fmap, "h1-leaf0r0", addresses)
    pairs = {(c.host, c.peer, c.avoid) for c in avoid.changes}
    others = [h for h in topo.hosts if h != "h1"]
    assert pairs == {("h1", h, ("nic0",)) for h in others} | {(h, "h1", ("nic0",)) for h in others}


def test_the_last_path_is_never_removed_nothing_is_planned_and_the_log_says_why(caplog) -> None:
    topo = Topology(TopologySpec(hosts=2, racks=2, rails=1, spines=2, gpus=0))
    fmap, addresses = RouteMap.from_fabric(topo), {h: topo.stable_ip(h) for h in topo.hosts}
    agents = FakeAgents(topo)
    plugin = plugin_for((topo, fmap, addresses), agents)
    with caplog.at_level(logging.WARNING):
        assert plugin.plan(incident("leaf0r0-spine0"), FLEET) is None
        assert plugin.plan(incident("leaf0r0-spine0"), FLEET) is None
    said = [r.getMessage() for r in caplog.records if "last path" in r.getMessage()]
    assert len(said) == 1 and "h0 reaches h1 only over leaf0r0-spine0" in said[0], "said once, with the pair"
    assert agents.calls == []


def test_other_incidents_are_not_this_plugins(lab4) -> None:
    plugin = plugin_for(lab4, FakeAgents(lab4[0]))
    assert plugin.plan(incident("h0/gpu1", "gpu_failing", "gpu"), FLEET) is None
    assert plugin.plan(incident("leaf0r1-spine0", "congestion"), FLEET) is None
    assert plugin.plan(incident("no-such-link"), FLEET) is None, "no known path crosses it"
    validate(plugin, plugin="reroute")


def test_apply_verify_and_rollback_move_routes_and_put_them_back(lab4) -> None:
    topo, _, addresses = lab4
    agents = FakeAgents(topo)
    plugin = plugin_for(lab4, agents)
    plan = plugin.plan(incident("leaf0r1-spine0"), FLEET)
    assert isinstance(plan, Plan) and plan.removes_paths
    applied, steps = in_action(lambda: plugin.apply(plan, Deadline.after(30)))
    assert applied.ok, applied.detail
    for host in topo.hosts:
        peers = [h for h in topo.hosts if topo.rack_of(h) != topo.rack_of(host)]
        assert agents.overrides(host) == {f"{addresses[p]}/32": ("nic0",) for p in peers}
        assert all(r.metric == CENTRAL_METRIC for (d, _), r in agents.tables[host].table.items()
                   if d != str(STABLE_NET))
    assert {s.attributes["step.name"] for s in steps} >= {f"reroute {h}" for h in topo.hosts}
    sent = [tp for _, command, tp in agents.calls if command == "route.set"]
    assert sent and all(tp is not None and tp.startswith(f"00-{TRACE}-") for tp in sent), "traceparent on each call"
    verified = plugin.verify(plan, Deadline.after(30))
    assert verified.ok, verified.detail
    undone = plugin.rollback(plan, Deadline.after(30))
    assert undone.ok and undone.detail == f"{len(decode_changes(plan.params['changes']))} routes restored"
    assert all(agents.overrides(h) == {} for h in topo.hosts)


def test_verify_fails_when_a_route_is_gone_or_traffic_still_takes_the_link(lab4) -> None:
    topo, _, addresses = lab4
    agents = FakeAgents(topo)
    plugin = plugin_for(lab4, agents)
    plan = plugin.plan(incident("leaf0r1-spine0"), FLEET)
    assert plan is not None and plugin.apply(plan, Deadline.after(30)).ok
    del agents.tables["h0"].table[(f"{addresses['h2']}/32", 254)]
    broken = plugin.verify(plan, Deadline.after(30))
    assert not broken.ok and "h0 -> h2: the route is gone" in broken.detail


def test_an_agent_that_refuses_fails_apply_by_name_and_rollback_undoes_what_was_set(lab4) -> None:
    topo, _, _ = lab4
    agents = FakeAgents(topo)
    agents.away.add("h2")
    plugin = plugin_for(lab4, agents)
    plan = plugin.plan(incident("leaf0r1-spine0"), FLEET)
    assert plan is not None
    failed = plugin.apply(plan, Deadline.after(30))
    assert not failed.ok and failed.detail.startswith("h2: route.get:")
    assert agents.overrides("h0") and agents.overrides("h1"), "the hosts before h2 were rerouted"
    partly = plugin.rollback(plan, Deadline.after(30))
    assert not partly.ok and "h2: route.restore" in partly.detail, "h2 may hold routes: says it could not check"
    assert agents.overrides("h0") == {} and agents.overrides("h1") == {}
    agents.away.clear()
    assert plugin.rollback(plan, Deadline.after(30)).ok, "h2 and h3 never set anything: nothing to undo there"
    assert all(agents.overrides(h) == {} for h in topo.hosts)


def test_a_host_whose_own_route_has_no_other_nexthop_is_not_left_without_one(lab4) -> None:
    topo, _, _ = lab4
    agents = FakeAgents(topo)
    only_nic1 = Route(str(STABLE_NET), "nic1", topo.nic_link("h0", "nic1").upper_ip)
    agents.tables["h0"].table[(str(STABLE_NET), 254)] = only_nic1
    plugin = plugin_for(lab4, agents)
    plan = plugin.plan(incident("leaf0r1-spine0"), FLEET)
    assert plan is not None
    result = plugin.apply(plan, Deadline.after(30))
    assert not result.ok and "not removing the last path" in result.detail
    assert agents.overrides("h0") == {}


def test_without_control_keys_apply_fails_with_the_reason(lab4, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RIDETHROUGH_CONTROL_KEYS", raising=False)
    monkeypatch.delenv("RIDETHROUGH_CONTROL_KEYS_FILE", raising=False)
    _, fmap, addresses = lab4
    plugin = ReroutePlugin(config=RerouteConfig(), fabric=lambda: fmap, addresses=lambda: addresses)
    plan = plugin.plan(incident("leaf0r1-spine0"), FLEET)
    assert plan is not None
    result = plugin.apply(plan, Deadline.after(5))
    assert not result.ok and "no control keys" in result.detail


def test_agent_targets_prefer_the_file_and_fall_back_to_the_template(tmp_path) -> None:
    path = tmp_path / "targets.json"
    path.write_text('{"h3": "198.18.0.13:7450"}')
    targets = AgentTargets(template="{node}.fabric:7450", file=str(path))
    assert targets("h3") == "198.18.0.13:7450" and targets("h4") == "h4.fabric:7450"
    path.write_text("not json")
    assert targets("h3") == "198.18.0.13:7450", "a bad rewrite keeps the last good table"
    with pytest.raises(ValueError, match="must contain"):
        AgentTargets(template="h3:7450")
    with pytest.raises(ValueError, match="agent targets file"):
        AgentTargets(file=str(tmp_path / "missing.json"))


def test_client_config_from_the_environment(tmp_path) -> None:
    keys = tmp_path / "keys"
    cfg = ControlClientConfig.from_environ({"RIDETHROUGH_CONTROL_KEYS_FILE": str(keys),
                                            "RIDETHROUGH_CONTROL_COMMAND_LIFETIME_S": "12"})
    assert cfg.secret_file == str(keys) and cfg.command_lifetime_s == 12.0
    with pytest.raises(ValueError, match="RIDETHROUGH_CONTROL_COMMAND_LIFETIME_S"):
        ControlClientConfig.from_environ({"RIDETHROUGH_CONTROL_COMMAND_LIFETIME_S": "soon"})
