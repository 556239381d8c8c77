"""What both lab modes share: the state file, host directories, host faults and running commands.

`LabBase` implements the host half of `LabControl` (clocks, fake GPUs, fake NIC counters,
freeze, straggle) on a lab's state file; `ridethrough.lab.fabric.Lab` adds the fabric
(namespaces, links) and `ridethrough.lab.loopback.LoopbackLab` refuses link faults.
Scheduled operations (a flap, a NIC ramp's eventual link down) are entries in the state
that the lab's supervisor runs when they are due.
"""

from __future__ import annotations

import atexit
import contextlib
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Self

from ridethrough.collector.clock import ClockScript
from ridethrough.lab import cgroups, netns, procs, teardown
from ridethrough.lab.control import Direction, GpuFault, LabError
from ridethrough.lab.fake_gpu import GpuScript
from ridethrough.lab.fake_ib import NicScript
from ridethrough.lab.procs import ProcRef
from ridethrough.lab.state import State, StateFile
from ridethrough.lab.teardown import DownReport


class LabBase:
    """A lab known by its state file; host-level faults and commands."""

    def __init__(self, sf: StateFile, state: State) -> None:
        self.sf = sf
        self.info = state
        """The state as it was when this handle was made (what the lab is; faults live in `state`)."""
        self.dir = Path(state["dir"])
        self.up_s = 0.0
        """How long `up` took (0 for an attached handle)."""
        self._supervisor: subprocess.Popen[bytes] | None = None
        self._children: dict[str, list[subprocess.Popen[bytes]]] = {}
        self._exit_hook: Any = None

    # -- lifecycle -------------------------------------------------------------------------

    def _wait_ready(self, timeout_s: float) -> None:
        """Wait until the supervisor runs (and the server is ready, with agents)."""
        deadline = time.monotonic() + timeout_s
        agents = bool(self.info.get("agents"))
        while time.monotonic() < deadline:
            status = self.state().get("status", {})
            if status.get("server_error"):
                raise LabError(f"lab {self.name}: {status['server_error']}")
            if status.get("supervisor") == "running" and (status.get("server") or not agents):
                return
            if self._supervisor is not None and self._supervisor.poll() is not None:
                tail = (self.dir / "logs" / "supervisor.log").read_text(errors="replace").strip().splitlines()[-3:]
                raise LabError(f"lab {self.name}: supervisor exited ({self._supervisor.returncode}): "
                               f"{' | '.join(tail)}")
            time.sleep(0.02)
        raise LabError(f"lab {self.name}: not ready after {timeout_s} s (see {self.dir / 'logs'})")

    def _cleanup_at_exit(self) -> None:
        self._exit_hook = self._down_at_exit
        atexit.register(self._exit_hook)

    def down(self, *, keep_dir: bool = False) -> DownReport:
        """Stop and remove everything the lab made (idempotent)."""
        if self._exit_hook is not None:
            atexit.unregister(self._exit_hook)
            self._exit_hook = None
        report = teardown.down(self.sf, keep_dir=keep_dir) if self.sf.exists() else DownReport(self.name)
        for child in [self._supervisor, *(c for cs in self._children.values() for c in cs)]:
            if child is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.wait(1.0)
        return report

    def _down_at_exit(self) -> None:
        with contextlib.suppress(Exception):
            self.down()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    # -- identity --------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The lab's name."""
        return str(self.info["name"])

    @property
    def mode(self) -> str:
        """``netns`` (the fabric) or ``loopback`` (the degraded mode)."""
        return str(self.info["mode"])

    def hosts(self) -> list[str]:
        """Host names, in order."""
        return list(self.info["hosts"])

    def host_info(self, host: str) -> Mapping[str, Any]:
        """A host's addresses, rack, namespace and directories; LabError if there is no such host."""
        try:
            return dict(self.info["hosts"][host])
        except KeyError:
            raise LabError(f"no host {host!r} in lab {self.name} (hosts: {', '.join(self.hosts())})") from None

    def host_dir(self, host: str) -> Path:
        """The host's directory: ``sysfs/``, ``gpus.json``, ``nic_faults.json``, ``clock.json``."""
        return Path(self.host_info(host)["dir"])

    def state(self) -> State:
        """The state file as it is now."""
        return self.sf.read()

    @property
    def server(self) -> Mapping[str, str]:
        """The server's addresses (``otlp``, ``store_http``) once it is ready; empty without agents."""
        return dict(self.state().get("status", {}).get("server", {}))

    # -- commands --------------------------------------------------------------------------

    def _node_ns(self, node: str) -> str | None:
        return self.host_info(node).get("ns")

    def _node_cgroup(self, node: str, *, job: bool) -> Path | None:
        cg = self.info.get("hosts", {}).get(node, {}).get("jobs_cgroup" if job else "cgroup")
        return None if cg is None else Path(cg)

    def exec(self, node: str, argv: Sequence[str], *, job: bool = False, **popen: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside a node (a job process with ``job``); the lab stops it at ``down``."""
        ns = self._node_ns(node)
        proc = netns.popen(ns, argv, cgroup=self._node_cgroup(node, job=job), **popen)
        rec = procs.ref(proc.pid)

        def record(st: State) -> None:
            table = st.setdefault("processes", {})
            for key in [k for k, v in table.items() if k.startswith("exec:") and not procs.alive(ProcRef.from_json(v))]:
                del table[key]  # keep the record short: forget commands that ended
            if rec is not None:
                table[f"exec:{node}:{proc.pid}"] = rec.to_json()
        self.sf.update(record)
        return proc

    def run(self, node: str, argv: Sequence[str], *, timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in a node to completion; its output as text."""
        proc = self.exec(node, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise LabError(f"{' '.join(argv)} in {node} did not finish in {timeout_s} s: {err.strip()}") from None
        finally:
            self.sf.update(lambda st: st.get("processes", {}).pop(f"exec:{node}:{proc.pid}", None))
        return subprocess.CompletedProcess(list(argv), proc.returncode, out, err)

    def host_pids(self, host: str) -> list[int]:
        """Every process the lab runs in a host (its namespace's, or in loopback mode its records)."""
        ns = self._node_ns(host)
        if ns is not None:
            return procs.netns_pids(netns.ns_path(ns))
        refs = self._recorded(lambda key: key == f"agent:{host}" or key.startswith(f"exec:{host}:"))
        return [r.pid for r in refs if procs.alive(r)]

    def _recorded(self, match: Any) -> list[ProcRef]:
        out: list[ProcRef] = []
        for key, value in self.state().get("processes", {}).items():
            if match(key):
                out += [ProcRef.from_json(v) for v in (value if isinstance(value, list) else [value])]
        return out

    def schedule(self, op: str, args: Mapping[str, Any], *, at_ns: int, tag: str = "") -> int:
        """Have the supervisor run ``op`` (a method of this lab) at ``at_ns``; returns the entry's id."""
        def add(st: State) -> int:
            sid = int(st.get("next_id", 1))
            st["next_id"] = sid + 1
            st.setdefault("schedule", []).append({"id": sid, "at_ns": at_ns, "op": op, "args": dict(args), "tag": tag})
            return sid
        sup = self.state().get("processes", {}).get("supervisor")
        if sup is None or not procs.alive(ProcRef.from_json(sup)):
            raise LabError(f"lab {self.name}: its supervisor is not running, so nothing can be scheduled")
        return self.sf.update(add)

    def _unschedule(self, tag: str) -> None:
        self.sf.update(lambda st: st.__setitem__("schedule", [e for e in st.get("schedule", []) if e["tag"] != tag]))

    def _fault(self, key: str, what: str | None) -> None:
        def put(st: State) -> None:
            faults = st.setdefault("faults", {})
            if what is None:
                faults.pop(key, None)
            else:
                faults[key] = what
        self.sf.update(put)

    # -- clocks, GPUs, NIC counters --------------------------------------------------------

    def step_clock(self, host: str, *, step_ns: int) -> None:
        """Step a host's clock by ``step_ns`` (negative steps go back in time)."""
        ClockScript(self.host_dir(host) / "clock.json").step(int(step_ns), at_ns=time.time_ns())

    def gpu_fault(self, host: str, gpu: int, fault: GpuFault, params: Mapping[str, float]) -> None:
        """Start a scripted GPU fault on one fake GPU."""
        try:
            GpuScript(self.host_dir(host) / "gpus.json").add(gpu, fault, params, start_ns=time.time_ns())
        except (ValueError, OSError) as exc:
            raise LabError(f"{host} gpu{gpu}: {exc}") from exc
        self._fault(f"gpu:{host}/gpu{gpu}/{fault.value}", f"{fault.value} {dict(params)}")

    def clear_gpu(self, host: str, gpu: int) -> None:
        """Make a fake GPU healthy again (counters keep their totals)."""
        try:
            GpuScript(self.host_dir(host) / "gpus.json").clear(gpu, at_ns=time.time_ns())
        except (ValueError, OSError) as exc:
            raise LabError(f"{host} gpu{gpu}: {exc}") from exc
        self.sf.update(lambda st: [st.get("faults", {}).pop(k) for k in list(st.get("faults", {}))
                                   if k.startswith(f"gpu:{host}/gpu{gpu}/")])

    def nic_error_ramp(self, host: str, nic: str, *, counter: str, rate_per_s: float,
                       link_down_after_s: float | None = None) -> None:
        """Make one fake IB error counter climb; optionally take the NIC's link down later."""
        now = time.time_ns()
        link = self._nic_link(host, nic)  # validates the NIC (and refuses a later down where impossible)
        if link_down_after_s is not None:
            self._check_can_cut(link)
        NicScript(self.host_dir(host) / "nic_faults.json").ramp(nic, counter, rate_per_s, start_ns=now)
        if link_down_after_s is not None:
            self.schedule("set_link", {"link": link, "up": False, "end": host},
                          at_ns=now + round(link_down_after_s * 1e9), tag=f"nic:{host}/{nic}")
        self._fault(f"nic:{host}/{nic}/{counter}", f"{counter} +{rate_per_s}/s")

    def clear_nic(self, host: str, nic: str) -> None:
        """Stop every error ramp on a NIC (and cancel a link down it had scheduled)."""
        self._nic_link(host, nic)
        NicScript(self.host_dir(host) / "nic_faults.json").clear(nic, at_ns=time.time_ns())
        self._unschedule(f"nic:{host}/{nic}")
        self.sf.update(lambda st: [st.get("faults", {}).pop(k) for k in list(st.get("faults", {}))
                                   if k.startswith(f"nic:{host}/{nic}/")])

    def _nic_link(self, host: str, nic: str) -> str:
        nics = self.host_info(host)["nics"]
        if nic not in nics:
            raise LabError(f"no NIC {nic!r} on {host} (NICs: {', '.join(nics)})")
        return str(nics[nic]["link"])

    def _check_can_cut(self, link: str) -> None:
        """Raise LabError if this lab cannot take ``link`` down (the loopback mode)."""

    # -- link faults: only a fabric has them -----------------------------------------------

    def _no_fabric(self, what: str) -> LabError:
        return LabError(f"lab {self.name} runs in {self.mode} mode without a fabric: {what} need network "
                        "namespaces (root)")

    def links(self) -> list[str]:
        """Link names, in order (none without a fabric)."""
        return []

    def set_link(self, link: str, *, up: bool, end: str | None = None) -> None:
        """Take a link down or up (refused without a fabric)."""
        raise self._no_fabric("link faults")

    def flap_link(self, link: str, *, period_s: float, count: int, end: str | None = None) -> None:
        """Flap a link (refused without a fabric)."""
        raise self._no_fabric("link faults")

    def degrade_link(self, link: str, *, rate_mbit: float, burst_kbit: float = 32.0, latency_ms: float = 20.0,
                     direction: Direction = Direction.BOTH) -> None:
        """Cap a link (refused without a fabric)."""
        raise self._no_fabric("link faults")

    def lose_packets(self, link: str, *, percent: float, direction: Direction = Direction.BOTH) -> None:
        """Make a link lossy (refused without a fabric)."""
        raise self._no_fabric("link faults")

    def restore_link(self, link: str) -> None:
        """Restore a link (refused without a fabric)."""
        raise self._no_fabric("link faults")

    def set_mtu(self, link: str, *, end: str, mtu: int) -> None:
        """Set an MTU (refused without a fabric)."""
        raise self._no_fabric("MTU changes")

    def start_load(self, link: str, *, direction: Direction, rate_mbit: float) -> str:
        """Load a link (refused without a fabric)."""
        raise self._no_fabric("link loads")

    def stop_load(self, handle: str) -> None:
        """Stop a load (refused without a fabric)."""
        raise self._no_fabric("link loads")

    # -- freeze and straggle ---------------------------------------------------------------

    def freeze_host(self, host: str) -> None:
        """SIGSTOP every process the lab runs in the host."""
        pids = self.host_pids(host)
        refs = [r for r in (procs.ref(p) for p in pids) if r is not None]
        procs.send(refs, signal.SIGSTOP)
        self.sf.update(lambda st: st.setdefault("frozen", {}).setdefault(host, []).extend(r.to_json() for r in refs))
        self._fault(f"host:{host}/freeze", f"frozen ({len(refs)} processes)")

    def thaw_host(self, host: str) -> None:
        """SIGCONT what `freeze_host` stopped."""
        self.host_info(host)
        refs = [ProcRef.from_json(r) for r in self.state().get("frozen", {}).get(host, [])]
        procs.send(refs, signal.SIGCONT)
        self.sf.update(lambda st: st.get("frozen", {}).pop(host, None))
        self._fault(f"host:{host}/freeze", None)

    def straggle(self, host: str, *, cpu_fraction: float) -> None:
        """Cap the host's job processes (all but its agent) to ``cpu_fraction`` of one CPU."""
        if not 0 < cpu_fraction < 1:
            raise LabError(f"cpu_fraction must be between 0 and 1, got {cpu_fraction}")
        jobs = self._node_cgroup(host, job=True)
        if jobs is None:
            raise LabError(f"lab {self.name}: straggle needs cgroups (cgroup v1 cpu, as root); this lab has none")
        agent = {r.pid for r in self._recorded(lambda key: key == f"agent:{host}")}
        for pid in self.host_pids(host):
            if pid not in agent:
                with contextlib.suppress(OSError):  # it may have just exited
                    cgroups.join(jobs, pid)
        cgroups.set_cpu_fraction(jobs, cpu_fraction)
        self._fault(f"host:{host}/straggle", f"cpu {cpu_fraction:g}")

    def starve(self, host: str, *, cpu_fraction: float | None) -> None:
        """Cap the whole host (its agent and its jobs) to ``cpu_fraction`` of one CPU; None lifts the cap.

        A host whose CPUs something else saturates: its agent runs late, its links are fine. The quota is
        granted per second (the kernel's longest period), so the host runs in bursts with up to a second
        between them, and a few percent leaves its agent falling seconds behind.
        """
        if cpu_fraction is not None and not 0 < cpu_fraction < 1:
            raise LabError(f"cpu_fraction must be between 0 and 1, got {cpu_fraction}")
        group = self._node_cgroup(host, job=False)
        if group is None:
            raise LabError(f"lab {self.name}: starve needs cgroups (cgroup v1 cpu, as root); this lab has none")
        cgroups.set_cpu_fraction(group, cpu_fraction, period_us=cgroups.STARVE_PERIOD_US)
        self._fault(f"host:{host}/starve", None if cpu_fraction is None else f"cpu {cpu_fraction:g}")

    def unstraggle(self, host: str) -> None:
        """Remove the CPU cap."""
        jobs = self._node_cgroup(host, job=True)
        if jobs is None:
            raise LabError(f"lab {self.name}: straggle needs cgroups (cgroup v1 cpu, as root); this lab has none")
        cgroups.set_cpu_fraction(jobs, None)
        self._fault(f"host:{host}/straggle", None)
