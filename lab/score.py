"""Score detector incidents against lab truth: recall, precision, localisation, lead time, latency.

A truth fault (one row of ``lab_truth``: a kind such as ``link_down`` on an entity such as
``h2-leaf0r1``) is **detected** when an incident of an accepted kind names that entity, or a part of
it (a NIC at either end of the link, a GPU's host, a link among the candidates the incident could
not tell apart), and opened while the fault could be seen: from
``started - lead`` (a prediction may come before a precursor is scripted to show) up to ``grace``
after it ended; an incident that names exactly the truth's entity and is still open when the fault
begins detects it too (a second symptom of a part already reported). It is **localised** when the
incident names exactly the truth's entity (the link, not a NIC at its end). An incident that
matches no truth fault of its run is a false positive.

Lead time: for a fault with both a precursor and a failure, the failure time minus the opening of
the first matching *predictive* incident (positive when the prediction came first). Detection
latency: for hard failures, the first matching *hard* incident minus the failure time.

Everything here is pure (no store, no lab): `bench/detect_eval.py` feeds it rows, tests feed it
hand-built cases.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

NS = 1_000_000_000


@dataclass(frozen=True, slots=True)
class Expect:
    """Which incident kinds answer one truth kind."""

    hard: frozenset[str] = frozenset()
    """Kinds that say "it failed" (scored for detection latency)."""
    predict: frozenset[str] = frozenset()
    """Kinds that say "it will fail" (scored for lead time)."""
    other: frozenset[str] = frozenset()
    """Kinds that are right but neither (congestion, a clock step)."""
    effects: frozenset[str] = frozenset()
    """Kinds the fault causes elsewhere, on whatever runs on the faulty part's host (a throttled GPU makes its
    rank a straggler): they name the host's rank, not the part, so they explain the fault without localising it."""

    @property
    def kinds(self) -> frozenset[str]:
        """Every accepted kind."""
        return self.hard | self.predict | self.other | self.effects


def _k(*kinds: str) -> frozenset[str]:
    return frozenset(kinds)


_GPU_WARN = Expect(predict=_k("gpu_failing"), hard=_k("gpu_failed"))
EXPECT: Mapping[str, Expect] = {
    "link_down": Expect(hard=_k("link_down", "link_flap")),
    # a link that keeps going down loses packets: tomography's "losing packets" names the right fault
    "link_flap": Expect(hard=_k("link_flap", "link_down"), other=_k("link_degrading")),
    "link_errors": Expect(predict=_k("link_degrading"), hard=_k("link_down", "link_flap")),
    "link_degraded": Expect(predict=_k("link_degrading")),
    "link_degrading": Expect(predict=_k("link_degrading")),
    "mtu_mismatch": Expect(predict=_k("link_degrading")),
    "link_congested": Expect(other=_k("congestion")),
    "clock_step": Expect(other=_k("clock_jump", "clock_unsynced")),
    "host_frozen": Expect(hard=_k("agent_silent")),
    "straggler": Expect(other=_k("straggler")),
    "gpu_ecc_sbe": _GPU_WARN,
    "gpu_row_remap": _GPU_WARN,
    "gpu_thermal": Expect(predict=_k("gpu_failing"), hard=_k("gpu_failed"), effects=_k("straggler")),
    "gpu_pcie_replay": _GPU_WARN,
    "gpu_nvlink_crc": _GPU_WARN,
    "gpu_xid_precursor": _GPU_WARN,
    "gpu_xid": Expect(hard=_k("gpu_failed")),
    "gpu_ecc_dbe": Expect(hard=_k("gpu_failed")),
    "gpu_lost": Expect(hard=_k("gpu_failed")),
}
"""Truth kind → the incident kinds that detect it. Recovery kinds (``link_up``) are not scored."""


@dataclass(frozen=True, slots=True)
class TruthFault:
    """One applied fault of one run, times in wall-clock nanoseconds."""

    run: str
    index: int
    kind: str
    entity: str
    entity_type: str
    started_ns: int
    ended_ns: int | None
    precursor_ns: int | None = None
    failure_ns: int | None = None


@dataclass(frozen=True, slots=True)
class Opened:
    """One incident as it first opened."""

    incident_id: str
    kind: str
    entity_type: str
    entity: str
    opened_ns: int
    hosts: tuple[str, ...] = ()
    """Hosts the incident's evidence names (a rank's host, a path's ends), for coarse matching."""
    candidates: tuple[str, ...] = ()
    """Entities the evidence says the data cannot tell apart from ``entity`` (ECMP members of a leaf-spine
    link, under a design route map): naming the truth among them detects it, without localising it."""
    resolved_ns: int | None = None
    """When it first resolved (None: still open when read)."""

    def open_at(self, t_ns: int) -> bool:
        """Opened before ``t_ns`` and not yet resolved then (a reopening later is not counted)."""
        return self.opened_ns <= t_ns and (self.resolved_ns is None or self.resolved_ns >= t_ns)


@dataclass(frozen=True, slots=True)
class Run:
    """One scenario run: its faults, and the span in which its incidents count."""

    run: str
    scenario: str
    started_ns: int
    ended_ns: int
    faults: tuple[TruthFault, ...]


@dataclass(slots=True)
class ClassScore:
    """Figures for one truth kind (recall side) or one incident kind (precision side)."""

    faults: int = 0
    detected: int = 0
    localised: int = 0
    incidents: int = 0
    true_incidents: int = 0
    lead_s: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    false: list[str] = field(default_factory=list)
    """Entities of the incidents no truth fault explains (for the report)."""

    def truth_figures(self) -> dict[str, object]:
        """JSON-ready figures of a truth class (None where there is nothing to divide by)."""
        return {
            "faults": self.faults, "recall": _ratio(self.detected, self.faults),
            "localisation": _ratio(self.localised, self.detected),
            "lead_time_s": [round(v, 2) for v in self.lead_s], "latency_s": [round(v, 3) for v in self.latency_s],
        }

    def incident_figures(self) -> dict[str, object]:
        """JSON-ready figures of an incident kind."""
        return {"incidents": self.incidents, "precision": _ratio(self.true_incidents, self.incidents),
                "false": self.false}


def _ratio(a: int, b: int) -> float | None:
    return round(a / b, 4) if b else None


def host_of(entity: str) -> str:
    """The host part of an entity name: ``h2/gpu3`` → ``h2``, ``h5`` → ``h5``, a link → ''."""
    head = entity.split("/", 1)[0]
    return head if "-" not in head else ""


def link_ends(entity: str) -> tuple[str, ...]:
    """A link's two ends (``h2-leaf0r1`` → ``('h2', 'leaf0r1')``); () for anything else."""
    parts = entity.split("-")
    return tuple(parts) if len(parts) == 2 and all(parts) else ()


def matches(fault: TruthFault, inc: Opened, *, nic_link: Callable[[str], str | None],
            effect: bool = False) -> tuple[bool, bool]:
    """(detected, localised): does ``inc`` name ``fault``'s entity, or a part of it? An ``effect``
    (`Expect.effects`) is found on the faulty part's host and never localises it."""
    if effect:
        host = host_of(fault.entity) if fault.entity_type == "gpu" else fault.entity
        return bool(host) and (host_of(inc.entity) == host or host in inc.hosts), False
    if inc.entity == fault.entity:
        return True, True
    if fault.entity in inc.candidates:
        return True, False
    ends = link_ends(fault.entity)
    if ends:
        # a NIC at one end of the link: found, but not localised to the link
        return (inc.entity_type == "nic" and nic_link(inc.entity) == fault.entity), False
    if fault.entity_type in ("host", "clock", "gpu"):
        host = host_of(fault.entity) if fault.entity_type == "gpu" else fault.entity
        coarse = host_of(inc.entity) == host or host in inc.hosts
        if fault.entity_type == "gpu":
            return False, False  # a GPU fault must name the GPU
        return coarse, coarse and inc.entity_type in ("host", "clock", "rank")
    return False, False


def score(runs: Sequence[Run], incidents: Iterable[Opened], *, grace_s: float = 30.0, lead_s: float = 5.0,
          nic_link: Callable[[str], str | None] = lambda _: None) -> dict[str, dict[str, ClassScore]]:
    """Per truth kind and per incident kind, the figures of `ClassScore` over every run."""
    by_truth: dict[str, ClassScore] = {}
    by_kind: dict[str, ClassScore] = {}
    incs = sorted(incidents, key=lambda i: i.opened_ns)
    for run in runs:
        mine = [i for i in incs if run.started_ns <= i.opened_ns <= run.ended_ns + grace_s * NS]
        explained: set[str] = set()
        failures = _failures(run.faults)
        for f in run.faults:
            expect = EXPECT.get(f.kind)
            if expect is None:
                continue
            cls = by_truth.setdefault(f.kind, ClassScore())
            cls.faults += 1
            end = (f.ended_ns if f.ended_ns is not None else run.ended_ns) + grace_s * NS
            hits = []
            for inc in mine:
                if inc.kind not in expect.kinds:
                    continue
                # an incident naming the very entity, still open when the fault began, already tells of it (a
                # GPU predicted failing from its ECC errors when its row remap starts)
                ongoing = inc.entity == f.entity and inc.open_at(f.started_ns)
                if not (ongoing or f.started_ns - lead_s * NS <= inc.opened_ns <= end):
                    continue
                found, exact = matches(f, inc, nic_link=nic_link, effect=inc.kind in expect.effects)
                if found:
                    hits.append((inc, exact))
                    explained.add(inc.incident_id)
            if not hits:
                continue
            cls.detected += 1
            cls.localised += any(exact for _, exact in hits)
            _timings(cls, f, expect, [inc for inc, _ in hits], failures.get(f.entity))
        for inc in mine:
            k = by_kind.setdefault(inc.kind, ClassScore())
            k.incidents += 1
            if inc.incident_id in explained:
                k.true_incidents += 1
            else:
                k.false.append(f"{run.scenario}:{inc.entity}")
    return {"truth": by_truth, "incidents": by_kind}


def _failures(faults: Sequence[TruthFault]) -> dict[str, int]:
    """The first hard failure time of each entity in a run (a precursor's failure may be a later fault)."""
    out: dict[str, int] = {}
    for f in faults:
        if f.failure_ns is not None:
            out[f.entity] = min(out.get(f.entity, f.failure_ns), f.failure_ns)
    return out


def _timings(cls: ClassScore, f: TruthFault, expect: Expect, hits: Sequence[Opened], failure_ns: int | None) -> None:
    predictions = [i.opened_ns for i in hits if i.kind in expect.predict]
    if f.precursor_ns is not None and failure_ns is not None and failure_ns > f.precursor_ns and predictions:
        cls.lead_s.append((failure_ns - min(predictions)) / NS)
    if f.failure_ns is not None:
        hard = [i.opened_ns for i in hits if i.kind in expect.hard and i.opened_ns >= f.failure_ns - NS]
        if hard:
            cls.latency_s.append((min(hard) - f.failure_ns) / NS)


def false_alarms_per_100h(incidents: int, hosts: int, seconds: float) -> float:
    """Incidents per 100 host-hours of a healthy soak."""
    hours = hosts * seconds / 3600
    return round(100 * incidents / hours, 3) if hours > 0 else float("nan")


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` (0..1) quantile by nearest rank; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
