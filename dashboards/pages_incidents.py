"""Incidents: a timeline of every incident open at some time in the range, and a table linking to each."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go
from dash import Dash, Input, Output, dcc, html
from dash.exceptions import PreventUpdate

from ridethrough.dashboards import queries_incidents
from ridethrough.dashboards.pages_common import (
    SEVERITY_COLOURS,
    Context,
    empty_figure,
    graph,
    guarded,
    incident_link,
    severity_badge,
    status,
    styled,
    table,
    timestamps,
    when,
)
from ridethrough.detectors.contract import Severity
from ridethrough.detectors.incidents import Incident, State

PATH = "/incidents"
TITLE = "Incidents"
LIMIT = 500


def layout(ctx: Context, arg: str = "") -> html.Div:
    """The page's skeleton; `register`'s callback fills it."""
    return html.Div([html.H2(TITLE), html.Div(id="incidents-status"), dcc.Store(id="incidents-page", data=PATH),
                     graph("incidents-timeline"), html.Div(id="incidents-table")])


def timeline_figure(found: Sequence[Incident], *, start_ns: int, now_ns: int) -> go.Figure:
    """One bar per incident from opened to resolved (to now while open), one row per incident key, coloured by
    severity; a click opens the incident (``customdata`` is its id)."""
    if not found:
        return empty_figure("no incidents in this range")
    fig = go.Figure()
    for severity in Severity:
        members = [i for i in found if i.severity is severity]
        if not members:
            continue
        starts = [max(i.opened_at_ns, start_ns) for i in members]
        ends = [i.resolved_at_ns if i.state is State.RESOLVED else now_ns for i in members]
        # Bar lengths are milliseconds on a date axis (how Plotly draws a timeline); at least a pixel's worth.
        widths = [max((e - s) / 1e6, 1000.0) for s, e in zip(starts, ends, strict=True)]
        fig.add_trace(go.Bar(
            base=timestamps(starts), x=widths, y=[i.key for i in members], orientation="h",
            name=severity.name.lower(), marker={"color": SEVERITY_COLOURS[severity]},
            customdata=[i.incident_id for i in members],
            text=[f"{i.summary} ({i.state.value})" for i in members], textposition="none",
            hovertemplate="%{y}<br>%{text}<extra>%{customdata}</extra>"))
    fig.update_xaxes(type="date")
    fig.update_yaxes(type="category", autorange="reversed")
    fig.update_layout(barmode="overlay")
    rows = len({i.key for i in found})
    return styled(fig, title="Incidents over time (click one to open it)", height=160 + 22 * rows)


def rows(found: Sequence[Incident], now_ns: int) -> list[list[Any]]:
    """Table rows: link, severity, state, kind, entity, opened, duration, summary."""
    out = []
    for i in found:
        end = i.resolved_at_ns if i.state is State.RESOLVED else now_ns
        out.append([incident_link(i.incident_id), severity_badge(i.severity), i.state.value, i.kind, i.entity,
                    when(i.opened_at_ns), f"{(end - i.opened_at_ns) / 60e9:.1f} min", i.summary])
    return out


def register(app: Dash, ctx: Context) -> None:
    """The timeline and the table, on load and each refresh; a click on a bar opens that incident."""
    @app.callback(Output("incidents-timeline", "figure"), Output("incidents-table", "children"),
                  Output("incidents-status", "children"),
                  Input("incidents-page", "data"), Input("refresh", "n_intervals"), Input("range", "value"))
    @guarded(empty_figure("store unavailable"), "")
    def update(_page: str, _tick: int | None, choice: str | None) -> tuple[Any, ...]:
        rng = ctx.range(choice)
        found = queries_incidents.incidents(ctx.store, start_ns=rng.start_ns, end_ns=rng.end_ns,
                                            cluster=ctx.cfg.cluster, limit=LIMIT)
        open_n = sum(1 for i in found if i.state is State.OPEN)
        return (timeline_figure(found, start_ns=rng.start_ns, now_ns=rng.end_ns),
                table(["incident", "severity", "state", "kind", "entity", "opened (UTC)", "lasted", "summary"],
                      rows(found, rng.end_ns), table_id="incidents-list", empty="no incidents in this range"),
                status(f"{len(found)} incidents in this range, {open_n} open" +
                       (f" (the newest {LIMIT} shown)" if len(found) >= LIMIT else "")))

    @app.callback(Output("url", "pathname", allow_duplicate=True), Input("incidents-timeline", "clickData"),
                  prevent_initial_call=True)
    def open_clicked(click: dict[str, Any] | None) -> str:
        points = (click or {}).get("points") or [{}]
        incident_id = points[0].get("customdata")
        if not isinstance(incident_id, str) or not incident_id:
            raise PreventUpdate
        return f"/incidents/{incident_id}"
