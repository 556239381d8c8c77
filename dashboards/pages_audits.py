"""Audits: every fleet audit (``ridethrough audit``) with its verdict, counts and budget coverage; one audit's
per-host and per-link results with the evidence and suggested action of each anomaly; its HTML report.

Paths: ``/audits`` (the list), ``/audits/{id}`` (one audit), ``/audits/{id}/report`` (the self-contained
report, served as HTML by `register_report`, outside Dash's pages).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go
from dash import Dash, Input, Output, dcc, html
from flask import Response, abort

from ridethrough.dashboards import queries_audits
from ridethrough.dashboards.pages_common import (
    Context,
    empty_figure,
    graph,
    guarded,
    status,
    styled,
    table,
    timestamps,
    when,
)
from ridethrough.dashboards.queries_audits import AuditSummary
from ridethrough.exporters.store import StoreError, StoreUnavailable

PATH = "/audits"
AUDIT_PATH = "/audits/"
TITLE = "Audits"
LIMIT = 200
STATUS_COLOURS = {"pass": "#2e7d32", "fail": "#c62828", "partial": "#ef6c00", "not_covered": "#757575"}
_ID = re.compile(r"[0-9A-Za-z_-]{1,64}\Z")
_REPORT_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
"""The report is self-contained: it may style itself, and fetch or run nothing."""


def report_path(audit_id: str) -> str:
    """Where the dashboard serves an audit's HTML report."""
    return f"{AUDIT_PATH}{audit_id}/report"


def badge(value: str) -> html.Span:
    """A verdict as a coloured word."""
    return html.Span(value.replace("_", " "), className=f"rt-audit-{value}",
                     style={"color": STATUS_COLOURS.get(value, "#222"), "fontWeight": "bold"})


def layout(ctx: Context, arg: str = "") -> html.Div:
    """The list (``arg`` empty) or one audit (``arg`` its id); the callbacks fill it."""
    if arg:
        return html.Div([
            html.H2(TITLE), html.Div(id="audit-status"), dcc.Store(id="audit-ref", data=arg),
            html.Div(id="audit-header"),
            html.H3("Anomalies"), html.Div(id="audit-anomalies"),
            html.H3("Hosts"), html.Div(id="audit-hosts"),
            html.H3("Links"), html.Div(id="audit-links"),
            html.H3("Not covered"), html.Div(id="audit-coverage"),
        ])
    return html.Div([html.H2(TITLE), html.Div(id="audits-status"), dcc.Store(id="audits-page", data=PATH),
                     graph("audits-history"), html.Div(id="audits-table")])


def history_figure(found: Sequence[AuditSummary]) -> go.Figure:
    """Failed hosts and links per audit over time; a marker per audit coloured by its verdict."""
    if not found:
        return empty_figure("no audits recorded (run ridethrough audit)")
    ordered = sorted(found, key=lambda a: a.started_ns)
    x = timestamps(a.started_ns for a in ordered)
    fig = go.Figure()
    for name, values in (("hosts failed", [a.hosts_failed for a in ordered]),
                         ("links failed", [a.links_failed for a in ordered])):
        fig.add_trace(go.Bar(x=x, y=values, name=name, customdata=[a.audit_id for a in ordered],
                             hovertemplate="%{y} " + name + "<extra>%{customdata}</extra>"))
    fig.add_trace(go.Scatter(x=x, y=[a.anomalies for a in ordered], mode="markers", name="anomalies",
                             marker={"size": 11, "color": [STATUS_COLOURS.get(a.status, "#222") for a in ordered]},
                             text=[f"{a.status}: {a.summary}" for a in ordered], hoverinfo="text"))
    fig.update_layout(barmode="group")
    fig.update_yaxes(title="count", rangemode="tozero")
    return styled(fig, title="Audits: what failed in each", height=300)


def list_rows(found: Sequence[AuditSummary]) -> list[list[Any]]:
    """Table rows, each linking to its audit."""
    return [[dcc.Link(a.audit_id[:12], href=f"{AUDIT_PATH}{a.audit_id}", className="rt-audit-link"),
             when(a.started_ns), a.cluster or "-", badge(a.status), f"{a.hosts_failed} / {a.hosts}",
             f"{a.links_failed} / {a.links}", str(a.anomalies),
             f"{a.duration_s:.0f} s of {a.budget_s:g} s", "everything" if not a.not_covered else
             f"{a.not_covered} not covered"] for a in found]


def header(audit_id: str, doc: Mapping[str, Any]) -> html.Div:
    """What the audit was: verdict, cluster, when, how long of its budget, and its report."""
    hosts, links = doc.get("hosts", {}), doc.get("links", {})
    facts = [("cluster", doc.get("cluster") or "-"), ("started", when(int(doc.get("started_ns", 0))) + " UTC"),
             ("took", f"{float(doc.get('duration_s', 0)):.0f} s of a {float(doc.get('budget_s', 0)):g} s budget"),
             ("hosts failed", f"{sum(v == 'fail' for v in hosts.values())} / {len(hosts)}"),
             ("links failed", f"{sum(v == 'fail' for v in links.values())} / {len(links)}"),
             ("not covered", str(len(doc.get("not_covered", {}))))]
    return html.Div([
        html.H3([badge(str(doc.get("status", "?"))), f" audit {audit_id}"], id="audit-title"),
        html.Ul([html.Li([html.B(k + ": "), v]) for k, v in facts]),
        html.P(html.A("Open the HTML acceptance report", href=report_path(audit_id), target="_blank",
                      id="audit-report-link")),
    ])


def anomaly_block(a: Mapping[str, Any]) -> html.Div:
    """One anomaly: entity, what failed, the evidence of each symptom, the suggested action."""
    symptoms = [html.Li([html.B(f"{s.get('phase')} / {s.get('check')}"), f" at {float(s.get('at_s', 0)):.1f} s: ",
                         s.get("summary", ""),
                         html.Details([html.Summary("evidence"),
                                       html.Pre(json.dumps(s.get("evidence", {}), indent=1, default=str))])])
                for s in a.get("symptoms", [])]
    also = a.get("candidates") or []
    return html.Div([
        html.H4(f"{a.get('entity_type')} {a.get('entity')}: {str(a.get('kind', '')).replace('_', ' ')}"),
        html.P(a.get("summary", "")),
        html.P(f"The evidence cannot tell it from: {', '.join(also)}") if also else None,
        html.P([html.B("Suggested action: "), a.get("action", "")], className="rt-audit-action",
               style={"background": "#fff8e1", "padding": ".3em .6em"}),
        html.Ul(symptoms),
    ], className="rt-audit-anomaly", style={"borderLeft": "4px solid #c62828", "padding": "0 1em", "margin": "1em 0"})


def link_rows(doc: Mapping[str, Any]) -> list[list[Any]]:
    """Per link: verdict, the worst loss under load, the worst delivered rate, the MTU probe."""
    figures = doc.get("facts", {}).get("links", {})
    out: list[list[Any]] = []
    for link, verdict in sorted(doc.get("links", {}).items()):
        own = [f for f in figures.get(link, []) if f.get("phase") == "links"]
        loss = max((float(f.get("loss", 0)) for f in own), default=None)
        delivered = min((float(f.get("delivered_mbit", 0)) for f in own), default=None)
        mtu = "-" if not own else "ok" if all(f.get("mtu_ok") for f in own) else "FAILED"
        out.append([link, badge(verdict), "-" if loss is None else f"{loss:.1%}",
                    "-" if delivered is None else f"{delivered:.1f}", mtu])
    return out


def detail(doc: Mapping[str, Any]) -> tuple[Any, Any, Any, Any]:
    """(anomalies, hosts table, links table, coverage table) of one audit's JSON result."""
    anomalies = [anomaly_block(a) for a in doc.get("anomalies", [])] or html.Div("No anomalies.", id="audit-none")
    hosts = table(["host", "verdict"], [[h, badge(v)] for h, v in sorted(doc.get("hosts", {}).items())],
                  table_id="audit-hosts-table", empty="no hosts")
    links = table(["link", "verdict", "loss under load", "delivered Mbit/s (worst way)", "MTU probe"], link_rows(doc),
                  table_id="audit-links-table", empty="no links")
    gaps = table(["phase: what", "why not covered"], sorted(doc.get("not_covered", {}).items()),
                 table_id="audit-coverage-table", empty="everything planned was covered")
    return anomalies, hosts, links, gaps


def register(app: Dash, ctx: Context) -> None:
    """The list's and one audit's callbacks, and the report route."""
    @app.callback(Output("audits-history", "figure"), Output("audits-table", "children"),
                  Output("audits-status", "children"),
                  Input("audits-page", "data"), Input("refresh", "n_intervals"))
    @guarded(empty_figure("store unavailable"), "")
    def update(_page: str, _tick: int | None) -> tuple[Any, ...]:
        found = queries_audits.audits(ctx.store, cluster=ctx.cfg.cluster, limit=LIMIT)
        failed = sum(a.status == "fail" for a in found)
        return (history_figure(found),
                table(["audit", "started (UTC)", "cluster", "verdict", "hosts failed", "links failed", "anomalies",
                       "time of budget", "coverage"], list_rows(found), table_id="audits-list",
                      empty="no audits recorded"),
                status(f"{len(found)} audits, {failed} failed" + (f" (the newest {LIMIT} shown)"
                                                                  if len(found) >= LIMIT else "")))

    @app.callback(Output("audit-header", "children"), Output("audit-anomalies", "children"),
                  Output("audit-hosts", "children"), Output("audit-links", "children"),
                  Output("audit-coverage", "children"), Output("audit-status", "children"),
                  Input("audit-ref", "data"))
    @guarded("", "", "", "", "")
    def one(audit_id: str) -> tuple[Any, ...]:
        found = queries_audits.audit(ctx.store, audit_id)
        if found is None:
            return "", "", "", "", "", status(f"no audit {audit_id} in the store")
        return (header(audit_id, found.result), *detail(found.result), status(f"audit {audit_id}"))

    register_report(app, ctx)


def register_report(app: Dash, ctx: Context) -> None:
    """``/audits/{id}/report``: the audit's HTML report as it was written (or rendered from its result)."""
    def report(audit_id: str) -> Response:
        if not _ID.match(audit_id):
            abort(404)
        try:
            found = queries_audits.audit(ctx.store, audit_id)
        except (StoreUnavailable, StoreError, ValueError) as exc:
            return Response(f"cannot read audit {audit_id}: {exc}\n", status=503, mimetype="text/plain")
        if found is None:
            return Response(f"no audit {audit_id} in the store\n", status=404, mimetype="text/plain")
        answer = Response(found.report_html, mimetype="text/html")
        answer.headers["Content-Security-Policy"] = _REPORT_CSP
        return answer

    app.server.add_url_rule(report_path("<audit_id>"), "audit_report", report)
