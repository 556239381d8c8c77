"""GPU probe: every field NVML can read on this machine's GPUs, and what the GPU source costs.

For each GPU, every per-GPU call of the `NvmlBackend` protocol is made once and printed
with its value (or "not supported" / the NVML error) and how long it took. Then the GPU
source itself runs: ``--ticks`` collections (their time per tick and the samples they
yield, each checked against the catalogue), and the XID watcher is started, left to
listen for ``--listen-s`` seconds and stopped (how long the stop took).

On a machine without an NVIDIA driver it says so and exits 0. ``--script gpus.json``
probes the lab's fake GPUs instead, through the same code. Human-readable lines go to
stdout first; the last line on stdout is one JSON object.
Run: ``.venv/bin/python bench/gpu_probe.py [--quick] [--script PATH]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from ridethrough.catalogue import metric
from ridethrough.collector.nvml import (
    NvmlBackend,
    NvmlError,
    NvmlGpuLost,
    NvmlNotSupported,
    NvmlUnavailable,
    PynvmlBackend,
)
from ridethrough.collector.sample import Event, Sample
from ridethrough.collector.sources.gpu import GpuSource

PER_GPU: tuple[str, ...] = (
    "uuid", "name", "serial", "pci_bus_id", "utilization", "memory", "temperature_c", "power_mw", "sm_clock_mhz",
    "clock_event_reasons", "ecc_errors", "remapped_rows", "retired_pages", "pcie_replay_count", "recovery_action",
    "nvlink_count",
)
"""The per-GPU calls that take only the index; NVLink calls are probed per link."""


def _timed(call: Callable[[], Any]) -> tuple[str, Any, float]:
    """(outcome, value or error text, microseconds): outcome is ok, unsupported, lost or error."""
    started = time.perf_counter()
    try:
        value = call()
        outcome = "ok"
    except NvmlNotSupported as err:
        value, outcome = err.message, "unsupported"
    except NvmlGpuLost as err:
        value, outcome = err.message, "lost"
    except NvmlError as err:
        value, outcome = str(err), "error"
    return outcome, value, (time.perf_counter() - started) * 1e6


def probe_gpu(nvml: NvmlBackend, index: int, timings: dict[str, list[float]]) -> dict[str, str]:
    """Print every field of one GPU; returns call -> outcome."""
    outcomes: dict[str, str] = {}
    for name in PER_GPU:
        outcome, value, micros = _timed(lambda name=name: getattr(nvml, name)(index))
        outcomes[name] = outcome
        timings.setdefault(name, []).append(micros)
        print(f"  gpu{index} {name:<20} {outcome:<11} {micros:8.1f} us  {value}")
    links = int(nvml.nvlink_count(index)) if outcomes["nvlink_count"] == "ok" else 0
    for name in ("nvlink_active", "nvlink_errors"):
        per_link = [_timed(lambda name=name, link=link: getattr(nvml, name)(index, link)) for link in range(links)]
        for link, (outcome, value, micros) in enumerate(per_link):
            timings.setdefault(name, []).append(micros)
            print(f"  gpu{index} {f'{name}[{link}]':<20} {outcome:<11} {micros:8.1f} us  {value}")
        # one outcome per call: ok if any link answers, else the first link's
        outcomes[name] = next((o for o, _, _ in per_link if o == "ok"), per_link[0][0] if per_link else "no links")
    return outcomes


def catalogue_mismatches(samples: list[Sample]) -> list[str]:
    """Samples that do not match their catalogue entry (name, unit, kind, attribute keys)."""
    bad: set[str] = set()
    for s in samples:
        try:
            spec = metric(s.name)
        except KeyError:
            bad.add(f"{s.name}: not catalogued")
            continue
        if (s.unit, s.kind, sorted(s.attributes)) != (spec.unit, spec.kind, sorted(spec.attributes)):
            bad.add(f"{s.name}: unit/kind/attributes differ from the catalogue")
    return sorted(bad)


def run_source(make: Callable[[], NvmlBackend], *, ticks: int, listen_s: float) -> dict[str, Any]:
    """Collect ``ticks`` times, listen for XIDs for ``listen_s``, stop; figures of the run."""
    events: list[Event] = []
    source = GpuSource(make(), interval_s=1.0)
    source.start(emit=events.append)
    times_ms: list[float] = []
    samples: list[Sample] = []
    for _ in range(ticks):
        started = time.perf_counter()
        samples = source.collect(time.time_ns())
        times_ms.append((time.perf_counter() - started) * 1000)
    listen_until = time.monotonic() + listen_s
    while time.monotonic() < listen_until and source.watcher.running:
        time.sleep(min(0.1, max(0.0, listen_until - time.monotonic())))
    watching = source.watcher.running
    started = time.perf_counter()
    source.stop(timeout_s=5)
    stop_ms = (time.perf_counter() - started) * 1000
    for event in events:
        print(f"  event {event.name} [{event.severity}] {event.body}")
    return {
        "collect_ms_p50": round(statistics.median(times_ms), 3), "collect_ms_max": round(max(times_ms), 3),
        "samples_per_collect": len(samples), "series_names": len({s.name for s in samples}),
        "catalogue_mismatches": catalogue_mismatches(samples), "xid_watcher_ran": watching,
        "xid_events": sum(e.name == "gpu.xid" for e in events), "xid_stop_ms": round(stop_ms, 1),
        "source_errors": source.errors_total,
    }


def main(argv: list[str] | None = None) -> int:
    """Probe; always exit 0 unless the probe itself is broken."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer ticks, a shorter XID listen (well under 60 s)")
    parser.add_argument("--script", default="", help="probe the lab's fake GPUs in this gpus.json instead")
    parser.add_argument("--ticks", type=int, default=0, help="collections to time (default 20, quick 5)")
    parser.add_argument("--listen-s", type=float, default=-1, help="seconds to listen for XIDs (default 10, quick 1)")
    args = parser.parse_args(argv)
    ticks = args.ticks or (5 if args.quick else 20)
    listen_s = args.listen_s if args.listen_s >= 0 else (1.0 if args.quick else 10.0)

    def make() -> NvmlBackend:
        if args.script:
            from ridethrough.lab.fake_gpu import FakeNvmlBackend

            return FakeNvmlBackend(args.script)
        return PynvmlBackend()

    result: dict[str, Any] = {"bench": "gpu_probe", "gpus": 0, "backend": "fake" if args.script else "nvml"}
    nvml = make()
    try:
        nvml.init()
    except NvmlUnavailable as err:
        print(f"no GPU: NVML is not available here ({err.message})")
        print(json.dumps({**result, "nvml": False, "reason": err.message}))
        return 0
    try:
        count = nvml.device_count()
        driver = nvml.driver_version()
        print(f"driver {driver}, {count} GPU(s)")
        timings: dict[str, list[float]] = {}
        outcomes = [probe_gpu(nvml, index, timings) for index in range(count)]
    finally:
        nvml.shutdown()
    calls = sorted({call for per_gpu in outcomes for call in per_gpu})
    result.update({
        "nvml": True, "gpus": count, "driver": driver,
        "supported": {c: sum(o.get(c) == "ok" for o in outcomes) for c in calls},
        "unsupported": sorted({c for o in outcomes for c, v in o.items() if v == "unsupported"}),
        "errors": sorted({c for o in outcomes for c, v in o.items() if v in ("error", "lost")}),
        "call_us_p50": {name: round(statistics.median(v), 1) for name, v in sorted(timings.items())},
    })
    print(f"GPU source: {ticks} collections, XIDs for {listen_s:.0f} s")
    result.update(run_source(make, ticks=ticks, listen_s=listen_s))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
