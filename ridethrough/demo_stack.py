"""What the demo runs besides its story: the lab (server, controller, agents), the PagerDuty sink, the dashboard.

The lab's supervisor starts ``ridethrough server`` (gateway, store endpoint, clock service, and the
controller with its detectors, actuator runner and PagerDuty exporter) and one agent per host; they
read their settings from the environment they inherit, so `lab_env` is the demo's whole
configuration: actuators on and not dry-run, the reflex on (in namespaces, on a probe budget for
hosts that share a machine), pages to the local sink, incidents that resolve after 10 quiet
seconds (so the story's pages resolve while it is told).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ridethrough.demo_sink import ALERT_PATH, CHANGE_PATH, PagerDutySink
from ridethrough.exporters.store import Store
from ridethrough.lab import netns, procs
from ridethrough.lab.control import LabError
from ridethrough.lab.fabric import Lab
from ridethrough.lab.loopback import LoopbackLab
from ridethrough.lab.topology import TopologySpec

DASHBOARD_LISTEN = "127.0.0.1:8050"
PAGERDUTY_KEY_ENV = "RIDETHROUGH_DEMO_PAGERDUTY_KEY"
DASHBOARD_KEY = "demo:dashboard"
"""The dashboard's entry in the lab's process table: ``lab down`` stops it with the rest."""


@dataclass(frozen=True, slots=True)
class Mode:
    """Where the demo can run: ``netns`` (the whole story) or ``loopback`` (no namespaces: GPU and clock acts)."""

    name: str
    reason: str = ""
    """Why namespaces are out (empty in ``netns``)."""

    @property
    def message(self) -> str:
        """What to tell the user about the mode."""
        if self.name == "netns":
            return "network namespaces available: the full story on an emulated fabric"
        return (f"{self.reason}. Running the degraded loopback mode: hosts on 127.x addresses, the GPU and clock "
                "acts only (link faults need namespaces; run `make demo` as root for the whole story).")


def detect_mode(unavailable: Callable[[], str | None] = netns.unavailable_reason) -> Mode:
    """``netns`` when this process can build namespace labs, else ``loopback`` with the reason."""
    reason = unavailable()
    return Mode("netns") if reason is None else Mode("loopback", reason)


def lab_env(*, data_dir: Path, sink_url: str, dashboard_url: str, pagerduty_key: str,
            reflex: bool = True) -> dict[str, str]:
    """The settings the lab's server and agents inherit (see the module docstring); ``reflex`` off where the
    agents share this host's own routing table (the loopback mode: nothing there is theirs to reroute)."""
    env = {
        "RIDETHROUGH_ACTUATORS_ENABLED": "true", "RIDETHROUGH_ACTUATORS_DRY_RUN": "false",
        # The story is minutes long. The runner considers an incident only when it changes, and a plan refused
        # for hysteresis waits for the next change, which may come after the act: act on the first one. Resolve
        # after 10 quiet seconds (default 30), so the pages resolve while the story is told.
        "RIDETHROUGH_ACTUATORS_HYSTERESIS_S": "0", "RIDETHROUGH_CONTROLLER_QUIET_S": "10",
        "RIDETHROUGH_AGENT_REFLEX": "true" if reflex else "false",
        # The demo's hosts share one machine's cores: at the default 500 liveness probes a second each, the job's
        # hosts spent a core between them on echoes, and a starved echo read as a lost one moved traffic
        # off healthy rails. Fewer probes per rail; the second probe still follows the first failure at once.
        "RIDETHROUGH_AGENT_REFLEX_MAX_PROBES_PER_S": "150",
        "RIDETHROUGH_PAGERDUTY_ENABLED": "true", "RIDETHROUGH_PAGERDUTY_EVENTS_URL": sink_url + ALERT_PATH,
        "RIDETHROUGH_PAGERDUTY_CHANGE_URL": sink_url + CHANGE_PATH,
        "RIDETHROUGH_PAGERDUTY_ROUTING_KEYS": f"*=env:{PAGERDUTY_KEY_ENV}", PAGERDUTY_KEY_ENV: pagerduty_key,
        "RIDETHROUGH_PAGERDUTY_OUTBOX": str(data_dir / "pagerduty.sqlite3"),
        "RIDETHROUGH_PAGERDUTY_INITIAL_BACKOFF_S": "0.5", "RIDETHROUGH_PAGERDUTY_MAX_BACKOFF_S": "5",
    }
    if dashboard_url:
        env["RIDETHROUGH_PAGERDUTY_DASHBOARD_URL"] = dashboard_url
    return env


def _port_free(listen: str) -> bool:
    host, _, port = listen.rpartition(":")
    with socket.socket() as s:
        try:
            s.bind((host, int(port)))
        except OSError:
            return False
    return True


@dataclass
class Stack:
    """The running pieces; `close` stops the sink and takes the lab (and the dashboard with it) down."""

    mode: Mode
    lab: Lab | LoopbackLab
    store: Store
    sink: PagerDutySink
    data_dir: Path
    dashboard_url: str = ""
    dashboard_note: str = ""

    def close(self) -> None:
        """Stop everything the demo started (idempotent); the lab's directory, with the store, stays."""
        self.sink.stop()
        self.store.close()
        self.lab.down(keep_dir=True)


def bring_up(*, mode: Mode, name: str, data_dir: Path, dashboard: bool,
             say: Callable[[str], None]) -> Stack:
    """Start the sink, the lab with its server, controller and agents, and the dashboard; LabError if the lab fails."""
    data_dir.mkdir(parents=True, exist_ok=True)
    sink = PagerDutySink(record_file=data_dir / "pagerduty-sink.jsonl")
    sink_url = sink.start()
    listen = DASHBOARD_LISTEN if _port_free(DASHBOARD_LISTEN) else "127.0.0.1:0"
    planned_url = f"http://{listen}" if dashboard and listen == DASHBOARD_LISTEN else ""
    # The lab's supervisor, server and agents are started from this process and inherit its
    # environment: the one way to hand them the demo's settings without a file per component.
    os.environ.update(lab_env(data_dir=data_dir, sink_url=sink_url, dashboard_url=planned_url,
                              pagerduty_key=secrets.token_hex(16), reflex=mode.name == "netns"))
    say(f"PagerDuty-contract sink on {sink_url} (events recorded in {sink.record_file})")
    try:
        lab = _lab_up(mode, name, data_dir / "labs")
    except BaseException:
        sink.stop()
        raise
    say(f"lab {name} up in {lab.up_s:.0f} s ({mode.name}): {len(lab.hosts())} hosts; "
        f"server {lab.server.get('otlp')}, store {lab.server.get('store_http')}")
    stack = Stack(mode=mode, lab=lab, store=Store(lab.server["store_http"], timeout_s=20.0), sink=sink,
                  data_dir=data_dir)
    if dashboard:
        _start_dashboard(stack, listen)
    return stack


DEMO_TOPOLOGY = TopologySpec(hosts=6, gpus=4)
"""2 racks of 3 hosts, 2 rails, 2 spines, 4 fake GPUs a host: every act's fabric (the job across both racks,
a spare host, a spine uplink half the cross-rack paths hash onto), on a 2-core machine with room to spare.
The default lab (8 hosts, 8 GPUs each) kept it at a load of 25: starved probers read as 3-8 % loss on every
cross-rack path, and the torch job took minutes to start."""


def _lab_up(mode: Mode, name: str, state_root: Path) -> Lab | LoopbackLab:
    kind = Lab if mode.name == "netns" else LoopbackLab
    return kind.up(DEMO_TOPOLOGY, name=name, state_root=state_root, cleanup_at_exit=True, timeout_s=120.0)


def _start_dashboard(stack: Stack, listen: str, timeout_s: float = 90.0) -> None:
    """``ridethrough dashboard`` over the lab's store endpoint, recorded as a lab process; its URL once it serves."""
    ready = stack.data_dir / "dashboard.json"
    ready.unlink(missing_ok=True)
    fabric = Path(str(stack.lab.state()["dir"])) / "fabric.json"
    argv = [sys.executable, "-m", "ridethrough", "dashboard", "--store", stack.lab.server["store_http"],
            "--listen", listen, "--ready-file", str(ready), "--refresh", "2"]
    if fabric.exists():
        argv += ["--fabric-map-file", str(fabric)]
    log_path = stack.data_dir / "dashboard.log"
    with log_path.open("ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    rec = procs.ref(proc.pid)
    if rec is not None:
        stack.lab.sf.set_in("processes", DASHBOARD_KEY, rec.to_json())
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if ready.exists():
            stack.dashboard_url = str(json.loads(ready.read_text())["url"])
            return
        time.sleep(0.2)
    tail = log_path.read_text(errors="replace").strip().splitlines()[-2:]
    stack.dashboard_note = f"dashboard did not come up ({' | '.join(tail) or 'no output'}); see {log_path}"


def take_down(*, name: str, data_dir: Path) -> str:
    """``ridethrough demo --down``: stop the demo's lab and everything recorded with it; what was done, in a line."""
    from ridethrough.lab.fabric import attach
    from ridethrough.lab.state import list_labs

    root = data_dir / "labs"
    if name not in list_labs(root):
        return f"no demo lab {name!r} under {root}: nothing to take down"
    try:
        report = attach(name, state_root=root).down()
    except LabError as exc:
        return f"demo lab {name}: {exc}"
    problems = f"; could not remove: {'; '.join(report.problems)}" if report.problems else ""
    return (f"demo lab {name} taken down in {report.seconds:.1f} s: {report.processes} processes, "
            f"{report.namespaces} namespaces, {report.interfaces} interfaces, {report.cgroups} cgroups{problems}")

