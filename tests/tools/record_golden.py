"""Record a detector golden case from a kept lab store (`bench/detect_eval.py --keep`).

Writes ``tests/fixtures/golden/detectors/<case>.rows.json.gz`` (the rows of the named metrics, and the
logs, from ``--start`` to ``--end``) and ``<case>.json`` (what the case runs; its ``expected``
findings are filled by ``pytest tests/test_detector_golden.py --update-golden``, and only so).

    .venv/bin/python tests/tools/record_golden.py --store /run/ridethrough/labs/deval58/store \\
        --case link_cut --start '2026-12-02 11:48:45' --end '2026-12-02 11:49:46' \\
        --metrics ridethrough.nic.up,ridethrough.ib.port.state --detectors link_down,link_flap \\
        --runs '2026-12-02 11:49:45.6' --description "..."
"""

from __future__ import annotations

import argparse
import datetime as dt
import gzip
import json
from pathlib import Path
from typing import Any

from ridethrough.exporters.store import Store

GOLDEN = Path(__file__).resolve().parent.parent / "fixtures" / "golden" / "detectors"
GAUGE_COLUMNS = ("ResourceAttributes", "ServiceName", "MetricName", "Attributes", "StartTimeUnix", "TimeUnix",
                 "Value")
SUM_COLUMNS = (*GAUGE_COLUMNS, "AggregationTemporality", "IsMonotonic")
LOG_COLUMNS = ("ResourceAttributes", "ServiceName", "Timestamp", "SeverityText", "SeverityNumber", "Body",
               "LogAttributes")
TIMES = {"StartTimeUnix", "TimeUnix", "Timestamp"}


def _ns(text: str) -> int:
    """Nanoseconds of a UTC 'YYYY-MM-DD HH:MM:SS[.fff]'."""
    d = dt.datetime.fromisoformat(text).replace(tzinfo=dt.UTC)
    return int(d.replace(microsecond=0).timestamp()) * 10**9 + d.microsecond * 1000  # exact: no float ns


def _select(store: Store, table: str, columns: tuple[str, ...], time_col: str, where: str,
            params: dict[str, Any]) -> list[dict[str, Any]]:
    # times as integer ns, under other names: an alias named like its column would shadow it in WHERE
    exprs = [f"toUnixTimestamp64Nano({c}) AS {c}_ns" if c in TIMES else c for c in columns]
    sql = f"SELECT {', '.join(exprs)} FROM {table} WHERE {where} ORDER BY {time_col}"
    _, rows = store.query(sql, parameters=params)
    return [dict(zip(columns, r, strict=True)) for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in ("store", "case", "start", "end", "metrics", "detectors", "runs", "description"):
        ap.add_argument(f"--{name}", required=True)
    ap.add_argument("--config", default="{}", help="JSON: detector settings (as the controller config's keys).")
    ap.add_argument("--hosts", default="", help="Comma-separated nodes to keep (default: every node).")
    a = ap.parse_args()
    store = Store(f"chdb://{a.store}")
    params = {"start": _ns(a.start), "end": _ns(a.end), "names": a.metrics.split(","),
              "hosts": a.hosts.split(",") if a.hosts else []}
    window = ("BETWEEN {start:Int64} AND {end:Int64} AND (empty({hosts:Array(String)}) "
              "OR ResourceAttributes['ridethrough.node.id'] IN {hosts:Array(String)})")
    points = f"MetricName IN {{names:Array(String)}} AND toUnixTimestamp64Nano(TimeUnix) {window}"
    rows = {t: _select(store, t, cols, "TimeUnix", points, params)
            for t, cols in (("otel_metrics_gauge", GAUGE_COLUMNS), ("otel_metrics_sum", SUM_COLUMNS))}
    rows["otel_logs"] = _select(store, "otel_logs", LOG_COLUMNS, "Timestamp",
                                f"toUnixTimestamp64Nano(Timestamp) {window}", params)
    GOLDEN.mkdir(parents=True, exist_ok=True)
    with gzip.open(GOLDEN / f"{a.case}.rows.json.gz", "wt", encoding="utf-8") as f:
        json.dump(rows, f, separators=(",", ":"), sort_keys=True)
    case = {"description": a.description, "recorded": f"bench/detect_eval.py lab store, {a.start} to {a.end} UTC",
            "detectors": a.detectors.split(","), "config": json.loads(a.config),
            "runs_ns": [_ns(r) for r in a.runs.split(",")], "expected": None}
    (GOLDEN / f"{a.case}.json").write_text(json.dumps(case, indent=1) + "\n")
    print(a.case, {t: len(r) for t, r in rows.items()})


if __name__ == "__main__":
    main()
