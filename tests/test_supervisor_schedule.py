"""The supervisor runs a scheduled operation when it is due, even while a counter pump is slow."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from ridethrough.lab.state import StateFile
from ridethrough.lab.supervisor import Supervisor
from tests.conftest import wait_for

PUMP_S = 2.0


class SlowPump:
    """A counter pump whose tick takes ``PUMP_S`` (a loaded host rewriting its sysfs trees)."""

    def tick(self, now_ns: int) -> None:
        time.sleep(PUMP_S)


class Fabric:
    """Records when each scheduled link change ran."""

    def __init__(self) -> None:
        self.ran: list[tuple[str, bool, int]] = []

    def set_link(self, link: str, *, up: bool, end: str | None = None) -> None:
        self.ran.append((link, up, time.time_ns()))


def test_a_due_link_cut_is_not_held_up_by_a_slow_counter_pump(tmp_path: Path) -> None:
    sf = StateFile(tmp_path, "sched")
    sf.create({"name": "sched", "mode": "loopback", "dir": str(tmp_path / "sched"), "hosts": {}})
    sup = Supervisor(sf)
    fabric = Fabric()
    sup.fabric = lambda: fabric  # type: ignore[method-assign]
    sup.pumps = [SlowPump()]  # type: ignore[list-item]
    due_ns = time.time_ns() + 800_000_000  # inside the first pump tick (from 0.5 s to 2.5 s)

    def add(st: Any) -> None:
        st["schedule"] = [{"id": 1, "at_ns": due_ns, "op": "set_link",
                           "args": {"link": "h3-leaf0r0", "up": False, "end": "h3"}}]
    sf.update(add)
    loop = threading.Thread(target=sup.loop)
    loop.start()
    try:
        wait_for(lambda: fabric.ran, timeout_s=10, what="the scheduled cut")
    finally:
        sup.stopping.set()
        loop.join(PUMP_S + 5)
    (link, up, ran_ns) = fabric.ran[0]
    assert (link, up) == ("h3-leaf0r0", False)
    # on the pump's thread it would wait for the tick to end, 1.7 s late
    assert 0 <= (ran_ns - due_ns) / 1e9 < 0.8
    assert sf.read()["schedule"] == []


class Topology:
    nodes = ["h0", "leaf0r0", "spine0"]  # a property on the real Topology, not a method


class AttachedFabric(Fabric):
    """A lab whose namespace handles the supervisor opens when its loop starts."""

    def __init__(self) -> None:
        super().__init__()
        self.topology = Topology()
        self.opened: list[str] = []

    def handle(self, node: str) -> object:
        self.opened.append(node)
        return object()


def test_a_netns_lab_is_attached_and_its_namespaces_opened_when_the_loop_starts(tmp_path: Path) -> None:
    sf = StateFile(tmp_path, "attach")
    sf.create({"name": "attach", "mode": "netns", "dir": str(tmp_path / "attach"), "hosts": {}})
    sup = Supervisor(sf)
    fabric = AttachedFabric()
    sup.fabric = lambda: fabric  # type: ignore[method-assign,assignment,return-value]
    loop = threading.Thread(target=sup.loop)
    loop.start()
    try:
        wait_for(lambda: len(fabric.opened) == 3, timeout_s=5, what="every namespace's handle")
    finally:
        sup.stopping.set()
        loop.join(5)
    assert fabric.opened == Topology.nodes
