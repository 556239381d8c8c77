"""Draining a bad leaf-spine link at the leaves: the plan, the blast radius it keeps, and the plugin acting on it.

The fabric is the lab's design and the switch map the one the lab writes (`lab_switch_map`); the
leaves are fake agents running the real route commands over an in-memory table that starts with
the leaf's own ECMP routes over its spines (as `ridethrough.lab.routing` configures them).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import pytest

from ridethrough.actuators.commands import Route, builtin_registry
from ridethrough.actuators.contract import Deadline, Plan
from ridethrough.actuators.policy import InFlight, RunnerPolicy, refusal
from ridethrough.actuators.reroute_drain import Flow, decode_flows, flow_rails, plan_drain
from ridethrough.actuators.reroute_plan import decode_changes, plan_avoid
from ridethrough.actuators.reroute_plugin import CENTRAL_METRIC, ReroutePlugin
from ridethrough.actuators.switch_map import SwitchFile, SwitchMap
from ridethrough.controller_wiring import fleet_from_map
from ridethrough.detectors.fabric_map import RouteMap
from ridethrough.lab.routing import plan as node_plan
from ridethrough.lab.switch_agent import switch_map as lab_switch_map
from ridethrough.lab.topology import Topology, TopologySpec
from tests.test_control_plane import FakeRoutes
from tests.test_reroute_plugin import FLEET, FakeAgents, in_action, incident

LINK = "leaf0r1-spine0"


def fabric(**spec: int) -> tuple[Topology, RouteMap, SwitchMap]:
    topo = Topology(TopologySpec(**{"hosts": 4, "racks": 2, "rails": 2, "spines": 2, "gpus": 0, **spec}))
    return topo, RouteMap.from_fabric(topo), SwitchMap.parse(lab_switch_map(topo))


class Leaves(FakeAgents):
    """`FakeAgents` with a control plane on every leaf too, its table holding the leaf's own uplink routes."""

    def __init__(self, topo: Topology) -> None:
        super().__init__(topo)
        for leaf in topo.leaves:
            routes = [Route(r.dst, r.nexthops[0][1], r.nexthops[0][0], more=tuple((d, g) for g, d in r.nexthops[1:]))
                      for r in node_plan(topo, leaf).routes if len(r.nexthops) > 1]
            self.tables[leaf] = FakeRoutes(*routes)
            self.registries[leaf] = builtin_registry(node_id=leaf, clock=time.time_ns, route_ops=self.tables[leaf])


def test_a_spine_link_is_drained_at_both_ingress_leaves_and_every_pair_keeps_its_rail() -> None:
    topo, fmap, switches = fabric()
    drain = plan_drain(fmap, LINK, switches)
    assert not drain.refusal
    got = {(c.host, c.peer, c.destination, c.avoid, c.keep) for c in drain.changes}
    assert got == {("leaf0r1", "leaf1r1", p, ("spine0",), ("spine1",)) for p in switches.leaves["leaf1r1"].prefixes} \
        | {("leaf1r1", "leaf0r1", p, ("spine0",), ("spine1",)) for p in switches.leaves["leaf0r1"].prefixes}
    # exactly the routes over the link go; the same pairs' routes over spine1 stay
    assert drain.removed_paths == {rid for pid in fmap.path_ids() for rid in fmap.route_ids(pid, crossing=LINK)}
    assert "h0/nic1->h2/nic1:forward#0" in drain.removed_paths
    assert "h0/nic1->h2/nic1:forward#1" not in drain.removed_paths
    cross = {(a, b) for a in topo.hosts for b in topo.hosts if topo.rack_of(a) != topo.rack_of(b)}
    assert {(f.host, f.peer) for f in drain.flows} == cross and {f.nic for f in drain.flows} == {"nic1"}
    assert decode_flows(json.dumps([[f.host, f.peer, f.nic] for f in drain.flows])) == drain.flows
    assert flow_rails([Flow("h0", "h2", "nic1"), Flow("h0", "h2", "nic0")])[0].nics == ("nic0", "nic1")


def test_with_three_racks_every_leaf_of_the_rail_stops_sending_to_the_link_owner_over_it() -> None:
    _, fmap, switches = fabric(hosts=6, racks=3)
    drain = plan_drain(fmap, "leaf0r0-spine1", switches)
    by_leaf = {(c.host, c.peer) for c in drain.changes}
    assert by_leaf == {("leaf0r0", "leaf1r0"), ("leaf0r0", "leaf2r0"), ("leaf1r0", "leaf0r0"),
                       ("leaf2r0", "leaf0r0")}, "rack1 <-> rack2 never crosses leaf0r0's uplink: untouched"
    assert all(c.avoid == ("spine1",) and c.keep == ("spine0",) for c in drain.changes)


def test_the_drain_passes_the_blast_radius_cap_that_the_host_reroute_of_the_same_link_fails() -> None:
    topo, fmap, switches = fabric(hosts=8)
    fleet = fleet_from_map(lambda: fmap, _NoIncidents())()  # type: ignore[arg-type]
    policy = RunnerPolicy()
    drain = plan_drain(fmap, LINK, switches)
    hosts = plan_avoid(fmap, LINK, {h: topo.stable_ip(h) for h in topo.hosts})
    shares = fleet.path_shares(drain.removed_paths)
    assert max(shares.values()) <= policy.max_path_share, shares
    assert max(fleet.path_shares(hosts.removed_paths).values()) > policy.max_path_share
    inc = incident(LINK)
    now = InFlight(now_ns=inc.opened_at_ns + 10**12)
    as_plan = Plan.for_incident("reroute", inc, removes_paths=drain.removed_paths)
    assert refusal(policy, as_plan, inc, fleet, now) is None


def test_a_reroute_waits_while_another_in_flight_changes_some_of_the_same_paths() -> None:
    # The demo's failure: h0-leaf0r0's host reroute rolled back while h4-leaf1r0's ran, and its restore of
    # h0 -> h4 deleted the route the other had just put there ("h0 -> h4: the route is gone").
    topo, fmap, _ = fabric(hosts=8)
    fleet = fleet_from_map(lambda: fmap, _NoIncidents())()  # type: ignore[arg-type]
    policy = RunnerPolicy(max_path_share=1.0)
    addresses = {h: topo.stable_ip(h) for h in topo.hosts}
    first, second, apart = (incident(link) for link in ("h0-leaf0r0", "h4-leaf1r0", "h6-leaf1r1"))

    def plan(inc: Any) -> Plan:
        return Plan.for_incident("reroute", inc, removes_paths=plan_avoid(fmap, inc.entity, addresses).removed_paths)

    now = InFlight(now_ns=second.opened_at_ns + 10**12, plans=[plan(first)])
    crossing, other_rail = plan(second), plan(apart)
    assert (refusal(policy, crossing, second, fleet, now) or "").startswith("busy: the action on h0-leaf0r0 in flight")
    assert refusal(policy, other_rail, apart, fleet, now) is None  # rail 1 shares no path with h0's rail 0
    assert refusal(policy, crossing, second, fleet, InFlight(now_ns=now.now_ns)) is None  # once it ended


def test_a_leaf_with_one_uplink_is_never_drained_and_the_plugin_moves_the_hosts_instead(caplog) -> None:
    topo, fmap, switches = fabric(spines=1)
    drain = plan_drain(fmap, "leaf0r1-spine0", switches)
    assert "leaf0r1 reaches leaf1r1 only over leaf0r1-spine0" in drain.refusal and not drain.changes
    agents = Leaves(topo)
    plugin = ReroutePlugin(agents, target=lambda node: f"{node}.mgmt:7450", fabric=lambda: fmap,
                           addresses=lambda: {h: topo.stable_ip(h) for h in topo.hosts}, switches=lambda: switches)
    plan = plugin.plan(incident("leaf0r1-spine0"), FLEET)
    assert plan is not None and plan.params.get("at") != "leaves"
    assert {c.host for c in decode_changes(plan.params["changes"])} == set(topo.hosts)
    with caplog.at_level(logging.WARNING):
        assert plugin.plan(incident("leaf0r0-spine0", "link_down"), FLEET) is not None


def test_a_host_link_is_rerouted_at_the_hosts_even_with_a_switch_map() -> None:
    topo, fmap, switches = fabric()
    plugin = ReroutePlugin(Leaves(topo), target=lambda node: f"{node}.mgmt:7450", fabric=lambda: fmap,
                           addresses=lambda: {h: topo.stable_ip(h) for h in topo.hosts}, switches=lambda: switches)
    plan = plugin.plan(incident("h1-leaf0r0"), FLEET)
    assert plan is not None and plan.params.get("at") != "leaves"
    assert "h1" in {c.host for c in decode_changes(plan.params["changes"])}


def test_apply_verify_and_rollback_of_a_drain_change_only_the_leaves() -> None:
    topo, fmap, switches = fabric()
    agents = Leaves(topo)
    plugin = ReroutePlugin(agents, target=lambda node: f"{node}.mgmt:7450", fabric=lambda: fmap,
                           addresses=lambda: {h: topo.stable_ip(h) for h in topo.hosts}, switches=lambda: switches)
    plan = plugin.plan(incident(LINK, "link_degrading"), FLEET)
    assert plan is not None and plan.params["at"] == "leaves"
    assert plan.steps[:2] == ("on leaf0r1: route leaf1r1 off spine0", "on leaf1r1: route leaf0r1 off spine0")
    before = {leaf: dict(agents.tables[leaf].table) for leaf in topo.leaves}
    applied, steps = in_action(lambda: plugin.apply(plan, Deadline.after(30)))
    assert applied.ok, applied.detail
    assert {s.attributes["step.name"] for s in steps} >= {"reroute leaf0r1", "reroute leaf1r1"}
    for leaf, behind in (("leaf0r1", "leaf1r1"), ("leaf1r1", "leaf0r1")):
        ours = {d: r for (d, _), r in agents.tables[leaf].table.items() if r.metric}
        assert set(ours) == set(switches.leaves[behind].prefixes)
        assert all(r.devs == ("spine1",) and r.metric == CENTRAL_METRIC for r in ours.values())
    assert all(agents.overrides(h) == {} for h in topo.hosts), "no host route changes"
    assert all(agents.tables[leaf].table == before[leaf] for leaf in ("leaf0r0", "leaf1r0")), "rail 0 untouched"
    verified = plugin.verify(plan, Deadline.after(30))
    assert verified.ok and "none leaves through leaf0r1-spine0's uplinks" in verified.detail
    undone = plugin.rollback(plan, Deadline.after(30))
    assert undone.ok, undone.detail
    assert all(agents.tables[leaf].table == before[leaf] for leaf in topo.leaves)


def test_verify_of_a_drain_fails_when_a_leaf_still_sends_over_the_link() -> None:
    topo, fmap, switches = fabric()
    agents = Leaves(topo)
    plugin = ReroutePlugin(agents, target=lambda node: f"{node}.mgmt:7450", fabric=lambda: fmap,
                           addresses=lambda: {}, switches=lambda: switches)
    plan = plugin.plan(incident(LINK), FLEET)
    assert plan is not None and plugin.apply(plan, Deadline.after(30)).ok
    prefix = switches.leaves["leaf1r1"].prefixes[0]
    del agents.tables["leaf0r1"].table[(prefix, 254)]  # someone took our route away: back on both spines
    broken = plugin.verify(plan, Deadline.after(30))
    assert not broken.ok and "leaf0r1 -> leaf1r1: the route is gone" in broken.detail


def test_switch_maps_are_checked_and_a_bad_rewrite_keeps_the_last_good_one(tmp_path) -> None:
    for bad, says in (([], "expected"), ({"leaf0": {"prefixes": []}}, "exactly the keys"),
                      ({"leaf0": {"prefixes": ["10.0.0.1/24"], "ports": {"l-s": "s"}}}, "host bits"),
                      ({"leaf0": {"prefixes": ["10.0.0.0/24"], "ports": {"l-s": "no such name!"}}}, "interface name"),
                      ({"leaf0": {"prefixes": ["10.0.0.0/24"], "ports": {}}}, "ports must map")):
        with pytest.raises(ValueError, match=says):
            SwitchMap.parse(bad)
    path = tmp_path / "switches.json"
    missing = SwitchFile(path)
    assert missing() is None
    path.write_text(json.dumps({"leaf0": {"prefixes": ["10.0.0.0/24"], "ports": {"leaf0-s0": "s0"}}}))
    good = SwitchFile(path)()
    assert good is not None and good.leaf_of("leaf0-s0") == "leaf0" and good.end_leaf("h1-leaf0") == "leaf0"
    files = SwitchFile(path)
    assert files() is not None
    path.write_text("{half")
    kept = files()
    assert kept is not None and kept.leaf_of("leaf0-s0") == "leaf0"


class _NoIncidents:
    def open(self) -> list[object]:
        return []
