"""Scenarios: the shipped files validate, bad ones are rejected with line and field, the runner
applies and undoes faults in order on an injected clock, and the truth each fault implies."""

from __future__ import annotations

import textwrap
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from ridethrough.lab.control import Direction, GpuFault, LabError
from ridethrough.lab.faults import KINDS, Effect, EntityType, names
from ridethrough.lab.runner import Phase, RunResult, plan, run_timeline
from ridethrough.lab.scenario import Scenario, ScenarioError, check_lab, load_scenario, parse_scenario
from ridethrough.lab.truth import run_scenario, summary

SCENARIOS = sorted((Path(__file__).resolve().parents[1] / "lab" / "scenarios").glob("*.yaml"))
WALL0_NS = 1_700_000_000_000_000_000


class FakeClock:
    """Monotonic seconds that only move when the runner sleeps; ``at(t, fn)`` runs fn once t is reached."""

    def __init__(self) -> None:
        self.now = 0.0
        self.hooks: list[tuple[float, Callable[[], None]]] = []

    def __call__(self) -> float:
        return self.now

    def wall_ns(self) -> int:
        return WALL0_NS + round(self.now * 1e9)

    def sleep(self, seconds: float) -> None:
        """Like ``Event.wait``: returns early, at the hook's time, when a hook fires during the sleep."""
        due = sorted((h for h in self.hooks if h[0] <= self.now + seconds), key=lambda h: h[0])
        if not due:
            self.now += seconds
            return
        self.hooks.remove(due[0])
        self.now = max(self.now, due[0][0])
        due[0][1]()

    def at(self, t: float, fn: Callable[[], None]) -> None:
        self.hooks.append((t, fn))


class RecordingLab:
    """A `LabControl` that records each call with the fake time; ``fail`` makes methods raise LabError."""

    def __init__(self, clock: FakeClock | None = None, *, fail: Mapping[str, str] | None = None) -> None:
        self.clock = clock or FakeClock()
        self.fail = dict(fail or {})
        self.calls: list[tuple[float, str, tuple[object, ...]]] = []
        self._names = names(8, 2, 2, 2)
        self._loads = 0

    @property
    def name(self) -> str:
        return "testlab"

    def hosts(self) -> list[str]:
        return list(self._names.hosts)

    def links(self) -> list[str]:
        return list(self._names.links)

    def _call(self, method: str, *args: object) -> None:
        self.calls.append((self.clock.now, method, args))
        if method in self.fail:
            raise LabError(self.fail[method])

    def set_link(self, link: str, *, up: bool, end: str | None = None) -> None:
        self._call("set_link", link, up, end)

    def degrade_link(self, link: str, *, rate_mbit: float, burst_kbit: float = 32.0, latency_ms: float = 20.0,
                     direction: Direction = Direction.BOTH) -> None:
        self._call("degrade_link", link, rate_mbit, burst_kbit, latency_ms, direction)

    def lose_packets(self, link: str, *, percent: float, direction: Direction = Direction.BOTH) -> None:
        self._call("lose_packets", link, percent, direction)

    def restore_link(self, link: str) -> None:
        self._call("restore_link", link)

    def set_mtu(self, link: str, *, end: str, mtu: int) -> None:
        self._call("set_mtu", link, end, mtu)

    def start_load(self, link: str, *, direction: Direction, rate_mbit: float) -> str:
        self._call("start_load", link, direction, rate_mbit)
        self._loads += 1
        return f"load-{self._loads}"

    def stop_load(self, handle: str) -> None:
        self._call("stop_load", handle)

    def step_clock(self, host: str, *, step_ns: int) -> None:
        self._call("step_clock", host, step_ns)

    def gpu_fault(self, host: str, gpu: int, fault: GpuFault, params: Mapping[str, float]) -> None:
        self._call("gpu_fault", host, gpu, fault, dict(params))

    def clear_gpu(self, host: str, gpu: int) -> None:
        self._call("clear_gpu", host, gpu)

    def nic_error_ramp(self, host: str, nic: str, *, counter: str, rate_per_s: float,
                       link_down_after_s: float | None = None) -> None:
        self._call("nic_error_ramp", host, nic, counter, rate_per_s, link_down_after_s)

    def clear_nic(self, host: str, nic: str) -> None:
        self._call("clear_nic", host, nic)

    def freeze_host(self, host: str) -> None:
        self._call("freeze_host", host)

    def thaw_host(self, host: str) -> None:
        self._call("thaw_host", host)

    def straggle(self, host: str, *, cpu_fraction: float) -> None:
        self._call("straggle", host, cpu_fraction)

    def unstraggle(self, host: str) -> None:
        self._call("unstraggle", host)


def scenario(body: str, *, duration: str = "60s") -> Scenario:
    return parse_scenario(f"name: t\nduration: {duration}\n" + textwrap.dedent(body), source="t.yaml")


def problems(text: str) -> list[str]:
    with pytest.raises(ScenarioError) as info:
        parse_scenario(textwrap.dedent(text), source="bad.yaml")
    return [str(p) for p in info.value.problems]


def run(sc: Scenario, lab: RecordingLab, **kwargs) -> RunResult:
    return run_timeline(sc, lab, clock=lab.clock, sleep=lab.clock.sleep, wall_ns=lab.clock.wall_ns, **kwargs)


# -- the shipped scenarios -----------------------------------------------------------------


def test_at_least_six_scenarios_ship_covering_every_fault_family() -> None:
    kinds = {f.kind for path in SCENARIOS for f in load_scenario(path).timeline}
    assert len(SCENARIOS) >= 6
    assert {"link-down", "nic-ramp", "gpu", "clock-step", "straggle", "freeze", "loss", "mtu"} <= kinds
    effects = {(f.truth.precursor_at_s is not None, f.truth.failure_at_s is not None)
               for path in SCENARIOS for f in load_scenario(path).timeline}
    assert {(True, True), (False, True), (True, False)} <= effects  # with and without precursors


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_shipped_scenario_validates_and_runs_against_the_default_lab(path: Path) -> None:
    sc = load_scenario(path)
    assert sc.name == path.stem and sc.description
    lab = RecordingLab()
    check_lab(sc, hosts=lab.hosts(), links=lab.links())
    result = run(sc, lab)
    assert all(o.applied and not o.error for o in result.outcomes)
    assert not result.stopped and lab.clock.now == pytest.approx(sc.duration_s)


# -- rejected before anything starts -------------------------------------------------------

GOOD_HEAD = """\
name: bad
duration: 60s
timeline:
"""


@pytest.mark.parametrize(("text", "expected"), [
    (GOOD_HEAD + "  - {at: 5s, fault: link-down, target: h2-leaf0r1}\ntimelin: []\n",
     "bad.yaml:5: timelin: unknown key (did you mean 'timeline'?)"),
    (GOOD_HEAD + "  - at: 5s\n    fault: degrade\n    target: h2-leaf0r1\n    rate: 10\n",
     "bad.yaml:7: timeline[0].rate: unknown key (did you mean 'rate_mbit'?)"),
    (GOOD_HEAD + "  - at: 5s\n    fault: link-dwn\n    target: h2-leaf0r1\n",
     "bad.yaml:5: timeline[0].fault: unknown fault kind 'link-dwn' (did you mean 'link-down'?)"),
    (GOOD_HEAD + "  - {at: 5s, fault: freeze, target: h1}\n  - at: 5s\n    fault: freeze\n    target: h9\n",
     "bad.yaml:7: timeline[1].target: no host 'h9' (hosts are h0..h7)"),
    (GOOD_HEAD + "  - at: 5s\n    fault: link-down\n    target: h2-leaf1r0\n",
     "bad.yaml:6: timeline[0].target: no link 'h2-leaf1r0' (links are like h0-leaf0r0, leaf1r1-spine1) "
     "(h2's links are h2-leaf0r0, h2-leaf0r1)"),
    (GOOD_HEAD + "  - {at: 5s, fault: gpu, target: h2, gpu_fault: xid, code: 79,\n     gpu: 8}\n",
     "bad.yaml:5: timeline[0].gpu: no GPU 8 (GPUs are 0..7)"),
    (GOOD_HEAD + "  - at: 5 secs\n    fault: freeze\n    target: h1\n",
     "bad.yaml:4: timeline[0].at: expected a duration like '500ms', '5s', '2m' or seconds, got '5 secs'"),
    (GOOD_HEAD + "  - {at: 5s, fault: straggle, target: h1, cpu_fraction: lots}\n",
     "bad.yaml:4: timeline[0].cpu_fraction: expected a number, got 'lots'"),
    (GOOD_HEAD + "  - at: 5s\n    fault: straggle\n    target: h1\n    cpu_fraction: 1.5\n",
     "bad.yaml:7: timeline[0].cpu_fraction: 1.5 is out of range (must be > 0 and < 1)"),
    (GOOD_HEAD + "  - {at: 5s, fault: mtu, target: h2-leaf0r1, end: spine0, mtu: 1400}\n",
     "bad.yaml:4: timeline[0].end: expected one of h2, leaf0r1, got 'spine0'"),
    (GOOD_HEAD + "  - {at: 5s, fault: gpu, target: h2, gpu: 1, gpu_fault: xid}\n",
     "bad.yaml:4: timeline[0]: missing required parameter 'code' of gpu"),
    (GOOD_HEAD + "  - {at: 5s, fault: gpu, target: h2, gpu: 1, gpu_fault: thermal, rate_per_s: 3}\n",
     "bad.yaml:4: timeline[0].rate_per_s: unknown key (did you mean 'deg_per_s'?)"),
    (GOOD_HEAD + "  - {at: 5s, for: 10s, fault: link-up, target: h2-leaf0r1}\n",
     "bad.yaml:4: timeline[0].for: link-up is instant and has no undo; drop 'for'"),
    (GOOD_HEAD + "  - {at: 70s, fault: freeze, target: h1}\n",
     "bad.yaml:4: timeline[0].at: 70s is not before the run ends (duration 60s)"),
    (GOOD_HEAD + "  - {at: 50s, for: 20s, fault: freeze, target: h1}\n",
     "bad.yaml:4: timeline[0].for: the fault ends at 70s, after the run ends (duration 60s)"),
    (GOOD_HEAD + "  - {at: 5s, for: 20s, fault: nic-ramp, target: h1, link_down_after_s: 30s}\n",
     "bad.yaml:4: timeline[0]: failure_at 35s is after the fault ends at 25s"),
    (GOOD_HEAD + "  - at: 5s\n    fault: freeze\n    target: h1\n    truth: {entiy: h1}\n",
     "bad.yaml:7: timeline[0].truth.entiy: unknown key (did you mean 'entity'?)"),
    (GOOD_HEAD + "  - at: 5s\n    fault: freeze\n    target: h1\n    truth:\n      failure_at: 2s\n",
     "bad.yaml:8: timeline[0].truth.failure_at: 2s is before the fault starts at 5s"),
    (GOOD_HEAD + "  - at: 5s\n    fault: freeze\n    target: h1\n    truth:\n      entity: h1/gpu9\n",
     "bad.yaml:8: timeline[0].truth.entity: no entity 'h1/gpu9' in the topology (a host, link, switch, "
     "host/nicN or host/gpuN)"),
    ("name: bad\nduration: 60s\ntopology: {hosts: 8, racks: 3}\ntimeline:\n  - {at: 5s, fault: freeze, target: h1}\n",
     "bad.yaml:3: topology.racks: 8 hosts do not split evenly into 3 racks"),
    ("name: bad\nduration: 60s\njobs:\n  - {name: j, hosts: [h0, h8], command: [x]}\ntimeline:\n"
     "  - {at: 5s, fault: freeze, target: h1}\n", "bad.yaml:4: jobs[0].hosts[1]: no host 'h8' (hosts are h0..h7)"),
    ("name: bad\nduration: 60s\ntimeline:\n  - {at: 5s, fault: freeze, target: h1\n  - {at: 6s}\n",
     "bad.yaml:5: invalid YAML: expected ',' or '}', but got '{'"),
    ("name: bad\ntimeline:\n  - {at: 5s, fault: freeze, target: h1}\n", "bad.yaml:1: missing required key 'duration'"),
    (GOOD_HEAD + "  - {at: 5s, for: 10s, fault: flap, target: h2-leaf0r1}\n",
     "bad.yaml:4: timeline[0].for: flap ends by itself after count x period_s; drop 'for'"),
    ("name: bad\nduration: 60s\njobs:\n  - {name: j, hosts: [h0], command: [x]}\n  - name: j\n    hosts: [h1]\n"
     "    command: [y]\ntimeline:\n  - {at: 5s, fault: freeze, target: h1}\n",
     "bad.yaml:5: jobs[1].name: a job named 'j' is already listed"),
], ids=["top-key", "param-key", "kind", "host", "link", "gpu-index", "duration", "param-type", "param-range",
        "link-end", "required-param", "variant-param", "for-on-instant", "at-after-end", "for-after-end",
        "truth-after-end", "truth-key", "truth-before-start", "truth-entity", "topology", "job-host", "yaml-syntax",
        "missing-duration", "for-on-flap", "duplicate-job"])
def test_bad_scenario_is_rejected_with_line_and_field(text: str, expected: str) -> None:
    assert expected in problems(text)


@pytest.mark.parametrize(("timeline", "expected"), [
    ("  - {at: 5s, for: 20s, fault: degrade, target: h2-leaf0r1}\n"
     "  - {at: 10s, for: 5s, fault: degrade, target: h2-leaf0r1, rate_mbit: 5}\n",
     "bad.yaml:5: timeline[1]: overlaps timeline[0] (degrade of h2-leaf0r1 from 5s to 25s): one fault at a time "
     "on link h2-leaf0r1"),
    ("  - {at: 5s, for: 20s, fault: link-down, target: h2-leaf0r1}\n"
     "  - {at: 10s, fault: link-up, target: h2-leaf0r1}\n",
     "bad.yaml:5: timeline[1]: link-up at 10s contradicts timeline[0] (link-down of h2-leaf0r1 from 5s to 25s): "
     "it is undone by the runner itself"),
    ("  - {at: 5s, fault: link-down, target: h2-leaf0r1}\n"
     "  - {at: 10s, for: 5s, fault: mtu, target: h2-leaf0r1, end: h2, mtu: 9000}\n",
     "bad.yaml:5: timeline[1]: overlaps timeline[0] (link-down of h2-leaf0r1 from 5s to 60s): one fault at a time "
     "on link h2-leaf0r1"),
    ("  - {at: 5s, fault: gpu, target: h2, gpu: 3, gpu_fault: thermal}\n"
     "  - {at: 10s, fault: gpu, target: h2, gpu: 3, gpu_fault: thermal}\n",
     "bad.yaml:5: timeline[1]: overlaps timeline[0] (gpu of h2 from 5s to 60s): one fault at a time on gpu h2/gpu3"),
    ("  - {at: 5s, fault: nic-ramp, target: h3, link_down_after_s: 10s}\n"
     "  - {at: 30s, for: 5s, fault: link-down, target: h3-leaf0r0}\n",
     "bad.yaml:5: timeline[1]: overlaps timeline[0] (nic-ramp of h3 from 5s to 60s): one fault at a time on link "
     "h3-leaf0r0"),
    ("  - {at: 5s, fault: freeze, target: h1}\n  - {at: 5s, fault: thaw, target: h1}\n",
     "bad.yaml:5: timeline[1]: thaw at 5s contradicts timeline[0] (freeze of h1 from 5s to 60s): it starts at the "
     "same time"),
])
def test_contradictory_overlaps_are_rejected(timeline: str, expected: str) -> None:
    assert expected in problems(GOOD_HEAD + timeline)


def test_every_problem_is_reported_at_once_in_line_order() -> None:
    found = problems(GOOD_HEAD + "  - {at: 5s, fault: nope, target: h1}\n  - {at: 1x, fault: freeze, target: h1}\n"
                     "  - {at: 5s, fault: freeze, target: h99}\nextra: 1\n")
    assert [p.split(":")[1] for p in found] == ["4", "5", "6", "7"]


def test_what_may_overlap_and_what_a_recovery_ends() -> None:
    sc = scenario("""\
        timeline:
          - {at: 5s, fault: gpu, target: h2, gpu: 3, gpu_fault: ecc_sbe_rising}
          - {at: 9s, fault: gpu, target: h2, gpu: 3, gpu_fault: xid, code: 79}
          - {at: 5s, fault: link-down, target: h2-leaf0r1}
          - {at: 20s, fault: link-up, target: h2-leaf0r1}
          - {at: 30s, for: 5s, fault: degrade, target: h2-leaf0r1}
          - {at: 40s, fault: thaw, target: h1}
          - {at: 5s, fault: freeze, target: h2}
          - {at: 6s, fault: straggle, target: h2}
          - {at: 7s, fault: clock-step, target: h2, step_ms: 1}
          - {at: 8s, fault: clock-step, target: h2, step_ms: -1}
        """)
    assert [f.closes for f in sc.timeline] == [(), (), (), (2,), (), (), (), (), (), ()]


# -- truth -----------------------------------------------------------------------------------


def test_truth_defaults_come_from_the_catalogue() -> None:
    sc = scenario("""\
        timeline:
          - {at: 10s, for: 40s, fault: nic-ramp, target: h5, nic: nic1, link_down_after_s: 20s}
          - {at: 5s, fault: gpu, target: h2, gpu: 3, gpu_fault: ecc_sbe_rising}
          - {at: 6s, fault: link-down, target: leaf1r0-spine1}
          - {at: 7s, fault: freeze, target: h6}
          - {at: 8s, fault: straggle, target: h4}
          - {at: 9s, fault: clock-step, target: h1, step_ms: 3}
          - {at: 9s, fault: gpu, target: h0, gpu: 0, gpu_fault: xid, code: 92}
          - {at: 9s, fault: gpu, target: h0, gpu: 1, gpu_fault: fallen_off_bus}
          - {at: 30s, fault: link-up, target: leaf1r0-spine1}
        """)
    got = [(t.entity, t.entity_type, t.kind, t.effect, t.precursor_at_s, t.failure_at_s)
           for t in (f.truth for f in sc.timeline)]
    assert got == [
        ("h5-leaf1r1", EntityType.LINK, "link_errors", Effect.FAILURE, 10.0, 30.0),
        ("h2/gpu3", EntityType.GPU, "gpu_ecc_sbe", Effect.PRECURSOR, 5.0, None),
        ("leaf1r0-spine1", EntityType.LINK, "link_down", Effect.FAILURE, None, 6.0),
        ("h6", EntityType.HOST, "host_frozen", Effect.FAILURE, None, 7.0),
        ("h4", EntityType.HOST, "straggler", Effect.DEGRADATION, None, None),
        ("h1", EntityType.CLOCK, "clock_step", Effect.DEGRADATION, None, None),
        ("h0/gpu0", EntityType.GPU, "gpu_xid", Effect.PRECURSOR, 9.0, None),
        ("h0/gpu1", EntityType.GPU, "gpu_lost", Effect.FAILURE, None, 9.0),
        ("leaf1r0-spine1", EntityType.LINK, "link_up", Effect.RECOVERY, None, None),
    ]


def test_truth_overrides_replace_add_and_remove_fields() -> None:
    sc = scenario("""\
        timeline:
          - at: 10s
            fault: degrade
            target: leaf0r0-spine0
            truth: {kind: link_degrading, precursor_at: 10s, failure_at: 30s, entity: spine0}
          - at: 10s
            fault: link-down
            target: h1-leaf0r0
            truth: {failure_at: null, entity: h1/nic0}
          - at: 10s
            fault: clock-step
            target: h3
            step_ms: 1
            truth: {entity: h4}
        """)
    a, b, c = (f.truth for f in sc.timeline)
    assert (a.entity, a.entity_type, a.kind, a.effect, a.precursor_at_s, a.failure_at_s) == \
        ("spine0", EntityType.SWITCH, "link_degrading", Effect.FAILURE, 10.0, 30.0)
    assert (b.entity, b.entity_type, b.effect, b.failure_at_s) == ("h1/nic0", EntityType.NIC, Effect.DEGRADATION, None)
    assert (c.entity, c.entity_type) == ("h4", EntityType.CLOCK)


# -- the runner --------------------------------------------------------------------------------


def test_runner_applies_and_undoes_in_order_at_the_planned_times() -> None:
    sc = scenario("""\
        timeline:
          - {at: 5s, for: 10s, fault: link-down, target: h2-leaf0r1, end: h2}
          - {at: 2s, for: 3s, fault: degrade, target: leaf0r0-spine0, rate_mbit: 10, direction: forward}
          - {at: 20s, fault: flap, target: h1-leaf0r0, period_s: 2s, count: 2}
          - {at: 30s, for: 10s, fault: congest, target: leaf1r1-spine1, rate_mbit: 100}
          - {at: 31s, for: 9s, fault: clock-step, target: h3, step_ms: 1.5}
          - {at: 45s, for: 5s, fault: nic-ramp, target: h4, nic: nic1, link_down_after_s: 2s}
          - {at: 50s, fault: gpu, target: h2, gpu: 3, gpu_fault: ecc_sbe_rising, rate_per_s: 2}
        """)
    lab = RecordingLab()
    events: list[object] = []
    result = run(sc, lab, on_event=events.append)
    assert lab.calls == [
        (2.0, "degrade_link", ("leaf0r0-spine0", 10.0, 32.0, 20.0, Direction.FORWARD)),
        (5.0, "restore_link", ("leaf0r0-spine0",)),  # the undo comes before a start at the same time
        (5.0, "set_link", ("h2-leaf0r1", False, "h2")),
        (15.0, "set_link", ("h2-leaf0r1", True, "h2")),
        (20.0, "set_link", ("h1-leaf0r0", False, None)),
        (21.0, "set_link", ("h1-leaf0r0", True, None)),
        (22.0, "set_link", ("h1-leaf0r0", False, None)),
        (23.0, "set_link", ("h1-leaf0r0", True, None)),
        (30.0, "degrade_link", ("leaf1r1-spine1", 100.0, 32.0, 20.0, Direction.FORWARD)),
        (30.0, "start_load", ("leaf1r1-spine1", Direction.FORWARD, 200.0)),
        (31.0, "step_clock", ("h3", 1_500_000)),
        (40.0, "stop_load", ("load-1",)),
        (40.0, "restore_link", ("leaf1r1-spine1",)),
        (40.0, "step_clock", ("h3", -1_500_000)),
        (45.0, "nic_error_ramp", ("h4", "nic1", "symbol_error", 10.0, 2.0)),
        (50.0, "clear_nic", ("h4", "nic1")),
        (50.0, "set_link", ("h4-leaf1r1", True, "h4")),  # h4 is in rack 1
        (50.0, "gpu_fault", ("h2", 3, GpuFault.ECC_SBE_RISING, {"rate_per_s": 2.0})),
        (60.0, "clear_gpu", ("h2", 3)),  # open-ended: undone when the run ends
    ]
    assert len(events) == len(result.records) == 16 and not result.stopped
    assert result.records[-1].reason == "run end"
    assert (result.started_at_ns, result.ended_at_ns) == (WALL0_NS, WALL0_NS + 60 * 10**9)


def test_outcomes_anchor_truth_to_when_the_fault_was_applied() -> None:
    sc = scenario("""\
        timeline:
          - {at: 10s, for: 40s, fault: nic-ramp, target: h3, link_down_after_s: 30s}
          - {at: 12s, fault: freeze, target: h1}
          - {at: 20s, fault: thaw, target: h1}
        """)
    result = run(sc, RecordingLab())
    ramp, freeze, thaw = result.outcomes
    s = 10**9
    assert (ramp.applied, ramp.started_at_ns, ramp.ended_at_ns) == (True, WALL0_NS + 10 * s, WALL0_NS + 50 * s)
    assert (ramp.precursor_at_ns, ramp.failure_at_ns) == (WALL0_NS + 10 * s, WALL0_NS + 40 * s)
    assert (freeze.failure_at_ns, freeze.ended_at_ns) == (WALL0_NS + 12 * s, WALL0_NS + 20 * s)
    assert [r.reason for r in result.records if r.index == 1] == ["timeline", "ended by timeline[2]"]
    assert (thaw.applied, thaw.ended_at_ns, thaw.failure_at_ns) == (True, None, None)


def test_a_failed_start_is_recorded_its_undo_skipped_and_the_run_goes_on() -> None:
    sc = scenario("""\
        timeline:
          - {at: 5s, for: 10s, fault: degrade, target: h2-leaf0r1}
          - {at: 6s, for: 10s, fault: freeze, target: h1}
          - {at: 7s, for: 10s, fault: straggle, target: h2}
        """)
    lab = RecordingLab(fail={"degrade_link": "loopback mode has no links", "thaw_host": "no such cgroup"})
    result = run(sc, lab)
    assert [c[1] for c in lab.calls] == ["degrade_link", "freeze_host", "straggle", "thaw_host", "unstraggle"]
    degrade, freeze, straggle = result.outcomes
    assert not degrade.applied and degrade.error == "loopback mode has no links" and degrade.failure_at_ns is None
    assert freeze.applied and freeze.error == "no such cgroup" and freeze.failure_at_ns == WALL0_NS + 6 * 10**9
    assert straggle.applied and not straggle.error
    assert [(r.phase, r.error) for r in result.records if r.error] == [
        (Phase.START, "loopback mode has no links"), (Phase.UNDO, "no such cgroup")]


def test_congest_restores_the_link_when_the_load_cannot_start() -> None:
    sc = scenario("  timeline:\n    - {at: 1s, for: 5s, fault: congest, target: h0-leaf0r0}\n".replace("  ", "", 1))
    lab = RecordingLab(fail={"start_load": "no iperf"})
    result = run(sc, lab)
    assert [c[1] for c in lab.calls] == ["degrade_link", "start_load", "restore_link"]
    assert not result.outcomes[0].applied


def test_stop_midway_undoes_active_faults_newest_first_and_skips_the_rest() -> None:
    sc = scenario("""\
        timeline:
          - {at: 5s, fault: link-down, target: h2-leaf0r1}
          - {at: 8s, for: 30s, fault: nic-ramp, target: h3, link_down_after_s: 20s}
          - {at: 9s, fault: clock-step, target: h1, step_ms: 2}
          - {at: 30s, fault: freeze, target: h1}
        """)
    lab = RecordingLab()
    stop = threading.Event()
    lab.clock.at(12.0, stop.set)
    result = run(sc, lab, stop=stop)
    assert [(t, m) for t, m, _ in lab.calls] == [
        (5.0, "set_link"), (8.0, "nic_error_ramp"), (9.0, "step_clock"),
        (12.0, "clear_nic"), (12.0, "set_link"), (12.0, "set_link")]
    assert lab.calls[-1][2] == ("h2-leaf0r1", True, None)
    assert result.stopped and {r.reason for r in result.records if r.phase is Phase.UNDO} == {"stopped"}
    down, ramp, step, freeze = result.outcomes
    assert ramp.precursor_at_ns == WALL0_NS + 8 * 10**9 and ramp.failure_at_ns is None  # stopped before 28s
    assert down.ended_at_ns == WALL0_NS + 12 * 10**9 and step.ended_at_ns is None
    assert not freeze.applied and freeze.error == "not reached: the run was stopped first"


def test_an_unexpected_exception_still_undoes_active_faults() -> None:
    sc = scenario("""\
        timeline:
          - {at: 1s, fault: freeze, target: h1}
          - {at: 2s, fault: straggle, target: h2}
        """)
    lab = RecordingLab()

    def boom(_record: object) -> None:
        raise AssertionError("not swallowed")

    original = lab.straggle

    def broken_straggle(host: str, *, cpu_fraction: float) -> None:
        original(host, cpu_fraction=cpu_fraction)
        raise RuntimeError("cgroup fs vanished")

    lab.straggle = broken_straggle  # type: ignore[method-assign]  # a lab bug, not a LabError
    with pytest.raises(RuntimeError, match="cgroup fs vanished"):
        run(sc, lab, on_event=boom)  # on_event errors are logged, not raised
    assert [c[1] for c in lab.calls] == ["freeze_host", "straggle", "thaw_host"]


class Launcher:
    def __init__(self, fail: bool = False) -> None:
        self.fail, self.log = fail, []

    def start(self, jobs) -> None:
        self.log.append(("start", [j.name for j in jobs]))
        if self.fail:
            raise LabError("no torch")

    def stop(self) -> None:
        self.log.append(("stop",))


def test_jobs_start_before_the_timeline_and_stop_after_it() -> None:
    sc = scenario("""\
        jobs:
          - {name: ar, hosts: [h0, h1], command: [python3, -m, x], ranks_per_host: 2}
        timeline:
          - {at: 1s, fault: freeze, target: h1}
        """)
    assert sc.jobs[0].hosts == ("h0", "h1") and sc.jobs[0].ranks_per_host == 2
    launcher = Launcher()
    run(sc, RecordingLab(), jobs=launcher)
    assert launcher.log == [("start", ["ar"]), ("stop",)]
    failing = Launcher(fail=True)
    result = run(sc, RecordingLab(), jobs=failing)
    assert result.job_error == "no torch" and result.outcomes[0].applied and failing.log == [("start", ["ar"])]


def test_plan_is_sorted_with_undos_first_at_equal_times() -> None:
    sc = load_scenario(next(p for p in SCENARIOS if p.stem == "spine_link_degrades"))
    assert [(a.offset_s, a.phase.value, a.index) for a in plan(sc)] == [
        (10.0, "start", 0), (55.0, "undo", 0), (55.0, "start", 1), (85.0, "undo", 1)]


# -- lab run ---------------------------------------------------------------------------------


def test_run_scenario_rejects_bad_files_before_any_lab_call(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(GOOD_HEAD + "  - {at: 5s, fault: freeze, target: h1}\n  - {at: 5s, fault: freeze, target: h9}\n")
    lab = RecordingLab()
    with pytest.raises(ScenarioError, match=r"bad\.yaml:5: timeline\[1\]\.target: no host 'h9'"):
        run_scenario(bad, lab=lab, store=None, print_fn=lambda _s: None)
    assert lab.calls == []


def test_run_scenario_rejects_targets_the_running_lab_lacks() -> None:
    sc = scenario("timeline:\n  - {at: 1s, fault: freeze, target: h1}\n", duration="5s")
    lab = RecordingLab()
    lab.hosts = lambda: ["h0"]  # type: ignore[method-assign]  # a smaller lab than the scenario's
    with pytest.raises(ScenarioError, match="the running lab has no host 'h1'"):
        run_scenario(sc, lab=lab, store=None, print_fn=lambda _s: None)
    assert lab.calls == []


def test_a_lab_without_links_takes_the_scenario_and_refuses_link_faults_as_they_come() -> None:
    sc = load_scenario(next(p for p in SCENARIOS if p.stem == "link_cut"))
    lab = RecordingLab(fail={"set_link": "link faults need network namespaces (loopback mode)"})
    lab.links = lambda: []  # type: ignore[method-assign]  # the degraded loopback mode
    check_lab(sc, hosts=lab.hosts(), links=lab.links())
    result = run(sc, lab)
    assert not result.outcomes[0].applied and "loopback" in result.outcomes[0].error
    assert [c[1] for c in lab.calls] == ["set_link", "set_link"]  # the link-up is tried too, and refused


def test_a_restore_ends_an_open_congestion_stopping_its_load() -> None:
    sc = scenario("""\
        timeline:
          - {at: 5s, fault: congest, target: leaf0r1-spine0, direction: reverse}
          - {at: 9s, fault: restore, target: leaf0r1-spine0}
        """, duration="20s")
    lab = RecordingLab()
    result = run(sc, lab)
    assert [(t, m) for t, m, _ in lab.calls] == [
        (5.0, "degrade_link"), (5.0, "start_load"), (9.0, "stop_load"), (9.0, "restore_link"), (9.0, "restore_link")]
    assert result.outcomes[0].ended_at_ns == WALL0_NS + 9 * 10**9


def test_summary_is_a_table_of_faults_relative_to_the_start() -> None:
    sc = load_scenario(next(p for p in SCENARIOS if p.stem == "nic_errors_then_link_down"))
    lab = RecordingLab(fail={"clear_nic": "gone"})
    result = run(sc, lab)
    text = summary(sc, result, run_id="r1")
    lines = text.splitlines()
    assert lines[0] == "run r1 completed after 90.0s: 1/1 faults applied"
    assert lines[1].split() == ["#", "at", "for", "fault", "target", "applied", "truth", "entity", "precursor",
                                "failure", "ended"]
    assert lines[2].split() == ["0", "10s", "60s", "nic-ramp", "h3", "yes", "link_errors", "(failure)", "h3-leaf0r0",
                                "10.0s", "40.0s", "70.0s"]
    assert lines[3] == "  timeline[0]: gone"


def test_every_kind_is_documented_and_undo_matches_instant() -> None:
    doc = KINDS["link-down"].__class__.__module__
    import importlib
    table = importlib.import_module(doc).__doc__ or ""
    for name, kind in KINDS.items():
        assert f"\n{name} " in table, f"{name} missing from the catalogue's docstring table"
        assert (kind.undo is None) == bool(kind.clears), name
