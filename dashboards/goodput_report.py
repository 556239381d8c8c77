"""Goodput reports: a table for a terminal, CSV and JSON for machines, one HTML page for a customer.

The HTML page is self-contained: its charts are inline SVG and its style is inline, so it can
be mailed or archived and still reads the same with no network (nothing is fetched).
CSV and JSON carry GPU-seconds (exact, as computed); the table and the page show GPU-hours.
"""

from __future__ import annotations

import csv
import datetime as dt
import html
import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ridethrough.dashboards.goodput import BADPUT, NS_PER_S, Category, JobGoodput, total
from ridethrough.query import format_table

FORMATS = ("table", "csv", "json", "html")
COLOURS = {Category.PRODUCTIVE: "#2e7d32", Category.RECOMPUTATION: "#c62828", Category.MIGRATION: "#6a1b9a",
           Category.CHECKPOINT: "#1565c0", Category.WAIT: "#ef6c00", Category.RESTART: "#ad1457",
           Category.IDLE: "#9e9e9e"}
DESCRIPTIONS = {
    Category.PRODUCTIVE: "completed training steps that were kept (not rolled back), less their stalls",
    Category.RECOMPUTATION: "steps that were computed, then lost to a rollback and computed again",
    Category.MIGRATION: "the job paused while a failing GPU's work moved to a spare",
    Category.CHECKPOINT: "training stalled while a checkpoint was written",
    Category.WAIT: "ranks waiting on slower peers, data or the network inside a step",
    Category.RESTART: "start-up and restarts after failures, and gaps while an incident on the job was open",
    Category.IDLE: "allocated GPUs that ran no step and had no restart or incident to explain it",
}
_ORDER = (Category.PRODUCTIVE, *BADPUT)


@dataclass(frozen=True, slots=True)
class Report:
    """One customer's goodput over ``[start_ns, end_ns)``: per job, and per time bucket for the timeline."""

    customer: str
    start_ns: int
    end_ns: int
    jobs: Sequence[JobGoodput]
    timeline: Sequence[JobGoodput] = ()
    """Totals over all jobs, one per consecutive bucket of the period (may be empty)."""

    @property
    def total(self) -> JobGoodput:
        """All jobs together."""
        return total(self.jobs, customer=self.customer, start_ns=self.start_ns, end_ns=self.end_ns)


def iso(ns: int) -> str:
    """UTC ISO 8601 with seconds, e.g. ``2024-06-10T06:13:20Z``."""
    return dt.datetime.fromtimestamp(ns // NS_PER_S, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def render(report: Report, fmt: str) -> str:
    """The report in ``fmt`` (one of `FORMATS`); ValueError for another."""
    renderers = {"table": _table, "csv": _csv, "json": _json, "html": _html}
    if fmt not in renderers:
        raise ValueError(f"unknown report format {fmt!r}: use one of {', '.join(FORMATS)}")
    return renderers[fmt](report)


def _rows(report: Report) -> list[dict[str, Any]]:
    return [g.as_dict() for g in (*report.jobs, report.total)]


def _csv(report: Report) -> str:
    rows = _rows(report)
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def _json(report: Report) -> str:
    doc = {"customer": report.customer, "from": iso(report.start_ns), "to": iso(report.end_ns),
           "unit": "GPU-seconds", "categories": [c.value for c in Category], "total": report.total.as_dict(),
           "jobs": [g.as_dict() for g in report.jobs], "timeline": [g.as_dict() for g in report.timeline]}
    return json.dumps(doc, indent=1) + "\n"


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f}"


def _table(report: Report) -> str:
    names = ["job", "gpus", "allocated_gpu_h", "goodput_%", *(f"{c.value}_gpu_h" for c in _ORDER)]
    rows = [[g.job, g.world_size, _hours(g.allocated_s), f"{100 * g.goodput:.1f}",
             *(_hours(g.seconds.get(c, 0.0)) for c in _ORDER)] for g in (*report.jobs, report.total)]
    head = f"goodput of {report.customer}, {iso(report.start_ns)} to {iso(report.end_ns)} (GPU-hours)\n"
    return head + format_table(names, rows)


# --- HTML --------------------------------------------------------------------------------------

_STYLE = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:60em;color:#222}
h1{font-size:1.4em}.cards{display:flex;gap:1em;flex-wrap:wrap}.card{border:1px solid #ddd;border-radius:6px;
padding:.6em 1em}.card b{display:block;font-size:1.5em}table{border-collapse:collapse;font-size:.85em}
td,th{border-bottom:1px solid #eee;padding:.25em .6em;text-align:right}td:first-child,th:first-child{text-align:left}
.sw{display:inline-block;width:.8em;height:.8em;margin:0 .3em 0 .8em}dt{font-weight:bold}"""


def _svg_bars(bars: Sequence[tuple[str, JobGoodput]], *, width: int = 720) -> str:
    """One horizontal 100% bar per (label, goodput), split by category."""
    label_w, bar_h, gap = 160, 22, 8
    height = len(bars) * (bar_h + gap) + gap
    parts = [f'<svg width="{width}" height="{height}" role="img">']
    for i, (label, g) in enumerate(bars):
        y = gap + i * (bar_h + gap)
        parts.append(f'<text x="0" y="{y + 15}" font-size="12">{html.escape(label[:24])}</text>')
        x = float(label_w)
        for c in _ORDER:
            share = g.seconds.get(c, 0.0) / g.allocated_s if g.allocated_s > 0 else 0.0
            w = share * (width - label_w)
            if w > 0:
                title = f"{c.value.replace('_', ' ')}: {100 * share:.1f}% ({_hours(g.seconds[c])} GPU-h)"
                parts.append(f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{bar_h}" fill="{COLOURS[c]}">'
                             f"<title>{html.escape(title)}</title></rect>")
            x += w
        if g.goodput >= 0.08:  # room for the label inside the productive segment
            parts.append(f'<text x="{label_w + 4}" y="{y + 15}" font-size="12" fill="#fff">'
                         f"{100 * g.goodput:.1f}% productive</text>")
    parts.append("</svg>")
    return "".join(parts)


def _svg_timeline(points: Sequence[JobGoodput], *, width: int = 720, height: int = 220) -> str:
    """Stacked columns per bucket: the share of allocated GPU-seconds in each category."""
    pad_l, pad_t, pad_b = 40, 10, 24
    usable_w, usable_h = width - pad_l, height - pad_t - pad_b
    col_w = usable_w / max(1, len(points))
    parts = [f'<svg width="{width}" height="{height}" role="img">']
    for pct in (0, 50, 100):
        y = pad_t + usable_h * (1 - pct / 100)
        parts.append(f'<text x="0" y="{y + 4:.1f}" font-size="10">{pct}%</text>'
                     f'<line x1="{pad_l}" x2="{width}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>')
    for i, g in enumerate(points):
        x, y = pad_l + i * col_w, float(pad_t + usable_h)
        for c in _ORDER:
            h = usable_h * (g.seconds.get(c, 0.0) / g.allocated_s if g.allocated_s > 0 else 0.0)
            if h > 0:
                y -= h
                title = f"{iso(g.start_ns)}: {c.value.replace('_', ' ')} {100 * h / usable_h:.1f}%"
                parts.append(f'<rect x="{x + 1:.2f}" y="{y:.2f}" width="{max(col_w - 2, 1):.2f}" height="{h:.2f}" '
                             f'fill="{COLOURS[c]}"><title>{html.escape(title)}</title></rect>')
    if points:
        y_text = height - 6
        parts += [f'<text x="{pad_l}" y="{y_text}" font-size="10">{iso(points[0].start_ns)}</text>',
                  f'<text x="{width}" y="{y_text}" font-size="10" text-anchor="end">{iso(points[-1].end_ns)}</text>']
    parts.append("</svg>")
    return "".join(parts)


def _key() -> str:
    """A one-line colour key for the charts."""
    return "<p>" + " ".join(f'<span class="sw" style="background:{COLOURS[c]}"></span>{c.value.replace("_", " ")}'
                            for c in _ORDER) + "</p>"


def _legend() -> str:
    items = "".join(f'<dt><span class="sw" style="background:{COLOURS[c]}"></span>{c.value.replace("_", " ")}</dt>'
                    f"<dd>{html.escape(DESCRIPTIONS[c])}</dd>" for c in _ORDER)
    return f"<dl>{items}</dl>"


def _html_table(report: Report) -> str:
    head = "".join(f"<th>{h}</th>" for h in ("job", "GPUs", "allocated GPU-h", "goodput",
                                             *(c.value.replace("_", " ") + " GPU-h" for c in _ORDER)))
    body = []
    for g in (*report.jobs, report.total):
        name = "all jobs" if g.job == "*" else g.job  # "*" is no job's name: ids start with a letter or digit
        cells = [html.escape(name), str(g.world_size), _hours(g.allocated_s), f"{100 * g.goodput:.1f}%",
                 *(_hours(g.seconds.get(c, 0.0)) for c in _ORDER)]
        body.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _html(report: Report) -> str:
    t = report.total
    worst = max(BADPUT, key=lambda c: t.seconds.get(c, 0.0))
    customer, period = html.escape(report.customer), f"{iso(report.start_ns)} to {iso(report.end_ns)}"
    cards = [("goodput", f"{100 * t.goodput:.1f}%"), ("allocated GPU-hours", _hours(t.allocated_s)),
             ("productive GPU-hours", _hours(t.productive_s)),
             ("largest loss", f"{worst.value.replace('_', ' ')} ({_hours(t.seconds.get(worst, 0.0))} GPU-h)")]
    bars = [(g.job, g) for g in report.jobs] + [("all jobs", t)]
    timeline = ("<h2>Over time</h2>" + _svg_timeline(report.timeline)) if report.timeline else ""
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>Goodput: {customer}, {period}</title><style>{_STYLE}</style></head><body>"
        f"<h1>GPU goodput of {customer}</h1><p>{period} (UTC). A GPU-second counts once, in the first category "
        "that applies, in the order below.</p><div class=\"cards\">"
        + "".join(f'<div class="card">{html.escape(k)}<b>{html.escape(v)}</b></div>' for k, v in cards)
        + "</div><h2>Where the GPU time went, per job</h2>" + _key() + _svg_bars(bars) + timeline
        + "<h2>GPU-hours</h2>" + _html_table(report) + "<h2>Categories</h2>" + _legend()
        + "</body></html>\n"
    )
