"""A bad spine link drained at the leaves, on the real kernel: real switch control planes, real probes, the runner.

One small lab (2 racks of one host, 2 rails, 2 spines) with its host agents (probing) and its leaves'
control planes on (the reflex and the server's controller off, so every route change is the central
one). The test process is the controller: the real `Runner` with the ``reroute`` plugin given the
lab's switch map, so a spine link is drained at the two leaves of its rail; verify reads the probes
from the lab server's store. The hosts keep both rails; a walk of the kernel's routes, hop by hop,
finds no flow over the link; the rollback puts the leaves' routes back. Needs root and network namespaces.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ridethrough.actuators.actions import Status
from ridethrough.actuators.contract import Deadline
from ridethrough.actuators.reroute_plugin import CENTRAL_METRIC, RerouteConfig, ReroutePlugin
from ridethrough.actuators.reroute_verify import ProbeVerifyConfig
from ridethrough.controller_wiring import fleet_from_map
from ridethrough.detectors.fabric_map import RouteFile
from ridethrough.exporters.store import Store
from ridethrough.lab import netns
from ridethrough.lab.fabric import Lab
from ridethrough.lab.pathwalk import Walker
from ridethrough.lab.supervisor import REFLEX_PEERS_FILE, controller_env
from tests.conftest import wait_for
from tests.test_reroute_central_lab import NoIncidents, agents_answer, central_routes, controller, quiet_lab, run
from tests.test_reroute_verify_lab import link_down, probes_stored

REASON = netns.unavailable_reason()
pytestmark = [pytest.mark.integration, pytest.mark.skipif(REASON is not None, reason=REASON or "")]
LINK = "leaf0r1-spine0"
LEAVES = ("leaf0r1", "leaf1r1")


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with quiet_lab("trd", timeout_s=180) as running:
        yield running


@pytest.fixture
def parts(lab: Lab, tmp_path: Path) -> Iterator[dict[str, Any]]:
    client, targets = controller(lab)
    wait_for(lambda: agents_answer(client, targets, ["h0", "h1", *LEAVES]), timeout_s=120, interval_s=0.5,
             what="the agents' and the leaves' control planes to answer signed pings")
    probes = Store(lab.server["store_http"])
    wait_for(lambda: probes_stored(probes, lab.name), timeout_s=120, interval_s=1.0,
             what="both agents' probes in the lab's store")
    env = controller_env(lab.dir)
    plugin = ReroutePlugin(client, target=targets, config=RerouteConfig(
        fabric_map_file=str(lab.dir / "fabric.json"), addresses_file=str(lab.dir / REFLEX_PEERS_FILE),
        switches_file=env["RIDETHROUGH_REROUTE_SWITCHES_FILE"], probes=ProbeVerifyConfig(poll_s=0.5)))
    plugin.use_store(probes)
    store = Store(f"chdb://{tmp_path / 'store'}")
    store.init_schema()
    yield {"plugin": plugin, "store": store, "fleet": fleet_from_map(RouteFile(lab.dir / "fabric.json"),
                                                                     NoIncidents())}
    client.close()
    store.close()
    probes.close()


def test_a_cut_spine_link_is_drained_at_the_leaves_and_the_hosts_keep_both_rails(lab: Lab,
                                                                                 parts: dict[str, Any]) -> None:
    walker = Walker(lab)
    flows = [(a, b, 40_000 + i, 50_000 + i) for a, b in (("h0", "h1"), ("h1", "h0")) for i in range(16)]
    before = [walker.walk(a, b, sport=s, dport=d) for a, b, s, d in flows]
    assert any(LINK in w.links for w in before), "some flow hashes onto the link before (else the test shows nothing)"
    lab.set_link(LINK, up=False, end="spine0")
    try:
        incident = link_down(lab)
        status, reason, detail = run(parts["store"], parts["plugin"], incident, parts["fleet"])
        assert status == Status.SUCCEEDED.value, f"{reason}: {detail}"
        assert "none leaves through leaf0r1-spine0's uplinks" in detail and "probes since the apply confirm" in detail
        assert central_routes(lab, "h0") == {} and central_routes(lab, "h1") == {}, "no host route changed"
        for leaf in LEAVES:
            ours = central_routes(lab, leaf)
            assert ours and all(v == (CENTRAL_METRIC, ["spine1"]) for v in ours.values()), (leaf, ours)
        after = [walker.walk(a, b, sport=s, dport=d) for a, b, s, d in flows]
        assert all(w.ok and LINK not in w.links for w in after), after
        assert {w.links[0] for w in after} == {w.links[0] for w in before}, "each flow leaves by the NIC it did"
        plan = parts["plugin"].plan(incident, parts["fleet"]())
        assert plan is not None
        undone = parts["plugin"].rollback(plan, Deadline.after(60))
        assert undone.ok, undone.detail
        assert all(central_routes(lab, leaf) == {} for leaf in LEAVES), "the leaves' own routes carry traffic again"
    finally:
        lab.set_link(LINK, up=True)
    time.sleep(0.2)
    assert all(w.ok for w in (walker.walk(a, b, sport=s, dport=d) for a, b, s, d in flows))
