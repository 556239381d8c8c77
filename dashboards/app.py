"""The Dash app: navigation, a router over the pages, a range selector and auto-refresh.

Paths::

    /                       Fleet: hosts x health, open incidents, recent actions
    /fabric                 Fabric: topology, one-way delays, link errors, a link's history
    /gpus                   GPUs: per-GPU health with sparklines, one GPU's charts
    /incidents              Incidents: timeline and table
    /incidents/{id}         one incident: evidence, trace waterfall, actions (PagerDuty links here)
    /traces/{trace_id}      the incident of that trace (PagerDuty links here too)
    /goodput                Goodput per customer and job
    /audits                 fleet audits: verdicts, counts, budget coverage
    /audits/{id}            one audit: per-host and per-link results, evidence, suggested actions
    /audits/{id}/report     its self-contained HTML report (a plain Flask route)

Figures refresh every ``refresh_s`` through a ``dcc.Interval`` (callbacks, no page reload).
`build_app` builds everything from a `Context`; nothing happens at import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dash import Dash, Input, Output, dcc, html

from ridethrough.dashboards import (
    pages_audits,
    pages_fabric,
    pages_fleet,
    pages_goodput,
    pages_gpus,
    pages_incident,
    pages_incidents,
)
from ridethrough.dashboards.pages_common import RANGES, Context, range_value

NAV = ((pages_fleet.PATH, pages_fleet.TITLE), (pages_fabric.PATH, pages_fabric.TITLE),
       (pages_gpus.PATH, pages_gpus.TITLE), (pages_incidents.PATH, pages_incidents.TITLE),
       (pages_goodput.PATH, pages_goodput.TITLE), (pages_audits.PATH, pages_audits.TITLE))
_PAGES: dict[str, Callable[[Context, str], Any]] = {
    pages_fleet.PATH: pages_fleet.layout, pages_fabric.PATH: pages_fabric.layout, pages_gpus.PATH: pages_gpus.layout,
    pages_incidents.PATH: pages_incidents.layout, pages_goodput.PATH: pages_goodput.layout,
    pages_audits.PATH: pages_audits.layout,
}
RENDERED_JS = """() => {
  if (!document.querySelector('.rt-page > *') || document.querySelector('[data-dash-is-loading="true"]')) return false;
  for (const g of document.querySelectorAll('.rt-graph')) {
    const plot = g.querySelector('.js-plotly-plot');
    if (!plot || !plot._fullData || (g.textContent || '').includes('loading…')) return false;
  }
  return true; }"""
"""For a browser driving the dashboard (tests, the load benchmark): true once a page is rendered, i.e. no
callback is in flight and every graph (``.rt-graph``) is drawn with its final figure, not the placeholder."""
FIGURE_POINTS_JS = """(id) => { const p = document.querySelector('#' + id + ' .js-plotly-plot');
  if (!p || !p.data) return -1;
  return p.data.reduce((n, t) => n + Math.max((t.x || []).length, (t.y || []).length, (t.z || []).length), 0); }"""
"""The points a graph (by id) draws, over all its traces (0: an empty figure; -1: not drawn yet)."""
HEALTH_PATH = "/healthz"
"""Answers 200 without touching the store (and without basic auth): for load balancers and probes."""
_STYLE = """
body{font-family:system-ui,sans-serif;margin:0;color:#222}
.rt-nav{display:flex;gap:1.2em;align-items:center;padding:.5em 1em;background:#263238;color:#fff}
.rt-nav a{color:#eceff1;text-decoration:none}.rt-nav a:hover{text-decoration:underline}
.rt-nav .rt-brand{font-weight:bold;margin-right:1em}.rt-page{padding:0 1em 2em 1em}
.rt-table{border-collapse:collapse;font-size:.85em;margin:.3em 0}
.rt-table td,.rt-table th{border-bottom:1px solid #eee;padding:.2em .6em;text-align:left}
.rt-card{border:1px solid #ddd;border-radius:6px;padding:.4em .9em}.rt-card b{font-size:1.4em;display:block}
"""


def route(ctx: Context, pathname: str | None) -> Any:
    """The layout of the page at ``pathname`` (a not-found message for anything else)."""
    path = (pathname or "/").rstrip("/") or "/"
    if path.startswith(pages_incident.INCIDENT_PATH) and len(path) > len(pages_incident.INCIDENT_PATH):
        return pages_incident.layout(ctx, "incident:" + path[len(pages_incident.INCIDENT_PATH):])
    if path.startswith(pages_incident.TRACE_PATH) and len(path) > len(pages_incident.TRACE_PATH):
        return pages_incident.layout(ctx, "trace:" + path[len(pages_incident.TRACE_PATH):])
    if path.startswith(pages_audits.AUDIT_PATH) and len(path) > len(pages_audits.AUDIT_PATH):
        return pages_audits.layout(ctx, path[len(pages_audits.AUDIT_PATH):])
    page = _PAGES.get(path)
    if page is None:
        return html.Div([html.H2("Not found"), html.P(f"No page at {path}."), dcc.Link("Fleet", href="/")],
                        id="not-found")
    return page(ctx, "")


def _layout(ctx: Context) -> html.Div:
    refresh_ms = max(1, round(ctx.cfg.refresh_s * 1000))
    nav = html.Nav([html.Span("ridethrough", className="rt-brand"),
                    *(dcc.Link(title, href=path, id=f"nav-{title.lower()}") for path, title in NAV),
                    html.Span(style={"flex": "1"}),
                    dcc.Dropdown(id="range", options=[{"label": f"last {k}", "value": k} for k in RANGES],
                                 value=range_value(ctx.cfg), clearable=False, style={"width": "9em", "color": "#222"})],
                   className="rt-nav")
    return html.Div([
        dcc.Location(id="url", refresh=False), nav,
        dcc.Interval(id="refresh", interval=refresh_ms, disabled=ctx.cfg.refresh_s <= 0),
        html.Div(id="page", className="rt-page"),
    ])


def build_app(ctx: Context) -> Dash:
    """The dashboard as a Dash app; serve ``app.server`` (a Flask WSGI app) with any WSGI server."""
    app = Dash(__name__, title="ridethrough", update_title="", suppress_callback_exceptions=True,
               serve_locally=True, health_endpoint=HEALTH_PATH.lstrip("/"))
    app.index_string = app.index_string.replace("{%css%}", "{%css%}<style>" + _STYLE + "</style>")
    app.layout = _layout(ctx)

    @app.callback(Output("page", "children"), Input("url", "pathname"))
    def show(pathname: str | None) -> Any:
        return route(ctx, pathname)

    for page in (pages_fleet, pages_fabric, pages_gpus, pages_incidents, pages_incident, pages_goodput, pages_audits):
        page.register(app, ctx)
    return app
