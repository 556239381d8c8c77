"""A real PyTorch job across the lab fabric: gloo all-reduce between hosts in different racks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from ridethrough.lab import netns
from ridethrough.lab.fabric import Lab
from ridethrough.lab.topology import TopologySpec

REASON = netns.unavailable_reason()
pytestmark = [pytest.mark.integration, pytest.mark.skipif(REASON is not None, reason=REASON or "")]
torch = pytest.importorskip("torch", reason="the torch extra (torch==2.13.0) is not installed")


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    spec = TopologySpec(hosts=4, racks=2, rails=2, spines=2, gpus=1)
    with Lab.up(spec, name=f"tjob{os.getpid() % 100000}", agents=False) as running:
        yield running


def test_gloo_allreduce_runs_across_racks(lab: Lab) -> None:
    hosts = ["h0", "h2"]  # different racks: every step crosses leaves and spines
    master = lab.topology.stable_ip(hosts[0])
    procs = [lab.exec(host, [sys.executable, "-m", "ridethrough.lab.allreduce", "--rank", str(rank),
                             "--world-size", "2", "--master-addr", master, "--master-port", "29511",
                             "--steps", "30", "--elements", "65536"],
                      job=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank, host in enumerate(hosts)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert [r["steps"] for r in results] == [30, 30]
    assert all(r["wrong_results"] == 0 for r in results)
