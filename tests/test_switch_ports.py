"""Switch ports from their kernels: state, MTU and receive drops, read over netlink and exported with the
netdev contract the agents use; the drops join the port's receive errors."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
from collections.abc import Iterator

import pytest

from ridethrough.lab import netns
from ridethrough.lab.control import LabError
from ridethrough.lab.switch_counters import METRIC, PortCounters
from ridethrough.lab.switch_counters import meter_providers as counter_providers
from ridethrough.lab.switch_ports import (
    INTERFACE,
    MTU,
    UP,
    KernelPorts,
    NetlinkReader,
    Port,
    meter_providers,
    port_of,
    watch,
)
from ridethrough.lab.topology import Topology, TopologySpec
from tests.conftest import wait_for
from tests.ns_fakes import PerNamespace
from tests.otlp_sink import export_once

IP_MTU_DISCOVER, IP_PMTUDISC_DO = 10, 2  # <linux/in.h>; Python's socket module does not name them
TOPO = Topology(TopologySpec(hosts=4, racks=2, rails=1, spines=2, gpus=0), name="t")


@pytest.fixture
def rig() -> Iterator[tuple[KernelPorts, PerNamespace[Port], list[float]]]:
    kernel, now = PerNamespace[Port]("reading the ports"), [0.0]
    yield KernelPorts(TOPO, kernel, max_age_s=1.0, clock=lambda: now[0]), kernel, now


def test_a_netlink_message_becomes_a_port_and_lo_is_left_out() -> None:
    msg = {"ifname": "spine0", "operstate": "UP", "mtu": 1400, "stats64": {"rx_dropped": 7, "rx_packets": 90}}
    assert port_of(msg) == ("spine0", Port(up=True, mtu=1400, rx_dropped=7.0))
    assert port_of({"ifname": "h0", "operstate": "LOWERLAYERDOWN", "mtu": 1500}) == ("h0", Port(False, 1500, 0.0))
    assert port_of({"ifname": "lo", "operstate": "UNKNOWN"}) is None


def test_only_cabled_ports_are_read_once_a_second_and_the_last_reading_outlives_a_failed_one(rig) -> None:
    ports, kernel, now = rig
    ns = TOPO.namespace("leaf0r0")
    kernel.answers[ns] = {"spine0": Port(True, 1500, 0.0), "h0": Port(True, 1500, 2.0), "stray": Port(True, 9000, 0.0)}
    assert set(ports.ports("leaf0r0")) == {"spine0", "h0"}, "a port the topology does not cable is not a switch port"
    kernel.answers[ns]["spine0"] = Port(False, 1500, 0.0)
    assert ports.ports("leaf0r0")["spine0"].up, "within a second the reading is reused"
    assert kernel.reads == 1
    now[0] += 1.0
    assert not ports.ports("leaf0r0")["spine0"].up
    kernel.broken.add(ns)
    now[0] += 1.0
    assert ports.rx_dropped("leaf0r0") == {"spine0": 0.0, "h0": 2.0}, "an unreadable kernel keeps the last reading"
    assert ports.ports("spine1") == {}, "never read: nothing to say"


class Flushes:
    """A meter provider that only counts its flushes."""

    def __init__(self) -> None:
        self.flushed = threading.Event()
        self.count = 0

    def force_flush(self, timeout_millis: float = 0) -> bool:
        self.count += 1
        self.flushed.set()
        return True


def test_a_port_that_changes_state_is_exported_at_once() -> None:
    kernel = PerNamespace[Port]("reading the ports")
    leaf, spine = TOPO.namespace("leaf0r0"), TOPO.namespace("spine0")
    kernel.answers = {leaf: {"spine0": Port(True, 1500, 0.0)}, spine: {"leaf0r0": Port(True, 1500, 0.0)}}
    ports = KernelPorts(TOPO, kernel, max_age_s=0.0)
    flushes = {"leaf0r0": Flushes(), "spine0": Flushes()}
    stopping = threading.Event()
    watcher = threading.Thread(target=watch, args=(ports, flushes, stopping), kwargs={"every_s": 0.01})
    watcher.start()
    try:
        wait_for(lambda: kernel.reads >= 6, timeout_s=10)
        assert flushes["leaf0r0"].count == 0, "nothing changed: the periodic export is enough"
        kernel.answers[spine] = {"leaf0r0": Port(False, 1500, 0.0)}
        assert flushes["spine0"].flushed.wait(10)
        assert flushes["leaf0r0"].count == 0
    finally:
        stopping.set()
        watcher.join(5)
    assert not watcher.is_alive()


class Stuck(Flushes):
    """A flush that waits for the gateway until released (a slow, durable acknowledgement)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def force_flush(self, timeout_millis: float = 0) -> bool:
        super().force_flush(timeout_millis)
        return self.release.wait(10)


def test_the_far_end_of_a_cut_is_exported_while_the_near_end_still_flushes() -> None:
    kernel = PerNamespace[Port]("reading the ports")
    leaf, spine = TOPO.namespace("leaf0r0"), TOPO.namespace("spine0")
    kernel.answers = {leaf: {"spine0": Port(True, 1500, 0.0)}, spine: {"leaf0r0": Port(True, 1500, 0.0)}}
    ports = KernelPorts(TOPO, kernel, max_age_s=0.0)
    near, far = Stuck(), Flushes()
    stopping = threading.Event()
    watcher = threading.Thread(target=watch, args=(ports, {"leaf0r0": near, "spine0": far}, stopping),
                               kwargs={"every_s": 0.01})
    watcher.start()
    try:
        wait_for(lambda: kernel.reads >= 6, timeout_s=10)
        kernel.answers = {leaf: {"spine0": Port(False, 1500, 0.0)}, spine: {"leaf0r0": Port(False, 1500, 0.0)}}
        assert near.flushed.wait(10)
        assert far.flushed.wait(10), "the far end's trap does not queue behind the near end's"
        assert not near.release.is_set()
    finally:
        near.release.set()
        stopping.set()
        watcher.join(5)
    assert not watcher.is_alive()


def test_state_and_mtu_leave_over_otlp_as_netdev_gauges_and_drops_join_the_receive_errors(rig) -> None:
    ports, kernel, _ = rig
    kernel.answers[TOPO.namespace("spine1")] = {"leaf0r0": Port(True, 1400, 5.0), "leaf1r0": Port(False, 1500, 0.0)}
    errors = PortCounters(TOPO, lambda: [], read=lambda ns: {})
    requests = export_once(lambda gateway: [
        *meter_providers(ports, gateway=gateway, cluster="t", interval_s=3600).values(),
        *counter_providers(errors, gateway=gateway, cluster="t", dropped=ports.rx_dropped, interval_s=3600)])
    seen: dict[tuple[str, str, str], float] = {}
    for req in requests:
        for rm in req.resource_metrics:
            node = {kv.key: kv.value.string_value for kv in rm.resource.attributes}["ridethrough.node.id"]
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    points = m.sum.data_points if m.name == METRIC else m.gauge.data_points
                    for dp in points:
                        attrs = {kv.key: kv.value.string_value for kv in dp.attributes}
                        seen[(m.name, node, attrs.get(INTERFACE) or attrs["ib.device"])] = dp.as_double or dp.as_int
    assert seen[(UP, "spine1", "leaf0r0")] == 1.0 and seen[(UP, "spine1", "leaf1r0")] == 0.0
    assert seen[(MTU, "spine1", "leaf0r0")] == 1400.0 and seen[(MTU, "spine1", "leaf1r0")] == 1500.0
    assert seen[(METRIC, "spine1", "leaf0r0")] == 5.0, "frames too long for the port are receive errors"
    assert seen[(METRIC, "spine0", "leaf0r0")] == 0.0


@pytest.fixture
def pair() -> Iterator[tuple[str, str]]:
    """Two namespaces cabled by a veth: ``va`` (MTU 1500, 10.9.0.1) in the first, ``vb`` (MTU 1400, 10.9.0.2) in
    the second, both up."""
    if netns.unavailable_reason() is not None:
        pytest.skip(netns.unavailable_reason() or "")
    a, b = f"rt-ports-a{os.getpid()}", f"rt-ports-b{os.getpid()}"
    try:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "add", ns], check=True)
        for ns, cmd in ((a, ["link", "add", "va", "type", "veth", "peer", "name", "vb", "netns", b]),
                        (b, ["link", "set", "vb", "mtu", "1400"]), (a, ["addr", "add", "10.9.0.1/24", "dev", "va"]),
                        (b, ["addr", "add", "10.9.0.2/24", "dev", "vb"]), (a, ["link", "set", "va", "up"]),
                        (b, ["link", "set", "vb", "up"])):
            subprocess.run(["ip", "-n", ns, *cmd], check=True)
        yield a, b
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)


def _send_oversized(ns: str, count: int) -> None:
    """``count`` 1500-byte IP packets from ``va`` in ``ns`` to ``vb``, not fragmented (as a host whose MTU is 1500
    sends them)."""
    fd = os.open(netns.ns_path(ns), os.O_RDONLY)
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        netns.setns(fd)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
            for _ in range(count):
                s.sendto(b"x" * 1472, ("10.9.0.2", 9))
    finally:
        netns.setns(own)
        os.close(fd)
        os.close(own)


def test_the_kernel_counts_frames_over_the_mtu_at_the_receiving_port_and_reports_a_downed_peer(
        pair: tuple[str, str]) -> None:
    a, b = pair
    reader = NetlinkReader([a, b])
    reader.open()
    try:
        assert reader(a)["va"] == Port(True, 1500, 0.0) and reader(b)["vb"].mtu == 1400
        _send_oversized(a, 5)
        assert reader(b)["vb"].rx_dropped == 5.0, "vb's MTU is 1400: each 1500-byte frame was dropped as it arrived"
        assert reader(a)["va"].rx_dropped == 0.0
        subprocess.run(["ip", "-n", a, "link", "set", "va", "down"], check=True)
        # the kernel's link watcher turns a veth peer's carrier off a moment later (up to a second on a busy machine)
        wait_for(lambda: not reader(b)["vb"].up, timeout_s=10, what="vb to lose its carrier with its peer down")
    finally:
        reader.close()
    with pytest.raises(LabError, match="no netlink socket"):
        reader(a)


def test_opening_a_missing_namespace_fails_clearly() -> None:
    if netns.unavailable_reason() is not None:
        pytest.skip(netns.unavailable_reason() or "")
    with pytest.raises(LabError, match="does not exist"):
        NetlinkReader(["rt-no-such-namespace"]).open()
