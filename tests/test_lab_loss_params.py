"""The lossy-link fault without a lab: its parameter checks, its catalogue entry, the scenario runner's
calls, the spine scenario that uses it, and the refusals (no nft, the loopback mode)."""

from __future__ import annotations

import math
import re
import textwrap
from pathlib import Path

import pytest

from ridethrough.lab import nft
from ridethrough.lab.control import Direction, LabError
from ridethrough.lab.fault_params import LOSS_PERCENT, coerce
from ridethrough.lab.faults import KINDS, Effect, EntityType, names
from ridethrough.lab.loopback import LoopbackLab
from ridethrough.lab.scenario import ScenarioError, load_scenario, parse_scenario
from ridethrough.lab.state import StateFile
from tests.test_scenario import RecordingLab, run

SCENARIOS = Path(__file__).resolve().parents[1] / "lab" / "scenarios"
NAMES = names(8, 2, 2, 2)


class LossRecordingLab(RecordingLab):
    """`RecordingLab` that also records `lose_packets`."""

    def lose_packets(self, link: str, *, percent: float, direction: Direction = Direction.BOTH) -> None:
        self._call("lose_packets", link, percent, direction)


@pytest.mark.parametrize("percent", [0.01, 5, 10.5, 100])
def test_percent_in_range_is_taken(percent: float) -> None:
    assert nft.check_percent(percent) == percent


@pytest.mark.parametrize(("percent", "message"), [
    (0, r"must be in \(0, 100\], got 0"),
    (-5, r"must be in \(0, 100\], got -5"),
    (100.01, r"must be in \(0, 100\], got 100\.01"),
    (math.inf, "must be a number"),
    (math.nan, "must be a number"),
    (True, "must be a number"),
    ("5", "must be a number"),
    (None, "must be a number"),
    (0.001, "below the smallest step"),
])
def test_percent_out_of_range_or_not_a_number_is_refused(percent: object, message: str) -> None:
    with pytest.raises(LabError, match=message):
        nft.check_percent(percent)


def test_catalogue_param_bounds_match_the_lab_check() -> None:
    assert coerce(LOSS_PERCENT, 100, names=NAMES) == 100.0
    assert coerce(LOSS_PERCENT, 7.5, names=NAMES) == 7.5
    for bad, why in ((0, "out of range"), (100.5, "out of range"), ("ten", "expected a number"), (True, "number")):
        with pytest.raises(ValueError, match=why):
            coerce(LOSS_PERCENT, bad, names=NAMES)
    kind = KINDS["loss"]
    assert [p.name for p in kind.params] == ["percent", "direction"]
    assert "loss" in KINDS["restore"].clears


def test_missing_nft_names_the_debian_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(nft, "_SBIN", ())
    assert not nft.available()
    with pytest.raises(LabError, match=r"install the nftables Debian package"):
        nft.nft_binary()
    with pytest.raises(LabError, match=r"install the nftables Debian package"):
        nft.set_loss("any", "eth0", 5)


def test_bad_interface_names_are_refused_before_nft_runs() -> None:
    for bad in ("", 'eth"0', "eth\n0"):
        with pytest.raises(LabError, match="bad interface name"):
            nft.set_loss(None, bad, 5)


def test_a_loss_fault_runs_and_is_undone_by_restore_with_link_truth() -> None:
    sc = parse_scenario(textwrap.dedent("""\
        name: t
        duration: 30s
        timeline:
          - {at: 2s, for: 10s, fault: loss, target: leaf0r0-spine1, percent: 7.5, direction: reverse}
          - {at: 15s, fault: loss, target: h2-leaf0r1}
          - {at: 20s, fault: restore, target: h2-leaf0r1}
        """), source="t.yaml")
    first, second, _ = sc.timeline
    assert (first.truth.entity, first.truth.entity_type, first.truth.kind, first.truth.effect) == \
        ("leaf0r0-spine1", EntityType.LINK, "link_degraded", Effect.DEGRADATION)
    assert second.params["percent"] == 5.0 and second.params["direction"] == "both"
    lab = LossRecordingLab()
    result = run(sc, lab)
    assert all(o.applied and not o.error for o in result.outcomes)
    assert lab.calls == [
        (2.0, "lose_packets", ("leaf0r0-spine1", 7.5, Direction.REVERSE)),
        (12.0, "restore_link", ("leaf0r0-spine1",)),
        (15.0, "lose_packets", ("h2-leaf0r1", 5.0, Direction.BOTH)),
        (20.0, "restore_link", ("h2-leaf0r1",)),  # the open loss's undo, as for any lasting link fault
        (20.0, "restore_link", ("h2-leaf0r1",)),  # the restore itself
    ]


@pytest.mark.parametrize(("line", "message"), [
    ("{at: 1s, fault: loss, target: h2-leaf0r1, percent: 0}", r"percent: 0 is out of range"),
    ("{at: 1s, fault: loss, target: h2-leaf0r1, percent: 150}", r"percent: 150 is out of range"),
    ("{at: 1s, fault: loss, target: h2-leaf9r1}", r"target: no link 'h2-leaf9r1'"),
    ("{at: 1s, fault: loss, target: h2, percent: 5}", r"target: no link 'h2'"),
    ("{at: 1s, fault: loss, target: h2-leaf0r1, direction: up}", r"direction: expected one of both, forward"),
])
def test_bad_loss_faults_in_a_scenario_are_rejected_with_the_field(line: str, message: str) -> None:
    with pytest.raises(ScenarioError) as info:
        parse_scenario(f"name: t\nduration: 30s\ntimeline:\n  - {line}\n", source="bad.yaml")
    assert any(re.search(message, str(p)) for p in info.value.problems), info.value.problems


def test_the_spine_scenario_degrades_its_link_with_loss_before_cutting_it() -> None:
    sc = load_scenario(SCENARIOS / "spine_link_degrades.yaml")
    loss, cut = sc.timeline
    assert (loss.kind, loss.target, loss.truth.kind, loss.truth.precursor_at_s) == \
        ("loss", "leaf1r0-spine0", "link_degrading", 10.0)
    assert 5 <= float(loss.params["percent"] or 0) <= 20
    assert (cut.kind, cut.target) == ("link-down", "leaf1r0-spine0")


def test_the_loopback_mode_refuses_loss_in_one_line(tmp_path: Path) -> None:
    lab = LoopbackLab(StateFile(tmp_path, "lb"), {"name": "lb", "mode": "loopback", "dir": str(tmp_path)})
    with pytest.raises(LabError, match="without a fabric: link faults need network namespaces") as info:
        lab.lose_packets("h0-leaf0r0", percent=5)
    assert "\n" not in str(info.value)
