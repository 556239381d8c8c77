"""The demo's story, act by act: each injects a real fault in the lab and reports what the store says happened.

The job runs on h0 and h1 (rack 0) and h4 and h5 (rack 1), one rank each, so every step crosses the
spines; its hot spares wait on h1. Each act ends by undoing its fault, whatever came of it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from ridethrough import demo_checks as checks
from ridethrough.demo_act_base import ActResult, Context, job_before, report_incident, report_job, watch
from ridethrough.demo_job import JOB_ID
from ridethrough.lab.control import GpuFault, LabError

JOB_HOSTS = ("h0", "h1", "h4", "h5")
SPARE_HOST = "h1"
SPINE_LINK = "leaf0r0-spine0"
"""Act 1: a rack-0 leaf's uplink to a spine; half the job's cross-rack traffic hashes onto it."""
SPINE_LOSS_PERCENT = 10.0
"""Act 1: the share of packets the failing optic drops each way (a rate cap alone is not seen without heavy load)."""
CUT_LINK, CUT_HOST = "h4-leaf1r0", "h4"
"""Act 2: h4's rail-0 cable; the reflex moves h4's peers onto rail 1."""
GPU_HOST, GPU_INDEX = "h4", 0
"""Act 3: the GPU of rank 2 (node 2, local rank 0)."""
FROZEN_HOST = "h5"
"""Act 4: rank 3's host."""
CLOCK_HOST = "h3"
REFLEX_BUDGET_MS = 100.0


@dataclass(frozen=True, slots=True)
class Act:
    """One act: its number, key (as the run record names it), title, whether it needs the fabric, how it runs."""

    number: int
    key: str
    title: str
    needs_fabric: bool
    run: Callable[[Context, ActResult], None]
    max_s: float = 60.0


def spine_degrades(ctx: Context, res: ActResult) -> None:
    """(1) A spine link degrades (a failing optic drops packets at random): predicted and localised; traffic
    moves off it; the job does not notice."""
    before, since = job_before(ctx), time.time_ns()
    kinds = ("link_degrading", "congestion", "link_down", "link_flap")
    ctx.stack.lab.lose_packets(SPINE_LINK, percent=SPINE_LOSS_PERCENT)
    try:
        seen = watch(ctx, since_ns=since, kinds=kinds, entities=(SPINE_LINK,), what=f"{SPINE_LINK} degraded")
    finally:
        ctx.stack.lab.restore_link(SPINE_LINK)
    report_incident(res, ctx, seen, since_ns=since, want_entity=SPINE_LINK, kinds=kinds)
    # Traffic moving off the link is the reroute plugin's drain at the leaves; its absence is said above.
    drained = [a for a in seen.actions if a.plugin == "reroute" and a.status == "succeeded"]
    res.facts["drained"] = bool(drained)
    if drained:
        verified = drained[0].detail.rpartition("verify: ")[2]  # the detail runs apply: ...; verify: ...
        res.add("ok", f"traffic moved off the link: {drained[0].summary}; {verified[:240]}")
    report_job(res, ctx, before)


def link_cut(ctx: Context, res: ActResult) -> None:
    """(2) A link is cut outright: the agents' reflex moves traffic within 100 ms."""
    before, since = job_before(ctx), time.time_ns()
    kinds = ("link_down", "link_flap")
    ctx.stack.lab.set_link(CUT_LINK, up=False)
    try:
        seen = watch(ctx, since_ns=since, kinds=kinds, entities=(CUT_LINK, f"{CUT_HOST}/mlx5_0", f"{CUT_HOST}/nic0"),
                     what=f"{CUT_LINK} cut",
                     until=lambda s: s.settled and bool(_reroutes(ctx, since)))
    finally:
        ctx.stack.lab.set_link(CUT_LINK, up=True)
    reroutes = _reroutes(ctx, since)
    res.facts["reflex"] = [{"node": e.node, "peer": e.peer, "evidence_ms": e.evidence_ms, "apply_ms": e.apply_ms}
                           for e in reroutes]
    if reroutes:
        fastest = min(reroutes, key=lambda e: e.evidence_ms + e.apply_ms)
        total = fastest.evidence_ms + fastest.apply_ms
        res.facts["reroute_ms"] = total
        res.add("ok" if total <= REFLEX_BUDGET_MS else "fail",
                f"reflex on {fastest.node} rerouted {fastest.peer} in {total:.1f} ms (first failed probe "
                f"{fastest.evidence_ms:.1f} ms + apply {fastest.apply_ms:.1f} ms; budget {REFLEX_BUDGET_MS:g} ms); "
                f"{len(reroutes)} reroute(s)")
    else:
        res.add("missing", "no reflex reroute recorded (reflex.reroute events in otel_logs)")
    report_incident(res, ctx, seen, since_ns=since, want_entity=CUT_LINK, kinds=kinds)
    report_job(res, ctx, before)


def _reroutes(ctx: Context, since_ns: int) -> list[checks.ReflexEvent]:
    # the cut host's own reroutes, and its peers' reroutes of traffic to it
    return [e for e in checks.reflex_events(ctx.stack.store, since_ns=since_ns)
            if e.name == "reflex.reroute" and CUT_HOST in (e.node, e.peer)]


def gpu_ecc(ctx: Context, res: ActResult) -> None:
    """(3) A GPU throws single-bit ECC errors and remaps rows: predicted; its rank migrates to a spare."""
    before, since = job_before(ctx), time.time_ns()
    kinds = ("gpu_failing", "gpu_failed")
    entity = f"{GPU_HOST}/gpu{GPU_INDEX}"
    lab = ctx.stack.lab
    lab.gpu_fault(GPU_HOST, GPU_INDEX, GpuFault.ECC_SBE_RISING, {"rate_per_s": 20.0})
    try:
        lab.gpu_fault(GPU_HOST, GPU_INDEX, GpuFault.ROW_REMAP_PENDING, {"rows": 2, "rate_per_s": 0.2})
        seen = watch(ctx, since_ns=since, kinds=kinds, entities=(entity,), what=f"{entity} ECC errors")
    finally:
        lab.clear_gpu(GPU_HOST, GPU_INDEX)
    report_incident(res, ctx, seen, since_ns=since, want_entity=entity, kinds=kinds)
    res.facts["predicted"] = seen.incident is not None and seen.incident.kind == "gpu_failing"
    report_job(res, ctx, before)


def host_freeze(ctx: Context, res: ActResult) -> None:
    """(4) A host freezes: it falls silent; the spare takes its rank over from a peer's state."""
    before, since = job_before(ctx), time.time_ns()
    kinds = ("agent_silent", "straggler")
    ctx.stack.lab.freeze_host(FROZEN_HOST)
    try:
        seen = watch(ctx, since_ns=since, kinds=kinds, entities=(FROZEN_HOST,), what=f"{FROZEN_HOST} frozen")
        # the job's launchers notice a silent node by its heartbeat: give the job the rest of the act
        while ctx.left_s() > 6 and ctx.job is not None and before is not None:
            now = checks.job_progress(ctx.stack.store, JOB_ID)
            ctx.status(f"{FROZEN_HOST} frozen: job at step {now.last_step} (was {before.last_step})")
            if now.last_step > before.last_step + 5 or not ctx.wait(2.0):
                break
    finally:
        ctx.stack.lab.thaw_host(FROZEN_HOST)
    report_incident(res, ctx, seen, since_ns=since, want_entity=FROZEN_HOST, kinds=kinds)
    report_job(res, ctx, before)


def clock_step(ctx: Context, res: ActResult) -> None:
    """A host's clock jumps: the clock service and detectors tell it from a fabric fault."""
    since = time.time_ns()
    kinds = ("clock_jump", "clock_unsynced")
    ctx.stack.lab.step_clock(CLOCK_HOST, step_ns=50_000_000)
    try:
        seen = watch(ctx, since_ns=since, kinds=kinds, entities=(CLOCK_HOST,), what=f"{CLOCK_HOST} clock +50 ms",
                     until=lambda s: s.incident is not None)
    finally:
        with contextlib.suppress(LabError):
            ctx.stack.lab.step_clock(CLOCK_HOST, step_ns=-50_000_000)
    report_incident(res, ctx, seen, since_ns=since, want_entity=CLOCK_HOST, kinds=kinds)


def page(ctx: Context, res: ActResult) -> None:
    """(5) The story's incidents page a local PagerDuty-contract sink, and the pages resolve."""
    sink = ctx.stack.sink
    while True:
        pages = sink.pages()
        resolved = [p for p in pages if p.resolved_at]
        ctx.status(f"pages: {len(pages)} triggered, {len(resolved)} resolved, {len(sink.changes())} change events")
        if (resolved and len(resolved) == len(pages)) or not ctx.wait(1.0) or ctx.left_s() <= 0:
            break
    res.facts["pages"] = [{"dedup_key": p.dedup_key, "summary": p.summary, "severity": p.severity,
                           "resolved": bool(p.resolved_at)} for p in pages]
    res.facts["changes"] = len(sink.changes())
    res.facts["rejected"] = sink.rejected
    if not pages:
        res.add("missing", "no page reached the sink (no incident was paged)")
    for p in pages[:6]:
        res.add("ok" if p.resolved_at else "info",
                f"page [{p.severity}] {p.summary[:90]}: {'resolved' if p.resolved_at else 'still open'}")
    res.add("ok" if resolved else "missing", f"{len(resolved)} of {len(pages)} page(s) resolved")
    res.add("info", f"{len(sink.changes())} change event(s) for actions taken")
    if sink.rejected:
        res.add("fail", f"{sink.rejected} event(s) broke the Events API v2 contract (see {sink.record_file})")


STORY: tuple[Act, ...] = (
    # prediction takes 20-40 s, the drain's verify waits for fresh probes on every pair that crossed the link
    Act(1, "spine", "a spine link degrades", True, spine_degrades, max_s=90.0),
    Act(2, "cut", "a link is cut", True, link_cut, max_s=45.0),
    Act(3, "gpu", "a GPU's memory starts failing", False, gpu_ecc),
    # the silence detector waits 30 s without data before it calls an agent silent
    Act(4, "freeze", "a host freezes", True, host_freeze, max_s=75.0),
    Act(5, "page", "pages go out and resolve", False, page, max_s=45.0),
)
LOOPBACK_STORY: tuple[Act, ...] = (
    Act(3, "gpu", "a GPU's memory starts failing", False, gpu_ecc),
    Act(4, "clock", "a host's clock jumps", False, clock_step, max_s=45.0),
    Act(5, "page", "pages go out and resolve", False, page, max_s=45.0),
)
