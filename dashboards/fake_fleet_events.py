"""The generated fleet's events: job step reports (goodput), and its incidents with their actions and traces.

Job reports are generated in SQL with the job source's attribute layout (``otel_logs``, as
``ridethrough.dashboards.goodput_sql`` reads them). Incidents, actions and spans are built with
the controller's and the runner's own types (`Incident`, `ActionRecord`, `ActionTrace`) and
written through their own write paths, so they read back exactly as real ones do.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ridethrough.actuators.actions import ActionLog, ActionRecord, Status, ensure_actions_table
from ridethrough.actuators.tracing import ActionTrace, SpanData, SpanWriter, action_attributes
from ridethrough.detectors.contract import Severity
from ridethrough.detectors.fabric_map import RouteMap
from ridethrough.detectors.incident_events import IncidentEmitter
from ridethrough.detectors.incidents import (
    INCIDENTS,
    Incident,
    State,
    Transition,
    TransitionKind,
    ensure_incidents_table,
)
from ridethrough.exporters.gateway_metrics import GatewayMetrics
from ridethrough.exporters.store import Store

if TYPE_CHECKING:
    from ridethrough.dashboards.fake_fleet import FleetSpec

S_NS = 1_000_000_000
_RES = ("map('service.name', 'ridethrough-agent', 'host.name', host, 'ridethrough.node.id', host, "
        "'ridethrough.cluster', {cluster:String})")
_STEPS = f"""
INSERT INTO otel_logs (Timestamp, ServiceName, SeverityText, SeverityNumber, Body, ResourceAttributes, ScopeName,
                       LogAttributes)
SELECT fromUnixTimestamp64Nano(e), 'ridethrough-agent', 'INFO', 9, 'job.step', {_RES}, 'ridethrough.job',
       map('event.name', 'job.step', 'job.id', {{job:String}}, 'job.customer', {{customer:String}},
           'job.world_size', toString({{world:UInt32}}), 'job.rank', toString(r), 'job.step', toString(step),
           'job.step.start_ns', toString(a), 'job.step.end_ns', toString(e), 'job.step.duration_s',
           toString((e - a) / 1e9), 'job.tokens', '16384', 'job.samples', '8', 'job.phase.checkpoint_s',
           if(step % 10 = 0, '6.0', '0.0'), 'job.phase.wait_s', toString(round(0.5 + 4 * u, 3)))
FROM (
    SELECT number % {{world:UInt32}} AS r, intDiv(number, {{world:UInt32}}) AS i,
           {{first:UInt32}} + intDiv(r, {{gpus:UInt32}}) AS h, concat('h', toString(h)) AS host,
           {{start:Int64}} + toInt64(i) * {{step_ns:Int64}} + if(i >= {{i_fail:Int64}}, {{restart_ns:Int64}}, 0) AS a,
           a + {{step_ns:Int64}} - toInt64(2e8 * (cityHash64(r, i) % 100) / 100) AS e,
           if(i >= {{i_fail:Int64}}, i + 1 - ({{i_fail:Int64}} - {{ckpt:Int64}}), i + 1) AS step,
           (cityHash64(r, i, {{seed:UInt32}}) % 1000) / 1000.0 AS u
    FROM numbers({{rows:UInt64}})
)
WHERE e <= {{end:Int64}} AND NOT (h = {{silent:UInt32}} AND e >= {{silent_at:Int64}})
"""
_LIFECYCLE = f"""
INSERT INTO otel_logs (Timestamp, ServiceName, SeverityText, SeverityNumber, Body, ResourceAttributes, ScopeName,
                       LogAttributes)
SELECT fromUnixTimestamp64Nano({{at:Int64}}), 'ridethrough-agent', 'INFO', 9, {{event:String}}, {_RES},
       'ridethrough.job', mapConcat(map('event.name', {{event:String}}, 'job.id', {{job:String}},
           'job.customer', {{customer:String}}, 'job.world_size', toString({{world:UInt32}}), 'job.rank', toString(r),
           'job.time_ns', toString({{at:Int64}})), if({{reason:String}} = '', map(), map('job.end.reason',
           {{reason:String}})))
FROM (SELECT number AS r, concat('h', toString({{first:UInt32}} + intDiv(r, {{gpus:UInt32}}))) AS host
      FROM numbers({{world:UInt32}}))
"""
_NEVER = 1 << 62


def jobs(spec: FleetSpec, roles: Mapping[str, int]) -> list[dict[str, Any]]:
    """The generated jobs: customer, job id, first host and hosts; the one on the failing GPU restarts."""
    n1, n2 = max(1, spec.hosts // 8), max(1, spec.hosts // 16)
    failed = roles["gpu_failed"]
    return [{"customer": "acme", "job": "llama-70b-pretrain", "first": 0, "hosts": n1, "fails": False},
            {"customer": "acme", "job": "llama-8b-sft", "first": failed, "hosts": n2, "fails": True},
            {"customer": "globex", "job": "vit-finetune", "first": failed + n2, "hosts": 1, "fails": False}]


def write_jobs(store: Store, spec: FleetSpec, bound: Mapping[str, Any], *, end_ns: int) -> int:
    """Every job's step reports and lifecycle events; returns the rows asked for."""
    step_ns = round(spec.step_s * S_NS)
    runs = int((end_ns - bound["start"]) // step_ns)
    total = 0
    for job in jobs(spec, bound):
        world = job["hosts"] * spec.gpus
        i_fail = (bound["failed_at"] - bound["start"]) // step_ns if job["fails"] else _NEVER
        p = {**bound, **job, "world": world, "step_ns": step_ns, "i_fail": i_fail, "ckpt": (i_fail // 10) * 10,
             "restart_ns": 10 * 60 * S_NS, "rows": world * runs, "end": end_ns}
        events = [("job.started", bound["start"], "")]
        if job["fails"]:
            events += [("job.ended", bound["failed_at"], "failed"),
                       ("job.started", bound["start"] + i_fail * step_ns + 10 * 60 * S_NS, "")]
        with store.lock:
            store.client().command(_STEPS, parameters=p)
            for event, at, reason in events:
                store.client().command(_LIFECYCLE, parameters={**p, "event": event, "at": at, "reason": reason})
        total += world * (runs + len(events))
    return total


# --- incidents, actions, traces ---------------------------------------------------------------------

def _incident(kind: str, etype: str, entity: str, severity: Severity, opened: int, resolved: int, summary: str,
              cluster: str) -> list[Incident]:
    """Version 1 (opened) and, when ``resolved``, version 2."""
    iid = hashlib.sha256(f"fake:{cluster}:{kind}:{entity}:{opened}".encode()).hexdigest()[:32]
    evidence = json.dumps({"detector": kind, "confidence": 0.9, "observed_at_ns": opened, "time_to_failure_s": None,
                           "evidence": {"entity": entity, "summary": summary}}, sort_keys=True)
    first = Incident(iid, f"{kind}:{etype}:{entity}", kind, etype, entity, cluster, kind, severity, State.OPEN, opened,
                     opened, 0, opened, 1, 0, summary, evidence, hashlib.sha256(iid.encode()).hexdigest()[:32], 1)
    if not resolved:
        return [first]
    return [first, Incident(iid, first.key, kind, etype, entity, cluster, kind, severity, State.RESOLVED, opened,
                            resolved, resolved, resolved - 30 * S_NS, 12, 0, summary, first.evidence,
                            first.trace_id, 2)]


def _specs(spec: FleetSpec, fmap: RouteMap, b: Mapping[str, Any], end_ns: int) -> dict[str, list[Incident]]:
    def link(host: int, nic: int) -> str:
        return fmap.link_of(f"h{host}/nic{nic}") or f"h{host}/nic{nic}"

    c, m = spec.cluster, 60 * S_NS
    dst = max(1, b["hot_rack"] * b["rack"])  # probed by the host before it (the first peer offset is 1)
    return {
        "gpu_failing": _incident("gpu_failing", "gpu", f"h{b['gpu_failing']}/gpu2", Severity.WARNING,
                                 b["failing_at"] + 4 * 3600 * S_NS, 0, "ECC corrected errors rising, XID 63", c),
        "gpu_failed": _incident("gpu_failed", "gpu", f"h{b['gpu_failed']}/gpu5", Severity.CRITICAL,
                                b["failed_at"] + 5 * S_NS, 0, "XID 79: GPU has fallen off the bus", c),
        "link_down": _incident("link_down", "link", link(b["link_down"], 1), Severity.CRITICAL,
                               b["down_from"] + 3 * S_NS, b["down_to"] + m, "port down (was up)", c),
        "link_degrading": _incident("link_degrading", "link", link(b["link_degrading"], 0), Severity.WARNING,
                                    b["degrading_at"] + 60 * m, 0, "receive errors climbing", c),
        "clock_unsynced": _incident("clock_unsynced", "clock", f"h{b['clock']}", Severity.WARNING, b["clock_at"] + m,
                                    0, "clock uncertainty 150 us", c),
        "agent_silent": _incident("agent_silent", "host", f"h{b['silent']}", Severity.ERROR, b["silent_at"] + m, 0,
                                  "agent silent", c),
        "congestion": _incident("congestion", "path", f"h{dst - 1}/nic0->h{dst}/nic0", Severity.WARNING,
                                b["hot_at"] + 5 * m, end_ns - 5 * m, "forward one-way delay up 35 us", c),
    }


def _action(i: Incident, plugin: str, status: Status, steps: Sequence[str], at: int) -> ActionRecord:
    started = at + 5_000_000 if status is Status.SUCCEEDED else 0
    ended = at + (900_000_000 if started else 2_000_000)
    return ActionRecord(hashlib.sha256(f"{i.incident_id}:{plugin}".encode()).hexdigest()[:32],
                        f"plan-{i.incident_id[:12]}", i.incident_id, i.key, i.trace_id, i.cluster, plugin, i.entity,
                        status, "" if status is Status.SUCCEEDED else "dry-run mode", status is Status.DRY_RUN,
                        f"{plugin} {i.entity}", tuple(steps), (), (), {}, "", at, started, ended,
                        {"apply_s": (ended - started) / 1e9} if started else {}, 3)


def _spans(r: ActionRecord) -> list[SpanData]:
    """decide, then (when it ran) apply with one child per step, then verify: times from the record."""
    trace = ActionTrace(trace_id=r.trace_id, action_id=r.action_id, clock=lambda: 0)
    attrs = action_attributes(r)
    out = []

    def span(name: str, a: int, b: int, parent: SpanData | None = None,
             extra: dict[str, str] | None = None) -> SpanData:
        s = trace.start(name, {**attrs, **(extra or {})} if parent is None else extra, parent=parent)
        s.start_ns = a
        s.end(b)
        out.append(s)
        return s

    span("action.decide", r.decided_at_ns, r.decided_at_ns + 2_000_000)
    if r.started_at_ns:
        apply = span("action.apply", r.started_at_ns, r.ended_at_ns - 200_000_000, extra={"result.detail": "applied"})
        width = (apply.end_ns - apply.start_ns) // max(1, len(r.steps))
        for n, name in enumerate(r.steps):
            a = apply.start_ns + n * width
            span("action.step", a + 1_000_000, a + width - 1_000_000, parent=apply, extra={"step.name": name})
        span("action.verify", r.ended_at_ns - 190_000_000, r.ended_at_ns, extra={"result.detail": "verified"})
    return out


def write_incidents(store: Store, spec: FleetSpec, fmap: RouteMap, bound: Mapping[str, Any], *,
                    end_ns: int) -> dict[str, Incident]:
    """The fleet's incidents (every version), their trace spans, and the actions taken on some."""
    ensure_incidents_table(store)
    ensure_actions_table(store)
    made = _specs(spec, fmap, bound, end_ns)
    versions = [i for vs in made.values() for i in vs]
    store.insert_columns(INCIDENTS, [list(c) for c in zip(*(i.row() for i in versions), strict=True)],
                         token=f"fake-incidents:{spec.cluster}:{end_ns}")
    metrics = GatewayMetrics.create()
    emit = IncidentEmitter(store=store, metrics=metrics)
    for vs in made.values():
        emit([Transition(TransitionKind.OPENED if v.version == 1 else TransitionKind.RESOLVED, v, None) for v in vs])
    plans = {"link_down": ("reroute", Status.SUCCEEDED, ("drain rail", "move routes", "check probes")),
             "gpu_failed": ("migrate", Status.SUCCEEDED, ("pause job", "move rank to spare", "resume job")),
             "gpu_failing": ("migrate", Status.DRY_RUN, ("pause job", "move rank to spare", "resume job"))}
    log, writer = ActionLog(store), SpanWriter(store=store, metrics=metrics)
    for kind, (plugin, status, steps) in plans.items():
        record = _action(made[kind][0], plugin, status, steps, made[kind][0].opened_at_ns + 2 * S_NS)
        log.write(record)
        writer.write(_spans(record))
    return {kind: vs[-1] for kind, vs in made.items()}
