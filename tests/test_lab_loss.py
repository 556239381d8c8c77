"""The lossy-link fault on the real kernel: nftables drops about the share asked, restore and down remove it.

Needs root, network namespaces and the ``nft`` tool (skipped with the reason otherwise). One small lab
(two racks of one host, one spine, no agents) serves the tests; each test puts it back as it found it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from ridethrough.lab import netns, nft
from ridethrough.lab.control import Direction, LabError
from ridethrough.lab.fabric import Lab
from ridethrough.lab.topology import TopologySpec

REASON = netns.unavailable_reason() or (None if nft.available() else "nft is not installed (the nftables package)")
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=REASON or "")]
SPEC = TopologySpec(hosts=2, racks=2, rails=1, spines=1, gpus=1)
SPINE = "leaf0r0-spine0"
"""h0 (rack 0) reaches h1 (rack 1) through leaf0r0, spine0 and leaf1r0: every packet crosses this link."""


def _name(tag: str) -> str:
    return f"t{tag}{os.getpid() % 100000}"


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with Lab.up(SPEC, name=_name("loss"), agents=False) as running:
        yield running


ECHO_PORT = 47011
ROUND_TRIPS = """
import socket, sys, time
dst, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setblocking(False)
got = set()
def drain():
    while True:
        try:
            got.add(int(s.recv(64)))
        except BlockingIOError:
            return
for i in range(count):
    s.sendto(str(i).encode(), (dst, port))
    time.sleep(0.005)
    drain()
deadline = time.monotonic() + 10  # a reply late on a loaded machine is still a reply, not a loss
while len(got) < count and time.monotonic() < deadline:
    time.sleep(0.05)
    drain()
print(count - len(got))
"""


@pytest.fixture(scope="module")
def echo(lab: Lab) -> Iterator[None]:
    """A UDP echo server on h1 (the lab's traffic tool), for the round trips `lost` counts."""
    server = lab.exec("h1", [sys.executable, "-m", "ridethrough.lab.traffic", "echo", "--bind",
                             lab.topology.stable_ip("h1"), "--port", str(ECHO_PORT), "--duration-s", "600"],
                      stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and "ready" in server.stdout.readline(), "the echo server did not start"
        yield
    finally:
        server.kill()
        server.wait()


def round_trips_lost(lab: Lab, count: int) -> int:
    """UDP round trips from h0 to h1 that never came back, out of ``count`` sent 5 ms apart."""
    done = lab.run("h0", [sys.executable, "-c", ROUND_TRIPS, lab.topology.stable_ip("h1"), str(ECHO_PORT),
                          str(count)], timeout_s=120)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip())


def tables(lab: Lab) -> dict[str, bool]:
    """Per node, whether its namespace holds the lab's nft table."""
    return {node: nft.has_table(lab.topology.namespace(node)) for node in ("h0", "leaf0r0", "spine0", "leaf1r0")}


@pytest.mark.usefixtures("echo")
def test_loss_drops_about_the_share_asked_and_restore_removes_it(lab: Lab) -> None:
    assert round_trips_lost(lab, 50) == 0
    lab.lose_packets(SPINE, percent=20, direction=Direction.FORWARD)
    try:
        # one way only: requests cross leaf0r0 -> spine0 and lose 20 %; replies come back untouched
        assert tables(lab) == {"h0": False, "leaf0r0": True, "spine0": False, "leaf1r0": False}
        assert lab.state()["faults"][f"link:{SPINE}/loss"] == "loss 20% forward"
        lost = round_trips_lost(lab, 200)
        # binomial(200, 0.2): mean 40, sd 5.7; the bounds are more than 4 sd away
        assert 15 <= lost <= 70, lost
        dropped = nft.losses(lab.topology.namespace("leaf0r0"))[lab.topology.link(SPINE).ifname("leaf0r0")]
        assert dropped["percent"] == 20 and dropped["dropped"] >= lost
    finally:
        lab.restore_link(SPINE)
    assert tables(lab) == {"h0": False, "leaf0r0": False, "spine0": False, "leaf1r0": False}
    assert not any(k.startswith(f"link:{SPINE}/") for k in lab.state().get("faults", {}))
    assert round_trips_lost(lab, 100) == 0


def test_both_ways_drops_at_each_end_and_two_links_of_one_switch_are_lossy_at_once(lab: Lab) -> None:
    host_link = "h0-leaf0r0"
    lab.lose_packets(SPINE, percent=30)
    lab.lose_packets(host_link, percent=5, direction=Direction.REVERSE)  # leaf0r0 -> h0
    try:
        assert tables(lab) == {"h0": False, "leaf0r0": True, "spine0": True, "leaf1r0": False}
        at_leaf = nft.losses(lab.topology.namespace("leaf0r0"))
        assert {k: v["percent"] for k, v in at_leaf.items()} == {
            lab.topology.link(SPINE).ifname("leaf0r0"): 30.0, lab.topology.link(host_link).ifname("leaf0r0"): 5.0}
        lab.lose_packets(SPINE, percent=10)  # setting it again replaces the rule
        assert sorted(v["percent"] for v in nft.losses(lab.topology.namespace("leaf0r0")).values()) == [5.0, 10.0]
        lab.restore_link(SPINE)
        assert tables(lab) == {"h0": False, "leaf0r0": True, "spine0": False, "leaf1r0": False}
        assert list(nft.losses(lab.topology.namespace("leaf0r0"))) == [lab.topology.link(host_link).ifname("leaf0r0")]
    finally:
        lab.restore_link(SPINE)
        lab.restore_link(host_link)
    assert not any(tables(lab).values())


@pytest.mark.parametrize(("link", "percent", "message"), [
    (SPINE, 0, r"loss percent must be in \(0, 100\], got 0"),
    (SPINE, 100.5, r"loss percent must be in \(0, 100\], got 100\.5"),
    (SPINE, float("nan"), "loss percent must be a number"),
    ("leaf0r0-spine7", 5, "leaf0r0-spine7"),
])
def test_bad_input_is_refused_in_one_line_and_nothing_is_applied(lab: Lab, link: str, percent: float,
                                                                   message: str) -> None:
    with pytest.raises(LabError, match=message) as info:
        lab.lose_packets(link, percent=percent)
    assert "\n" not in str(info.value)
    assert not any(tables(lab).values())


def test_without_nft_the_fault_says_what_to_install(lab: Lab, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(nft, "_SBIN", ())
    with pytest.raises(LabError, match="install the nftables Debian package"):
        lab.lose_packets(SPINE, percent=5)
    lab.restore_link(SPINE)  # a plain restore still works without nft
    monkeypatch.undo()
    assert not any(tables(lab).values())


def test_the_lab_cli_injects_loss_and_restore_ends_it(lab: Lab) -> None:
    from typer.testing import CliRunner

    from ridethrough.lab.cli import lab_app

    def inject(*args: str) -> tuple[int, str]:
        done = CliRunner().invoke(lab_app, ["inject", *args, "--name", lab.name])
        return done.exit_code, done.output

    code, out = inject("loss", SPINE, "-p", "percent=0")
    assert code == 1 and "out of range" in out and not any(tables(lab).values())
    code, out = inject("loss", SPINE, "-p", "percent=10", "-p", "direction=reverse")
    assert code == 0 and "applied" in out, out
    assert tables(lab) == {"h0": False, "leaf0r0": False, "spine0": True, "leaf1r0": False}
    code, out = inject("restore", SPINE)
    assert code == 0 and not any(tables(lab).values()), out


def test_lab_down_leaves_no_namespace_and_so_no_rule() -> None:
    with Lab.up(TopologySpec(hosts=2, racks=1, rails=1, spines=1, gpus=1), name=_name("lossdn"),
                agents=False) as small:
        small.lose_packets("h0-leaf0r0", percent=50)
        namespaces = [small.topology.namespace(n) for n in ("h0", "leaf0r0")]
        assert all(nft.has_table(ns) for ns in namespaces)
    assert not set(namespaces) & set(netns.list_names())
