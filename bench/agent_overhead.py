"""Agent overhead: CPU and memory of ``ridethrough agent`` on a fake 8-GPU, 8-NIC host at 1 s intervals.

Targets (from the issue): at most 2% of one core, at most 150 MB RSS.

The fake host lives in a temporary directory:

* a sysfs tree with ``--nics`` mlx5 ports and matching ``class/net/nicR`` folders
  (`ridethrough.lab.fake_ib.create_tree`), rewritten every second by a `CounterPump` in
  this process from synthetic, veth-like traffic counters;
* ``--gpus`` scripted GPUs (`ridethrough.lab.fake_gpu.create_fake_gpus`), read by the
  ``gpu`` source through ``RIDETHROUGH_AGENT_GPU_SCRIPT``, if that source exists;
* ``--ranks`` reporters sending one step a second each to the ``job`` source's socket
  (`ridethrough.collector.job_client.JobReporter`), if that source exists.

Sources are those of ``--sources`` that the registry names and that import today; the
JSON lists the ones that ran.

A real gateway (``ridethrough server`` on a temporary chDB store) receives the exports.
The agent runs as its own process; after ``--warmup`` seconds its CPU time (utime +
stime of all threads, /proc/PID/stat) is read around a window of ``--seconds``, and its
RSS (VmRSS, sampled every second, and the VmHWM peak) from /proc/PID/status. Rows in the
store prove the exports happened. ``--scrape S`` also serves /metrics and scrapes it
every S seconds.

Progress goes to stderr; the last line on stdout is one JSON object.
Run: ``.venv/bin/python bench/agent_overhead.py [--quick]`` (quick: under 60 s).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TARGET_CPU_CORE_PCT = 2.0
TARGET_RSS_MB = 150.0
NODE_ID = "bench-node"
WANTED_SOURCES = ("netdev", "infiniband", "ethtool", "gpu", "job")
"""Every source (the agent's default). ethtool asks real interfaces by ioctl; the fake
host's NICs are only files, so it finds nothing to read and stays idle."""


def say(text: str) -> None:
    print(f"[agent_overhead] {text}", file=sys.stderr, flush=True)


def wait_for(predicate: Callable[[], Any], *, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.1)
    raise SystemExit(f"agent_overhead: timed out after {timeout_s} s waiting for {what}")


def available_sources(wanted: tuple[str, ...]) -> list[str]:
    """The wanted sources that the registry names and whose module imports today."""
    from ridethrough.collector.registry import SOURCES

    found = []
    for name in wanted:
        if name not in SOURCES:
            continue
        try:
            module = importlib.import_module(SOURCES[name])
        except ImportError as exc:
            say(f"source {name} not available: {exc}")
            continue
        if hasattr(module, "from_config"):
            found.append(name)
    return found


def spawn(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "ridethrough", *args], stdout=out,
                                stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def read_json(path: Path, proc: subprocess.Popen[bytes], log: Path) -> dict[str, str]:
    def ready() -> bool:
        if proc.poll() is not None:
            raise SystemExit(f"agent_overhead: {proc.args} exited early:\n{log.read_text()[-3000:]}")
        return path.exists()
    wait_for(ready, timeout_s=60, what=f"ready file {path}")
    return dict(json.loads(path.read_text()))


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


class Ticker(threading.Thread):
    """Calls ``action`` every ``interval_s`` until stopped; counts what it could not do."""

    def __init__(self, action: Callable[[], None], interval_s: float, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self._action, self._interval_s = action, interval_s
        self._stop_event = threading.Event()
        self.errors = 0

    def run(self) -> None:
        next_at = time.monotonic()
        while not self._stop_event.is_set():
            try:
                self._action()
            except Exception as exc:  # the bench reports it; one bad tick must not end the run
                self.errors += 1
                say(f"{self.name}: {exc}")
            next_at += self._interval_s
            self._stop_event.wait(max(0.0, next_at - time.monotonic()))

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive():
            self.join(5)


def fake_nics(root: Path, nics: int) -> Ticker:
    """The sysfs tree and a pump that moves its counters like busy 200G links."""
    from ridethrough.lab.fake_ib import CounterPump, NicStats, create_tree

    create_tree(root, nics)
    t0 = time.monotonic()

    def stats() -> dict[str, NicStats]:
        dt = time.monotonic() - t0
        return {f"nic{i}": NicStats(rx_bytes=int(1e9 * (i + 1) * dt), tx_bytes=int(9e8 * (i + 1) * dt),
                                    rx_packets=int(2e5 * (i + 1) * dt), tx_packets=int(1.8e5 * (i + 1) * dt))
                for i in range(nics)}

    pump = CounterPump(root, root.parent / "nic_faults.json", stats)
    pump.tick(time.time_ns())
    return Ticker(lambda: pump.tick(time.time_ns()), 1.0, "counter-pump")


def fake_ranks(sock: Path, ranks: int) -> Ticker:
    """``ranks`` reporters of one job, each reporting a step a second."""
    from ridethrough.collector.job_client import JobReporter

    reporters = [JobReporter(socket_path=sock, job="bench-job", customer="bench", rank=r, world_size=ranks)
                 for r in range(ranks)]
    step = [0]

    def tick() -> None:
        now = time.time_ns()
        for reporter in reporters:
            if step[0] == 0:
                reporter.started()
            reporter.step(step[0], now - 900_000_000, now, tokens=4096, phases={"compute_s": 0.8, "wait_s": 0.1})
        step[0] += 1

    return Ticker(tick, 1.0, "job-reporters")


def proc_cpu_s(pid: int) -> float:
    """utime + stime of every thread of ``pid``, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_status_mb(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def count_rows(store_http: str) -> tuple[int, int]:
    """(rows, distinct series) this node exported to the store."""
    import clickhouse_connect

    host, port = store_http.removeprefix("http://").rsplit(":", 1)
    db = clickhouse_connect.get_client(host=host, port=int(port))
    where = f"ResourceAttributes['ridethrough.node.id'] = '{NODE_ID}'"
    rows = series = 0
    for table in ("otel_metrics_sum", "otel_metrics_gauge"):
        r, s = db.query(f"SELECT count(), uniqExact(MetricName, Attributes) FROM {table} WHERE {where}").result_rows[0]
        rows, series = rows + int(r), series + int(s)
    return rows, series


def measure(pid: int, seconds: float, scrape: Callable[[], None] | None) -> dict[str, float]:
    """CPU share and RSS of ``pid`` over ``seconds``."""
    rss: list[float] = []
    cpu0, t0 = proc_cpu_s(pid), time.monotonic()
    end = t0 + seconds
    while (now := time.monotonic()) < end:
        rss.append(proc_status_mb(pid, "VmRSS"))
        if scrape is not None:
            scrape()
        time.sleep(min(1.0, max(0.0, end - now)))
    cpu1, t1 = proc_cpu_s(pid), time.monotonic()
    return {"cpu_core_pct": round(100 * (cpu1 - cpu0) / (t1 - t0), 3), "rss_mb": round(max(rss), 1),
            "rss_mean_mb": round(sum(rss) / len(rss), 1), "rss_peak_mb": round(proc_status_mb(pid, "VmHWM"), 1),
            "window_s": round(t1 - t0, 1)}


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    sources = available_sources(tuple(args.sources.split(",")))
    say(f"sources: {sources}")
    server_log, agent_log = tmp / "server.log", tmp / "agent.log"
    server = spawn(["server", "--store", f"chdb://{tmp / 'store'}", "--spool", str(tmp / "spool"),
                    "--otlp-listen", "127.0.0.1:0", "--ready-file", str(tmp / "server.json")], server_log)
    tickers: list[Ticker] = []
    agent: subprocess.Popen[bytes] | None = None
    try:
        addresses = read_json(tmp / "server.json", server, server_log)
        tickers.append(fake_nics(tmp / "sys", args.nics))
        env = {"RIDETHROUGH_AGENT_SOURCES": ",".join(sources), "RIDETHROUGH_AGENT_JOB_SOCKET": str(tmp / "job.sock")}
        if "gpu" in sources:
            from ridethrough.lab.fake_gpu import create_fake_gpus

            create_fake_gpus(tmp / "gpus.json", args.gpus, host=NODE_ID, seed=1)
            env["RIDETHROUGH_AGENT_GPU_SCRIPT"] = str(tmp / "gpus.json")
        agent_args = ["agent", "--gateway", addresses["otlp"], "--sysfs-root", str(tmp / "sys"), "--node-id",
                      NODE_ID, "--interval", str(args.interval), "--export-interval", str(args.interval),
                      "--ready-file", str(tmp / "agent.json")]
        if args.scrape:
            agent_args += ["--prometheus-listen", "127.0.0.1:0"]
        agent = spawn(agent_args, agent_log, env)
        agent_addresses = read_json(tmp / "agent.json", agent, agent_log)
        if "job" in sources:
            wait_for(lambda: (tmp / "job.sock").exists(), timeout_s=30, what="the job socket")
            tickers.append(fake_ranks(tmp / "job.sock", args.ranks))
        for ticker in tickers:
            ticker.start()
        scrape = None
        if args.scrape:
            url = f"http://{agent_addresses['prometheus']}/metrics"
            last = [0.0]

            def scrape() -> None:
                if time.monotonic() - last[0] >= args.scrape:
                    last[0] = time.monotonic()
                    urllib.request.urlopen(url, timeout=5).read()
        say(f"agent pid {agent.pid}: warming up {args.warmup} s")
        time.sleep(args.warmup)  # the window starts after start-up costs: imports, first exports
        say(f"measuring {args.seconds} s")
        figures = measure(agent.pid, args.seconds, scrape)
        if agent.poll() is not None:
            raise SystemExit(f"agent_overhead: the agent died:\n{agent_log.read_text()[-3000:]}")
        rows, series = count_rows(addresses["store_http"])
    finally:
        try:
            for ticker in tickers:
                ticker.stop()
        finally:
            if agent is not None:
                stop(agent)
            stop(server)
    if rows == 0:
        raise SystemExit(f"agent_overhead: nothing reached the store:\n{agent_log.read_text()[-3000:]}")
    return {**figures, "series": series, "exported_rows": rows, "sources": sources,
            "errors": sum(t.errors for t in tickers)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short window: under 60 s in all")
    parser.add_argument("--seconds", type=float, help="measurement window (default 120, quick 30)")
    parser.add_argument("--warmup", type=float, help="seconds before the window (default 15, quick 6)")
    parser.add_argument("--nics", type=int, default=8)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--sources", default=",".join(WANTED_SOURCES),
                        help="sources to run, of those available (default: all of %(default)s)")
    parser.add_argument("--interval", type=float, default=1.0, help="sampling and export interval, s")
    parser.add_argument("--scrape", type=float, default=0.0, help="also scrape /metrics every S s (0: off)")
    args = parser.parse_args()
    args.seconds = args.seconds or (30.0 if args.quick else 120.0)
    args.warmup = args.warmup if args.warmup is not None else (6.0 if args.quick else 15.0)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rt-agent-bench-") as tmp:
        result = run(args, Path(tmp))
    sources = result["sources"]
    out = {"bench": "agent_overhead", "cpu_core_pct": result.pop("cpu_core_pct"), "rss_mb": result.pop("rss_mb"),
           **result, "nics": args.nics, "gpus": args.gpus if "gpu" in sources else 0,
           "ranks": args.ranks if "job" in sources else 0, "interval_s": args.interval, "scrape_s": args.scrape,
           "targets": {"cpu_core_pct": TARGET_CPU_CORE_PCT, "rss_mb": TARGET_RSS_MB},
           "wall_s": round(time.monotonic() - started, 1), "quick": args.quick}
    out["ok"] = out["cpu_core_pct"] <= TARGET_CPU_CORE_PCT and out["rss_peak_mb"] <= TARGET_RSS_MB
    print(json.dumps(out))


if __name__ == "__main__":
    main()
