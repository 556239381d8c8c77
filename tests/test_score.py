"""Scoring incidents against lab truth, on hand-built runs with known answers."""

from __future__ import annotations

import math

from ridethrough.lab.score import NS, Opened, Run, TruthFault, false_alarms_per_100h, percentile, score

T = 1_700_000_000 * NS


def run(*faults: TruthFault, start: int = T, end: int = T + 60 * NS) -> Run:
    return Run("r1", "sc", start, end, faults)


def fault(kind: str, entity: str, etype: str, at_s: float, *, end_s: float | None = None,
          precursor_s: float | None = None, failure_s: float | None = None) -> TruthFault:
    def ns(s: float | None) -> int | None:
        return None if s is None else T + round(s * NS)
    return TruthFault("r1", 0, kind, entity, etype, T + round(at_s * NS), ns(end_s), ns(precursor_s), ns(failure_s))


def inc(iid: str, kind: str, etype: str, entity: str, at_s: float, hosts: tuple[str, ...] = ()) -> Opened:
    return Opened(iid, kind, etype, entity, T + round(at_s * NS), hosts)


def nic_link(entity: str) -> str | None:
    return {"h2/nic1": "h2-leaf0r1", "h2/mlx5_1": "h2-leaf0r1"}.get(entity)


def test_a_link_named_exactly_is_detected_and_localised_with_its_latency() -> None:
    s = score([run(fault("link_down", "h2-leaf0r1", "link", 10, end_s=40, failure_s=10))],
              [inc("a", "link_down", "link", "h2-leaf0r1", 11.5)], nic_link=nic_link)
    c = s["truth"]["link_down"]
    assert (c.faults, c.detected, c.localised) == (1, 1, 1)
    assert c.latency_s == [1.5]
    assert s["incidents"]["link_down"].true_incidents == 1


def test_a_nic_at_the_links_end_detects_but_does_not_localise() -> None:
    s = score([run(fault("link_down", "h2-leaf0r1", "link", 10, end_s=40, failure_s=10))],
              [inc("a", "link_down", "nic", "h2/nic1", 11), inc("b", "link_down", "nic", "h2/mlx5_1", 11)],
              nic_link=nic_link)
    c = s["truth"]["link_down"]
    assert (c.detected, c.localised) == (1, 0)
    assert s["incidents"]["link_down"].incident_figures()["precision"] == 1.0


def test_wrong_entity_wrong_kind_and_too_late_are_false_positives_and_misses() -> None:
    s = score([run(fault("link_down", "h2-leaf0r1", "link", 10, end_s=20, failure_s=10))],
              [inc("a", "link_down", "link", "h3-leaf0r0", 11),   # another link
               inc("b", "gpu_failed", "gpu", "h2/gpu0", 11),      # not a link finding
               inc("c", "link_down", "link", "h2-leaf0r1", 55)],  # after end + grace (20 + 30 s)
              grace_s=30)
    assert s["truth"]["link_down"].detected == 0
    figures = s["incidents"]["link_down"].incident_figures()
    assert figures["precision"] == 0.0 and figures["false"] == ["sc:h3-leaf0r0", "sc:h2-leaf0r1"]
    assert s["incidents"]["gpu_failed"].true_incidents == 0
    assert s["truth"]["link_down"].truth_figures()["recall"] == 0.0


def test_incidents_outside_every_run_are_not_counted() -> None:
    s = score([run(fault("gpu_xid", "h1/gpu0", "gpu", 5, failure_s=5))],
              [inc("a", "gpu_failed", "gpu", "h1/gpu0", -30), inc("b", "gpu_failed", "gpu", "h1/gpu0", 6)])
    assert s["incidents"]["gpu_failed"].incidents == 1
    assert s["truth"]["gpu_xid"].latency_s == [1.0]


def test_lead_time_from_the_first_prediction_to_the_failure_of_the_same_entity() -> None:
    ramp = fault("link_errors", "h3-leaf0r0", "link", 10, end_s=70, precursor_s=10, failure_s=40)
    s = score([run(ramp)], [inc("p", "link_degrading", "link", "h3-leaf0r0", 18),
                            inc("d", "link_down", "link", "h3-leaf0r0", 41)])
    c = s["truth"]["link_errors"]
    assert c.lead_s == [22.0] and c.latency_s == [1.0] and c.localised == 1


def test_a_precursor_whose_failure_is_a_later_fault_gets_a_lead_time() -> None:
    degrade = fault("link_degrading", "leaf1r0-spine0", "link", 10, end_s=40, precursor_s=10)
    down = fault("link_down", "leaf1r0-spine0", "link", 40, end_s=70, failure_s=40)
    s = score([run(degrade, down, end=T + 90 * NS)],
              [inc("p", "link_degrading", "link", "leaf1r0-spine0", 15),
               inc("d", "link_down", "link", "leaf1r0-spine0", 41)])
    assert s["truth"]["link_degrading"].lead_s == [25.0]
    assert s["truth"]["link_down"].detected == 1


def test_a_gpu_fault_must_name_the_gpu_and_a_host_fault_may_be_named_by_a_rank() -> None:
    s = score([run(fault("gpu_ecc_sbe", "h2/gpu3", "gpu", 10, precursor_s=10),
                   fault("straggler", "h4", "host", 10, end_s=50))],
              [inc("g", "gpu_failing", "gpu", "h2/gpu2", 20),
               inc("r", "straggler", "rank", "allreduce/2", 30, hosts=("h4",))])
    assert s["truth"]["gpu_ecc_sbe"].detected == 0
    st = s["truth"]["straggler"]
    assert (st.detected, st.localised) == (1, 1)


def test_a_throttled_gpus_straggling_rank_explains_the_fault_without_localising_it() -> None:
    s = score([run(fault("gpu_thermal", "h5/gpu0", "gpu", 10, end_s=40))],
              [inc("t", "gpu_failing", "gpu", "h5/gpu0", 25),
               inc("r", "straggler", "rank", "train/rank21", 30, hosts=("h5",)),
               inc("x", "straggler", "rank", "train/rank3", 30, hosts=("h0",))])
    th = s["truth"]["gpu_thermal"]
    assert (th.detected, th.localised) == (1, 1), "localised by the GPU's own incident"
    assert s["incidents"]["straggler"].true_incidents == 1 and s["incidents"]["straggler"].false == ["sc:train/rank3"]
    alone = score([run(fault("gpu_thermal", "h5/gpu0", "gpu", 10, end_s=40))],
                  [inc("r", "straggler", "rank", "train/rank21", 30, hosts=("h5",))])
    assert (alone["truth"]["gpu_thermal"].detected, alone["truth"]["gpu_thermal"].localised) == (1, 0)


def test_a_prediction_still_open_when_a_second_symptom_starts_detects_it_with_its_lead() -> None:
    faults = (fault("gpu_ecc_sbe", "h2/gpu3", "gpu", 10, precursor_s=10, failure_s=60),
              fault("gpu_row_remap", "h2/gpu3", "gpu", 30, precursor_s=30),
              fault("gpu_lost", "h2/gpu3", "gpu", 60, failure_s=60))
    failing = Opened("p", "gpu_failing", "gpu", "h2/gpu3", T + 18 * NS, resolved_ns=None)
    s = score([run(*faults)], [failing, inc("f", "gpu_failed", "gpu", "h2/gpu3", 62)])
    remap = s["truth"]["gpu_row_remap"]
    assert (remap.detected, remap.localised, remap.lead_s) == (1, 1, [42.0])
    gone = Opened("p", "gpu_failing", "gpu", "h2/gpu3", T + 18 * NS, resolved_ns=T + 25 * NS)
    s = score([run(*faults)], [gone])
    assert s["truth"]["gpu_row_remap"].detected == 0, "resolved before the remap began: no news of it"
    other = Opened("p", "gpu_failing", "gpu", "h2/gpu2", T + 18 * NS)
    assert score([run(*faults)], [other])["truth"]["gpu_row_remap"].detected == 0


def test_recovery_kinds_are_not_scored_and_figures_handle_nothing() -> None:
    s = score([run(fault("link_up", "h2-leaf0r1", "link", 40))], [])
    assert s["truth"] == {} and s["incidents"] == {}


def test_false_alarm_rate_and_percentile() -> None:
    assert false_alarms_per_100h(0, 8, 1800) == 0.0
    assert false_alarms_per_100h(1, 8, 1800) == 25.0
    assert math.isnan(false_alarms_per_100h(0, 8, 0))
    assert percentile([], 0.99) is None
    assert percentile([1.0, 2.0, 3.0], 0.5) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 0.99) == 99.0


def test_a_flapping_link_reported_as_losing_packets_is_right_but_not_its_latency() -> None:
    s = score([run(fault("link_flap", "h5-leaf1r1", "link", 10, end_s=20, failure_s=10))],
              [inc("a", "link_degrading", "link", "h5-leaf1r1", 14), inc("b", "link_flap", "link", "h5-leaf1r1", 16)])
    c = s["truth"]["link_flap"]
    assert (c.detected, c.localised, c.latency_s) == (1, 1, [6.0])  # latency from the hard kind only
    assert s["incidents"]["link_degrading"].true_incidents == 1


def test_a_link_among_the_candidates_is_detected_but_not_localised() -> None:
    s = score([run(fault("link_down", "leaf1r0-spine0", "link", 10, end_s=40, failure_s=10))],
              [Opened("a", "link_down", "link", "leaf0r0-spine0", T + 12 * NS, (),
                      ("leaf0r0-spine0", "leaf1r0-spine0")),
               Opened("b", "link_down", "link", "leaf0r1-spine0", T + 12 * NS, (),
                      ("leaf0r1-spine0", "leaf1r1-spine0"))])
    c = s["truth"]["link_down"]
    assert (c.detected, c.localised) == (1, 0)
    assert s["incidents"]["link_down"].false == ["sc:leaf0r1-spine0"]
