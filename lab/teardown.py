"""Taking a lab down from its state file, whatever state it crashed in.

Order: ask the supervisor to stop its children gracefully; then stop every process the lab
still has (recorded ones, its cgroups' and its namespaces'); delete its root-namespace
interfaces; unbind its namespaces; remove its cgroups, directory and state file. Only
what the state names (or what lives in the lab's own namespaces and cgroups) is touched.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from pyroute2.netlink.exceptions import NetlinkError

from ridethrough.lab import cgroups, netns, procs
from ridethrough.lab.procs import ProcRef
from ridethrough.lab.state import State, StateFile

SUPERVISOR_GRACE_S = 3.0
"""How long the supervisor gets to stop the agents and the server gently."""
STRAGGLER_GRACE_S = 0.5


@dataclass
class DownReport:
    """What `down` removed, how long it took, and anything it could not remove."""

    name: str
    processes: int = 0
    namespaces: int = 0
    interfaces: int = 0
    cgroups: int = 0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)


def _recorded(state: State) -> list[ProcRef]:
    out: list[ProcRef] = []
    for value in state.get("processes", {}).values():
        for item in value if isinstance(value, list) else [value]:
            with contextlib.suppress(KeyError, TypeError, ValueError):
                out.append(ProcRef.from_json(item))
    return out


def _lab_processes(state: State) -> list[ProcRef]:
    """Recorded processes, and everything in the lab's cgroups and namespaces."""
    pids = {p.pid for p in _recorded(state) if procs.alive(p)}
    for cg in state.get("cgroups", []):
        pids.update(cgroups.procs(Path(cg)))
    for ns in state.get("namespaces", []):
        pids.update(procs.netns_pids(netns.ns_path(ns)))
    pids.discard(os.getpid())
    return [r for r in (procs.ref(p) for p in sorted(pids)) if r is not None]


def _stop_supervisor(state: State) -> None:
    sup = state.get("processes", {}).get("supervisor")
    if sup is None:
        return
    ref = ProcRef.from_json(sup)
    procs.send([ref], signal.SIGTERM)
    procs.send([ref], signal.SIGCONT)
    if procs.wait_gone([ref], SUPERVISOR_GRACE_S):
        procs.send([ref], signal.SIGKILL)


def _delete_root_links(state: State, report: DownReport) -> None:
    names = state.get("root_links", [])
    if not names:
        return
    root = netns.NsHandle(None)
    try:
        present = {str(m.get("ifname")): m["index"] for m in root.links()}
        for name in sorted(names, key=lambda n: n.endswith("br")):  # veths first, the bridge last
            if name not in present:
                continue
            try:
                root.ipr.link("del", index=present[name])
                report.interfaces += 1
            except NetlinkError as exc:
                if exc.code != errno.ENODEV:  # gone with its peer's namespace meanwhile
                    report.problems.append(f"interface {name}: {exc}")
    finally:
        root.close()


def down(sf: StateFile, *, keep_dir: bool = False) -> DownReport:
    """Remove everything the lab made; the report lists anything that would not go."""
    started = time.monotonic()
    state = sf.read()
    report = DownReport(state["name"])
    _stop_supervisor(state)
    state = sf.read()  # the supervisor may have recorded more
    lab_procs = _lab_processes(state)
    survivors = procs.stop(lab_procs, grace_s=STRAGGLER_GRACE_S)
    report.processes = len(lab_procs) - len(survivors)
    report.problems += [f"process {p.pid} survived SIGKILL" for p in survivors]
    _delete_root_links(state, report)
    for ns in state.get("namespaces", []):
        if netns.ns_path(ns).exists():
            netns.remove(ns)
            report.namespaces += 1
    for cg in state.get("cgroups", []):
        if Path(cg).exists():
            problems = cgroups.remove_tree(Path(cg))
            report.problems += problems
            report.cgroups += not problems
    if not keep_dir and state.get("dir"):
        shutil.rmtree(state["dir"], ignore_errors=True)
    if not report.problems:
        sf.remove()
    report.seconds = time.monotonic() - started
    return report
