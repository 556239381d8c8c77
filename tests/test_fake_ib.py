"""The fake IB tree: counters follow veth stats and scripted ramps, and the real sources read it."""

from __future__ import annotations

from pathlib import Path

import pytest

from ridethrough.collector.sources.infiniband import InfinibandSource
from ridethrough.collector.sources.netdev import NetdevSource
from ridethrough.lab.control import LabError
from ridethrough.lab.fake_ib import CounterPump, NicScript, NicStats, create_tree

S = 1_000_000_000


def _values(samples, name: str, **attrs: str) -> list[float]:
    return [s.value for s in samples if s.name == name and all(s.attributes.get(k) == v for k, v in attrs.items())]


def test_traffic_and_ramps_reach_the_agent_sources(tmp_path: Path) -> None:
    root = tmp_path / "sysfs"
    create_tree(root, 2)
    stats = {"nic0": NicStats(4000, 8000, 10, 20), "nic1": (0, 0, 0, 0)}
    pump = CounterPump(root, tmp_path / "nic_faults.json", lambda: stats)
    script = NicScript(tmp_path / "nic_faults.json")
    script.ramp("nic0", "symbol_error", 10.0, start_ns=0)
    pump.tick(5 * S)
    ib = list(InfinibandSource(sysfs_root=root).collect(5 * S))
    assert _values(ib, "ridethrough.ib.port.io", **{"ib.device": "mlx5_0", "network.io.direction": "transmit"}) \
        == [8000], "4-byte words in the tree, bytes out of the source"
    assert _values(ib, "ridethrough.ib.port.errors", **{"ib.device": "mlx5_0", "ib.counter": "symbol_error"}) == [50]
    assert _values(ib, "ridethrough.ib.port.errors", **{"ib.device": "mlx5_1", "ib.counter": "symbol_error"}) == [0]
    net = list(NetdevSource(sysfs_root=root).collect(5 * S))
    assert _values(net, "system.network.io", **{"network.interface.name": "nic0",
                                                 "network.io.direction": "receive"}) == [4000]

    script.clear("nic0", at_ns=6 * S)
    stats["nic0"] = NicStats(4000, 8000, 10, 20, up=False)
    pump.tick(9 * S)
    ib = list(InfinibandSource(sysfs_root=root).collect(9 * S))
    assert _values(ib, "ridethrough.ib.port.errors", **{"ib.device": "mlx5_0", "ib.counter": "symbol_error"}) == [60]
    assert _values(ib, "ridethrough.ib.port.errors", **{"ib.device": "mlx5_0", "ib.counter": "link_downed"}) == [1]
    assert _values(ib, "ridethrough.ib.port.state", **{"ib.device": "mlx5_0"}) == [1]
    assert (root / "class/net/nic0/operstate").read_text() == "down\n"


def test_bad_ramps_are_refused(tmp_path: Path) -> None:
    script = NicScript(tmp_path / "f.json")
    with pytest.raises(LabError, match="no IB counter"):
        script.ramp("nic0", "rx_bytes", 1.0, start_ns=0)
    with pytest.raises(LabError, match="no NIC"):
        script.ramp("eth0", "symbol_error", 1.0, start_ns=0)
    with pytest.raises(LabError, match="positive"):
        script.ramp("nic0", "symbol_error", 0.0, start_ns=0)


def test_a_broken_script_stops_ramps_not_traffic(tmp_path: Path) -> None:
    root = tmp_path / "sysfs"
    create_tree(root, 1)
    (tmp_path / "f.json").write_text("[garbage")
    CounterPump(root, tmp_path / "f.json", lambda: {"nic0": (40, 80, 1, 2)}).tick(S)
    assert (root / "class/infiniband/mlx5_0/ports/1/counters/port_rcv_data").read_text() == "10\n"
