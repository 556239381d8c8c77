"""``ridethrough demo``: the whole loop on an emulated cluster, told as a story in five acts.

It brings up a lab of 6 hosts (2 racks, 2 rails, 2 spines, 4 fake GPUs each) with an agent
per host and the server (gateway, controller with detectors and actuators, not dry-run, PagerDuty
to a local sink) on an embedded store under ``<data-dir>/labs/<name>/store``, the dashboard on
http://127.0.0.1:8050, and a training job under ``ridethrough run`` with hot spares; then plays
the acts (`ridethrough.demo_acts`), prints what the store says happened after each, ends with a
goodput summary, and keeps the dashboard up until Ctrl-C (or stops at ``--duration``). Without
root it runs the degraded loopback mode (GPU and clock acts). ``--down`` takes a demo down.
"""

from __future__ import annotations

import json
import shutil
import signal
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console

from ridethrough import demo_checks as checks
from ridethrough.demo_act_base import ActResult, Context
from ridethrough.demo_acts import JOB_HOSTS, LOOPBACK_STORY, SPARE_HOST, STORY, Act
from ridethrough.demo_job import JOB_ID, DemoJob
from ridethrough.demo_stack import Mode, Stack, bring_up, detect_mode, take_down
from ridethrough.demo_view import View
from ridethrough.lab.control import LabError
from ridethrough.lab.state import list_labs
from ridethrough.signals import wait_for_stop

SUMMARY_RESERVE_S = 25.0
"""Seconds kept at the end of ``--duration`` for the summary and the teardown."""
MIN_ACT_S = 10.0
JOB_READY_STEPS = 3
JOB_WAIT_S = 300.0
"""Longest wait for the job's first steps before the story goes on without it."""
RECORD = "demo-run.json"


def down(*, name: str, data_dir: Path) -> int:
    """``ridethrough demo --down``."""
    print(take_down(name=name, data_dir=data_dir.resolve()))
    return 0


def run(*, name: str, data_dir: Path, duration_s: float | None, dashboard: bool, loopback: bool = False,
        console: Console | None = None) -> int:
    """Run the demo until its story ends and then Ctrl-C (or ``duration_s``); returns the exit status.

    ``loopback`` asks for the degraded mode even where namespaces are available.
    """
    view = View(console or Console())
    data_dir = data_dir.resolve()
    started = time.monotonic()
    deadline = None if duration_s is None else started + duration_s
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    mode = Mode("loopback", "asked for with --loopback") if loopback else detect_mode()
    view.say(("[bold]mode[/]: " if mode.name == "netns" else "[bold yellow]mode[/]: ") + mode.message)
    if problem := _clear_previous(name, data_dir):
        view.say(f"[red]{problem}[/]")
        return 2
    try:
        stack = bring_up(mode=mode, name=name, data_dir=data_dir, dashboard=dashboard, say=view.say)
    except LabError as exc:
        view.say(f"[red]the lab did not come up: {exc}[/]")
        return 1
    try:
        if stack.dashboard_url:
            view.say(f"[bold]dashboard[/]: {stack.dashboard_url}")
        elif stack.dashboard_note:
            view.say(f"[yellow]{stack.dashboard_note}[/]")
        record = _tell(view, stack, mode, stop, deadline)
        (data_dir / RECORD).write_text(json.dumps(record, indent=1, default=str))
        view.say(f"run record: {data_dir / RECORD}; store kept at {record['store']}")
        if deadline is None and not stop.is_set():
            view.say("the lab keeps running; Ctrl-C stops everything" +
                     (f" (dashboard: {stack.dashboard_url})" if stack.dashboard_url else ""))
            wait_for_stop(stop)
    finally:
        view.say("stopping: job, lab, agents, server, dashboard ...")
        stack.close()
    return 0


def _clear_previous(name: str, data_dir: Path) -> str:
    """Remove a finished run's data of this lab name; a message when a demo of that name still runs."""
    root = data_dir / "labs"
    if name in list_labs(root):
        return f"a demo lab {name!r} is already running under {root}: `ridethrough demo --down` first"
    if (root / name).exists():
        shutil.rmtree(root / name)  # the previous run's store and logs: a new story starts from nothing
    return ""


def _tell(view: View, stack: Stack, mode: Mode, stop: threading.Event, deadline: float | None) -> dict[str, Any]:
    """Start the job, play the acts, show the summary; the run record."""
    from ridethrough import demo_summary

    started_ns = time.time_ns()
    job = DemoJob(stack.lab, hosts=JOB_HOSTS, spare_host=SPARE_HOST, spares=2,
                  log_dir=Path(str(stack.lab.state()["dir"])) / "job")
    story = STORY if mode.name == "netns" else LOOPBACK_STORY
    record: dict[str, Any] = {"mode": mode.name, "mode_message": mode.message,
                              "store": f"chdb://{stack.lab.state()['dir']}/store",
                              "store_http": stack.lab.server.get("store_http"),
                              "dashboard": stack.dashboard_url, "job": JOB_ID, "acts": []}
    try:
        job.start()
        record["job_ready"] = _wait_job(view, stack, job, stop, deadline, acts=len(story))
        results = _play(view, stack, job if record["job_ready"] else None, story, stop, deadline)
        record["acts"] = [asdict(r) for r in results]
        view.console.rule("[bold]summary[/]")
        record["summary"] = demo_summary.show(view, stack.store, results, started_ns=started_ns)
    finally:
        job.stop()
    return record


def _wait_job(view: View, stack: Stack, job: DemoJob, stop: threading.Event, deadline: float | None, *,
              acts: int) -> bool:
    """Wait for the job's first steps in the store; False (said) when they do not come in time."""
    # Up to 5 minutes: the wait ends at the job's first steps, so only a slow start uses it (seven processes
    # importing torch at once on a busy 2-core machine took over 3 minutes in CI, and the story ran without a job)
    room = JOB_WAIT_S if deadline is None else min(JOB_WAIT_S, deadline - time.monotonic() - SUMMARY_RESERVE_S
                                                   - acts * MIN_ACT_S * 2)
    until = time.monotonic() + max(room, 20.0)
    with view.act("job", f"a training job: ridethrough run on {', '.join(job.hosts)}, spares on {job.spare_host}",
                  max(room, 20.0)) as status:
        while not stop.is_set() and time.monotonic() < until:
            progress = checks.job_progress(stack.store, JOB_ID)
            if progress.last_step >= JOB_READY_STEPS:
                view.say(f"  [green]✔[/] job {JOB_ID} training: {progress.ranks} ranks at step {progress.last_step}")
                return True
            if exited := job.exited():
                view.say(f"  [red]✘[/] launcher(s) exited: {exited} (logs under {job.log_dir})")
                return False
            status(f"waiting for the job's steps (at {progress.last_step})")
            stop.wait(1.0)
    view.say(f"  [yellow]∅[/] no step of the job reached the store in time (logs under {job.log_dir})")
    return False


def _play(view: View, stack: Stack, job: DemoJob | None, story: tuple[Act, ...], stop: threading.Event,
          deadline: float | None) -> list[ActResult]:
    """Every act in turn, each within its share of the time left (shares in proportion to the acts' ``max_s``)."""
    results: list[ActResult] = []
    for i, act in enumerate(story):
        res = ActResult(act.number, act.key, act.title)
        results.append(res)
        budget = act.max_s
        if deadline is not None:
            weight = act.max_s / sum(a.max_s for a in story[i:])
            budget = min(budget, (deadline - time.monotonic() - SUMMARY_RESERVE_S) * weight)
        if stop.is_set() or budget < MIN_ACT_S:
            res.add("missing", "skipped: " + ("stopped" if stop.is_set() else "out of time (--duration)"))
            view.say(f"act {act.number} ({act.title}) skipped")
            continue
        with view.act(f"act {act.number}", act.title, budget) as status:
            ctx = Context(stack=stack, job=job, deadline=time.monotonic() + budget, status=status, stop=stop)
            try:
                act.run(ctx, res)
            except LabError as exc:
                res.add("fail", f"the lab refused the fault: {exc}")
        view.result(res)
    return results
