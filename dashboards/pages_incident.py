"""One incident (``/incidents/{id}``, or ``/traces/{trace_id}`` for the incident of that trace): what it is,
the evidence around it, its trace as a waterfall (from ``otel_traces``) and the actions taken on it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go
from dash import Dash, Input, Output, dcc, html
from plotly.subplots import make_subplots

from ridethrough.actuators.trace_view import KEY_ATTRIBUTES, SpanRow, TraceNotFound, load_trace
from ridethrough.dashboards import pages_fabric, pages_gpus, queries, queries_incidents
from ridethrough.dashboards.pages_common import (
    Context,
    empty_figure,
    graph,
    guarded,
    severity_badge,
    status,
    styled,
    table,
    timestamps,
    when,
)
from ridethrough.dashboards.pages_fleet import action_rows
from ridethrough.detectors.incidents import Incident, State

INCIDENT_PATH = "/incidents/"
TRACE_PATH = "/traces/"
TITLE = "Incident"
BEFORE_S = 3600.0
AFTER_S = 900.0
"""The evidence charts cover from this long before the incident opened to this long after it resolved."""
_STATUS_COLOURS = {"Error": "#c62828", "Ok": "#2e7d32"}


def layout(ctx: Context, arg: str) -> html.Div:
    """``arg`` is ``incident:<id>`` or ``trace:<trace id>``."""
    kind, _, ref = arg.partition(":")
    return html.Div([
        html.H2(TITLE), html.Div(id="incident-status"), dcc.Store(id="incident-ref", data={kind: ref}),
        html.Div(id="incident-header"),
        html.H3("Evidence"), graph("incident-evidence"),
        html.H3("Trace"), graph("incident-waterfall"),
        html.H3("Actions"), html.Div(id="incident-actions"),
        html.Details([html.Summary("evidence (JSON)"), html.Pre(id="incident-evidence-json")]),
    ])


def header(i: Incident) -> html.Div:
    """What the incident is, its state, and links to its trace."""
    facts = [("key", i.key), ("state", i.state.value), ("opened", when(i.opened_at_ns) + " UTC"),
             ("resolved", when(i.resolved_at_ns) + " UTC" if i.state is State.RESOLVED else "-"),
             ("findings", str(i.findings)), ("reopened", str(i.reopens)), ("detector", i.detector),
             ("cluster", i.cluster or "-")]
    return html.Div([
        html.H3([severity_badge(i.severity), f" {i.kind} on {i.entity}"], id="incident-title"),
        html.P(i.summary),
        html.Ul([html.Li([html.B(k + ": "), v]) for k, v in facts]),
        html.P(["trace ", dcc.Link(i.trace_id, href=f"{TRACE_PATH}{i.trace_id}", id="incident-trace-link")]),
    ])


def pretty(evidence: str) -> str:
    """The evidence JSON indented; as stored when it is not JSON."""
    try:
        return json.dumps(json.loads(evidence), indent=1, sort_keys=True)
    except ValueError:
        return evidence


def tree(spans: Sequence[SpanRow]) -> list[tuple[int, SpanRow]]:
    """(depth, span), each span after its parent, siblings by start (a span whose parent is missing is a root)."""
    ids = {s.span_id for s in spans}
    children: dict[str, list[SpanRow]] = {}
    for s in spans:
        parent = s.parent_span_id if s.parent_span_id in ids and s.parent_span_id != s.span_id else ""
        children.setdefault(parent, []).append(s)
    out: list[tuple[int, SpanRow]] = []
    stack = [(0, s) for s in reversed(sorted(children.get("", []), key=lambda s: s.start_ns))]
    seen: set[str] = set()
    while stack:
        depth, span = stack.pop()
        if span.span_id in seen:  # a duplicated or cyclic id is drawn once
            continue
        seen.add(span.span_id)
        out.append((depth, span))
        stack += [(depth + 1, c) for c in sorted(children.get(span.span_id, []), key=lambda s: -s.start_ns)]
    return out


def waterfall(spans: Sequence[SpanRow]) -> go.Figure:
    """The trace as a waterfall: one bar per span from its start, in milliseconds after the trace began."""
    rows = tree(spans)
    t0 = min(s.start_ns for s in spans)
    total_ms = max((s.start_ns + s.duration_ns - t0) / 1e6 for s in spans) or 1.0
    # Tick labels are right-aligned, so depth is drawn as tree marks before the name.
    labels = [("│ " * (depth - 1) + "└ " if depth else "") + s.name for depth, s in rows]
    hover = []
    for _, s in rows:
        attrs = "<br>".join(f"{k}={s.attributes[k]}" for k in KEY_ATTRIBUTES if s.attributes.get(k))
        hover.append(f"{s.name} [{s.service}] {s.status}<br>+{(s.start_ns - t0) / 1e6:.1f} ms, "
                     f"{s.duration_ns / 1e6:.1f} ms<br>{attrs}{'<br>' + s.message if s.message else ''}")
    fig = go.Figure(go.Bar(
        y=list(range(len(rows))), base=[(s.start_ns - t0) / 1e6 for _, s in rows], orientation="h",
        x=[max(s.duration_ns / 1e6, total_ms / 400) for _, s in rows],  # a zero-length span still shows
        marker={"color": [_STATUS_COLOURS.get(s.status, "#90a4ae") for _, s in rows]},
        hovertext=hover, hoverinfo="text", customdata=[s.span_id for _, s in rows]))
    fig.update_yaxes(tickvals=list(range(len(rows))), ticktext=labels, autorange="reversed")
    fig.update_xaxes(title="ms after the incident opened")
    return styled(fig, title=f"{len(rows)} spans over {total_ms / 1e3:.3f} s", height=120 + 24 * len(rows))


def evidence_figure(ctx: Context, i: Incident) -> go.Figure:
    """The metrics behind the incident's entity around its lifetime."""
    end = i.resolved_at_ns if i.state is State.RESOLVED else ctx.now_ns()
    rng = queries.TimeRange(i.opened_at_ns - round(BEFORE_S * 1e9), min(end + round(AFTER_S * 1e9), ctx.now_ns()),
                            ctx.cfg.max_points)
    if i.entity_type == "gpu":
        return pages_gpus.detail_figure(ctx, rng, i.entity)
    if i.entity_type in ("link", "nic"):
        nics = _nics(ctx, i)
        if nics:
            return pages_fabric.history_figure(ctx, rng, i.entity, nics)
    if i.entity_type in ("host", "clock"):
        return _node_figure(ctx, rng, i)
    if i.entity_type == "path":
        return _path_figure(ctx, rng, i.entity)
    return empty_figure(f"no charts for a {i.entity_type} entity ({i.entity}); see the evidence below")


def _nics(ctx: Context, i: Incident) -> list[str]:
    if i.entity_type == "nic":
        return [i.entity]
    try:
        listed = json.loads(i.evidence).get("evidence", {}).get("nics") or []
    except (ValueError, AttributeError):
        listed = []
    if not listed and ctx.fabric is not None:  # the map's cabling names the link's NICs
        doc = ctx.fabric().to_json()
        listed = [nic for nic, link in doc.get("nics", {}).items() if link == i.entity]
    return [str(n) for n in listed if isinstance(n, str) and "/" in n]


def _lines(fig: go.Figure, found: dict[queries.SeriesKey, queries.Points], label: str, row: int) -> None:
    for key, (times, values) in found.items():
        fig.add_trace(go.Scatter(x=timestamps(times), y=values, mode="lines", name=" ".join([label, *key])),
                      row=row, col=1)


def _node_figure(ctx: Context, rng: queries.TimeRange, i: Incident) -> go.Figure:
    node = i.entity.partition("/")[0]
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True,
                        subplot_titles=("agent reports per bucket", "clock offset / uncertainty (µs)"))
    _lines(fig, queries.series(ctx.store, rng, queries.HEARTBEAT, agg="count", nodes=[node]), "reports", 1)
    for metric in ("ridethrough.clock.node.offset", "ridethrough.clock.node.uncertainty"):
        found = queries.series(ctx.store, rng, metric, nodes=[node], node_attr="clock.node")
        scaled = {k: (t, [v * 1e6 for v in vs]) for k, (t, vs) in found.items()}
        _lines(fig, scaled, metric.rsplit(".", 1)[1], 2)
    return styled(fig, title=f"{node} around the incident", height=440) if fig.data else empty_figure(
        f"{node}: no agent or clock data around the incident")


def _path_figure(ctx: Context, rng: queries.TimeRange, path: str) -> go.Figure:
    a, _, b = path.partition("->")
    nodes = [a.partition("/")[0], b.partition("/")[0]]
    found = queries.series(ctx.store, rng, "ridethrough.probe.owd", keys=("probe.dst.node", "probe.direction"),
                           match={"probe.quantile": ["p50"], "probe.dst.node": nodes}, nodes=nodes)
    fig = go.Figure()
    for (src, dst, direction), (times, values) in found.items():
        fig.add_trace(go.Scatter(x=timestamps(times), y=[v * 1e6 for v in values], mode="lines",
                                 name=f"{src}→{dst} {direction}"))
    if not fig.data:
        return empty_figure(f"{path}: no one-way delays around the incident")
    fig.update_yaxes(title="one-way delay p50 (µs)")
    return styled(fig, title=f"{path}", height=360)


def register(app: Dash, ctx: Context) -> None:
    """The page's callback: the incident (by id or by trace), its evidence, trace and actions."""
    @app.callback(Output("incident-header", "children"), Output("incident-evidence", "figure"),
                  Output("incident-waterfall", "figure"), Output("incident-actions", "children"),
                  Output("incident-evidence-json", "children"), Output("incident-status", "children"),
                  Input("incident-ref", "data"), Input("refresh", "n_intervals"))
    @guarded("", empty_figure("store unavailable"), empty_figure("store unavailable"), "", "")
    def update(ref: dict[str, str], _tick: int | None) -> tuple[Any, ...]:
        found = (queries_incidents.incident_of_trace(ctx.store, ref["trace"]) if "trace" in ref
                 else queries_incidents.incident(ctx.store, ref.get("incident", "")))
        if found is None:
            what = f"trace {ref['trace']}" if "trace" in ref else f"incident {ref.get('incident', '')}"
            missing = empty_figure(f"no {what} in the store")
            return "", missing, missing, "", "", status(f"no {what} in the store")
        try:
            _, _, spans = load_trace(ctx.store, found.incident_id)
            trace_fig = waterfall(spans)
        except TraceNotFound as exc:
            trace_fig = empty_figure(str(exc))
        acted = queries_incidents.actions(ctx.store, incident_id=found.incident_id)
        actions = table(["decided (UTC)", "plugin", "entity", "status", "reason", "incident"], action_rows(acted),
                        table_id="incident-actions-table", empty="no actions on this incident")
        return (header(found), evidence_figure(ctx, found), trace_fig, actions,
                pretty(found.evidence),
                status(f"incident {found.incident_id}, version {found.version}"))
