"""The reflex on the real kernel: a spine link cut, traffic rerouted by the hosts' agents, reported, and returned.

One small lab (2 racks of one host, 2 rails, 2 spines) with its agents and their reflex (the
server's controller off: nothing here needs it); h0 and h1 (different racks) hold an idle TCP
connection between their stable addresses, which makes them each other's watched peer. Hold-down
1 s and no flap damping (the agents inherit this environment), so the tests need not wait long for
traffic to return. Needs root and network namespaces.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from ridethrough.actuators.routes import RTPROT_RIDETHROUGH
from ridethrough.lab import netns
from ridethrough.lab.fabric import Lab
from ridethrough.lab.supervisor import REFLEX_PEERS_FILE
from ridethrough.lab.topology import TopologySpec
from tests.conftest import wait_for

REASON = netns.unavailable_reason()
pytestmark = [pytest.mark.integration, pytest.mark.skipif(REASON is not None, reason=REASON or "")]
TOOL = [sys.executable, "-m", "ridethrough.lab.traffic"]
PORT = 29640
TUNING = {"RIDETHROUGH_AGENT_REFLEX": "true", "RIDETHROUGH_AGENT_REFLEX_HOLDDOWN_S": "1",
          "RIDETHROUGH_AGENT_REFLEX_HOLDDOWN_MAX_S": "1", "RIDETHROUGH_CONTROLLER_ENABLED": "false"}


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with pytest.MonkeyPatch.context() as env:  # the supervisor, hence the agents, inherit it
        for k, v in TUNING.items():
            env.setenv(k, v)
        with Lab.up(TopologySpec(hosts=2, racks=2, rails=2, spines=2, gpus=0),
                    name=f"trr{os.getpid() % 100000}") as running:
            stable = running.dir / REFLEX_PEERS_FILE
            if not stable.exists():  # older supervisors do not write it yet
                stable.write_text(json.dumps({h: i["stable_ip"] for h, i in running.state()["hosts"].items()}))
            h0, h1 = (running.topology.stable_ip(h) for h in ("h0", "h1"))
            sink = running.exec("h1", [*TOOL, "tcp-sink", "--bind", h1, "--port", str(PORT), "--duration-s", "600"],
                                stdout=subprocess.PIPE, text=True)
            assert sink.stdout is not None and "ready" in sink.stdout.readline()
            client = running.exec("h0", [sys.executable, "-c", "import socket, sys, time\n"
                                         f"s = socket.create_connection(('{h1}', {PORT}), source_address=('{h0}', 0))\n"
                                         "time.sleep(600)"])
            wait_for(lambda: watched(running), timeout_s=60, what="h0 and h1 to watch each other")
            yield running
            for p in (client, sink):
                p.kill()
                p.wait()


def watched(lab: Lab) -> bool:
    """Whether both agents' reflexes have seen the connection (their logs say so only when they act, so
    ask the kernel: established TCP between the two stable addresses, both ways)."""
    out = lab.run("h1", ["ss", "-Htn", "state", "established", "src", lab.topology.stable_ip("h1")]).stdout
    return lab.topology.stable_ip("h0") in out


def overrides(lab: Lab, host: str) -> dict[str, list[str]]:
    """The reflex's /32 routes on a host: destination → interfaces (with rto_min checked on the way)."""
    h = lab.handle(host)
    names = h.names_by_index()
    out: dict[str, list[str]] = {}
    for r in h.ipr.get_routes(family=2, table=254, proto=RTPROT_RIDETHROUGH):
        metrics = dict((r.get_attr("RTA_METRICS") or {}).get("attrs", []))
        assert metrics.get("RTAX_RTO_MIN") == 50, "an override locks a low rto_min"
        hops = r.get_attr("RTA_MULTIPATH") or [{"oif": r.get_attr("RTA_OIF")}]
        out[str(r.get_attr("RTA_DST"))] = sorted(str(names[nh["oif"]]) for nh in hops)
    return out


def both_moved(lab: Lab, via: list[str]) -> bool:
    h0, h1 = (lab.topology.stable_ip(h) for h in ("h0", "h1"))
    return overrides(lab, "h0") == {h1: via} and overrides(lab, "h1") == {h0: via}


def sql(lab: Lab, query: str) -> list[list[Any]]:
    url = f"{lab.server['store_http']}/?query={urllib.parse.quote(query + ' FORMAT JSONCompact')}"
    with urllib.request.urlopen(url, timeout=30) as r:
        return list(json.loads(r.read())["data"])


def reported(lab: Lab, host: str, name: str) -> bool:
    """Whether ``host``'s agent has reported ``name`` both as an event and as a span, in the store."""
    node = f"ResourceAttributes['ridethrough.node.id'] = '{host}'"
    logs = sql(lab, f"SELECT count() FROM otel_logs WHERE {node} AND LogAttributes['event.name'] = '{name}'")
    spans = sql(lab, f"SELECT count() FROM otel_traces WHERE {node} AND SpanName = '{name}' "
                     "AND SpanAttributes['reflex.peer'] != ''")
    return int(logs[0][0]) > 0 and int(spans[0][0]) > 0


def echo_flows_ok(lab: Lab, flows: int = 16) -> list[bool]:
    """UDP echo round trips from h0's stable address to h1's, from ``flows`` source ports."""
    h0, h1 = (lab.topology.stable_ip(h) for h in ("h0", "h1"))
    server = lab.exec("h1", [*TOOL, "echo", "--bind", h1, "--port", str(PORT + 1), "--duration-s", "30"],
                      stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and "ready" in server.stdout.readline()
        spec = ",".join(f"{41000 + i}:{h1}:{PORT + 1}" for i in range(flows))
        done = lab.run("h0", [*TOOL, "probe", "--bind", h0, "--flows", spec], timeout_s=60)
        assert done.returncode == 0, done.stderr
        return [bool(x) for x in json.loads(done.stdout.strip().splitlines()[-1])["ok"]]
    finally:
        server.kill()
        server.wait()


def test_a_cut_spine_link_is_routed_around_reported_and_returned(lab: Lab) -> None:
    link = "leaf0r1-spine0"  # rail 1 between the racks loses one of its two spines
    lab.set_link(link, up=False, end="spine0")
    try:
        wait_for(lambda: both_moved(lab, ["nic0"]), timeout_s=30, what="h0 and h1 to move each other off rail 1")
        assert all(echo_flows_ok(lab)), "every flow between the stable addresses gets through meanwhile"
        wait_for(lambda: reported(lab, "h0", "reflex.reroute") and reported(lab, "h1", "reflex.reroute"),
                 timeout_s=60, interval_s=1.0, what="the reroutes' events and spans in the store")
    finally:
        lab.set_link(link, up=True)
    wait_for(lambda: not overrides(lab, "h0") and not overrides(lab, "h1"), timeout_s=30,
             what="traffic to return after the hold-down")
    wait_for(lambda: reported(lab, "h0", "reflex.return"), timeout_s=60, interval_s=1.0, what="the return reported")


def test_when_every_rail_between_them_fails_the_last_path_is_kept(lab: Lab) -> None:
    rail1 = ["leaf0r1-spine0", "leaf0r1-spine1"]
    rail0 = ["leaf0r0-spine0", "leaf0r0-spine1"]
    try:
        for link in rail1:
            lab.set_link(link, up=False, end=link.split("-")[1])
        wait_for(lambda: both_moved(lab, ["nic0"]), timeout_s=30, what="both hosts to leave rail 1")
        for link in rail0:
            lab.set_link(link, up=False, end=link.split("-")[1])
        # Nothing is to happen now: watch for a while (many timeouts' worth) that nothing does.
        time.sleep(3.0)
        assert both_moved(lab, ["nic0"]), "the last path stays: no override removed, emptied or moved"
        route = lab.handle("h0").route_get(lab.topology.stable_ip("h1"))
        assert lab.handle("h0").names_by_index()[route.get_attr("RTA_OIF")] == "nic0"
        for link in rail0:
            lab.set_link(link, up=True)
        assert wait_for(lambda: all(echo_flows_ok(lab, flows=4)), timeout_s=30, what="rail 0 to carry traffic again")
    finally:
        for link in rail0 + rail1:
            lab.set_link(link, up=True)
    wait_for(lambda: not overrides(lab, "h0") and not overrides(lab, "h1"), timeout_s=30, what="the return")
