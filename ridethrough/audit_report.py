"""The audit's acceptance report: one self-contained HTML page (inline style, nothing fetched).

Sections, each a ``<section id=...>`` so tools (and tests) can find them: ``summary`` (the verdict
and counts), ``anomalies`` (each failure: entity, what failed, the evidence, a suggested action),
``hosts`` and ``links`` (pass/fail of each, with its figures), ``coverage`` (what was not
checked, and why) and ``phases`` (what ran, when).
"""

from __future__ import annotations

import datetime as dt
import html
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ridethrough.audit_model import Anomaly, AuditResult, Status

SECTIONS = ("summary", "anomalies", "hosts", "links", "coverage", "phases")
_COLOURS = {Status.PASS: "#2e7d32", Status.FAIL: "#c62828", Status.PARTIAL: "#ef6c00", Status.NOT_COVERED: "#757575"}
_STYLE = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:70em;color:#222}h1{font-size:1.4em}
.cards{display:flex;gap:1em;flex-wrap:wrap}.card{border:1px solid #ddd;border-radius:6px;padding:.6em 1em}
.card b{display:block;font-size:1.5em}table{border-collapse:collapse;font-size:.85em;width:100%}
td,th{border-bottom:1px solid #eee;padding:.25em .6em;text-align:left;vertical-align:top}
.st{color:#fff;border-radius:3px;padding:0 .4em;font-size:.85em}.anomaly{border-left:4px solid #c62828;
padding:.2em 1em;margin:1em 0}.action{background:#fff8e1;padding:.4em .6em}pre{background:#f6f6f6;padding:.5em;
overflow-x:auto;font-size:.8em;max-height:20em}"""


def _iso(ns: int) -> str:
    return dt.datetime.fromtimestamp(ns / 1e9, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _e(value: object) -> str:
    return html.escape(str(value))


def _badge(status: Status) -> str:
    return f'<span class="st" style="background:{_COLOURS[status]}">{_e(status.value.replace("_", " "))}</span>'


def _table(head: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A table whose cells are already HTML."""
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return "<table><tr>" + "".join(f"<th>{_e(h)}</th>" for h in head) + f"</tr>{body}</table>"


def _summary(r: AuditResult) -> str:
    def failed(d: Mapping[str, Status]) -> str:
        return f"{sum(s is Status.FAIL for s in d.values())} / {len(d)}"
    cards = [("verdict", _badge(r.status)), ("anomalies", _e(len(r.anomalies))),
             ("hosts failed", _e(failed(r.hosts))), ("links failed", _e(failed(r.links))),
             ("duration", _e(f"{r.duration_s:.0f} s of {r.budget_s:g} s")),
             ("not covered", _e(len(r.not_covered())))]
    return ('<section id="summary"><h2>Summary</h2><div class="cards">'
            + "".join(f'<div class="card">{_e(k)}<b>{v}</b></div>' for k, v in cards) + "</div></section>")


def _anomaly(a: Anomaly) -> str:
    symptoms = "".join(f"<li><b>{_e(s.phase)} / {_e(s.check)}</b> at {s.at_s:.1f} s: {_e(s.summary)}"
                       f"<pre>{_e(json.dumps(s.evidence, indent=1, default=str))}</pre></li>" for s in a.symptoms)
    also = f"<p>The evidence cannot tell it from: {_e(', '.join(a.candidates))}</p>" if a.candidates else ""
    return (f'<div class="anomaly" data-entity="{_e(a.entity)}"><h3>{_e(a.entity_type)} {_e(a.entity)}: '
            f"{_e(a.kind.replace('_', ' '))}</h3><p>{_e(a.summary)}</p>{also}"
            f'<p class="action"><b>Suggested action:</b> {_e(a.action)}</p><ul>{symptoms}</ul></div>')


def _anomalies(r: AuditResult) -> str:
    body = "".join(_anomaly(a) for a in r.anomalies) or "<p>No anomalies.</p>"
    return f'<section id="anomalies"><h2>Anomalies</h2>{body}</section>'


def _nic(name: str, v: Mapping[str, Any]) -> str:
    mtu = v.get("mtu")
    state = "up" if v.get("up") == 1.0 else "DOWN"
    return f"{name} {state}" + (f" mtu {mtu:g}" if isinstance(mtu, int | float) else "")


def _host_cells(name: str, status: Status, facts: Mapping[str, Any]) -> list[str]:
    f = facts.get(name, {})
    nics = ", ".join(_nic(n, v) for n, v in sorted(f.get("nics", {}).items()))
    ib = ", ".join(f"{d} state {v.get('state', '?')} {v.get('rate_gbit', '?')} Gb/s"
                   for d, v in sorted(f.get("ib", {}).items()))
    gpus = f.get("gpus", {})
    models = sorted({g.get("model", "") for g in gpus.values()})
    clock = f.get("clock_uncertainty_s")
    return [_e(name), _badge(status), _e(nics or "-"), _e(ib or "-"), _e(f"{len(gpus)} {'/'.join(models)}"),
            _e("-" if clock is None else f"±{clock * 1e6:.0f} µs")]


def _hosts(r: AuditResult) -> str:
    facts = r.facts.get("hosts", {})
    rows = [_host_cells(h, s, facts) for h, s in sorted(r.hosts.items())]
    return ('<section id="hosts"><h2>Hosts</h2>'
            + _table(("host", "status", "NICs", "RDMA ports", "GPUs", "clock"), rows) + "</section>")


def _links(r: AuditResult) -> str:
    figures = r.facts.get("links", {})
    rows = []
    for link, status in sorted(r.links.items()):
        flows = figures.get(link, [])
        own = [f for f in flows if f.get("phase") == "links"]
        loss = max((f["loss"] for f in own), default=None)
        delivered = min((f["delivered_mbit"] for f in own), default=None)
        mtu = "-" if not own else "ok" if all(f.get("mtu_ok") for f in own) else "FAILED"
        owd = [f["owd_ms_p50_p99_max"][0] for f in own if f.get("owd_ms_p50_p99_max")]
        rows.append([_e(link), _badge(status), _e("-" if loss is None else f"{loss:.1%}"),
                     _e("-" if delivered is None else f"{delivered:.1f}"), _e(mtu),
                     _e(f"{max(owd):.2f}" if owd else "-"), _e(len(flows) - len(own))])
    head = ("link", "status", "loss under load", "delivered Mbit/s (worst way)", "MTU probe", "one-way delay p50 ms",
            "path flows across it")
    return f'<section id="links"><h2>Links</h2>{_table(head, rows)}</section>'


def _coverage(r: AuditResult) -> str:
    gaps = r.not_covered()
    body = (_table(("phase: what", "why not covered"), [[_e(k), _e(v)] for k, v in sorted(gaps.items())])
            if gaps else "<p>Everything planned was covered.</p>")
    return f'<section id="coverage"><h2>Not covered</h2>{body}</section>'


def _phases(r: AuditResult) -> str:
    rows = [[_e(p.name), _e(f"{p.started_s:.1f}"), _e(f"{p.ended_s - p.started_s:.1f}"), _e(p.note)] for p in r.phases]
    return f'<section id="phases"><h2>Phases</h2>{_table(("phase", "start s", "took s", "note"), rows)}</section>'


def render_html(r: AuditResult) -> str:
    """The whole report as one HTML document."""
    title = f"Fleet audit {r.cluster or ''} {_iso(r.started_ns)}".replace("  ", " ")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_e(title)}</title><style>{_STYLE}</style></head><body>"
            f"<h1>{_e(title)}: {_badge(r.status)}</h1><p>Audit {_e(r.audit_id)}, {_iso(r.started_ns)} to "
            f"{_iso(r.ended_ns)} (UTC). A host or link passes when every check that covered it passed.</p>"
            + _summary(r) + _anomalies(r) + _hosts(r) + _links(r) + _coverage(r) + _phases(r) + "</body></html>\n")
