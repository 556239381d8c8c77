"""Golden cases: the detectors on windows recorded from lab runs, against the findings they were approved with.

Each case in ``tests/fixtures/golden/detectors`` is the rows a kept `bench/detect_eval.py` lab store
held around one fault (``<case>.rows.json.gz``, written by ``tests/tools/record_golden.py``) and
what to run on them (``<case>.json``: the detectors, their settings, the window ends of the
runs, in order, through the same detector objects). The findings of every run must equal the
case's ``expected``: a change in what a detector finds on real telemetry shows as a diff here.
``expected`` is rewritten only by ``pytest tests/test_detector_golden.py --update-golden``, to
be read and committed with the change that explains it.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ridethrough.detectors.contract import Finding, Window
from ridethrough.detectors.controller import default_detectors
from ridethrough.exporters import schema
from ridethrough.exporters.store import Store
from tests.test_detectors import insert

pytestmark = pytest.mark.integration

GOLDEN = Path(__file__).resolve().parent / "fixtures" / "golden" / "detectors"
CASES = sorted(p.name.removesuffix(".json") for p in GOLDEN.glob("*.json") if p.name != "fabric.json")
TABLES = {t.name: t for t in (schema.GAUGE, schema.SUM, schema.LOGS)}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    st = Store(f"chdb://{tmp_path_factory.mktemp('golden') / 'store'}")
    st.init_schema()
    yield st
    st.close()


def load(store: Store, case: str) -> None:
    """Write the case's rows, each marked with the case's cluster (so cases never see each other's rows)."""
    with gzip.open(GOLDEN / f"{case}.rows.json.gz", "rt", encoding="utf-8") as f:
        tables: dict[str, list[dict[str, Any]]] = json.load(f)
    for name, rows in tables.items():
        if not rows:
            continue
        for r in rows:
            r["ResourceAttributes"] = {**r["ResourceAttributes"], "ridethrough.cluster": case}
        insert(store, TABLES[name], rows, token=f"golden-{case}-{name}")


def summary(f: Finding) -> dict[str, Any]:
    """What a finding is compared by: everything but evidence values that are not its query's name."""
    return {"detector": f.detector, "kind": f.kind.value, "entity_type": f.entity_type.value, "entity": f.entity,
            "severity": f.severity.name, "confidence": f.confidence, "summary": f.summary,
            "observed_at_ns": f.observed_at_ns, "time_to_failure_s": f.time_to_failure_s,
            "query": f.evidence.get("query")}


def run_case(store: Store, case: str, spec: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """Every run's findings (summaries, sorted), in the case's order."""
    cfg = SimpleNamespace(fabric_map_file=str(GOLDEN / "fabric.json"), **spec["config"])
    detectors = [d for d in default_detectors(cfg) if d.name in spec["detectors"]]
    assert sorted(d.name for d in detectors) == sorted(spec["detectors"]), "a detector the case names is gone"

    def query(sql: str, params: Any) -> tuple[list[str], list[tuple[Any, ...]]]:
        return store.query(sql, parameters=dict(params))

    out = []
    for end in spec["runs_ns"]:
        found = [summary(f) for d in detectors
                 for f in d.detect(Window(start_ns=end - round(d.window_s * 1e9), end_ns=end, query=query,
                                          cluster=case))]
        out.append(sorted(found, key=lambda s: (s["detector"], s["entity"])))
    return out


@pytest.mark.parametrize("case", CASES)
def test_golden_case(store: Store, case: str, request: pytest.FixtureRequest) -> None:
    path = GOLDEN / f"{case}.json"
    spec = json.loads(path.read_text())
    load(store, case)
    got = run_case(store, case, spec)
    if request.config.getoption("--update-golden"):
        path.write_text(json.dumps({**spec, "expected": got}, indent=1) + "\n")
        pytest.skip(f"{path.name}: expected rewritten; read the diff before committing it")
    assert spec["expected"] is not None, f"{path.name} has no expected findings yet: run with --update-golden"
    assert got == spec["expected"]


def test_every_case_expects_a_finding_somewhere() -> None:
    """A case whose runs all find nothing would pass against a detector that finds nothing at all."""
    assert CASES
    for case in CASES:
        spec = json.loads((GOLDEN / f"{case}.json").read_text())
        assert spec["expected"] and any(spec["expected"]), f"{case}: no run expects a finding"
