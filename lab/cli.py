"""``ridethrough lab``: bring a lab up, look at it, fault it, run scenarios on it, take it down.

`lab_app` is a Typer sub-app (mounted as ``ridethrough lab``); ``python -m ridethrough.lab.cli``
runs it alone.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from ridethrough.lab.control import LabError
from ridethrough.lab.state import StateFile, default_state_root, list_labs

lab_app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False,
                      help="An emulated GPU cluster on this machine: hosts and switches as network namespaces, "
                           "real agents, scripted faults.")

StateRoot = Annotated[Path | None, typer.Option("--state-root", help="Where labs keep their state "
                                                "(default: $RIDETHROUGH_LAB_STATE_ROOT or /run/ridethrough/labs).")]
NameOpt = Annotated[str | None, typer.Option("--name", help="The lab (default: the only one running).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def _root(state_root: Path | None) -> Path:
    return state_root or default_state_root(os.environ)


def _fail(message: str, code: int = 1) -> typer.Exit:
    typer.echo(f"ridethrough lab: {message}", err=True)
    return typer.Exit(code)


def _resolve(name: str | None, root: Path) -> str:
    if name:
        return name
    labs = list_labs(root)
    if len(labs) == 1:
        return labs[0]
    raise _fail("no lab is running" if not labs else f"several labs run ({', '.join(labs)}); pass --name")


def _attach(name: str | None, root: Path) -> Any:
    from ridethrough.lab.fabric import attach
    try:
        return attach(_resolve(name, root), state_root=root)
    except LabError as exc:
        raise _fail(str(exc)) from exc


def hosts_table(state: dict[str, Any]) -> str:
    """The hosts of a lab and their addresses, one line each."""
    rows = [["host", "rack", "address", *(next(iter(state["hosts"].values()))["nics"]), "mgmt", "namespace"]]
    for host, info in state["hosts"].items():
        rows.append([host, str(info["rack"]), info["stable_ip"], *(n["ip"] for n in info["nics"].values()),
                     info["mgmt_ip"], info["ns"] or "-"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _server_line(state: dict[str, Any]) -> str:
    server = state.get("status", {}).get("server")
    if not state.get("agents"):
        return "no server or agents (--no-agents)"
    if not server:
        return f"server not ready: {state.get('status', {}).get('server_error', 'starting')}"
    return f"server: OTLP {server.get('otlp')}, store {server.get('store_http')}"


def _clocks(name: str, hosts: int, items: list[str]) -> dict[str, tuple[int, float]]:
    """Every host's (offset ns, drift ppm): from the name, with ``--clock`` overrides."""
    from ridethrough.collector.clock import MAX_DRIFT_PPM, MAX_OFFSET_NS
    from ridethrough.lab.build import default_clocks

    clocks = default_clocks(name, [f"h{i}" for i in range(hosts)])
    for item in items:
        host, _, spec = item.partition("=")
        offset, _, drift = spec.partition(":")
        if host not in clocks or not offset:
            raise ValueError(f"--clock wants HOST=OFFSET_MS[:DRIFT_PPM] for a host h0..h{hosts - 1}, got {item!r}")
        clocks[host] = (round(float(offset) * 1e6), float(drift or 0.0))
        if abs(clocks[host][0]) > MAX_OFFSET_NS or abs(clocks[host][1]) > MAX_DRIFT_PPM:
            raise ValueError(f"--clock {item}: offsets go to ±{MAX_OFFSET_NS / 1e6:g} ms, "
                             f"drifts to ±{MAX_DRIFT_PPM:g} ppm")
    return clocks


@lab_app.command()
def up(
    name: Annotated[str, typer.Option("--name", help="Lab name (prefix of everything it makes).")] = "lab",
    hosts: Annotated[int, typer.Option(help="Hosts.")] = 8,
    racks: Annotated[int, typer.Option(help="Racks (hosts split evenly).")] = 2,
    rails: Annotated[int, typer.Option(help="NICs per host, one leaf per rack and rail.")] = 2,
    spines: Annotated[int, typer.Option(help="Spine switches.")] = 2,
    gpus: Annotated[int, typer.Option(help="Fake GPUs per host.")] = 8,
    no_agents: Annotated[bool, typer.Option("--no-agents", help="No server and no agents.")] = False,
    loopback: Annotated[bool, typer.Option("--loopback", help="The degraded mode: no namespaces, hosts on "
                                                              "127.x.y.z, link faults refused.")] = False,
    clock: Annotated[list[str] | None, typer.Option("--clock", help="HOST=OFFSET_MS:DRIFT_PPM, e.g. h3=2.5:-40 "
                                                    "(repeatable; other hosts' clocks follow from the name).")] = None,
    as_json: JsonOpt = False,
    state_root: StateRoot = None,
) -> None:
    """Bring a lab up; returns once it runs, and prints its hosts and addresses."""
    from ridethrough.lab.fabric import Lab
    from ridethrough.lab.loopback import LoopbackLab
    from ridethrough.lab.netns import unavailable_reason
    from ridethrough.lab.topology import TopologySpec

    try:
        spec = TopologySpec(hosts=hosts, racks=racks, rails=rails, spines=spines, gpus=gpus)
    except ValueError as exc:
        raise _fail(str(exc), 2) from exc
    if not loopback and (reason := unavailable_reason()):
        raise _fail(f"{reason}; run `ridethrough lab up --loopback` for the degraded mode", 2)
    kind = LoopbackLab if loopback else Lab
    try:
        clocks = _clocks(name, spec.hosts, clock or [])
        lab = kind.up(spec, name=name, agents=not no_agents, state_root=_root(state_root), clocks=clocks,
                      cleanup_at_exit=False)
    except (LabError, ValueError) as exc:
        raise _fail(str(exc)) from exc
    state = lab.state()
    if as_json:
        typer.echo(json.dumps(state, indent=1))
        return
    typer.echo(f"lab {lab.name} up in {lab.up_s:.1f} s ({lab.mode}): {hosts} hosts, {len(state['namespaces'])} "
               f"namespaces; {_server_line(state)}")
    typer.echo(hosts_table(state))
    typer.echo(f"take it down with: ridethrough lab down {lab.name}")


@lab_app.command()
def status(name: Annotated[str | None, typer.Argument(help="A lab (default: all).")] = None,
           as_json: JsonOpt = False, state_root: StateRoot = None) -> None:
    """Show running labs, or one lab's hosts, processes, faults and schedule."""
    from ridethrough.lab import procs

    root = _root(state_root)
    names = [name] if name else list_labs(root)
    if not names:
        typer.echo("no labs")
        return
    for lab in names:
        try:
            state = StateFile(root, lab).read()
        except LabError as exc:
            raise _fail(str(exc)) from exc
        if as_json:
            typer.echo(json.dumps(state, indent=1))
            continue
        running = [k for k, v in state.get("processes", {}).items()
                   if any(procs.alive(procs.ProcRef.from_json(r)) for r in (v if isinstance(v, list) else [v]))]
        typer.echo(f"lab {lab} ({state['mode']}, {len(state['hosts'])} hosts): {_server_line(state)}; "
                   f"{len(running)} of {len(state.get('processes', {}))} processes running")
        if name:
            typer.echo(hosts_table(state))
            for key, what in sorted(state.get("faults", {}).items()):
                typer.echo(f"fault {key}: {what}")
            for handle, load in state.get("loads", {}).items():
                if not load.get("stopped"):
                    typer.echo(f"load {handle}: {load['rate_mbit']:g} Mbit/s {load['direction']} on {load['link']}")
            for entry in state.get("schedule", []):
                typer.echo(f"scheduled {entry['op']} {entry['args']} at {entry['at_ns']}")
            for key, code in state.get("exits", {}).items():
                typer.echo(f"exited: {key} ({code})")


@lab_app.command()
def down(name: Annotated[str, typer.Argument(help="The lab.")],
         keep_dir: Annotated[bool, typer.Option("--keep-dir", help="Keep its directory (logs, store).")] = False,
         state_root: StateRoot = None) -> None:
    """Stop and remove everything a lab made (also after a crash)."""
    from ridethrough.lab.teardown import down as take_down

    try:
        report = take_down(StateFile(_root(state_root), name), keep_dir=keep_dir)
    except LabError as exc:
        raise _fail(str(exc)) from exc
    typer.echo(f"lab {name} down in {report.seconds:.1f} s: {report.processes} processes, {report.namespaces} "
               f"namespaces, {report.interfaces} root interfaces, {report.cgroups} cgroups removed")
    for problem in report.problems:
        typer.echo(f"  left behind: {problem}", err=True)
    if report.problems:
        raise typer.Exit(1)


@lab_app.command("exec", context_settings={"allow_interspersed_args": False})
def exec_(name: Annotated[str, typer.Argument(help="The lab.")],
          node: Annotated[str, typer.Argument(help="A host (or, on a fabric, a switch).")],
          cmd: Annotated[list[str], typer.Argument(help="The command, after --.")],
          job: Annotated[bool, typer.Option("--job", help="A job process (straggle caps it).")] = False,
          state_root: StateRoot = None) -> None:
    """Run a command inside a lab node (its namespace and cgroup); replaces this process."""
    from ridethrough.lab import netns, procs

    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise _fail("no command given (lab exec NAME NODE -- CMD ...)", 2)
    lab = _attach(name, _root(state_root))
    try:
        enter = netns.enter_fn(lab._node_ns(node), lab._node_cgroup(node, job=job))
        me = procs.ref(os.getpid())
        if me is not None:  # the same pid and start time after exec: down finds it
            lab.sf.set_in("processes", f"exec:{node}:{me.pid}", me.to_json())
        enter()
    except (LabError, OSError) as exc:
        raise _fail(str(exc)) from exc
    try:
        os.execvp(cmd[0], cmd)
    except OSError as exc:
        raise _fail(f"{cmd[0]}: {exc.strerror}", 127) from exc


def _params(items: list[str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise _fail(f"--param wants KEY=VALUE, got {item!r}", 2)
        out[key] = yaml.safe_load(value) if value else ""
    return out


@lab_app.command()
def inject(kind: Annotated[str, typer.Argument(help="link-down, link-up, flap, degrade, loss, restore, mtu, "
                                                     "congest, clock-step, gpu, nic-ramp, freeze, thaw, straggle, "
                                                     "unstraggle.")],
           target: Annotated[str, typer.Argument(help="A link (h3-leaf1r0, leaf0r0-spine1) or a host (h3).")],
           param: Annotated[list[str] | None, typer.Option("--param", "-p", help="KEY=VALUE, repeatable.")] = None,
           name: NameOpt = None, state_root: StateRoot = None) -> None:
    """Apply one fault now (see `ridethrough.lab.faults` for each kind's parameters)."""
    from difflib import get_close_matches

    from ridethrough.lab import faults

    spec = faults.KINDS.get(kind)
    if spec is None:
        close = get_close_matches(kind, list(faults.KINDS), n=1)
        raise _fail(f"unknown fault kind {kind!r}" + (f" (did you mean {close[0]!r}?)" if close else ""), 2)
    lab = _attach(name, _root(state_root))
    s = lab.info["spec"]
    names = faults.names(s["hosts"], s["racks"], s["rails"], s["spines"], s["gpus"])
    raw = _params(param or [])
    known = spec.params_for(raw)
    unknown = sorted(set(raw) - {p.name for p in known})
    if unknown:
        raise _fail(f"{kind} takes {', '.join(p.name for p in known) or 'no parameters'}; not {', '.join(unknown)}", 2)
    values: dict[str, faults.ParamValue] = {}
    try:
        for p in known:
            if p.name in raw:
                values[p.name] = faults.coerce(p, raw[p.name], names=names, target=target)
            elif p.required:
                raise ValueError(f"missing {p.name}")
            else:
                values[p.name] = p.default
        if kind == "flap":
            lab.flap_link(target, period_s=float(values["period_s"] or 0), count=int(values["count"] or 0),
                          end=None if values.get("end") is None else str(values["end"]))
            handle = None
        else:
            handle = spec.start(lab, faults.Call(target, values, names))
    except (LabError, ValueError) as exc:
        raise _fail(f"{kind} {target}: {exc}") from exc
    typer.echo(f"{kind} {target}: applied" + (f" (load {handle}; `lab inject restore {target}` stops it)"
                                              if handle else ""))


def _scenario_lab(path: Path, root: Path, name: str | None) -> tuple[Any, bool]:
    """The lab to run a scenario on: the named (or only) running one, else a new one of its topology."""
    if name or list_labs(root):
        return _attach(name, root), False
    from ridethrough.lab.fabric import Lab
    from ridethrough.lab.scenario import load_scenario
    from ridethrough.lab.topology import TopologySpec

    sc = load_scenario(path)
    t = sc.topology
    lab_name = re.sub(r"[^a-z0-9-]+", "-", sc.name.lower()).strip("-")[:24] or "scenario"
    typer.echo(f"no lab running: bringing up {lab_name} ({t.hosts} hosts) for the scenario")
    lab = Lab.up(TopologySpec(hosts=t.hosts, racks=t.racks, rails=t.rails, spines=t.spines, gpus=t.gpus),
                 name=lab_name, state_root=root)
    return lab, True


@lab_app.command()
def run(scenario: Annotated[Path, typer.Argument(help="A scenario YAML file.")],
        name: NameOpt = None,
        store: Annotated[str | None, typer.Option("--store", help="Write the run's truth to this store DSN.")] = None,
        state_root: StateRoot = None) -> None:
    """Run a scenario's fault timeline on a lab and record its truth.

    On the named (or only) running lab; with none running, on a new lab of the scenario's
    topology that is taken down afterwards.
    """
    from ridethrough.exporters.store import Store
    from ridethrough.lab.fabric import Lab
    from ridethrough.lab.jobs import LabJobLauncher
    from ridethrough.lab.truth import run_scenario

    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        lab, own = _scenario_lab(scenario, _root(state_root), name)
    except (LabError, ValueError) as exc:
        raise _fail(str(exc)) from exc
    try:
        jobs = LabJobLauncher(lab, log_dir=Path(lab.state()["dir"]) / "jobs") if isinstance(lab, Lab) else None
        run_scenario(scenario, lab=lab, store=Store(store) if store else None, stop=stop, print_fn=typer.echo,
                     jobs=jobs)
    except (LabError, ValueError) as exc:
        raise _fail(str(exc)) from exc
    finally:
        if own:
            lab.down()


if __name__ == "__main__":
    sys.exit(lab_app())
