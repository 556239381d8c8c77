"""A short compute burn for the audit's GPU phase: every GPU multiplies matrices for a few seconds.

A GPU passes when every product is finite and equal (within rounding) to its first one: a GPU
with failing memory or a marginal SM gives wrong or non-finite numbers under load long before
it falls off the bus. Its rate (TFLOP/s) goes in the result, for comparing GPUs across a fleet.
Run it where the GPUs are (a driver runs it on each host, as the lab driver runs its traffic
endpoints)::

    python -m ridethrough.audit_gpu --seconds 5
    {"gpus": {"0": {"ok": true, "tflops": 612.4, "iterations": 7301}}}

With no CUDA GPU it says so (``skipped``) rather than burning the CPU; ``--device cpu`` burns the
CPU on purpose (tests do). torch is imported only when a burn runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any


def _burn_one(torch: Any, device: str, seconds: float, size: int) -> dict[str, Any]:
    dtype = torch.float32
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(size, size, generator=gen, dtype=dtype).to(device)
    b = torch.randn(size, size, generator=gen, dtype=dtype).to(device)
    ref = a @ b
    iterations, deadline, started = 0, time.monotonic() + seconds, time.monotonic()
    worst = 0.0
    while time.monotonic() < deadline:
        c = a @ b
        iterations += 1
        if iterations % 8 == 0 or time.monotonic() >= deadline:  # compare now and then: a sync costs time
            if not bool(torch.isfinite(c).all()):
                return {"ok": False, "error": "non-finite results", "iterations": iterations}
            worst = max(worst, float((c - ref).abs().max()))
            if worst > 1e-3 * float(ref.abs().max()):
                return {"ok": False, "error": f"results differ from the first by {worst:g}", "iterations": iterations}
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    elapsed = time.monotonic() - started
    tflops = 2 * size**3 * (iterations + 1) / elapsed / 1e12
    return {"ok": True, "iterations": iterations, "tflops": float(f"{tflops:.4g}"), "max_abs_diff": worst}


def burn(seconds: float = 5.0, *, device: str | None = None, size: int = 4096) -> dict[str, Any]:
    """Burn every CUDA GPU (or just ``device``) for ``seconds``; ``{"gpus": {index: {"ok": ...}}}``."""
    try:
        import torch
    except ImportError:
        return {"skipped": "torch is not installed", "gpus": {}}
    if device is not None:
        devices = {device.rpartition(":")[2] if ":" in device else "0": device}
    elif torch.cuda.is_available():
        devices = {str(i): f"cuda:{i}" for i in range(torch.cuda.device_count())}
    else:
        return {"skipped": "no CUDA GPU here (torch.cuda.is_available() is False)", "gpus": {}}
    out: dict[str, Any] = {}
    for index, dev in devices.items():
        try:
            out[index] = _burn_one(torch, dev, seconds, size)
        except RuntimeError as exc:  # an XID, out of memory, a lost GPU: that GPU fails, the burn goes on
            out[index] = {"ok": False, "error": str(exc).splitlines()[0][:300]}
    return {"gpus": out}


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: one JSON line."""
    p = argparse.ArgumentParser(prog="ridethrough.audit_gpu")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--device", default=None, help="One device (cuda:1, cpu); default: every CUDA GPU.")
    p.add_argument("--size", type=int, default=4096)
    a = p.parse_args(argv)
    print(json.dumps(burn(a.seconds, device=a.device, size=a.size)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
