"""Fuzz for longer than the tests do: the OTLP receiver, the probe responder and the job endpoint.

The strategies and the oracles are those of ``tests/test_fuzz.py`` (what each input must get: the
status its content calls for, every accepted item stored once, one counted outcome per datagram,
replies no larger than probes); here each target runs for ``--seconds`` of generated examples, in
rounds of fresh random seeds, against one in-process gateway over a real chDB store, a responder
on loopback and a job socket. This process's RSS is read before and after each target: a target
that leaks grows it by far more than the allocator's wander.

Run: ``.venv/bin/python bench/fuzz.py [--quick] [--seconds S] [--target NAME ...]``; progress on
stderr, one JSON object last on stdout: ``{"bench": "fuzz", "failures": …, "examples": {…}, …}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the strategies and oracles live with the tests

from hypothesis import HealthCheck, given, settings  # noqa: E402 - after the path is set
from hypothesis import strategies as st  # noqa: E402

from ridethrough.exporters.signals import Signal  # noqa: E402
from ridethrough.exporters.store import Store  # noqa: E402
from tests.test_fuzz import (  # noqa: E402
    STRATEGIES,
    JobOracle,
    OtlpOracle,
    ResponderOracle,
    job_datagrams,
    probe_datagrams,
    raw_requests,
)
from tests.test_ingest_auth import serving  # noqa: E402

ROUND = settings(max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck))
TARGETS = ("otlp-metrics", "otlp-traces", "otlp-logs", "otlp-raw", "responder", "job")


def log(message: str) -> None:
    """One progress line on stderr."""
    print(f"[fuzz {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def rss_mb(key: str = "VmRSS") -> float:
    """This process's resident set (or ``VmHWM``, its peak), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def fuzz(strategy: st.SearchStrategy[Any], check: Callable[[Any], None], seconds: float) -> tuple[int, str | None]:
    """Rounds of ``check`` on examples of ``strategy`` until ``seconds`` pass; (examples, first failure)."""
    examples = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        @ROUND
        @given(example=strategy)
        def one(example: Any) -> None:
            nonlocal examples
            examples += 1
            check(example)
        try:
            one()
        except Exception as exc:  # hypothesis re-raises the shrunk failure: report it and stop this target
            return examples, f"{type(exc).__name__}: {exc}"[:4000]
    return examples, None


Target = tuple[st.SearchStrategy[Any], Callable[[Any], None]]


def targets(stack: ExitStack, store: Store, tmp: Path) -> dict[str, Target]:
    """Each target's strategy and check, its servers entered on ``stack``."""
    gw = stack.enter_context(serving(store, tmp / "spool"))
    otlp = OtlpOracle(gw.target, store)
    responder = stack.enter_context(ResponderOracle())
    job = stack.enter_context(JobOracle())
    out: dict[str, Target] = {}
    for signal in Signal:
        service = f"bench-fuzz-{signal.name.lower()}"
        out[f"otlp-{signal.name.lower()}"] = (
            STRATEGIES[signal](service), lambda request, s=signal, svc=service: otlp.request(s, request, svc))
    out["otlp-raw"] = (raw_requests(), lambda case: otlp.raw(*case))
    out["responder"] = (probe_datagrams(), responder.check)
    out["job"] = (job_datagrams(), job.check)
    return out


def run(names: list[str], seconds: float) -> dict[str, Any]:
    """Every named target for ``seconds``; the report."""
    examples: dict[str, int] = {}
    failures: dict[str, str] = {}
    growth: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="rt-bench-fuzz-") as tmp, ExitStack() as stack:
        store = Store(f"chdb://{tmp}/store")
        store.init_schema()
        stack.callback(store.close)
        made = targets(stack, store, Path(tmp))
        for name in names:
            strategy, check = made[name]
            before = rss_mb()
            examples[name], failure = fuzz(strategy, check, seconds)
            growth[name] = round(rss_mb() - before, 1)
            if failure:
                failures[name] = failure
            log(f"{name}: {examples[name]} examples, RSS {growth[name]:+.1f} MiB"
                + (f", FAILED: {failure.splitlines()[0]}" if failure else ""))
    return {"bench": "fuzz", "failures": len(failures), "examples": examples, "peak_rss_mb": round(rss_mb("VmHWM"), 1),
            "rss_growth_mb": growth, "seconds_per_target": seconds, "failure_details": failures}


def main(argv: list[str] | None = None) -> int:
    """Fuzz; exit 1 when any target failed."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="6 s per target (under a minute in all).")
    ap.add_argument("--seconds", type=float, help="Seconds per target (default 300; --quick: 6).")
    ap.add_argument("--target", action="append", choices=TARGETS, help="Only these targets (repeat).")
    args = ap.parse_args(argv)
    seconds = args.seconds or (6.0 if args.quick else 300.0)
    # the targets log each kind of drop at 1, 10, 100, ...: errors only, so progress stays readable
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    result = run(args.target or list(TARGETS), seconds)
    print(json.dumps(result), flush=True)
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
