"""Network namespaces over netlink (pyroute2): create, configure, enter, read, remove.

One `NsHandle` (one netlink socket) per namespace does every operation there. Veth pairs
are created with each end directly in its namespace, so lab links never appear in the
root namespace. Sysctls (``/proc/sys/net`` follows the calling *thread*'s namespace) are
written by a worker thread that enters each namespace in turn.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import socket
import subprocess
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pyroute2 import IPRoute
from pyroute2 import config as pyroute2_config
from pyroute2 import netns as _netns
from pyroute2.netlink import NLM_F_REQUEST, nlmsg
from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.rtnl import RTM_GETROUTE
from pyroute2.netlink.rtnl.rtmsg import rtmsg

from ridethrough.lab.control import LabError
from ridethrough.lab.routing import OPTIONAL_SYSCTLS, NodePlan, Route

# pyroute2 runs each namespace's netlink socket in a forked helper and gives up on it after 2 s
# without an answer; a lab on a busy 2-core machine can take longer than that just to be scheduled.
pyroute2_config.default_communicate_timeout = max(pyroute2_config.default_communicate_timeout, 30)

NETNS_DIR = Path("/var/run/netns")
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def ns_path(name: str) -> Path:
    """Where a named namespace is bound (as ``ip netns`` does)."""
    return NETNS_DIR / name


def setns(fd: int) -> None:
    """Move the calling thread into the network namespace open at ``fd``."""
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def unavailable_reason() -> str | None:
    """Why this process cannot build namespace labs (None: it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (this process is not root)"
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child only probes and exits
        os._exit(0 if _libc.unshare(CLONE_NEWNET) == 0 else 1)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        return "this kernel or container does not let us create network namespaces (unshare failed)"
    return None


def create(name: str) -> None:
    """Create a named namespace (LabError if one of that name exists)."""
    if ns_path(name).exists():
        raise LabError(f"namespace {name} already exists (another lab of that name, or a leftover: "
                       f"ridethrough lab down)")
    _netns.create(name)


def remove(name: str) -> None:
    """Unbind a named namespace; it goes once no process or socket holds it."""
    with contextlib.suppress(FileNotFoundError, OSError):
        _netns.remove(name)


def list_names() -> list[str]:
    """Names of the bound namespaces (``ip netns list``)."""
    return sorted(_netns.listnetns())


def set_sysctls(per_ns: Mapping[str, Mapping[str, str]]) -> None:
    """Write sysctls (``net/ipv4/ip_forward`` → value) inside each named namespace."""
    errors: list[BaseException] = []

    def work() -> None:
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            for name, values in per_ns.items():
                fd = os.open(ns_path(name), os.O_RDONLY)
                try:
                    setns(fd)
                finally:
                    os.close(fd)
                for key, value in values.items():
                    try:
                        with open(f"/proc/sys/{key}", "w") as f:
                            f.write(value)
                    except FileNotFoundError:
                        if key not in OPTIONAL_SYSCTLS:
                            raise
        except BaseException as exc:  # handed to the caller's thread below
            errors.append(exc)
        finally:
            setns(home)
            os.close(home)

    t = threading.Thread(target=work, name="lab-sysctl")
    t.start()
    t.join()
    if errors:
        raise LabError(f"setting sysctls failed: {errors[0]}") from errors[0]


def enter_fn(name: str | None, cgroup: Path | None) -> Callable[[], None]:
    """A ``preexec_fn`` that enters a namespace and joins a cgroup (in the child, before exec)."""
    path = None if name is None else os.fsencode(ns_path(name))
    procs = None if cgroup is None else os.fsencode(cgroup / "cgroup.procs")

    def enter() -> None:
        if path is not None:
            fd = os.open(path, os.O_RDONLY)
            setns(fd)
            os.close(fd)
        if procs is not None:
            fd = os.open(procs, os.O_WRONLY)
            os.write(fd, b"0")
            os.close(fd)
    return enter


def popen(name: str | None, argv: Sequence[str], *, cgroup: Path | None = None, **kw: Any) -> subprocess.Popen[Any]:
    """Start ``argv`` inside a namespace (None: this one) and, optionally, a cgroup."""
    return subprocess.Popen(list(argv), preexec_fn=enter_fn(name, cgroup), **kw)  # preexec_fn: see enter_fn


class _RouteGetMsg(nlmsg):  # type: ignore[misc]  # pyroute2 is untyped
    """An RTM_GETROUTE request with the L4 fields pyroute2's ``rtmsg`` does not map (kernel >= 4.17).

    Not a subclass of ``rtmsg``: pyroute2 caches a compiled attribute table per class and a
    subclass would inherit ``rtmsg``'s (without these). Answers are decoded as plain ``rtmsg``.
    """

    fields = rtmsg.fields
    nla_map = ((1, "RTA_DST", "ip4addr"), (2, "RTA_SRC", "ip4addr"), (3, "RTA_IIF", "uint32"),
               (27, "RTA_IP_PROTO", "uint8"), (28, "RTA_SPORT", "be16"), (29, "RTA_DPORT", "be16"))


class NsHandle:
    """A netlink socket inside one namespace, with an interface-index cache."""

    def __init__(self, name: str | None) -> None:
        self.name = name
        self.ipr = IPRoute() if name is None else IPRoute(netns=name, flags=0)
        # pyroute2 0.9.7's sync IPRoute never sets this key, which its own nlm_request reads.
        self.ipr.asyncore.status.setdefault("nlm_generator", False)
        self._index: dict[str, int] = {}

    def close(self) -> None:
        """Close the socket."""
        self.ipr.close()

    def index(self, ifname: str) -> int:
        """The index of an interface; LabError if there is none."""
        if ifname not in self._index:
            found = self.ipr.link_lookup(ifname=ifname)
            if not found:
                raise LabError(f"no interface {ifname} in namespace {self.name or '(root)'}")
            self._index[ifname] = found[0]
        return self._index[ifname]

    def links(self) -> list[Any]:
        """Every interface's RTM_NEWLINK message."""
        return list(self.ipr.get_links())

    def names_by_index(self) -> dict[int, str]:
        """Interface names by index."""
        return {m["index"]: m.get("ifname") for m in self.links()}

    def add_veth(self, ifname: str, peer: str, peer_ns_fd: int | None) -> None:
        """A veth pair: ``ifname`` here, ``peer`` in the namespace open at ``peer_ns_fd`` (None: here)."""
        spec: dict[str, Any] = {"ifname": peer}
        if peer_ns_fd is not None:
            spec["net_ns_fd"] = peer_ns_fd
        self.ipr.link("add", ifname=ifname, kind="veth", peer=spec)

    def set_up(self, ifname: str, up: bool = True) -> None:
        """Set an interface administratively up or down."""
        self.ipr.link("set", index=self.index(ifname), state="up" if up else "down")

    def set_mtu(self, ifname: str, mtu: int) -> None:
        """Set an interface's MTU."""
        self.ipr.link("set", index=self.index(ifname), mtu=mtu)

    def apply(self, plan: NodePlan, *, interfaces: Iterable[str]) -> None:
        """Addresses, interfaces up (with ``lo``), policy rules, then routes."""
        for a in plan.addresses:
            self.ipr.addr("add", index=self.index(a.ifname), address=a.address, prefixlen=a.prefixlen)
        for ifname in ("lo", *interfaces):
            self.set_up(ifname)
        for rule in plan.rules:
            self.ipr.rule("add", table=rule.table, iifname=rule.iifname, priority=rule.priority)
        for route in plan.routes:
            self.route(route)

    def route(self, route: Route) -> None:
        """Install (or replace) one route."""
        kw: dict[str, Any] = {"dst": route.dst, "table": route.table}
        if route.prefsrc:
            kw["prefsrc"] = route.prefsrc
        if len(route.nexthops) == 1:
            gw, dev = route.nexthops[0]
            kw.update(gateway=gw, oif=self.index(dev))
        else:
            kw["multipath"] = [{"gateway": gw, "oif": self.index(dev)} for gw, dev in route.nexthops]
        self.ipr.route("replace", **kw)

    def tbf(self, ifname: str, *, rate_mbit: float, burst_kbit: float, latency_ms: float) -> None:
        """Put (or replace) a token-bucket qdisc at the root of an interface."""
        # pyroute2 parses integer strings only: whole kbit/s and microseconds
        rate, latency = f"{max(1, round(rate_mbit * 1000))}kbit", f"{max(1, round(latency_ms * 1000))}us"
        self.ipr.tc("replace", "tbf", index=self.index(ifname), handle="1:", rate=rate,
                    burst=max(1600, round(burst_kbit * 1000 / 8)), latency=latency)

    def clear_qdisc(self, ifname: str) -> None:
        """Remove the root qdisc the lab put on an interface (none there is fine)."""
        try:
            self.ipr.tc("del", index=self.index(ifname), root=True)
        except NetlinkError as exc:
            if exc.code not in (errno.ENOENT, errno.EINVAL):
                raise

    def qdiscs(self) -> list[Any]:
        """Every qdisc in the namespace."""
        return list(self.ipr.get_qdiscs())

    def route_get(self, dst: str, *, src: str | None = None, iif: int | None = None, ip_proto: int | None = None,
                  sport: int | None = None, dport: int | None = None) -> Any:
        """``ip route get DST [from SRC] [iif IDX] [ipproto P sport S dport D]``; raises NetlinkError.

        With ``iif`` it is the route of a packet arriving there (forwarding, policy rules on
        ``iif``); the ports feed the L4 multipath hash as a real packet's would.
        """
        msg = _RouteGetMsg()
        msg["family"] = socket.AF_INET
        msg["dst_len"] = 32
        attrs: list[tuple[str, Any]] = [("RTA_DST", dst)]
        if src is not None:
            msg["src_len"] = 32
            attrs.append(("RTA_SRC", src))
        for name, value in (("RTA_IIF", iif), ("RTA_IP_PROTO", ip_proto), ("RTA_SPORT", sport), ("RTA_DPORT", dport)):
            if value is not None:
                attrs.append((name, value))
        msg["attrs"] = attrs
        return self.ipr.nlm_request(msg, msg_type=RTM_GETROUTE, msg_flags=NLM_F_REQUEST)[0]


class Handles:
    """Lazily opened `NsHandle` per namespace name; close them all at the end."""

    def __init__(self) -> None:
        self._open: dict[str | None, NsHandle] = {}

    def __call__(self, name: str | None) -> NsHandle:
        if name not in self._open:
            if name is not None and not ns_path(name).exists():
                raise LabError(f"namespace {name} does not exist (is the lab up?)")
            self._open[name] = NsHandle(name)
        return self._open[name]

    def close(self) -> None:
        """Close every socket."""
        for h in self._open.values():
            with contextlib.suppress(Exception):
                h.close()
        self._open.clear()
