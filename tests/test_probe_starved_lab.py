"""A starved agent is not a lossy network: one host held to a few percent of a CPU for 10 s, its links healthy.

One lab (4 hosts in 2 racks, 2 rails, 2 spines) with its server (gateway, store, controller with the
lab's fabric map and every detector) and agents. h1's whole cgroup (its agent) is capped at 3 % of a CPU
for 10 s: its responder answers late and its prober runs late. The probes must say so
(``ridethrough.probe.stalled``, late replies) and charge no loss to h1's paths, and the controller must
open no link incident. Needs root and network namespaces.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from ridethrough.lab import netns
from ridethrough.lab.fabric import Lab
from ridethrough.lab.topology import TopologySpec
from tests.conftest import store_sql, wait_for

REASON = netns.unavailable_reason()
pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.skipif(REASON is not None, reason=REASON or "")]
HOST = "h1"
STARVED_S = 10.0
CPU_FRACTION = 0.01
LINK_KINDS = ("link_degrading", "link_down", "link_flap", "congestion")


def _increase(store_http: str, metric: str, where: str, start_ns: int, end_ns: int) -> float:
    """A counter's increase over [start, end], summed over its series (each: newest minus oldest point)."""
    rows = store_sql(store_http, f"""
        SELECT sum(d) FROM (
            SELECT argMax(Value, TimeUnix) - argMin(Value, TimeUnix) AS d FROM otel_metrics_sum
            WHERE MetricName = '{metric}' AND {where}
              AND TimeUnix BETWEEN fromUnixTimestamp64Nano(toInt64({start_ns}))
                               AND fromUnixTimestamp64Nano(toInt64({end_ns}))
            GROUP BY ResourceAttributes, Attributes)""")
    return float(rows[0][0] or 0.0)


def _losses(store_http: str, where: str, start_ns: int, end_ns: int) -> list[list[Any]]:
    """Where losses were charged, for a failure's message: (prober, peer, direction, increase) and the probe
    packets dropped, by node, role and reason."""
    span = (f"TimeUnix BETWEEN fromUnixTimestamp64Nano(toInt64({start_ns})) "
            f"AND fromUnixTimestamp64Nano(toInt64({end_ns}))")
    lost = store_sql(store_http, f"""
        SELECT Attributes['probe.src.node'] s, Attributes['probe.dst.node'] d, Attributes['probe.direction'] dir,
               argMax(Value, TimeUnix) - argMin(Value, TimeUnix) AS inc
        FROM otel_metrics_sum WHERE MetricName = 'ridethrough.probe.lost' AND {where} AND {span}
        GROUP BY s, d, dir, Attributes['probe.src.nic'] HAVING inc > 0""")
    dropped = store_sql(store_http, f"""
        SELECT ResourceAttributes['ridethrough.node.id'] n, Attributes['probe.role'] r, Attributes['reason'] re,
               argMax(Value, TimeUnix) - argMin(Value, TimeUnix) AS inc
        FROM otel_metrics_sum WHERE MetricName = 'ridethrough.probe.dropped' AND {span}
        GROUP BY n, r, re HAVING inc > 0""")
    return lost + dropped


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with Lab.up(TopologySpec(hosts=4, racks=2, rails=2, spines=2, gpus=0), name=f"tps{os.getpid() % 100000}",
                agents=True, timeout_s=120) as running:
        store = running.server["store_http"]
        wait_for(lambda: store_sql(store, "SELECT uniqExact(ResourceAttributes['ridethrough.node.id']) FROM "
                                     "otel_metrics_sum WHERE MetricName = 'ridethrough.probe.received' "
                                     "AND Value > 0")[0][0] >= 4,
                 timeout_s=120, interval_s=1.0, what="all four agents' probes answered, in the store")
        time.sleep(35)  # past the probes' first-contact grace (30 s): from here an unanswered probe is judged
        yield running


def test_a_starved_agent_is_a_stall_not_a_lossy_network(lab: Lab) -> None:
    store = lab.server["store_http"]
    began = time.time_ns()
    lab.starve(HOST, cpu_fraction=CPU_FRACTION)
    try:
        time.sleep(STARVED_S)
    finally:
        lab.starve(HOST, cpu_fraction=None)
    ended = time.time_ns()
    # Once the agent is back: its counters reach the store, and the late replies' overdue twins are judged
    # (late_s, 10 s); the controller's tomography then has run over the whole stall more than once.
    time.sleep(40)
    settled = time.time_ns()

    on_host = f"(ResourceAttributes['ridethrough.node.id'] = '{HOST}')"
    stalled = _increase(store, "ridethrough.probe.stalled", on_host, began - 5 * 10**9, settled)
    assert stalled >= 2.0, f"{HOST}'s probe threads stalled only {stalled:.2f} s by their own count"

    its_paths = f"(Attributes['probe.src.node'] = '{HOST}' OR Attributes['probe.dst.node'] = '{HOST}')"
    late = _increase(store, "ridethrough.probe.late", its_paths, began - 5 * 10**9, settled)
    lost = _increase(store, "ridethrough.probe.lost", its_paths, began - 5 * 10**9, settled)
    unknown = _increase(store, "ridethrough.probe.unknown", its_paths, began - 5 * 10**9, settled)
    received = _increase(store, "ridethrough.probe.received", its_paths, began - 5 * 10**9, settled)
    assert received > 0, "the probes went on"
    assert lost == 0, f"{lost:.0f} probes charged to {HOST}'s healthy paths as lost ({late:.0f} late, " \
                      f"{unknown:.0f} unknown, {received:.0f} received; {stalled:.1f} s stalled): " \
                      f"{_losses(store, its_paths, began - 5 * 10**9, settled)}"

    opened = store_sql(store, f"""
        SELECT Kind, Entity, Summary FROM incidents FINAL
        WHERE Kind IN {LINK_KINDS} AND OpenedAt >= fromUnixTimestamp64Nano(toInt64({began}))""")
    assert opened == [], f"link incidents on healthy links while {HOST} was starved ({(ended - began) / 1e9:.0f} " \
                         f"s): {opened}"
