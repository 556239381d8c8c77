"""Ride through a lost rank: ridethrough migration vs checkpoint-restart, same job, same failures.

The job is tests/fixtures/train_plain.py (an MLP, DDP on gloo, a shuffled DistributedSampler),
unchanged, under ``ridethrough run``. Side by side, in one run:

* **ridethrough**: one hot spare (``--spares``; each failure waits until the launcher has
  replaced the spare the previous one used; --quick: two). First a proactive
  migration (a rank asked to move, as for a GPU predicted to fail), then a rank killed (SIGKILL)
  every M steps: a hot spare takes it over from a peer and the interrupted step is replayed.
* **checkpoint-restart** (the usual practice): no spare, a checkpoint every K steps
  (``--snapshot-every K``); for the predicted failure, a checkpoint taken on demand and a restart
  from it (a drain); each kill makes the job restart every rank from the last checkpoint and redo
  the steps since.

Figures (from the ranks' own step lines, which carry a wall-clock time):

* ``resume_s``: from the failure signal to the first step completed by the process that took over
  (a spare, or a restarted rank);
* ``recovered_s``: from the failure signal until that process completes the step that was in flight;
* ``steps_lost``: steps whose work is done again (the in-flight one counts): k + 1 - S for a
  kill during step k resumed at step S; T - S for a migration asked to happen at boundary T;
* ``pause_s``: for the planned move, the longest stall of the other ranks beyond a normal step
  (ridethrough), or the time from the rank's stop until training runs again (drain and restart);
* ``wall_s``: the whole job, start to exit, with its failures.

``breakdown_ridethrough`` (one row per kill) splits ridethrough's ``resume_s`` by the instants its
processes logged, each in seconds after the signal: ``failed_s`` (the first surviving rank's
collective failed), ``lost_s`` (the coordinator heard of the exit), ``spare_assigned_s``,
``planned_s`` (every report in: the donor and step posted), ``spare_continues_s`` (the spare has the
state and the new generation is formed), then ``resume_s`` itself. Log times have millisecond
resolution.

Both variants must end with the same model as each other (every resume here is exact): the
``digests_match`` figure checks it. Without --quick the job runs across two lab hosts (network
namespaces; one launcher per host, the spares on the second host) when this machine can build a
lab, else across local processes (``"where"`` says which; ``--lab`` or ``--where lab`` asks for the
lab, ``--quick --lab`` too). --quick: local, 2 ranks, 24 steps, one failure each.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "fixtures" / "train_plain.py"
_CLI = [sys.executable, "-m", "ridethrough.actuators.run_cli", "run"]
sys.path.insert(0, str(REPO))

from ridethrough.actuators.shim.control_socket import request, socket_path  # noqa: E402


@dataclass
class Step:
    rank: int
    step: int
    t: float
    log: str
    segment: int
    """Which process life of the log this step belongs to (0: the first; a resume starts the next)."""


@dataclass
class Job:
    """One ``ridethrough run`` of the fixture, with its failures injected on the way."""

    name: str
    nproc: int
    spares: int
    checkpoint_every: int
    job_args: list[str]
    root: Path
    lab: Any = None
    """A running namespace lab: one launcher per host (two hosts), else one local launcher."""
    procs: list[Any] = field(default_factory=list)
    started: float = 0.0
    wall_s: float = 0.0
    code: int = -1
    signals: list[dict[str, Any]] = field(default_factory=list)
    socket: Path | None = None
    """Node 0's control socket (None: the local launcher's, in the shared run directory)."""
    output: str = ""
    """The launchers' own output (their logs on lab hosts; the local launcher's stderr)."""

    @property
    def logs(self) -> Path:
        return self.root / self.name / "logs"

    def start(self) -> None:
        extra = ["--snapshot-dir", str(self.root / self.name / "snaps"), "--snapshot-every",
                 str(self.checkpoint_every)] if self.checkpoint_every else []
        common = ["--job-id", self.name, "--log-dir", str(self.logs), "--run-dir", str(self.root / "run"),
                  "--rendezvous-timeout", "120", *extra]
        tail = ["--", "python", str(SCRIPT), *self.job_args]
        self.started = time.time()
        if self.lab is None:
            argv = [*_CLI, "--nproc-per-node", str(self.nproc), "--spares", str(self.spares), *common, *tail]
            self.procs = [subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)]
            return
        from ridethrough.lab.jobs import LabRun

        # One launcher per host, each serving its socket in its host's run directory; the spares wait on
        # the other host than rank 0 (whose launcher hosts the job's coordinator).
        run = LabRun(self.lab, ["h0", "h1"], ["python", str(SCRIPT), *self.job_args], job_id=self.name,
                     log_dir=self.logs, nproc_per_node=self.nproc // 2, spares=[0, self.spares], master_port=29650,
                     extra=["--rendezvous-timeout", "120", *extra])
        run.start()
        self.procs, self.socket = run.procs, socket_path(run.run_dir("h0"), self.name, 0)

    def steps(self) -> list[Step]:
        """Every step line of every process, with its global step (a resumed process counts from its resume)."""
        out = []
        for path in sorted(self.logs.glob("*.log")):
            if path.stem.startswith("launcher-"):
                continue  # a launcher's own output (lab runs)
            offset, segment = 0, 0  # (every node writes its logs into the same directory)
            for line in path.read_text().splitlines():
                if m := re.search(r"continues at step (\d+)", line):
                    offset, segment = int(m[1]), segment + 1
                elif line.startswith("{") and '"loss"' in line:
                    rec = json.loads(line)
                    out.append(Step(rec["rank"], offset + rec["i"], rec["t"], path.stem, segment))
        return out

    def wait_step(self, step: int, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while max((s.step for s in self.steps()), default=-1) < step:
            if any(p.poll() is not None for p in self.procs) or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: ended or stalled before step {step}")
            time.sleep(0.05)

    def ask(self, doc: dict[str, Any]) -> dict[str, Any]:
        return request(self.socket or socket_path(self.root / "run", self.name, 0), doc, timeout_s=300)

    def wait_spare(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(s["state"] == "ready" for s in self.ask({"cmd": "status"})["spares"].values()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: no spare ready within {timeout_s} s")
            time.sleep(0.2)

    def kill(self, rank: int, *, kind: str = "kill") -> None:
        pid = int(self.ask({"cmd": "status"})["ranks"][str(rank)]["pid"])
        done = max((s.step for s in self.steps() if s.rank == rank), default=-1)
        self.signals.append({"kind": kind, "rank": rank, "t": time.time(), "in_flight": done + 1})
        os.kill(pid, signal.SIGKILL)

    def migrate(self, rank: int) -> None:
        t = time.time()
        reply = self.ask({"cmd": "migrate", "ranks": [rank], "reason": "bench: predicted failure"})
        if not reply.get("ok"):
            raise RuntimeError(f"{self.name}: migration failed: {reply}")
        self.signals.append({"kind": "migrate", "rank": rank, "t": t})

    def finish(self, timeout_s: float = 600.0) -> None:
        errors = [p.communicate(timeout=timeout_s)[1] or "" for p in self.procs]
        self.code, self.wall_s = max(p.returncode for p in self.procs), time.time() - self.started
        self.output = "\n".join([*errors, *(p.read_text(errors="replace")
                                            for p in sorted(self.logs.glob("launcher-*.log")))])
        if self.code != 0:
            errors += [p.read_text(errors="replace") for p in sorted(self.logs.glob("launcher-*.log"))]
            raise RuntimeError(f"{self.name} exited {self.code}:\n" + "\n".join(e[-2000:] for e in errors))

    def digests(self) -> set[str]:
        found = set()
        for path in self.logs.glob("*.log"):
            found |= {json.loads(x)["digest"] for x in path.read_text().splitlines() if '"digest"' in x}
        return found


def measure(job: Job) -> list[dict[str, Any]]:
    """Per failure: resume and recovery times, steps lost."""
    steps = job.steps()
    firsts: dict[tuple[str, int], Step] = {}
    for s in sorted(steps, key=lambda s: s.t):
        firsts.setdefault((s.log, s.segment), s)
    out = []
    for n, sig in enumerate(job.signals):
        t, until = sig["t"], job.signals[n + 1]["t"] if n + 1 < len(job.signals) else float("inf")
        fresh = [f for f in firsts.values() if t < f.t < until and (f.segment > 0 or f.log.startswith("spare"))]
        resumed = min(f.step for f in fresh)
        if sig["kind"] == "migrate":
            left = max(s.step for s in steps if s.log == f"rank-{sig['rank']}" and s.segment == 0)
            others = sorted(s.t for s in steps if s.rank != sig["rank"])
            gaps = [b - a for a, b in itertools.pairwise(others)]
            out.append({"kind": "migrate", "left_after": left, "resumed_at": resumed,
                        "steps_lost": (left + 1) - resumed, "pause_s": round(max(gaps) - statistics.median(gaps), 3)})
            continue
        k = sig["in_flight"]
        later = sorted((s for s in steps if t < s.t < until), key=lambda s: s.t)
        # Counted from the processes that took over (a spare, a restarted rank): a survivor may still
        # print the in-flight step when the lost rank had sent its share before it died.
        started = {(f.log, f.segment) for f in fresh}
        first = next((s for s in later if (s.log, s.segment) in started), None)
        regained = next((s for s in later if s.step >= k and (s.log, s.segment) in started), None)
        row = {"kind": sig["kind"], "in_flight": k, "resumed_at": resumed, "steps_lost": k + 1 - resumed,
               "resume_s": round(first.t - t, 3) if first else None,
               "recovered_s": round(regained.t - t, 3) if regained else None}
        if sig["kind"] == "drain":  # a planned stop: its pause is the time until training runs again
            row["pause_s"] = row["resume_s"]
        out.append(row)
    return out


_STAMP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})")


def _stamp(line: str) -> float | None:
    """The wall-clock time of a log line's ``asctime`` (local time, milliseconds), or None."""
    m = _STAMP.search(line)
    return time.mktime(time.strptime(m[1], "%Y-%m-%d %H:%M:%S")) + int(m[2]) / 1000 if m else None


def breakdown(job: Job, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per kill: when each stage of the ride-through was logged, in seconds after the signal."""
    notes: list[tuple[float, str, dict[str, Any]]] = []
    for line in job.output.splitlines():
        if m := re.search(r"coordinator: (\w+) (\{.*\})$", line):
            doc = ast.literal_eval(m[2])
            t = doc.get("at") or _stamp(line)
            if t is not None:
                notes.append((float(t), m[1], doc))
    lines: list[tuple[float, str, str]] = []
    for path in job.logs.glob("*.log"):
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("[ridethrough rank") and (t := _stamp(line)) is not None:
                lines.append((t, path.stem, line))
    out = []
    for n, (sig, row) in enumerate(zip(job.signals, rows, strict=True)):
        if sig["kind"] != "kill":
            continue
        t, until = sig["t"], job.signals[n + 1]["t"] if n + 1 < len(job.signals) else float("inf")

        def first(times: list[float], t: float = t, until: float = until) -> float | None:
            later = [x for x in times if t - 0.001 <= x < until]  # log times are truncated to the millisecond
            return round(min(later) - t, 3) if later else None

        spare_lines = [(x, line) for x, name, line in lines if name.startswith("spare")]
        out.append({"rank": sig["rank"],
                    "failed_s": first([x for x, _, line in lines if "in generation" in line and (
                        "failed" in line or "replacing a rank" in line)]),
                    "lost_s": first([x for x, kind, _ in notes if kind == "rank_lost"]),
                    "spare_assigned_s": first([x for x, kind, _ in notes if kind == "recovery_spares_assigned"]),
                    "planned_s": first([x for x, kind, _ in notes if kind == "recovery_planned"]),
                    "spare_takes_s": first([x for x, line in spare_lines if " takes rank " in line]),
                    "spare_continues_s": first([x for x, line in spare_lines if " continues at step " in line]),
                    "resume_s": row.get("resume_s")})
    return out


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return round(statistics.fmean(vals), 3) if vals else float("nan")


def run(args: argparse.Namespace, lab: Any = None) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="rtb", dir="/tmp"))
    total = args.samples // (4 * args.nproc) * args.epochs  # the fixture's batch is 4
    kills = list(range(args.every, total - 2, args.every))
    job_args = ["--epochs", str(args.epochs), "--samples", str(args.samples), "--step-sleep", str(args.step_sleep),
                "--width", str(args.width)]
    ride = Job("ride", args.nproc, args.spares, 0, job_args, root, lab)
    ride.start()
    ride.wait_step(args.proactive_at - 1)
    ride.wait_spare()  # a loaded machine may still be warming the spare up
    ride.migrate(1)
    for j, step in enumerate(kills):
        ride.wait_spare()
        ride.wait_step(step)
        ride.kill((j + 2) % args.nproc)
    ride.finish()
    # The usual practice for the same two events: drain a failing GPU by checkpointing and restarting
    # (a snapshot now, then the rank stops), and restart from the last periodic checkpoint on a crash.
    restart = Job("ckpt", args.nproc, 0, args.checkpoint_every, job_args, root, lab)
    restart.start()
    restart.wait_step(args.proactive_at - 1)
    taken = restart.ask({"cmd": "snapshot"})
    if not taken.get("ok"):
        raise RuntimeError(f"ckpt: snapshot failed: {taken}")
    restart.kill(1, kind="drain")
    for j, step in enumerate(kills):
        restart.wait_step(step)
        restart.kill((j + 2) % args.nproc)
    restart.finish()
    ride_m, ckpt_m = measure(ride), measure(restart)
    ride_kills = [m for m in ride_m if m["kind"] == "kill"]
    ckpt_kills = [m for m in ckpt_m if m["kind"] == "kill"]
    return {"where": "lab" if lab is not None else "local", "ranks": args.nproc, "steps": total, "kills_at": kills,
            "checkpoint_every": args.checkpoint_every, "ridethrough": ride_m, "checkpoint_restart": ckpt_m,
            "wall_s_ridethrough": round(ride.wall_s, 2), "wall_s_checkpoint_restart": round(restart.wall_s, 2),
            "resume_s_ridethrough": _mean(ride_kills, "resume_s"), "resume_s_checkpoint_restart":
                _mean(ckpt_kills, "resume_s"),
            "pause_s_migration": _mean(ride_m, "pause_s"), "pause_s_drain_restart": _mean(ckpt_m, "pause_s"),
            "recover_speedup": round(_mean(ckpt_kills, "recovered_s") / _mean(ride_kills, "recovered_s"), 2),
            "steps_lost_checkpoint_restart": max(m["steps_lost"] for m in ckpt_kills),
            "breakdown_ridethrough": breakdown(ride, ride_m),
            "digests_match": len(ride.digests() | restart.digests()) == 1,
            "bench": "migrate",
            "resume_speedup": round(_mean(ckpt_kills, "resume_s") / _mean(ride_kills, "resume_s"), 2),
            "steps_lost_proactive": max(m["steps_lost"] for m in ride_m if m["kind"] == "migrate"),
            "steps_lost_reactive": max(m["steps_lost"] for m in ride_kills)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 ranks, 24 steps, one failure (for CI)")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--spares", type=int, default=1, help="Hot spares of the ridethrough run (on the second host).")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--every", type=int, default=16, help="Kill a rank every M steps.")
    ap.add_argument("--checkpoint-every", type=int, default=10, help="K: checkpoint-restart's interval.")
    ap.add_argument("--proactive-at", type=int, default=6)
    ap.add_argument("--step-sleep", type=float, default=0.4, help="Extra seconds per step (stands in for compute).")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--where", choices=("auto", "lab", "local"), default="auto",
                    help="lab: two lab hosts (network namespaces, root), 4 ranks and the spares on the second; "
                         "local: processes on this machine; auto: lab unless --quick or no namespaces here.")
    ap.add_argument("--lab", dest="where", action="store_const", const="lab", help="Same as --where lab.")
    args = ap.parse_args(argv)
    if args.quick:
        args.nproc, args.epochs, args.samples, args.every, args.checkpoint_every = 2, 3, 64, 14, 4
        args.proactive_at, args.width, args.step_sleep = 4, 64, 0.1
        args.spares = 2  # its job trains for seconds: a used spare's replacement would come after its end
    where = args.where if args.where != "auto" else ("local" if args.quick else "lab")
    if where == "lab":
        from ridethrough.lab import netns

        reason = netns.unavailable_reason()
        if reason is not None:
            print(f"bench/migrate: no lab ({reason}); running across local processes", file=sys.stderr)
            where = "local"
    if where == "local":
        result = run(args)
    else:
        from ridethrough.lab.fabric import Lab
        from ridethrough.lab.topology import TopologySpec

        spec = TopologySpec(hosts=2, racks=2, rails=1, spines=1, gpus=args.nproc)
        with Lab.up(spec, name=f"bmig{os.getpid() % 10000}", agents=False) as lab:
            result = run(args, lab)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
