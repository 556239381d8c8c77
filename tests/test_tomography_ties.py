"""Tomography ties broken by the switches' port error counters, on synthetic windows in the embedded store.

With two leaves per rail every path over ``leaf1r0-spine0`` also crosses ``leaf0r0-spine0``: the
probes alone name both (the first in name order, half the confidence each). A failing optic on
``leaf1r0-spine0`` also shows as receive errors at a port of its cable (``leaf1r0/spine0`` or
``spine0/leaf1r0``), which the switches export as hosts export their IB ports.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ridethrough.detectors import link, tomography
from ridethrough.detectors.contract import EntityType, Finding, FindingKind, Window
from ridethrough.detectors.tomography import Blame, RouteMap, Tomography, untie
from ridethrough.exporters import schema
from ridethrough.exporters.store import Store, StoreError
from tests import test_detectors as td
from tests import test_tomography as tt

store = td.store  # the module-scoped chDB store of the detector tests

BAD = "leaf1r0-spine0"
TWIN = "leaf0r0-spine0"  # every path over BAD crosses it too, and it comes first in name order
DESIGN = RouteMap.from_fabric(tt.TWO_RACKS)  # ECMP: the spine1 links of rail 0 tie with them as well
ERRORS_PER_S = 4.0
WINDOW_ERRORS = ERRORS_PER_S * 60  # 12 collections 5 s apart in the detector's 60 s window


def _errors(c: str, port: str, per_s: float, counter: str = "port_rcv_errors") -> list[dict[str, Any]]:
    """``port`` (``SWITCH/IFNAME``) counting ``per_s`` errors a second all along, as a switch exports it."""
    node, _, device = port.partition("/")
    attrs = {"ib.device": device, "ib.port": "1", "ib.counter": counter}
    return td.series(c, node, td.ERR, attrs, td._cumulative([per_s] * td.N))


def _run(store: Store, c: str, ports: Mapping[str, float], *, routes: RouteMap = DESIGN,
         fail_counters: bool = False) -> Finding:
    """The one finding for a lossy BAD, with ``ports`` counting errors at those rates."""
    tt.write(store, tt.fabric_rows(c, tt.TWO_RACKS, tt.exact(tt.TWO_RACKS), {BAD: 0.1}))
    td.insert(store, schema.SUM, [r for port, per_s in ports.items() for r in _errors(c, port, per_s)])

    def query(sql: str, params: Mapping[str, Any]) -> tuple[list[str], list[tuple[Any, ...]]]:
        if fail_counters and params.get("metric") == td.ERR:
            raise StoreError("the store refused the port counters")
        answer: tuple[list[str], list[tuple[Any, ...]]] = store.query(sql, parameters=dict(params))
        return answer

    det = Tomography(routes=routes)
    [f] = det.detect(Window(start_ns=td.END - int(det.window_s * td.S), end_ns=td.END, query=query, cluster=c))
    assert f.kind is FindingKind.LINK_DEGRADING and f.entity_type is EntityType.LINK
    return f


@pytest.mark.integration
@pytest.mark.parametrize("port", ["leaf1r0/spine0", "spine0/leaf1r0"])
@pytest.mark.parametrize("map_name", ["design", "walked"])
def test_store_errors_at_one_end_of_a_candidate_name_it_alone(store: Store, port: str, map_name: str) -> None:
    # exact routes, as a walk of the running fabric finds them, with the design's cabling
    routes = DESIGN if map_name == "design" else RouteMap(tt.exact(tt.TWO_RACKS).to_json()["routes"],
                                                          DESIGN.to_json()["nics"])
    f = _run(store, f"tie-one-{port.replace('/', '-')}-{map_name}", {port: ERRORS_PER_S}, routes=routes)
    assert f.entity == BAD and f.confidence == 1.0  # no good path crosses it: not split between candidates
    assert {BAD, TWIN} <= set(f.evidence["candidates"])
    assert f.evidence["port_errors"][BAD] == pytest.approx(WINDOW_ERRORS)
    assert all(n == 0 for lk, n in f.evidence["port_errors"].items() if lk != BAD)
    assert set(f.evidence["port_errors"]) == set(f.evidence["candidates"])
    assert f"its ports counted {WINDOW_ERRORS:g} error(s)" in f.summary


@pytest.mark.integration
@pytest.mark.parametrize(("case", "ports"), [
    ("none", {}),
    ("both", {"leaf1r0/spine0": ERRORS_PER_S, "spine0/leaf0r0": ERRORS_PER_S / 2}),
    ("below-floor", {"leaf1r0/spine0": 0.1}),  # 6 errors in the window: noise on a PAM4 link
    ("not-a-candidate", {"leaf1r1/spine0": ERRORS_PER_S, "leaf1r0/h4": ERRORS_PER_S}),  # same port names elsewhere
], ids=lambda v: v if isinstance(v, str) else "")
def test_store_errors_that_single_out_no_candidate_leave_the_tie(store: Store, case: str,
                                                                 ports: dict[str, float]) -> None:
    f = _run(store, f"tie-{case}", ports)
    assert f.entity == TWIN and f.confidence == pytest.approx(1 / len(f.evidence["candidates"]))
    assert {BAD, TWIN} <= set(f.evidence["candidates"]) and "port_errors" not in f.evidence
    assert "the data cannot tell it from" in f.summary


@pytest.mark.integration
def test_store_a_map_without_cabling_leaves_the_tie(store: Store) -> None:
    f = _run(store, "tie-no-cabling", {"leaf1r0/spine0": ERRORS_PER_S}, routes=tt.exact(tt.TWO_RACKS))
    assert f.entity == TWIN and f.confidence == 0.5 and "port_errors" not in f.evidence


@pytest.mark.integration
def test_store_a_failed_counter_read_keeps_the_finding(store: Store, caplog: pytest.LogCaptureFixture) -> None:
    f = _run(store, "tie-store-error", {"leaf1r0/spine0": ERRORS_PER_S}, fail_counters=True)
    assert "reading ridethrough.ib.port.errors at the tied links' ports failed" in caplog.text
    assert f.entity == TWIN and "port_errors" not in f.evidence and len(f.evidence["candidates"]) > 1


@pytest.mark.integration
def test_store_a_switch_port_s_rising_errors_are_named_by_its_link(store: Store) -> None:
    c = "tie-link-degrading"
    rising = td._cumulative([0.1 * i for i in range(td.N)])
    td.insert(store, schema.SUM, td.series(c, "spine0", td.ERR, {"ib.device": "leaf1r0", "ib.port": "1",
                                                                 "ib.counter": "symbol_error"}, rising))
    [f] = td.run(store, link.LinkDegrading(fabric=lambda: DESIGN), c)
    assert (f.kind, f.entity_type, f.entity) == (FindingKind.LINK_DEGRADING, EntityType.LINK, BAD)
    assert f.evidence["nics"] == ["spine0/leaf1r0"]


# -- untie, pure -------------------------------------------------------------------------------

def _tie(candidates: Sequence[str] = (TWIN, BAD), votes: float = 8.0) -> Blame:
    return Blame(candidates[0], ("p1", "p2"), ("g0",), votes, tuple(candidates), 0.8 / len(candidates))


@pytest.mark.parametrize(("errors", "chosen"), [
    ({BAD: 50.0}, BAD),
    ({BAD: 50.0, TWIN: 5.0}, BAD),      # the other at most a tenth: noise beside a failing optic
    ({BAD: 50.0, TWIN: 5.1}, TWIN),     # more: both ends of the tie are erring, the counters say nothing
    ({BAD: 9.9}, TWIN),                 # under the floor
    ({}, TWIN),
])
def test_untie_needs_one_candidate_well_ahead(errors: dict[str, float], chosen: str) -> None:
    got = untie(_tie(), errors, {BAD: ["g1", "g2"], TWIN: ["g0"]})
    assert got.link == chosen
    if chosen == BAD:
        assert got.contradicting == ("g1", "g2") and got.confidence == 8.0 / 10.0
        assert got.port_errors == {TWIN: errors.get(TWIN, 0.0), BAD: 50.0} and got.candidates == (TWIN, BAD)
    else:
        assert got == _tie()


def test_untie_leaves_a_single_candidate_alone() -> None:
    alone = _tie((BAD,))
    assert untie(alone, {BAD: 1e6}, {}) is alone


@pytest.mark.parametrize("knobs", [{"tie_min_errors": 0.0}, {"tie_max_share": 1.0}, {"tie_max_share": -0.1}])
def test_bad_tie_knobs_are_refused(knobs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="tie_"):
        Tomography(routes=DESIGN, **knobs)


def test_build_reads_the_tie_knobs(tmp_path: Path) -> None:
    path = tmp_path / "fabric.json"
    path.write_text(json.dumps(DESIGN.to_json()))
    [det] = tomography.build(SimpleNamespace(fabric_map_file=str(path), tomography_tie_min_errors=3.0,
                                             tomography_tie_max_share=0.2))
    assert isinstance(det, Tomography) and (det.tie_min_errors, det.tie_max_share) == (3.0, 0.2)
