"""The central reroute verified by real probes: real agents probe, the lab's server stores, the plugin reads.

One small lab (2 racks of one host, 2 rails, 2 spines) with its agents' control planes and probers on
(the reflex and the server's controller off, so every route change is the central one). The test
process is the controller: the real `Runner` with the ``reroute`` plugin, whose verify reads the
probes from the lab server's store through its read-only ClickHouse HTTP endpoint. Cutting a spine
link on rail 1 moves the hosts' traffic to rail 0, and the probes over rail 0 confirm it (and a walk of
the kernel's routes, hop by hop, finds no flow over the link); the same reroute applied while both
hosts are starved of CPU is not rolled back for their late answers; when rail 0 is cut at a host as
well, the routes still read back right, but the probes show the pair has no path left, and the runner
rolls back. Needs root and network namespaces.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ridethrough.actuators.actions import Status
from ridethrough.actuators.contract import Deadline
from ridethrough.actuators.reroute_plugin import RerouteConfig, ReroutePlugin
from ridethrough.actuators.reroute_verify import ProbeVerifyConfig
from ridethrough.controller_wiring import fleet_from_map
from ridethrough.detectors.contract import Severity
from ridethrough.detectors.fabric_map import RouteFile
from ridethrough.detectors.incidents import Incident, State, new_trace_id
from ridethrough.exporters.store import Store, StoreError, StoreUnavailable
from ridethrough.lab import netns
from ridethrough.lab.fabric import Lab
from ridethrough.lab.pathwalk import Walker
from ridethrough.lab.supervisor import REFLEX_PEERS_FILE
from tests.conftest import wait_for
from tests.test_reroute_central_lab import NoIncidents, agents_answer, central_routes, controller, moved, quiet_lab, run

REASON = netns.unavailable_reason()
pytestmark = [pytest.mark.integration, pytest.mark.skipif(REASON is not None, reason=REASON or "")]
LINK = "leaf0r1-spine0"


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with quiet_lab("trv", timeout_s=180) as running:
        yield running


def probes_stored(store: Store, cluster: str) -> bool:
    """Both hosts' probers have reported rail 0 to each other at least twice."""
    try:
        _, rows = store.query(
            "SELECT count(DISTINCT ResourceAttributes['ridethrough.node.id']), min(n) FROM (SELECT ResourceAttributes,"
            " count() AS n FROM otel_metrics_sum WHERE MetricName = 'ridethrough.probe.sent' AND "
            "Attributes['probe.src.nic'] = 'nic0' AND ResourceAttributes['ridethrough.cluster'] = {c:String} "
            "GROUP BY ResourceAttributes)", parameters={"c": cluster})
    except (StoreUnavailable, StoreError):
        return False
    return bool(rows) and rows[0][0] == 2 and rows[0][1] >= 2


@pytest.fixture
def parts(lab: Lab, tmp_path: Path) -> Iterator[dict[str, Any]]:
    client, targets = controller(lab)
    wait_for(lambda: agents_answer(client, targets, ["h0", "h1"]), timeout_s=120, interval_s=0.5,
             what="both agents' control planes to answer signed pings")
    probes = Store(lab.server["store_http"])
    wait_for(lambda: probes_stored(probes, lab.name), timeout_s=120, interval_s=1.0,
             what="both agents' probes over rail 0 in the lab's store")
    plugin = ReroutePlugin(client, target=targets, config=RerouteConfig(
        fabric_map_file=str(lab.dir / "fabric.json"), addresses_file=str(lab.dir / REFLEX_PEERS_FILE),
        probes=ProbeVerifyConfig(poll_s=0.5)))
    plugin.use_store(probes)
    store = Store(f"chdb://{tmp_path / 'store'}")
    store.init_schema()
    fleet = fleet_from_map(RouteFile(lab.dir / "fabric.json"), NoIncidents())
    yield {"plugin": plugin, "store": store, "fleet": fleet}
    client.close()
    store.close()
    probes.close()


def link_down(lab: Lab) -> Incident:
    opened = time.time_ns() - 60 * 10**9
    return Incident(f"inc-probes-{time.time_ns()}", f"link_down:link:{LINK}", "link_down", "link", LINK, lab.name,
                    "link", Severity.ERROR, State.OPEN, opened, opened, 0, opened, 1, 0, f"{LINK}: down", "{}",
                    new_trace_id(), 1)


def test_the_probes_over_the_rail_left_confirm_a_reroute(lab: Lab, parts: dict[str, Any]) -> None:
    lab.set_link(LINK, up=False, end="spine0")
    try:
        incident = link_down(lab)
        status, reason, detail = run(parts["store"], parts["plugin"], incident, parts["fleet"])
        assert status == Status.SUCCEEDED.value, f"{reason}: {detail}"
        assert "probes since the apply confirm all 2 pairs" in detail and f"crosses {LINK}" in detail, detail
        assert moved(lab)
        walker = Walker(lab)  # the kernel's own answer, hop by hop: no flow between the two crosses the link now
        walks = [walker.walk(a, b, sport=40_000 + i, dport=50_000 + i) for a, b in (("h0", "h1"), ("h1", "h0"))
                 for i in range(8)]
        assert all(w.ok and LINK not in w.links for w in walks), walks
    finally:
        plan = parts["plugin"].plan(link_down(lab), parts["fleet"]())
        if plan is not None:
            parts["plugin"].rollback(plan, Deadline.after(60))
        lab.set_link(LINK, up=True)
    assert central_routes(lab, "h0") == {} and central_routes(lab, "h1") == {}


def test_a_correct_reroute_applied_while_the_agents_are_starved_is_not_rolled_back(lab: Lab,
                                                                                  parts: dict[str, Any]) -> None:
    """Both hosts held to 1 % of a CPU from before the apply until 20 s into it: their responders answer late and
    their probers run late. That is no evidence against the reroute: it verifies, or stays unverified."""
    lab.set_link(LINK, up=False, end="spine0")
    for host in ("h0", "h1"):
        lab.starve(host, cpu_fraction=0.01)
    fed = threading.Timer(20.0, lambda: [lab.starve(h, cpu_fraction=None) for h in ("h0", "h1")])
    fed.start()
    try:
        status, reason, detail = run(parts["store"], parts["plugin"], link_down(lab), parts["fleet"])
        assert status in (Status.SUCCEEDED.value, Status.UNVERIFIED.value), f"{status}: {reason}: {detail}"
        assert moved(lab), "the routes stay"
    finally:
        fed.cancel()
        for host in ("h0", "h1"):
            lab.starve(host, cpu_fraction=None)
        plan = parts["plugin"].plan(link_down(lab), parts["fleet"]())
        if plan is not None:
            parts["plugin"].rollback(plan, Deadline.after(60))
        lab.set_link(LINK, up=True)
    assert central_routes(lab, "h0") == {} and central_routes(lab, "h1") == {}


def test_a_pair_left_without_a_path_fails_verify_by_its_probes_and_rolls_back(lab: Lab,
                                                                           parts: dict[str, Any]) -> None:
    lab.set_link(LINK, up=False, end="spine0")
    lab.set_link("h0-leaf0r0", up=False, end="leaf0r0")  # rail 0, the one the plan keeps, is dead at h0
    try:
        status, reason, detail = run(parts["store"], parts["plugin"], link_down(lab), parts["fleet"])
        assert status == Status.ROLLED_BACK.value, f"{reason}: {detail}"
        assert "none leaves through" in detail, "the routes read back right: only the probes tell"
        # lost probes, or the prober's giving up on the path: whichever the store shows first
        said = ("h0 -> h1 over nic0: ", "probes lost since the apply", "its probes go unanswered")
        assert said[0] in detail and (said[1] in detail or said[2] in detail), detail
        assert "routes restored" in detail
        assert central_routes(lab, "h0") == {} and central_routes(lab, "h1") == {}
    finally:
        lab.set_link("h0-leaf0r0", up=True)
        lab.set_link(LINK, up=True)
