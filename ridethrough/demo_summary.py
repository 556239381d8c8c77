"""The demo's closing numbers: the job's goodput from the store, and the story at scale under both policies.

The second part runs the goodput simulator (`ridethrough goodput simulate`) on Llama 3's failure
table, checkpoint-restart against ridethrough, with the costs this run measured where it measured
them (the reflex's reroute time, the job's stall while a rank moved); the others keep the
simulator's defaults, and the table says which is which.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from ridethrough.dashboards.goodput_sql import GoodputError, Period, job_goodput
from ridethrough.demo_act_base import ActResult
from ridethrough.demo_job import CUSTOMER, JOB_ID
from ridethrough.demo_view import View
from ridethrough.exporters.store import Store, StoreError, StoreUnavailable

SIM_REPLICATIONS = 50


def job_summary(store: Store, *, started_ns: int) -> dict[str, Any] | None:
    """The job's goodput since ``started_ns`` (None when the store has no step of it)."""
    try:
        rows = job_goodput(store, customer=CUSTOMER, periods=[Period(started_ns, time.time_ns())], job=JOB_ID)
    except (GoodputError, StoreError, StoreUnavailable):
        return None
    return rows[0].as_dict() if rows else None


def measured_costs(results: Sequence[ActResult]) -> dict[str, float]:
    """Ridethrough policy costs this run measured (seconds), by the simulator's parameter names."""
    costs: dict[str, float] = {}
    for res in results:
        if res.key == "cut" and "reroute_ms" in res.facts:
            costs["reroute_pause_s"] = float(res.facts["reroute_ms"]) / 1000.0
        migrated = any(a["plugin"] == "migrate" and a["status"] == "succeeded" for a in res.facts.get("actions", []))
        if res.key == "gpu" and migrated:
            apply_s = next(a["timings"].get("apply_s") for a in res.facts["actions"] if a["plugin"] == "migrate")
            if apply_s is not None:
                costs["migrate_predicted_s"] = float(apply_s)
    return costs


def simulate(costs: dict[str, float]) -> dict[str, Any]:
    """Checkpoint-restart vs ridethrough on the Llama 3 failure table, with ``costs`` set."""
    from ridethrough.dashboards import goodput_sim

    # Any: the policy also has non-float fields; only its float costs are set here
    given: dict[str, Any] = dict(costs)
    policy = dataclasses.replace(goodput_sim.Ridethrough(), **given)
    result: dict[str, Any] = goodput_sim.simulate(goodput_sim.load_rates(), replications=SIM_REPLICATIONS,
                                                  ridethrough=policy)
    return result


def show(view: View, store: Store, results: Sequence[ActResult], *, started_ns: int) -> dict[str, Any]:
    """Print both summaries; return them for the run record."""
    job = job_summary(store, started_ns=started_ns)
    if job is None:
        view.say("[yellow]goodput: no step of the job reached the store[/]")
    else:
        view.table(f"goodput of {JOB_ID} (from the store)", ("allocated GPU-s", "productive GPU-s", "goodput",
                                                              "steps", "steps rolled back"),
                   [(f"{job['allocated_s']:.0f}", f"{job['productive_s']:.0f}", f"{100 * job['goodput']:.1f}%",
                     str(job["steps"]), str(job["steps_rolled_back"]))])
    costs = measured_costs(results)
    sim = simulate(costs)
    rows = []
    for name, policy in sim["policies"].items():
        rows.append((str(name), f"{100 * policy['goodput_loss']:.2f}%", f"{policy['gpu_hours_lost']:,.0f}"))
    view.table(f"the same failures at scale: {sim['gpus']} GPUs, {sim['days']:g} days, "
               f"{sim['interruptions']:.0f} interruptions (simulated)", ("policy", "goodput lost", "GPU-hours lost"),
               rows)
    measured = ", ".join(f"{k}={v:.3g}" for k, v in costs.items()) or "none (the simulator's defaults throughout)"
    view.say(f"  costs measured in this run: {measured}")
    view.say(f"  ridethrough saves {100 * sim['goodput_loss_saved']['mean']:.2f} points of goodput")
    return {"job": job, "measured_costs": costs, "simulation": {
        k: sim["policies"][k]["goodput_loss"] for k in sim["policies"]}}
