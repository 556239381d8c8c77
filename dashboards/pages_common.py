"""What every page shares: the context a page reads through, figure and table helpers, error handling.

A page module has ``PATH`` (or a path prefix), ``TITLE``, ``layout(ctx, arg)`` and
``register(app, ctx)``; its callbacks read the store only through `ridethrough.dashboards.queries`
and turn a store failure into a message on the page (`guarded`), never a broken page.
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import plotly.graph_objects as go
from dash import dcc, html
from dash.development.base_component import Component

from ridethrough.dashboards.config import DashboardConfig
from ridethrough.dashboards.queries import TimeRange
from ridethrough.dashboards.queries_gpus import GpuInventory
from ridethrough.detectors.contract import Severity
from ridethrough.detectors.fabric_map import RouteMap
from ridethrough.exporters.store import Store, StoreError, StoreUnavailable

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])

LEVEL_COLOURS = ("#2e7d32", "#f9a825", "#c62828")
"""ok, warning, bad."""
SEVERITY_COLOURS = {Severity.INFO: "#607d8b", Severity.WARNING: "#f9a825", Severity.ERROR: "#ef6c00",
                    Severity.CRITICAL: "#c62828"}
RANGES = {"15m": 900.0, "1h": 3600.0, "6h": 21600.0, "24h": 86400.0, "7d": 604800.0}
"""The range selector's choices, in seconds."""
_BLOCKS = "▁▂▃▄▅▆▇█"


@dataclass
class Context:
    """What the pages read through: the store, the config, the clock, the fabric map (if any) and the GPU
    inventory (which host each GPU is on: kept between page loads, see `GpuInventory`)."""

    store: Store
    cfg: DashboardConfig
    fabric: Callable[[], RouteMap] | None = None
    clock: Callable[[], int] = field(default=time.time_ns)
    gpus: GpuInventory = field(default_factory=GpuInventory)

    def now_ns(self) -> int:
        """The current time, rounded down to ``cfg.cache_s``: views asked within that time are the same queries,
        answered once by the store's cache."""
        now = self.clock()
        step = round(self.cfg.cache_s * 1e9)
        return now - now % step if step > 0 else now

    def range(self, choice: str | None, *, buckets: int | None = None) -> TimeRange:
        """The range a page's charts cover: the selector's ``choice`` (default: ``cfg.window_s``) up to now."""
        seconds = RANGES.get(choice or "", self.cfg.window_s)
        now = self.now_ns()
        return TimeRange(now - round(seconds * 1e9), now, buckets or self.cfg.max_points)


def range_value(cfg: DashboardConfig) -> str:
    """The selector choice closest to ``cfg.window_s``."""
    return min(RANGES, key=lambda k: abs(RANGES[k] - cfg.window_s))


def guarded(*fallback: Any) -> Callable[[F], F]:
    """A callback that shows a store failure as its last output (a status line) and ``fallback`` for the others.

    The store being away or refusing a query is a message on the page, not a broken page; the next
    refresh tries again.
    """
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except (StoreUnavailable, StoreError, ValueError) as exc:
                log.warning("dashboard callback %s failed: %s", fn.__name__, exc)
                return (*fallback, error(str(exc)))
        return call  # type: ignore[return-value]  # functools.wraps keeps the signature Dash inspects
    return wrap


def error(message: str) -> html.Div:
    """A visible error line (the store is away, a query failed)."""
    return html.Div(message, className="rt-error", style={"color": "#c62828", "fontWeight": "bold"})


def status(text: str) -> html.Div:
    """A quiet status line under a page's title."""
    return html.Div(text, className="rt-status", style={"color": "#666", "fontSize": "0.85em"})


def empty_figure(message: str, *, height: int = 260) -> go.Figure:
    """A figure that says why it has no data (so an empty chart is never mistaken for a healthy one)."""
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, font={"size": 14, "color": "#666"})
    fig.update_layout(height=height, xaxis={"visible": False}, yaxis={"visible": False}, template="plotly_white",
                      margin={"l": 20, "r": 20, "t": 30, "b": 20})
    return fig


def styled(fig: go.Figure, *, title: str = "", height: int = 320) -> go.Figure:
    """The house style: white, tight margins, a small title."""
    fig.update_layout(template="plotly_white", height=height, title={"text": title, "font": {"size": 14}},
                      margin={"l": 60, "r": 20, "t": 40 if title else 10, "b": 40}, uirevision="keep")
    return fig


def graph(graph_id: str) -> dcc.Graph:
    """A graph slot; the figure comes from the page's callback (a placeholder until then)."""
    return dcc.Graph(id=graph_id, figure=empty_figure("loading…"), config={"displaylogo": False},
                     className="rt-graph")


def natural_key(name: str) -> tuple[Any, ...]:
    """Sort key that puts ``h2`` before ``h10``."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def sparkline(values: Sequence[float]) -> str:
    """Values as a line of block characters (empty for no values; a flat line for constant values)."""
    if not values:
        return ""
    lo, hi = min(values), max(values)
    span = hi - lo
    return "".join(_BLOCKS[0 if span <= 0 else min(7, int((v - lo) / span * 8))] for v in values)


def when(ns: int) -> str:
    """UTC time of day (with the date when not today): ``2024-06-10 06:13:20``."""
    if ns <= 0:
        return "-"
    return dt.datetime.fromtimestamp(ns / 1e9, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def timestamps(times_ns: Iterable[int]) -> list[dt.datetime]:
    """Nanoseconds → datetimes for a time axis (UTC)."""
    return [dt.datetime.fromtimestamp(t / 1e9, dt.UTC) for t in times_ns]


Cell = str | int | float | Component


def table(columns: Sequence[str], rows: Iterable[Sequence[Cell]], *, table_id: str = "",
          empty: str = "none") -> html.Table | html.Div:
    """A plain HTML table (cells may be links: ``dcc.Link`` navigates without reloading the page)."""
    body = [html.Tr([html.Td(c) for c in row]) for row in rows]
    if not body:
        return html.Div(empty, id=table_id or "rt-empty", style={"color": "#666"})
    children = [html.Thead(html.Tr([html.Th(c) for c in columns])), html.Tbody(body)]
    if table_id:
        return html.Table(children, className="rt-table", id=table_id)
    return html.Table(children, className="rt-table")


def incident_link(incident_id: str, text: str = "") -> dcc.Link:
    """A link to an incident's page."""
    return dcc.Link(text or incident_id[:12], href=f"/incidents/{incident_id}", className="rt-incident-link")


def severity_badge(severity: Severity) -> html.Span:
    """The severity as a coloured word."""
    return html.Span(severity.name.lower(), style={"color": SEVERITY_COLOURS[severity], "fontWeight": "bold"})
