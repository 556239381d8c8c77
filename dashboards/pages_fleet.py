"""Fleet: hosts x health (GPU, NIC, clock, agent freshness), open incidents, actions in the last hour."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go
from dash import Dash, Input, Output, dcc, html

from ridethrough.actuators.actions import ActionRecord
from ridethrough.dashboards import queries, queries_incidents
from ridethrough.dashboards.pages_common import (
    LEVEL_COLOURS,
    Context,
    empty_figure,
    graph,
    guarded,
    incident_link,
    natural_key,
    severity_badge,
    status,
    styled,
    table,
    when,
)
from ridethrough.detectors.incidents import Incident

PATH = "/"
TITLE = "Fleet"
COLUMNS = ("gpu", "nic", "clock", "agent")
LABELS = {"gpu": "GPU", "nic": "NIC", "clock": "clock", "agent": "agent freshness"}
RECENT_S = 300.0
"""The newest points of this last stretch say what a host's state is now."""
SEEN_S = 3600.0
"""A host whose agent reported in this last stretch is part of the fleet (a silent one shows as stale)."""
_LEVEL_SCALE = [[0.0, LEVEL_COLOURS[0]], [0.33, LEVEL_COLOURS[0]], [0.34, LEVEL_COLOURS[1]], [0.66, LEVEL_COLOURS[1]],
                [0.67, LEVEL_COLOURS[2]], [1.0, LEVEL_COLOURS[2]]]


def layout(ctx: Context, arg: str = "") -> html.Div:
    """The page's skeleton; `register`'s callback fills it."""
    return html.Div([
        html.H2(TITLE), html.Div(id="fleet-status"), dcc.Store(id="fleet-page", data=PATH),
        graph("fleet-health"),
        html.H3("Open incidents"), html.Div(id="fleet-incidents"),
        html.H3("Actions in the last hour"), html.Div(id="fleet-actions"),
    ])


def health_matrix(found: Sequence[dict[str, Any]], *, now_ns: int,
                  stale_s: float) -> tuple[list[str], list[list[float | None]], list[list[str]]]:
    """(hosts, levels[column][host], hover text) from `queries.fleet_health` rows; None where there is no data.

    An agent's level is its heartbeat's age: older than ``stale_s`` is a warning, older than three
    times that is bad.
    """
    by: dict[tuple[str, str], dict[str, Any]] = {(r["node"], r["what"]): r for r in found}
    hosts = sorted({node for node, _ in by}, key=natural_key)
    levels: list[list[float | None]] = []
    texts: list[list[str]] = []
    for col in COLUMNS:
        row_levels: list[float | None] = []
        row_texts: list[str] = []
        for host in hosts:
            r = by.get((host, col))
            if r is None:
                row_levels.append(None)
                row_texts.append(f"{host}: no {LABELS[col]} data")
                continue
            level, detail = float(r["level"]), str(r["detail"])
            if col == "agent":
                age_s = max(0.0, (now_ns - float(r["value"])) / 1e9)
                level = 2.0 if age_s > 3 * stale_s else 1.0 if age_s > stale_s else 0.0
                detail = f"last report {age_s:.0f} s ago"
            row_levels.append(level)
            row_texts.append(f"{host} {LABELS[col]}: {detail or 'ok'}")
        levels.append(row_levels)
        texts.append(row_texts)
    return hosts, levels, texts


def health_figure(hosts: list[str], levels: list[list[float | None]], texts: list[list[str]]) -> go.Figure:
    """The hosts x health heatmap (green ok, amber warning, red bad, blank no data)."""
    if not hosts:
        return empty_figure("no agent has reported in the last hour")
    fig = go.Figure(go.Heatmap(
        z=levels, x=hosts, y=[LABELS[c] for c in COLUMNS], text=texts, hoverinfo="text", zmin=0, zmax=2,
        colorscale=_LEVEL_SCALE, showscale=False, xgap=1, ygap=1))
    fig.update_xaxes(type="category", tickangle=-90)
    fig.update_yaxes(type="category", autorange="reversed")
    return styled(fig, title=f"Health of {len(hosts)} hosts, now", height=260)


def incident_rows(found: Sequence[Incident], now_ns: int) -> list[list[Any]]:
    """Open incidents as table rows, each linking to its page."""
    return [[incident_link(i.incident_id, i.key), severity_badge(i.severity), i.summary, when(i.opened_at_ns),
             f"{(now_ns - i.opened_at_ns) / 60e9:.0f} min"] for i in found]


def action_rows(found: Sequence[ActionRecord]) -> list[list[Any]]:
    """Actions as table rows, each linking to its incident's page."""
    return [[when(a.decided_at_ns), a.plugin, a.entity, a.status.value + (" (dry run)" if a.dry_run else ""),
             a.reason or a.summary, incident_link(a.incident_id) if a.incident_id else "-"] for a in found]


def register(app: Dash, ctx: Context) -> None:
    """The page's one callback: every figure and table, on load and on each refresh."""
    @app.callback(Output("fleet-health", "figure"), Output("fleet-incidents", "children"),
                  Output("fleet-actions", "children"), Output("fleet-status", "children"),
                  Input("fleet-page", "data"), Input("refresh", "n_intervals"))
    @guarded(empty_figure("store unavailable"), "", "")
    def update(_page: str, _tick: int | None) -> tuple[Any, ...]:
        now = ctx.now_ns()
        found = queries.fleet_health(ctx.store, now_ns=now, recent_s=RECENT_S, seen_s=SEEN_S,
                                     cluster=ctx.cfg.cluster, inventory=ctx.gpus)
        hosts, levels, texts = health_matrix(found, now_ns=now, stale_s=ctx.cfg.agent_stale_s)
        open_now = queries_incidents.incidents(ctx.store, cluster=ctx.cfg.cluster, open_only=True, limit=100)
        acted = queries_incidents.actions(ctx.store, since_ns=now - 3600 * 10**9, cluster=ctx.cfg.cluster,
                                          limit=100)
        bad = sum(1 for i in range(len(hosts)) if any((col[i] or 0) >= 2 for col in levels))
        return (health_figure(hosts, levels, texts),
                table(["incident", "severity", "summary", "opened (UTC)", "open for"], incident_rows(open_now, now),
                      table_id="fleet-incidents-table", empty="no open incidents"),
                table(["decided (UTC)", "plugin", "entity", "status", "reason", "incident"], action_rows(acted),
                      table_id="fleet-actions-table", empty="no actions in the last hour"),
                status(f"{len(hosts)} hosts, {bad} with a red cell; {len(open_now)} open incidents; "
                       f"as of {when(now)} UTC"))
