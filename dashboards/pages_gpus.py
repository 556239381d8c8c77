"""GPUs: one row per GPU (state, temperature, throttling, ECC, XIDs) with sparklines, and one GPU's charts.

Sparklines are text (block characters) over `SPARK_BUCKETS` buckets the store computes; a click on
a GPU (``/gpus?gpu=h3/gpu2``, a link that can be shared) charts it at full resolution (the worst GPU
until then).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qs, urlencode

import plotly.graph_objects as go
from dash import Dash, Input, Output, dcc, html
from plotly.subplots import make_subplots

from ridethrough.dashboards import queries, queries_gpus
from ridethrough.dashboards.pages_common import (
    Cell,
    Context,
    empty_figure,
    graph,
    guarded,
    natural_key,
    sparkline,
    status,
    styled,
    table,
    timestamps,
)
from ridethrough.exporters.store import StoreError, StoreUnavailable

PATH = "/gpus"
TITLE = "GPUs"
SPARK_BUCKETS = 24
RECENT_S = 300.0
TEMPERATURE, CLOCK_EVENTS = "hw.temperature", "ridethrough.gpu.clock_event_reasons"
ECC, XID = "hw.errors", "ridethrough.gpu.xid"
STATE_RANK = {"failed": 3, "predicted_failure": 2, "degraded": 1, "ok": 0, "unknown": 0}
_COLUMNS = [("gpu", "GPU"), ("state", "state"), ("temp_now", "°C now"), ("temp_max", "°C max"),
            ("temp_spark", "temperature"), ("throttled_pct", "throttled %"), ("throttle_spark", "throttling"),
            ("ecc_corrected", "ECC corr."), ("ecc_uncorrected", "ECC uncorr."), ("ecc_spark", "ECC"),
            ("xids", "XIDs"), ("xid_spark", "XID")]
_STATE_COLOURS = {"failed": "#c62828", "predicted_failure": "#ef6c00", "degraded": "#f9a825"}
SHOWN = 64
"""Rows the table shows: the worst GPUs first (the status line says how many there are)."""


def layout(ctx: Context, arg: str = "") -> html.Div:
    """The page's skeleton; `register`'s callbacks fill it."""
    return html.Div([html.H2(TITLE), html.Div(id="gpus-status"), dcc.Store(id="gpus-page", data=PATH),
                     dcc.Store(id="gpus-worst"),
                     html.Div(id="gpu-table", style={"fontFamily": "monospace", "fontSize": "12px"}),
                     graph("gpu-detail")])


def table_rows(rows: list[dict[str, Any]]) -> list[list[Cell]]:
    """Table cells; a GPU's name links to its charts (``/gpus?gpu=...``, no page reload)."""
    out: list[list[Cell]] = []
    for r in rows[:SHOWN]:
        gpu = dcc.Link(r["gpu"], href=f"{PATH}?{urlencode({'gpu': r['gpu']})}", className="rt-gpu-link")
        state = html.Span(r["state"], style={"color": _STATE_COLOURS.get(r["state"], "#222"), "fontWeight": "bold"})
        out.append([gpu, state, *("" if r[k] is None else r[k] for k, _ in _COLUMNS[2:])])
    return out


def _total(points: queries.Points, step_s: float) -> float:
    return sum(points[1]) * step_s


def gpu_rows(temp: Mapping[queries.SeriesKey, queries.Points], throttle: Mapping[queries.SeriesKey, queries.Points],
             ecc: Mapping[queries.SeriesKey, queries.Points], xid: Mapping[queries.SeriesKey, queries.Points],
             states: Mapping[tuple[str, str], str], *, step_s: float) -> list[dict[str, Any]]:
    """One table row per GPU seen in any series, worst first (state, uncorrected ECC, XIDs, throttling, heat)."""
    gpus = {k[:2] for series in (temp, throttle, ecc, xid) for k in series} | set(states)
    rows = []
    for node, index in gpus:
        state = states.get((node, index), "unknown")
        t = temp.get((node, index), ([], []))[1]
        th = throttle.get((node, index), ([], []))[1]
        corrected = ecc.get((node, index, "corrected"), ([], []))
        uncorrected = ecc.get((node, index, "uncorrected"), ([], []))
        both = [a + b for a, b in zip(corrected[1] or [0.0] * len(uncorrected[1]),
                                      uncorrected[1] or [0.0] * len(corrected[1]), strict=False)]
        x = xid.get((node, index), ([], []))
        rows.append({
            "id": f"{node}/gpu{index}", "gpu": f"{node}/gpu{index}", "state": state,
            "temp_now": round(t[-1], 1) if t else None, "temp_max": round(max(t), 1) if t else None,
            "temp_spark": sparkline(t), "throttled_pct": round(100 * sum(th) / len(th), 1) if th else None,
            "throttle_spark": sparkline(th), "ecc_corrected": round(_total(corrected, step_s)),
            "ecc_uncorrected": round(_total(uncorrected, step_s)), "ecc_spark": sparkline(both),
            "xids": round(_total(x, step_s)), "xid_spark": sparkline(x[1])})
    return sorted(rows, key=lambda r: (-STATE_RANK.get(r["state"], 0), -r["ecc_uncorrected"], -r["xids"],
                                       -(r["throttled_pct"] or 0), -(r["temp_max"] or 0), natural_key(r["gpu"])))


Panel = dict[queries.SeriesKey, queries.Points]


def gpu_series(ctx: Context, rng: queries.TimeRange, *, per_code: bool,
               **where: Any) -> tuple[Panel, Panel, Panel, Panel]:
    """(temperature, throttled share, ECC errors/s by error.type, XIDs/s [by code when ``per_code``]), keyed
    (node, GPU index, ...): two scans, one of the gauges and one of the counters, read by GPU id
    (`queries_gpus.gpu_metrics`)."""
    def read(metric: dict[str, str], kind: str, keys: tuple[str, ...]) -> Panel:
        return queries_gpus.gpu_metrics(ctx.store, rng, metric, inventory=ctx.gpus, kind=kind, keys=keys,
                                        cluster=ctx.cfg.cluster, **where)
    gauges = read({TEMPERATURE: "avg", CLOCK_EVENTS: "throttled"}, "gauge", ("gpu.index",))
    keys = ("gpu.index", "error.type", "gpu.xid") if per_code else ("gpu.index", "error.type")
    counters = read({ECC: "avg", XID: "avg"}, "counter", keys)
    temp: Panel = {(k[0], k[2]): v for k, v in gauges.items() if k[1] == TEMPERATURE}
    throttle: Panel = {(k[0], k[2]): v for k, v in gauges.items() if k[1] == CLOCK_EVENTS}
    ecc: Panel = {(k[0], k[2], k[3]): v for k, v in counters.items() if k[1] == ECC}
    xid: Panel = {(k[0], k[2], *k[4:]): v for k, v in counters.items() if k[1] == XID}  # XIDs carry no error.type
    return temp, throttle, ecc, xid


def detail_figure(ctx: Context, rng: queries.TimeRange, gpu: str) -> go.Figure:
    """One GPU's temperature, throttling, ECC and XID rates over the range."""
    node, _, index = gpu.partition("/gpu")
    temp, throttle, ecc, xid = gpu_series(ctx, rng, per_code=True, match={"gpu.index": [index]}, nodes=[node])
    fig = make_subplots(rows=4, cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=("temperature °C", "throttled (share of samples)", "ECC errors / s", "XIDs / s"))
    for row, found, label in ((1, temp, "temperature"), (2, throttle, "throttled"), (3, ecc, "ECC"), (4, xid, "XID")):
        for key, (times, values) in found.items():
            name = " ".join([label, *key[2:]])
            fig.add_trace(go.Scatter(x=timestamps(times), y=values, mode="lines", name=name), row=row, col=1)
    if not fig.data:
        return empty_figure(f"{gpu}: no data in this range")
    return styled(fig, title=f"{gpu}", height=640)


def register(app: Dash, ctx: Context) -> None:
    """The table (on load and each refresh) and the chart of the clicked (or worst) GPU.

    Two callbacks, the chart's after the table's: drawn in one update with the table, the chart took the
    browser over a second longer to lay out than drawn after it (measured on a 128-GPU table)."""
    @app.callback(Output("gpu-table", "children"), Output("gpus-worst", "data"), Output("gpus-status", "children"),
                  Input("gpus-page", "data"), Input("refresh", "n_intervals"), Input("range", "value"))
    @guarded("", None)
    def update(_id: str, _tick: int | None, choice: str | None) -> tuple[Any, ...]:
        rng = ctx.range(choice, buckets=SPARK_BUCKETS)
        c = ctx.cfg.cluster
        temp, throttle, ecc, xid = gpu_series(ctx, rng, per_code=False)
        states = queries_gpus.gpu_states(ctx.store, now_ns=rng.end_ns, recent_s=RECENT_S, cluster=c,
                                         inventory=ctx.gpus)
        rows = gpu_rows(temp, throttle, ecc, xid, states, step_s=rng.step_ns / 1e9)
        bad = sum(1 for r in rows if r["state"] not in ("ok", "unknown"))
        shown = f" (the worst {SHOWN} shown)" if len(rows) > SHOWN else ""
        return (table(["GPU (click for charts)", *(n for _, n in _COLUMNS[1:])], table_rows(rows), table_id="gpu-rows",
                      empty="no GPU reported in this range"),
                rows[0]["gpu"] if rows else None,
                status(f"{len(rows)} GPUs, {bad} not ok{shown}; sparklines over {SPARK_BUCKETS} buckets of "
                       f"{rng.step_ns / 60e9:.0f} min"))

    @app.callback(Output("gpu-detail", "figure"), Input("url", "search"), Input("gpus-worst", "data"),
                  Input("range", "value"))
    def detail(search: str | None, worst: str | None, choice: str | None) -> go.Figure:
        gpu = parse_qs((search or "").lstrip("?")).get("gpu", [worst or ""])[0]
        if not gpu:
            return empty_figure("no GPU reported in this range")
        try:
            return detail_figure(ctx, ctx.range(choice), str(gpu))
        except (StoreUnavailable, StoreError) as exc:
            return empty_figure(f"{gpu}: {exc}")
