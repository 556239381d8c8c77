"""Goodput: where a customer's allocated GPU time went, per job and over time.

The numbers are `ridethrough.dashboards.goodput_sql.job_goodput`'s (the same as ``ridethrough
goodput report``), coloured and described as `ridethrough.dashboards.goodput_report` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go
from dash import Dash, Input, Output, dcc, html

from ridethrough.dashboards import queries
from ridethrough.dashboards.goodput import BADPUT, Category, JobGoodput, total
from ridethrough.dashboards.goodput_report import COLOURS, DESCRIPTIONS, Report
from ridethrough.dashboards.goodput_sql import GoodputError, Period, buckets, job_goodput, materialized_cte
from ridethrough.dashboards.pages_common import (
    Cell,
    Context,
    empty_figure,
    graph,
    guarded,
    status,
    styled,
    table,
    timestamps,
)

PATH = "/goodput"
TITLE = "Goodput"
TIMELINE_BUCKETS = 24
LOOKBACK_MIN_S = 6 * 3600.0
_ORDER = (Category.PRODUCTIVE, *BADPUT)


def layout(ctx: Context, arg: str = "") -> html.Div:
    """The page's skeleton; `register`'s callbacks fill it."""
    return html.Div([
        html.H2(TITLE), html.Div(id="goodput-status"),
        html.Div([html.Span("customer: "), dcc.Dropdown(id="goodput-customer", clearable=False,
                                                         style={"width": "20em", "display": "inline-block"})]),
        html.Div(id="goodput-cards", style={"display": "flex", "gap": "2em", "margin": "0.5em 0"}),
        graph("goodput-jobs"), graph("goodput-timeline"), html.Div(id="goodput-table"),
    ])


def report(ctx: Context, customer: str, rng: queries.TimeRange, *, materialize: bool | None = None) -> Report:
    """The customer's goodput over the range: per job, and the total per timeline bucket (``materialize``: as
    `job_goodput` takes it)."""
    whole = Period(rng.start_ns, rng.end_ns)
    parts = buckets(whole, TIMELINE_BUCKETS)
    # Events before the range matter only for gaps and rollbacks reaching into it: read back as far as the
    # range is long (at least LOOKBACK_MIN_S), not goodput_sql's week, so a short view reads little.
    lookback_s = max(LOOKBACK_MIN_S, (rng.end_ns - rng.start_ns) / 1e9)
    found = job_goodput(ctx.store, customer=customer, periods=[whole, *parts], lookback_s=lookback_s,
                        materialize=materialize)
    jobs = [g for g in found if (g.start_ns, g.end_ns) == (whole.start_ns, whole.end_ns)]
    timeline = [total([g for g in found if (g.start_ns, g.end_ns) == (p.start_ns, p.end_ns)], customer=customer,
                      start_ns=p.start_ns, end_ns=p.end_ns) for p in parts]
    return Report(customer, whole.start_ns, whole.end_ns, jobs, timeline)


def _share(g: JobGoodput, c: Category) -> float:
    return 100 * g.seconds.get(c, 0.0) / g.allocated_s if g.allocated_s > 0 else 0.0


def jobs_figure(r: Report) -> go.Figure:
    """One 100% bar per job (and all jobs), split by category."""
    bars: list[tuple[str, JobGoodput]] = [(g.job, g) for g in r.jobs] + [("all jobs", r.total)]
    fig = go.Figure()
    for c in _ORDER:
        fig.add_trace(go.Bar(
            y=[label for label, _ in bars], x=[_share(g, c) for _, g in bars], orientation="h",
            name=c.value.replace("_", " "), marker={"color": COLOURS[c]},
            hovertemplate=f"%{{y}}: {c.value.replace('_', ' ')} %{{x:.1f}}%<extra>{DESCRIPTIONS[c]}</extra>"))
    fig.update_layout(barmode="stack", legend={"orientation": "h", "y": -0.25, "traceorder": "normal"})
    fig.update_xaxes(title="% of allocated GPU-seconds", range=[0, 100])
    fig.update_yaxes(type="category", autorange="reversed")
    return styled(fig, title="Where the GPU time went, per job", height=180 + 40 * len(bars))


def timeline_figure(points: Sequence[JobGoodput]) -> go.Figure:
    """GPU-hours per category in each bucket, stacked."""
    times = timestamps(p.start_ns for p in points)
    fig = go.Figure([go.Bar(x=times, y=[p.seconds.get(c, 0.0) / 3600 for p in points], name=c.value.replace("_", " "),
                            marker={"color": COLOURS[c]}) for c in _ORDER])
    fig.update_layout(barmode="stack", bargap=0.05, legend={"orientation": "h", "y": -0.25, "traceorder": "normal"})
    fig.update_yaxes(title="GPU-hours")
    return styled(fig, title="Over time", height=320)


def cards(r: Report) -> list[html.Div]:
    """The headline numbers."""
    t = r.total
    worst = max(BADPUT, key=lambda c: t.seconds.get(c, 0.0))
    items = [("goodput", f"{100 * t.goodput:.1f}%"), ("allocated GPU-hours", f"{t.allocated_s / 3600:.1f}"),
             ("productive GPU-hours", f"{t.productive_s / 3600:.1f}"),
             ("largest loss", f"{worst.value.replace('_', ' ')} ({t.seconds.get(worst, 0.0) / 3600:.1f} GPU-h)")]
    return [html.Div([html.Div(k, style={"color": "#666"}), html.B(v, className="rt-card-value")],
                     className="rt-card") for k, v in items]


def register(app: Dash, ctx: Context) -> None:
    """One callback: the customers with jobs in the range, and the figures of the chosen one (the first until
    another is chosen), so the page needs one round trip."""
    # Whether the store keeps a CTE is asked once: a read-only endpoint refuses the setting on every ask.
    store_can: dict[str, bool] = {}
    @app.callback(Output("goodput-customer", "options"), Output("goodput-customer", "value"),
                  Output("goodput-jobs", "figure"), Output("goodput-timeline", "figure"),
                  Output("goodput-cards", "children"), Output("goodput-table", "children"),
                  Output("goodput-status", "children"),
                  Input("goodput-customer", "value"), Input("refresh", "n_intervals"), Input("range", "value"))
    @guarded([], None, empty_figure("store unavailable"), empty_figure("store unavailable"), [], "")
    def update(chosen: str | None, _tick: int | None, choice: str | None) -> tuple[Any, ...]:
        rng = ctx.range(choice)
        names = queries.customers(ctx.store, rng)
        customer = chosen if chosen in names else (names[0] if names else None)
        if customer is None:
            none = empty_figure("no job reported steps in this range")
            return names, None, none, none, [], "", status("no customers in this range")
        try:
            if "materialize" not in store_can:
                store_can["materialize"] = materialized_cte(ctx.store)
            r = report(ctx, customer, rng, materialize=store_can["materialize"])
        except GoodputError as exc:
            bad = empty_figure(str(exc))
            return names, customer, bad, bad, [], "", status(str(exc))
        named = [*((g.job, g) for g in r.jobs), ("all jobs", r.total)]
        rows: list[list[Cell]] = [[name, g.world_size, f"{g.allocated_s / 3600:.2f}", f"{100 * g.goodput:.1f}%",
                                   *(f"{g.seconds.get(c, 0.0) / 3600:.2f}" for c in _ORDER)] for name, g in named]
        head = ["job", "GPUs", "allocated GPU-h", "goodput", *(c.value.replace("_", " ") + " GPU-h" for c in _ORDER)]
        return (names, customer, jobs_figure(r), timeline_figure(r.timeline), cards(r),
                table(head, rows, table_id="goodput-jobs-table"), status(f"{customer}: {len(r.jobs)} jobs"))
