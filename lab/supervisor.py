"""The lab's supervisor: ``python -m ridethrough.lab.supervisor STATE_FILE``.

Started detached by ``lab up``; it owns what must keep running after ``lab up`` returns:

* the server (``ridethrough server``: gateway, store endpoint and clock service on an embedded
  chDB store under the lab's directory), listening on the lab's management address;
* one ``ridethrough agent`` per host, inside the host's namespace, once the fabric is built
  and the server is ready (none is restarted; exits are logged and recorded);
* the fake-IB `CounterPump` of every host, ticking every 0.5 s from the host's NIC veth
  statistics (IFLA_STATS64 over netlink, inside the host's namespace);
* scheduled operations (a flap's downs and ups, a NIC ramp's link down), run when due, on a
  thread of their own with the lab's handle attached beforehand: a scenario's truth puts the
  failure at the due time, so neither a counter pump in progress nor the first use's imports and
  netlink sockets may delay it (each run logs how long after its due time it finished);
* in a namespace lab, the switch agent (`ridethrough.lab.switch_agent`, in the root namespace),
  once the server is ready: one control plane per leaf, on the server's management address.

Every agent runs its control plane (signed route and job commands) on its host's management
address, port `CONTROL_PORT`, checking commands against the lab's key in ``control/keys`` under
the lab's directory (made once, mode 0600). A controller outside the lab reaches the agents
with the environment `controller_env` gives (the lab's server gets it too)::

    RIDETHROUGH_CONTROL_KEYS_FILE=<lab dir>/control/keys        the key to sign commands with
    RIDETHROUGH_CONTROL_TARGETS_FILE=<lab dir>/control/targets.json  {"h3": "198.18.x.13:7450", ...}
    RIDETHROUGH_REROUTE_ADDRESSES_FILE=<lab dir>/stable.json    each host's stable address
    RIDETHROUGH_REROUTE_SWITCHES_FILE=<lab dir>/switches.json   each leaf's prefixes and uplink ports

(the root namespace reaches the hosts' management addresses over the lab's bridge; host names
do not resolve there, hence the targets file). The targets file lists the leaves too, each at
``<server ip>:SWITCH_CONTROL_PORT_BASE + i`` (7460 for the first leaf, `switch_agent.switch_port`); the
switches file is ``{"leaf0r0": {"prefixes": ["10.200.0.0/24", "10.64.0.0/24"], "ports":
{"leaf0r0-spine0": "spine0", ...}}, ...}`` (`switch_agent.switch_map`; ``{}`` in a loopback lab, which
has no switches).

SIGTERM stops the agents, then the server, gently, and exits.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ridethrough.lab import cgroups, netns, procs
from ridethrough.lab.fake_ib import CounterPump, NicStats
from ridethrough.lab.netns import Handles, NsHandle
from ridethrough.lab.state import State, StateFile
from ridethrough.lab.switch_agent import SWITCHES_FILE, lab_topology, switch_map, switch_targets

if TYPE_CHECKING:  # imported when first used: the supervisor starts before it needs the fabric
    from ridethrough.lab.fabric import Lab

log = logging.getLogger("ridethrough.lab.supervisor")
PUMP_INTERVAL_S = 0.5
LOOP_INTERVAL_S = 0.05
SCHEDULABLE = frozenset({"set_link"})
AGENT_GRACE_S = 1.0
REFLEX_PEERS_FILE = "stable.json"
"""Beside the probe peers file: each host's stable address, for the agents' reflex."""
SERVER_GRACE_S = 2.0
CONTROL_PORT = 7450
CONTROL_KEY_ID = "lab"


def write_control(lab_dir: Path, hosts: Mapping[str, Mapping[str, Any]],
                  switches: Mapping[str, str] | None = None) -> tuple[Path, Path]:
    """The lab's control key (kept if there) and each agent's control address, then each leaf's
    (``switches``: leaf → ``HOST:PORT``, `switch_agent.switch_targets`); returns (keys, targets).

    The key is 32 random bytes as ``lab=HEX`` (`ridethrough.actuators.command_auth`), mode 0600.
    """
    import secrets

    d = lab_dir / "control"
    d.mkdir(mode=0o700, exist_ok=True)
    keys = d / "keys"
    if not keys.exists():
        fd = os.open(keys, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"{CONTROL_KEY_ID}={secrets.token_hex(32)}\n")
    targets = d / "targets.json"
    tmp = targets.with_suffix(".tmp")
    tmp.write_text(json.dumps({**{h: f"{i['mgmt_ip']}:{CONTROL_PORT}" for h, i in hosts.items()}, **(switches or {})}))
    tmp.replace(targets)
    return keys, targets


def controller_env(lab_dir: Path) -> dict[str, str]:
    """What a controller needs to act on the lab's agents (see the module docstring)."""
    return {"RIDETHROUGH_CONTROL_KEYS_FILE": str(lab_dir / "control" / "keys"),
            "RIDETHROUGH_CONTROL_TARGETS_FILE": str(lab_dir / "control" / "targets.json"),
            "RIDETHROUGH_REROUTE_ADDRESSES_FILE": str(lab_dir / REFLEX_PEERS_FILE),
            "RIDETHROUGH_REROUTE_SWITCHES_FILE": str(lab_dir / SWITCHES_FILE)}


def nic_stats(handle: NsHandle) -> dict[str, NicStats]:
    """The host's NIC veths as the fake IB tree wants them."""
    out: dict[str, NicStats] = {}
    for m in handle.links():
        name = str(m.get("ifname"))
        if not name.startswith("nic"):
            continue
        s = m.get("stats64") or {}
        out[name] = NicStats(
            rx_bytes=s.get("rx_bytes", 0), tx_bytes=s.get("tx_bytes", 0), rx_packets=s.get("rx_packets", 0),
            tx_packets=s.get("tx_packets", 0), rx_errors=s.get("rx_errors", 0), tx_errors=s.get("tx_errors", 0),
            rx_dropped=s.get("rx_dropped", 0), tx_dropped=s.get("tx_dropped", 0),
            up=m.get("operstate") == "UP", mtu=int(m.get("mtu") or 1500),
            carrier_changes=int(m.get("carrier_changes") or 0))
    return out


def _veth_nics(handle: NsHandle) -> Callable[[], Mapping[str, NicStats]]:
    return lambda: nic_stats(handle)


def _idle_nics(nics: list[str]) -> Callable[[], Mapping[str, NicStats]]:
    return lambda: {n: NicStats(0, 0, 0, 0) for n in nics}


def agent_env(host_dir: Path, peers_file: Path, clock_url: str = "", *, control_listen: str = "",
              control_keys: Path | None = None) -> dict[str, str]:
    """What a lab host's agent reads besides its flags: fake GPUs, the job endpoint, the probe peers,
    the clock service's corrections (``clock_url``, empty for none), the reflex and its peers file,
    and its control plane (``control_listen`` with ``control_keys``; none without them).

    The reflex is off unless whoever brought the lab up set ``RIDETHROUGH_AGENT_REFLEX=true`` (the
    reroute bench and tests do): agents inherit that environment. Off by default because on the lab's
    two cores eight agents probing every 10 ms would crowd out everything else.
    """
    sources = ["netdev", "infiniband"]
    env = {"RIDETHROUGH_AGENT_JOB_SOCKET": str(host_dir / "job.sock"),
           "RIDETHROUGH_AGENT_PROBE_PEERS_FILE": str(peers_file),
           "RIDETHROUGH_AGENT_REFLEX_PEERS_FILE": str(peers_file.with_name(REFLEX_PEERS_FILE))}
    if clock_url:
        env["RIDETHROUGH_AGENT_CLOCK_CORRECTIONS_URL"] = clock_url
    if control_listen and control_keys is not None:
        env["RIDETHROUGH_AGENT_CONTROL_LISTEN"] = control_listen
        env["RIDETHROUGH_AGENT_CONTROL_KEYS_FILE"] = str(control_keys)
        env["RIDETHROUGH_AGENT_JOB_RUN_DIR"] = str(host_dir / "run")
    if (host_dir / "gpus.json").exists():
        sources.append("gpu")
        env["RIDETHROUGH_AGENT_GPU_SCRIPT"] = str(host_dir / "gpus.json")
    sources += ["job", "probe"]
    env["RIDETHROUGH_AGENT_SOURCES"] = ",".join(sources)
    return env


class Supervisor:
    """Runs a lab's long-lived processes and timers from its state file."""

    def __init__(self, sf: StateFile) -> None:
        self.sf = sf
        self.state: State = sf.read()
        self.dir = Path(self.state["dir"])
        self.logs = self.dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self.reported: set[str] = set()
        self.stopping = threading.Event()
        self.handles = Handles()
        self.pumps: list[CounterPump] = []
        self._lab: Lab | None = None

    # -- processes ---------------------------------------------------------------------------

    def _spawn(self, key: str, argv: list[str], *, ns: str | None, cgroup: str | None,
               env_extra: dict[str, str] | None = None) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
        with open(self.logs / f"{key.replace(':', '-')}.log", "ab") as out:
            proc = netns.popen(ns, argv, cgroup=None if cgroup is None else Path(cgroup), stdin=subprocess.DEVNULL,
                               stdout=out, stderr=subprocess.STDOUT, env=env)
        self.children[key] = proc
        rec = procs.ref(proc.pid)
        if rec is not None:
            self.sf.set_in("processes", key, rec.to_json())

    def start_server(self) -> None:
        """``ridethrough server`` on the management address, its store under the lab directory."""
        ip = self.state["server_ip"]
        clock = ["--clock-listen", f"{ip}:{self.state['clock_port']}"] if "clock_port" in self.state else []
        fabric = self.write_fabric_map()
        self.write_switch_map()
        write_control(self.dir, self.state["hosts"], self.switch_targets())
        self._spawn("server", [
            sys.executable, "-m", "ridethrough", "server", "--store", f"chdb://{self.dir / 'store'}",
            "--spool", str(self.dir / "spool"), "--otlp-listen", f"{ip}:{self.state['otlp_port']}",
            "--store-http-listen", f"{ip}:{self.state['store_http_port']}", *clock,
            "--ready-file", str(self.dir / "server.json")], ns=None, cgroup=self.server_cgroup(),
            env_extra={"RIDETHROUGH_CONTROLLER_FABRIC_MAP_FILE": str(fabric), **controller_env(self.dir)})

    def server_cgroup(self) -> str | None:
        """The server's own cgroup (`cgroups.server_dir`), or the lab's where there is none (a lab built before)."""
        lab = self.state.get("cgroup")
        if lab is None:
            return None
        server = cgroups.server_dir(Path(lab))
        return str(server) if server.is_dir() else str(lab)

    def write_fabric_map(self) -> Path:
        """The lab's cabling and design routes for the controller (NIC ``r`` and its RDMA device ``mlx5_r``
        are one port), written atomically so the controller never reads half a file."""
        from ridethrough.detectors.fabric_map import RouteMap
        from ridethrough.lab.topology import Topology, TopologySpec

        fmap = RouteMap.from_fabric(Topology(TopologySpec(**self.state["spec"])), aliases=lambda r: (f"mlx5_{r}",))
        path = self.dir / "fabric.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(fmap.to_json()))
        tmp.replace(path)
        return path

    def switches(self) -> bool:
        """Whether the lab has switches (a namespace lab; a loopback lab has none)."""
        return bool(self.state.get("mode") == "netns")

    def switch_targets(self) -> dict[str, str]:
        """Each leaf's control address (none in a loopback lab)."""
        return switch_targets(lab_topology(self.state)) if self.switches() else {}

    def write_switch_map(self) -> Path:
        """The leaves' prefixes and uplink ports for the controller's drain, written atomically."""
        path: Path = self.dir / SWITCHES_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(switch_map(lab_topology(self.state)) if self.switches() else {}))
        tmp.replace(path)
        return path

    def start_switches(self) -> None:
        """The switch agent (every leaf's control plane), in the root namespace and the server's cgroup."""
        if self.switches():
            self._spawn("switches", [sys.executable, "-m", "ridethrough.lab.switch_agent", str(self.sf.path)],
                        ns=None, cgroup=self.state.get("cgroup"))

    def wait_server(self, timeout_s: float = 120.0) -> bool:
        """Wait for the server's ready file; record its addresses (or why it failed)."""
        ready = self.dir / "server.json"
        deadline = time.monotonic() + timeout_s
        server = self.children["server"]
        while not self.stopping.is_set() and time.monotonic() < deadline:
            if ready.exists():
                self.sf.set_in("status", "server", json.loads(ready.read_text()))
                return True
            if server.poll() is not None:
                tail = (self.logs / "server.log").read_text(errors="replace").strip().splitlines()[-3:]
                self.sf.set_in("status", "server_error", f"server exited ({server.returncode}): {' | '.join(tail)}")
                return False
            time.sleep(0.02)
        self.sf.set_in("status", "server_error", f"server not ready after {timeout_s} s")
        return False

    def start_agents(self) -> None:
        """One ``ridethrough agent`` per host, inside its namespace."""
        gateway = f"{self.state['server_ip']}:{self.state['otlp_port']}"
        peers = self.dir / "peers.json"
        peers.write_text(json.dumps({h: {nic: n["ip"] for nic, n in i["nics"].items()}
                                     for h, i in self.state["hosts"].items()}))
        stable = {h: i["stable_ip"] for h, i in self.state["hosts"].items()}  # what the reflex reroutes
        (self.dir / REFLEX_PEERS_FILE).write_text(json.dumps(stable))
        port = self.state.get("clock_port")
        clock_url = f"http://{self.state['server_ip']}:{port}/clock/corrections" if port else ""
        keys, _ = write_control(self.dir, self.state["hosts"], self.switch_targets())
        for host, info in self.state["hosts"].items():
            d = Path(info["dir"])
            self._spawn(f"agent:{host}", [
                sys.executable, "-m", "ridethrough", "agent", "--gateway", gateway, "--node-id", host,
                "--cluster", self.state["name"], "--rack", f"rack{info['rack']}",
                "--sysfs-root", str(d / "sysfs"), "--clock-script", str(d / "clock.json")],
                ns=info.get("ns"), cgroup=info.get("cgroup"), env_extra=agent_env(
                    d, peers, clock_url, control_listen=f"{info['mgmt_ip']}:{CONTROL_PORT}", control_keys=keys))

    def reap(self) -> None:
        """Log (once) every child that exited; none is restarted."""
        for key, proc in self.children.items():
            if key not in self.reported and proc.poll() is not None:
                self.reported.add(key)
                log.warning("%s exited with status %s (not restarted)", key, proc.returncode)
                self.sf.set_in("exits", key, proc.returncode)

    def stop_children(self) -> None:
        """Agents first (they flush to a live server), then the server."""
        for keys, grace in (([k for k in self.children if k != "server"], AGENT_GRACE_S), (["server"], SERVER_GRACE_S)):
            refs = [r for r in (procs.ref(self.children[k].pid) for k in keys if k in self.children) if r]
            procs.stop(refs, grace_s=grace)
            for k in keys:
                if k in self.children:
                    self.children[k].wait()

    # -- fabric ----------------------------------------------------------------------------

    def wait_fabric(self, timeout_s: float = 120.0) -> bool:
        """Wait until ``lab up`` has built the fabric (False: told to stop, the lab is gone, or it never came)."""
        deadline = time.monotonic() + timeout_s
        while not self.stopping.is_set() and time.monotonic() < deadline:
            if not self.sf.exists():
                return False
            status = self.sf.read().get("status", {})
            if status.get("fabric") == "ready":
                return True
            time.sleep(0.02)
        return False

    def make_pumps(self) -> None:
        """One counter pump per host."""
        for info in self.state["hosts"].values():
            d = Path(info["dir"])
            ns = info.get("ns")
            stats = _veth_nics(self.handles(ns)) if ns else _idle_nics(list(info["nics"]))
            self.pumps.append(CounterPump(d / "sysfs", d / "nic_faults.json", stats))

    def tick_pumps(self) -> None:
        """Rewrite every host's counters once; a failing host is logged and skipped."""
        now = time.time_ns()
        for pump in self.pumps:
            try:
                pump.tick(now)
            except Exception:  # telemetry never takes the lab down
                log.exception("counter pump for %s failed", pump.root)

    def run_due(self) -> None:
        """Run scheduled operations whose time has come."""
        now = time.time_ns()
        if not any(e["at_ns"] <= now for e in self.sf.read().get("schedule", [])):
            return

        def take(st: State) -> list[dict[str, Any]]:
            due = [e for e in st.get("schedule", []) if e["at_ns"] <= now]
            st["schedule"] = [e for e in st.get("schedule", []) if e["at_ns"] > now]
            return due
        for entry in self.sf.update(take):
            try:
                if entry["op"] not in SCHEDULABLE:
                    raise ValueError(f"not a schedulable operation: {entry['op']}")
                getattr(self.fabric(), entry["op"])(**entry["args"])
                log.info("ran scheduled %s %s (done %.3f s after due)", entry["op"], entry["args"],
                         (time.time_ns() - entry["at_ns"]) / 1e9)
            except Exception:
                log.exception("scheduled %s %s failed", entry["op"], entry["args"])

    def fabric(self) -> Lab:
        """The handle scheduled operations run on (attached once)."""
        if self._lab is None:
            from ridethrough.lab.fabric import Lab
            self._lab = Lab.attach(self.state["name"], state_root=self.sf.root)
        return self._lab

    def run_schedule(self) -> None:
        """Run scheduled operations when due, until told to stop (the scheduler thread)."""
        while not self.stopping.wait(LOOP_INTERVAL_S):
            try:
                self.run_due()
            except Exception:
                log.exception("schedule check failed")

    # -- main ------------------------------------------------------------------------------

    def run(self) -> int:
        """Start everything, then tick until SIGTERM."""
        me = procs.ref(os.getpid())
        assert me is not None
        self.sf.set_in("processes", "supervisor", me.to_json())
        agents = bool(self.state.get("agents"))
        if agents:
            self.start_server()
        if self.wait_fabric():
            self.make_pumps()
            self.tick_pumps()
            if agents and self.wait_server():
                self.start_agents()
                self.start_switches()
            self.sf.set_in("status", "supervisor", "running")
            self.loop()
        self.stop_children()
        self.handles.close()
        if self.sf.exists():
            self.sf.set_in("status", "supervisor", "stopped")
        return 0

    def loop(self) -> None:
        """Reap and pump counters, scheduled operations on their own thread; until told to stop."""
        if self.state.get("mode") == "netns":
            try:
                lab = self.fabric()  # now, not at the first due operation
                for node in lab.topology.nodes:
                    lab.handle(node)  # each namespace's netlink socket open before a scheduled cut needs it
            except Exception:
                log.exception("attaching to the lab failed (tried again at the first scheduled operation)")
        scheduler = threading.Thread(target=self.run_schedule, name="schedule", daemon=True)
        scheduler.start()
        next_pump = time.monotonic() + PUMP_INTERVAL_S
        while not self.stopping.wait(LOOP_INTERVAL_S):
            self.reap()
            if time.monotonic() >= next_pump:
                self.tick_pumps()
                next_pump += PUMP_INTERVAL_S
        scheduler.join(5)


def main(argv: list[str] | None = None) -> int:
    """Entry point: the state file's path is the only argument."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m ridethrough.lab.supervisor STATE_FILE", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    path = Path(args[0])
    sup = Supervisor(StateFile(path.parent, path.stem))
    signal.signal(signal.SIGTERM, lambda *_: sup.stopping.set())
    signal.signal(signal.SIGINT, lambda *_: sup.stopping.set())
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    return sup.run()


if __name__ == "__main__":
    sys.exit(main())
