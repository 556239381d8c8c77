"""`Lab`: a small GPU cluster of network namespaces on this machine, implementing `LabControl`.

    with Lab.up(TopologySpec(hosts=4, racks=2), name="t1", agents=False) as lab:
        lab.run("h0", ["python", "-c", "print(1)"])
        lab.set_link("leaf0r0-spine1", up=False)

`Lab.up` builds the fabric (see `ridethrough.lab.topology` and `ridethrough.lab.routing`),
lays out each host's fake devices, starts the supervisor (server, agents, counter pump,
timers) and returns once processes are started and the server is ready. `Lab.attach`
opens a running lab by name (``ridethrough lab inject`` does); `Lab.down` (also on leaving
the ``with`` block, and at exit) removes everything, even after a crash.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar, cast

from pyroute2.netlink.exceptions import NetlinkError

from ridethrough.lab import build, netns, nft, procs
from ridethrough.lab.control import Direction, LabError
from ridethrough.lab.hostops import LabBase
from ridethrough.lab.netns import Handles, NsHandle
from ridethrough.lab.procs import ProcRef
from ridethrough.lab.routing import plan
from ridethrough.lab.state import State, StateFile, default_state_root, read_running
from ridethrough.lab.teardown import DownReport
from ridethrough.lab.topology import Kind, Link, Topology, TopologySpec, check_lab_name

IFF_UP = 0x1
LOAD_MAX_S = 900.0
"""A load generator stops by itself after this long, even if nobody stops it."""
DEFAULT_MTU = 1500


F = TypeVar("F", bound=Callable[..., Any])


def _as_lab_error(method: F) -> F:
    """Report netlink and OS failures of a fault as `LabError` (one line, naming the target)."""
    @functools.wraps(method)
    def wrapper(self: Lab, *args: Any, **kw: Any) -> Any:
        try:
            return method(self, *args, **kw)
        except (NetlinkError, OSError) as exc:
            target = args[0] if args else next(iter(kw.values()), "")
            raise LabError(f"lab {self.name}: {method.__name__} {target}: {exc}") from exc
    return cast(F, wrapper)


class Lab(LabBase):
    """A running namespace lab (see the module docstring)."""

    def __init__(self, sf: StateFile, state: State, *, supervisor: subprocess.Popen[bytes] | None = None) -> None:
        super().__init__(sf, state)
        self.topology = Topology(TopologySpec(**state["spec"]), name=state["name"], mgmt_subnet=state["mgmt_subnet"])
        self._handles = Handles()
        self._supervisor = supervisor
        self.veth_pairs = 0

    # -- lifecycle -------------------------------------------------------------------------

    @classmethod
    def up(cls, spec: TopologySpec | None = None, *, name: str = "lab", agents: bool = True,
           state_root: Path | None = None, clocks: Mapping[str, tuple[int, float]] | None = None,
           cleanup_at_exit: bool = True, timeout_s: float = 60.0) -> Lab:
        """Build and start a lab; returns once its processes run and its server is ready.

        ``clocks`` maps hosts to (offset ns, drift ppm); by default they follow from ``name``.
        LabError (one line) if namespaces are unavailable or anything fails; whatever was made
        by then is removed.
        """
        reason = netns.unavailable_reason()
        if reason:
            raise LabError(f"{reason}; the degraded mode works without: ridethrough lab up --loopback")
        started = time.monotonic()
        sf = StateFile(state_root or default_state_root(os.environ), check_lab_name(name))
        topo, state = build.allocate(sf, spec or TopologySpec(), name=name, agents=agents, clocks=clocks)
        lab = cls(sf, state)
        try:
            build.make_cgroups(sf, state)
            build.make_bridge(topo, sf)
            lab._supervisor = build.spawn_supervisor(sf, state)
            lab.veth_pairs = build.build_fabric(topo, sf, lab._handles)
            lab.close()  # a netlink socket holds its namespace: keep none open that nobody uses
            build.make_host_dirs(topo, state)
            sf.set_in("status", "fabric", "ready")
            lab._wait_ready(timeout_s)
        except BaseException as exc:
            with contextlib.suppress(Exception):
                lab.down()
            if isinstance(exc, NetlinkError | OSError):
                raise LabError(f"lab {name}: bring-up failed: {exc}") from exc
            raise
        if cleanup_at_exit:
            lab._cleanup_at_exit()
        lab.up_s = time.monotonic() - started
        return lab

    @classmethod
    def attach(cls, name: str, *, state_root: Path | None = None) -> Lab:
        """A handle on a running namespace lab (no cleanup at exit: it is not ours)."""
        return cls(*read_running(name, state_root=state_root, mode="netns"))

    def close(self) -> None:
        """Close this handle's netlink sockets (each keeps its namespace alive); they reopen on use."""
        self._handles.close()

    def down(self, *, keep_dir: bool = False) -> DownReport:
        """Stop and remove everything the lab made (idempotent)."""
        self.close()
        return super().down(keep_dir=keep_dir)

    # -- topology --------------------------------------------------------------------------

    def links(self) -> list[str]:
        """Link names, in order (host links, then leaf-spine links)."""
        return [link.name for link in self.topology.links]

    def handle(self, node: str) -> NsHandle:
        """The netlink handle of any node's namespace (for reading routes and counters)."""
        self._kind(node)
        return self._handles(self.topology.namespace(node))

    def _kind(self, node: str) -> Kind:
        try:
            return self.topology.kind(node)
        except ValueError as exc:
            raise LabError(str(exc)) from None

    def _link(self, name: str) -> Link:
        try:
            return self.topology.link(name)
        except ValueError as exc:
            raise LabError(str(exc)) from None

    def _node_ns(self, node: str) -> str | None:
        self._kind(node)
        return self.topology.namespace(node)

    def _node_cgroup(self, node: str, *, job: bool) -> Path | None:
        if self._kind(node) is Kind.HOST:
            return super()._node_cgroup(node, job=job)
        return None if self.info.get("cgroup") is None else Path(self.info["cgroup"])

    @staticmethod
    def _ends(link: Link, end: str | None) -> list[str]:
        if end is None:
            return [link.lower, link.upper]
        if end not in (link.lower, link.upper):
            raise LabError(f"{end!r} is not an end of {link.name} (ends: {link.lower}, {link.upper})")
        return [end]

    # -- link faults -----------------------------------------------------------------------

    @_as_lab_error
    def set_link(self, link: str, *, up: bool, end: str | None = None) -> None:
        """Set a link administratively down or up at one end (``end``) or both.

        An end set down drops its own routes through the link (the kernel does, as a switch
        drops a dead port from its ECMP groups); the far end only loses carrier and keeps
        sending into it. Up puts back the routes the lab had through it.
        """
        lk = self._link(link)
        ends = self._ends(lk, end)
        for node in ends:
            self.handle(node).set_up(lk.ifname(node), up)
        for node in ends:
            if up:
                self._reroute(node, lk.ifname(node))
            self._fault(f"link:{link}/down@{node}", None if up else "down")

    def _reroute(self, node: str, ifname: str) -> None:
        h = self.handle(node)
        up = {str(m.get("ifname")) for m in h.links() if m["flags"] & IFF_UP}
        for route in plan(self.topology, node).routes:
            if route.via(ifname):
                hops = tuple(nh for nh in route.nexthops if nh[1] in up)
                if hops:
                    h.route(dataclasses.replace(route, nexthops=hops))

    @_as_lab_error
    def flap_link(self, link: str, *, period_s: float, count: int, end: str | None = None) -> None:
        """``count`` cycles: down at the start of each period, up half a period later (run by the supervisor)."""
        lk = self._link(link)
        self._ends(lk, end)
        if period_s <= 0 or count < 1:
            raise LabError(f"flap needs period_s > 0 and count >= 1, got {period_s} and {count}")
        t0 = time.time_ns() + 50_000_000
        for i in range(count):
            for up, offset in ((False, i * period_s), (True, (i + 0.5) * period_s)):
                self.schedule("set_link", {"link": link, "up": up, "end": end}, at_ns=t0 + round(offset * 1e9),
                              tag=f"flap:{link}")

    def _directed(self, lk: Link, direction: Direction) -> list[str]:
        """The sending ends of a one-way fault: forward is from the lower end."""
        return {Direction.FORWARD: [lk.lower], Direction.REVERSE: [lk.upper]}.get(direction, [lk.lower, lk.upper])

    @_as_lab_error
    def degrade_link(self, link: str, *, rate_mbit: float, burst_kbit: float = 32.0, latency_ms: float = 20.0,
                     direction: Direction = Direction.BOTH) -> None:
        """Cap a link with ``tbf`` on the sending side(s) of ``direction`` (a small queue: congests and drops)."""
        lk = self._link(link)
        if min(rate_mbit, burst_kbit, latency_ms) <= 0:
            raise LabError(f"degrade needs positive rate_mbit, burst_kbit and latency_ms on {link}")
        for node in self._directed(lk, direction):
            self.handle(node).tbf(lk.ifname(node), rate_mbit=rate_mbit, burst_kbit=burst_kbit, latency_ms=latency_ms)
        self._fault(f"link:{link}/degrade", f"tbf {rate_mbit:g} mbit/s {direction.value}")

    @_as_lab_error
    def lose_packets(self, link: str, *, percent: float, direction: Direction = Direction.BOTH) -> None:
        """Drop ``percent`` % of the packets leaving each sending end of ``direction``, at random (nftables).

        A failing optic or a dirty fibre: loss whatever the load, where a rate cap only shows under
        load. Each end's rule is keyed by its interface (`ridethrough.lab.nft`); `restore_link` removes it.
        """
        lk = self._link(link)
        percent = nft.check_percent(percent)
        nft.nft_binary()  # refuse before touching anything when nft is missing
        ends = self._directed(lk, direction)
        try:
            for node in ends:
                nft.set_loss(self._node_ns(node), lk.ifname(node), percent)
        except LabError:
            for node in ends:  # nothing half applied
                with contextlib.suppress(LabError):
                    nft.clear_loss(self._node_ns(node), lk.ifname(node))
            raise
        self._fault(f"link:{link}/loss", f"loss {percent:g}% {direction.value}")

    @_as_lab_error
    def restore_link(self, link: str) -> None:
        """Stop loads on the link, remove its qdiscs, packet loss and MTU changes, and bring both ends up."""
        lk = self._link(link)
        for handle, info in list(self.state().get("loads", {}).items()):
            if info.get("link") == link and not info.get("stopped"):
                self.stop_load(handle)
        lossy = any(k == f"link:{link}/loss" for k in self.state().get("faults", {}))
        loss_errors: list[str] = []
        for node in (lk.lower, lk.upper):
            h = self.handle(node)
            h.clear_qdisc(lk.ifname(node))
            h.set_mtu(lk.ifname(node), DEFAULT_MTU)
            if lossy or nft.available():  # the latter: a rule the state missed (a crash in between)
                try:
                    nft.clear_loss(self._node_ns(node), lk.ifname(node))
                except LabError as exc:  # finish the restore first; a recorded loss left behind is said after
                    if lossy:
                        loss_errors.append(f"{node}: {exc}")
        self.set_link(link, up=True)
        self.sf.update(lambda st: [st.get("faults", {}).pop(k) for k in list(st.get("faults", {}))
                                   if k.startswith(f"link:{link}/") and not (loss_errors and k.endswith("/loss"))])
        if loss_errors:
            raise LabError(f"{link} restored but its packet loss was not removed: {'; '.join(loss_errors)}")

    @_as_lab_error
    def set_mtu(self, link: str, *, end: str, mtu: int) -> None:
        """Set the MTU of one end of a link (an MTU mismatch when the ends differ)."""
        lk = self._link(link)
        self._ends(lk, end)
        if not 68 <= mtu <= 65535:
            raise LabError(f"MTU must be 68..65535, got {mtu}")
        self.handle(end).set_mtu(lk.ifname(end), mtu)
        self._fault(f"link:{link}/mtu@{end}", f"mtu {mtu}")

    @_as_lab_error
    def start_load(self, link: str, *, direction: Direction, rate_mbit: float) -> str:
        """UDP at ``rate_mbit`` across the link, one way (both: two blasters), to a sink at the far end."""
        lk = self._link(link)
        if rate_mbit <= 0:
            raise LabError(f"load rate must be positive, got {rate_mbit}")
        def next_id(st: State) -> int:
            n = int(st.get("next_id", 1))
            st["next_id"] = n + 1
            return n
        n = self.sf.update(next_id)
        handle, port = f"load:{n}", 40000 + n % 20000
        started: list[subprocess.Popen[bytes]] = []
        for src in self._directed(lk, direction):
            dst = lk.peer(src)
            src_ip, dst_ip = (lk.lower_ip, lk.upper_ip) if src == lk.lower else (lk.upper_ip, lk.lower_ip)
            started.append(self._tool(dst, ["sink", "--bind", dst_ip, "--port", str(port)]))
            started.append(self._tool(src, ["blast", "--dst", dst_ip, "--port", str(port), "--bind", src_ip,
                                            "--rate-mbit", str(rate_mbit)]))
        self._children[handle] = started
        refs = [r.to_json() for r in (procs.ref(p.pid) for p in started) if r is not None]

        def record(st: State) -> None:
            st.setdefault("processes", {})[handle] = refs
            st.setdefault("loads", {})[handle] = {"link": link, "direction": direction.value, "rate_mbit": rate_mbit}
        self.sf.update(record)
        return handle

    def _tool(self, node: str, args: list[str]) -> subprocess.Popen[bytes]:
        """A `ridethrough.lab.traffic` tool in a node, bounded by `LOAD_MAX_S`."""
        argv = [sys.executable, "-m", "ridethrough.lab.traffic", *args, "--duration-s", str(LOAD_MAX_S)]
        return netns.popen(self._node_ns(node), argv, cgroup=self._node_cgroup(node, job=False),
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    @_as_lab_error
    def stop_load(self, handle: str) -> None:
        """Stop a load started by `start_load` (stopping a stopped one is fine)."""
        st = self.state()
        if handle not in st.get("loads", {}):
            raise LabError(f"no load {handle!r} in lab {self.name}")
        procs.stop([ProcRef.from_json(r) for r in st.get("processes", {}).get(handle, [])], grace_s=0.2)
        for child in self._children.pop(handle, []):
            child.wait()

        def forget(s: State) -> None:
            s.get("processes", {}).pop(handle, None)
            s["loads"][handle]["stopped"] = True
        self.sf.update(forget)

    def __repr__(self) -> str:
        return f"Lab({self.name!r}, {self.topology.spec}, dir={self.dir})"


def attach(name: str, *, state_root: Path | None = None) -> LabBase:
    """A handle on any running lab by name: a `Lab`, or a `LoopbackLab` in the degraded mode."""
    sf = StateFile(state_root or default_state_root(os.environ), check_lab_name(name))
    if sf.read().get("mode") == "loopback":
        from ridethrough.lab.loopback import LoopbackLab
        return LoopbackLab.attach(name, state_root=sf.root)
    return Lab.attach(name, state_root=sf.root)
