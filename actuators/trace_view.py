"""``ridethrough trace INCIDENT_ID``: an incident's trace from ``otel_traces``, printed as a tree.

    incident 3f2a… link_down:link:h3-leaf1r0, trace 9c1d… (6 spans over 2.104 s)
    incident           +0.000 s        0.0 ms  Error  incident.transition=opened incident.kind=link_down …
      action.decide    +2.001 s        1.2 ms  Ok     entity.name=h3-leaf1r0 action.plugin=reroute …
      action.apply     +2.003 s       80.4 ms  Ok     action.plugin=reroute result.detail=rerouted
        action.step    +2.004 s       40.1 ms  Ok     step.name=drain h3
          agent.rpc    +2.010 s       30.2 ms  Ok     [ridethrough-agent]

Spans from other services (an agent called with the step's ``traceparent``) hang under the
step that called them. A span whose parent is not in the store is shown at the top level.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from ridethrough.detectors.incident_events import SERVICE
from ridethrough.exporters.store import Store, StoreError, StoreUnavailable

KEY_ATTRIBUTES = ("incident.transition", "incident.kind", "entity.name", "action.plugin", "action.status",
                  "action.reason", "approval.verdict", "approval.by", "step.name", "result.detail")
"""The attributes a tree line shows, in this order, when a span has them."""
_MAX_VALUE = 80

_INCIDENT = """
SELECT argMax(TraceId, Version), argMax(Key, Version) FROM incidents
WHERE IncidentId = {incident_id:String} GROUP BY IncidentId
"""
# The trace's time range from the trace-id index narrows the scan (as the upstream Grafana
# plugin does); without an index row the whole table is searched by the TraceId bloom filter.
_SPANS = """
WITH (SELECT (min(Start), max(End), count()) FROM otel_traces_trace_id_ts WHERE TraceId = {trace_id:String})
     AS bounds
SELECT SpanId, ParentSpanId, SpanName, ServiceName, toUnixTimestamp64Nano(Timestamp), Duration, StatusCode,
       StatusMessage, SpanAttributes
FROM otel_traces
WHERE TraceId = {trace_id:String}
  AND (bounds.3 = 0 OR (Timestamp >= bounds.1 AND toDateTime(Timestamp) <= bounds.2))
ORDER BY Timestamp, SpanId
"""


class TraceNotFound(LookupError):
    """No incident with that id, or its trace has no spans in the store."""


@dataclass(frozen=True, slots=True)
class SpanRow:
    """One span of a trace as the tree shows it."""

    span_id: str
    parent_span_id: str
    name: str
    service: str
    start_ns: int
    duration_ns: int
    status: str
    message: str
    attributes: Mapping[str, str]


def load_trace(store: Store, incident_id: str, *,
               settings: dict[str, Any] | None = None) -> tuple[str, str, list[SpanRow]]:
    """The incident's (trace id, key, spans in start order); `TraceNotFound` if there is none."""
    _, found = store.query(_INCIDENT, parameters={"incident_id": incident_id}, settings=settings)
    if not found:
        raise TraceNotFound(f"no incident {incident_id!r} in the store")
    trace_id, key = found[0]
    _, rows = store.query(_SPANS, parameters={"trace_id": trace_id}, settings=settings)
    if not rows:
        raise TraceNotFound(f"incident {incident_id} ({key}): no spans of trace {trace_id} in otel_traces")
    spans = [SpanRow(r[0], r[1], r[2], r[3], int(r[4]), int(r[5]), r[6], r[7], dict(r[8])) for r in rows]
    return trace_id, key, spans


def _tree(spans: Sequence[SpanRow]) -> list[tuple[int, SpanRow]]:
    """(depth, span) in display order: each span after its parent, siblings by start time."""
    ids = {s.span_id for s in spans}
    children: dict[str, list[SpanRow]] = {}
    tops: list[SpanRow] = []
    for s in spans:
        if s.parent_span_id and s.parent_span_id in ids and s.parent_span_id != s.span_id:
            children.setdefault(s.parent_span_id, []).append(s)
        else:
            tops.append(s)
    out: list[tuple[int, SpanRow]] = []
    seen: set[str] = set()

    def walk(span: SpanRow, depth: int) -> None:
        if span.span_id in seen:  # a duplicated or cyclic id: print it once
            return
        seen.add(span.span_id)
        out.append((depth, span))
        for child in children.get(span.span_id, []):
            walk(child, depth + 1)

    for top in tops:
        walk(top, 0)
    return out


def _describe(span: SpanRow) -> str:
    parts = []
    if span.service and span.service != SERVICE:
        parts.append(f"[{span.service}]")
    for key in KEY_ATTRIBUTES:
        value = span.attributes.get(key, "")
        if value:
            parts.append(f"{key}={value if len(value) <= _MAX_VALUE else value[:_MAX_VALUE - 1] + '…'}")
    if span.status == "Error" and span.message and span.message not in span.attributes.values():
        parts.append(f"error={span.message}")
    return " ".join(parts)


def render(trace_id: str, key: str, incident_id: str, spans: Sequence[SpanRow]) -> str:
    """The tree as text: indentation for depth, offset from the trace's start, duration, status, attributes."""
    start = min(s.start_ns for s in spans)
    end = max(s.start_ns + s.duration_ns for s in spans)
    ids = {s.span_id for s in spans}
    lines = [f"incident {incident_id} {key}, trace {trace_id} ({len(spans)} spans over {(end - start) / 1e9:.3f} s)"]
    rows = _tree(spans)
    width = max(2 * depth + len(s.name) for depth, s in rows)
    for depth, s in rows:
        label = ("  " * depth + s.name).ljust(width)
        orphan = "  (parent not in store)" if s.parent_span_id and s.parent_span_id not in ids else ""
        offset = f"+{(s.start_ns - start) / 1e9:.3f}"
        lines.append(f"{label}  {offset:>9} s  {s.duration_ns / 1e6:9.1f} ms  "
                     f"{s.status:<5}  {_describe(s)}{orphan}".rstrip())
    return "\n".join(lines) + "\n"


def show(store: Store, incident_id: str) -> str:
    """The incident's trace, rendered (read-only: an embedded store is queried with ``readonly=2``)."""
    settings = {"readonly": 2} if store.embedded else None
    trace_id, key, spans = load_trace(store, incident_id, settings=settings)
    return render(trace_id, key, incident_id, spans)


def trace_command(
    incident_id: Annotated[str, typer.Argument(help="The incident's id (IncidentId in the incidents table).")],
    store: Annotated[str | None, typer.Option("--store", help="ClickHouse DSN: chdb://PATH or http(s)://...")] = None,
    config: Annotated[Path | None, typer.Option("--config", help="YAML file with one section per component.")] = None,
) -> None:
    """Print an incident's trace as a tree: detection, decisions, actions and their steps."""
    from ridethrough.config import ConfigError
    from ridethrough.settings import load_component

    try:
        cfg = load_component("gateway", file=config, env=os.environ, flags={"store": store}).config
    except ConfigError as exc:
        typer.echo(f"ridethrough: config error: {exc}", err=True)
        raise typer.Exit(2) from exc
    target = Store(cfg.store)
    try:
        typer.echo(show(target, incident_id), nl=False)
    except (TraceNotFound, StoreUnavailable, StoreError) as exc:
        typer.echo(f"ridethrough: {exc}", err=True)
        raise typer.Exit(1) from exc
    finally:
        target.close()
