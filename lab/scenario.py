"""Scenarios: a lab topology, jobs, and a timeline of faults with the ground truth each implies.

A scenario is a YAML file, validated completely before anything starts::

    name: nic_errors_then_link_down           # required
    description: symbol errors climb on h3's NIC 0, then its link goes down
    topology: {hosts: 8, racks: 2, rails: 2, spines: 2, gpus: 8}   # these are the defaults
    duration: 90s                             # required; faults still on at the end are undone
    jobs:                                     # handed to the job launcher before the timeline
      - {name: allreduce, hosts: [h0, h3], command: [python, -m, bench.allreduce], ranks_per_host: 1}
    timeline:
      - at: 10s                               # when the fault starts (from the run's start)
        for: 60s                              # optional: undone at at+for with the catalogue's inverse
        fault: nic-ramp                       # a kind from ridethrough.lab.faults.KINDS
        target: h3                            # a host, or a link like h3-leaf0r0 / leaf0r0-spine1
        nic: nic0                             # the kind's parameters, inline
        counter: symbol_error
        rate_per_s: 50
        link_down_after_s: 30s
        truth:                                # optional overrides of the catalogue's truth
          precursor_at: 10s                   # scenario-clock times, like ``at``; null removes one
          failure_at: 40s
          # entity: h3-leaf0r0, entity_type: link, kind: link_errors

Durations are numbers of seconds or strings like ``500ms``, ``5s``, ``2m``, ``1h``. Parameters
are listed in `ridethrough.lab.faults`; a missing optional one takes the catalogue default.

Rules, each reported as ``file:line: field: problem`` (all of them at once, in `ScenarioError`):

* unknown keys (with the nearest valid name), unknown fault kinds, bad types, ranges and
  durations, a topology that does not divide (hosts per rack), targets, NICs, GPU indexes, link
  ends and truth entities that the topology does not have;
* ``for`` on an instant kind (``link-up``, ``restore``, ``thaw``, ``unstraggle``); a fault or a
  truth time past ``duration``; a truth time before ``at`` or after the fault's own end;
* contradictions: two faults on one resource (a link, a host's clock, CPU cap or freeze, one GPU,
  one NIC) whose active windows overlap. Open-ended GPU faults with different ``fault`` values
  on one GPU (and NIC ramps of different counters on one NIC) may overlap: they stack, as a GPU
  that is failing shows several symptoms. A recovery kind (``link-up``, ``restore``, ``thaw``,
  ``unstraggle``) *ends* an open-ended fault it clears on the same target (the runner undoes it
  there), is fine with nothing to clear (it is idempotent), and is a contradiction inside a
  fault that has its own ``for`` (or inside a flap).
"""


from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from ridethrough.lab.faults import KINDS, Call, EntityType, FaultKind, Names, ParamValue, Target, Truth, coerce, names
from ridethrough.lab.overlaps import Overlaps
from ridethrough.lab.scenario_truth import TruthReader
from ridethrough.lab.scenario_yaml import Doc, FieldPath, Problem, ScenarioError, field_name, read
from ridethrough.lab.topology import TopologySpec
from ridethrough.suggest import did_you_mean

__all__ = ["Fault", "FieldPath", "Job", "Problem", "Scenario", "ScenarioError", "Topology", "check_lab", "field_name",
           "load_scenario", "parse_scenario", "suggest"]

Topology = TopologySpec
"""Lab sizes (the fabric's own `TopologySpec`); the defaults are the default lab."""


@dataclass(frozen=True, slots=True)
class Job:
    """A job to start before the timeline (the launcher decides how)."""

    name: str
    hosts: tuple[str, ...]
    command: tuple[str, ...]
    ranks_per_host: int = 1
    line: int = 0


@dataclass(frozen=True, slots=True)
class Fault:
    """One timeline item, validated: its kind, target, typed parameters and resolved truth."""

    index: int
    line: int
    kind: str
    target: str
    at_s: float
    for_s: float | None
    params: Mapping[str, ParamValue]
    truth: Truth
    closes: tuple[int, ...] = ()
    """Open-ended faults this recovery ends (the runner undoes them when it applies this one)."""

    @property
    def spec(self) -> FaultKind:
        """The catalogue entry of this fault's kind."""
        return KINDS[self.kind]

    def call(self, lab_names: Names) -> Call:
        """The fault as the catalogue's start/undo functions take it."""
        return Call(self.target, self.params, lab_names, self.at_s)

    def windows(self, lab_names: Names) -> tuple[tuple[float, float | None], ...]:
        """When the fault is on, on the scenario clock; an end of None means until the run ends."""
        return self.spec.windows(self.call(lab_names), self.for_s)


@dataclass(frozen=True, slots=True)
class Scenario:
    """A validated scenario."""

    name: str
    description: str
    topology: Topology
    duration_s: float
    jobs: tuple[Job, ...]
    timeline: tuple[Fault, ...]
    names: Names
    source: str = "<scenario>"


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file; raises `ScenarioError` (or OSError if unreadable)."""
    return parse_scenario(Path(path).read_text(encoding="utf-8"), source=str(path))


def parse_scenario(text: str, *, source: str = "<scenario>") -> Scenario:
    """Validate scenario YAML text; ``source`` names it in error messages."""
    doc, data = read(text, source)
    if not isinstance(data, dict):
        doc.error((), "a scenario is a mapping with name, duration and timeline")
        raise ScenarioError(doc.problems)
    scenario = _Builder(doc).scenario(data)
    if doc.problems or scenario is None:
        raise ScenarioError(doc.problems)
    return scenario


def check_lab(scenario: Scenario, *, hosts: Sequence[str], links: Sequence[str]) -> None:
    """Reject a scenario whose targets or job hosts the running lab does not have.

    A lab that reports no links at all (the degraded loopback mode) is not checked for links:
    it refuses link faults when they are applied, and the run records that.
    """
    problems: list[Problem] = []
    for f in scenario.timeline:
        known = hosts if f.spec.target is Target.HOST else links
        if (known or f.spec.target is Target.HOST) and f.target not in known:
            problems.append(Problem(scenario.source, f.line, f"timeline[{f.index}].target",
                                    f"the running lab has no {f.spec.target.value} {f.target!r}"))
    for i, job in enumerate(scenario.jobs):
        for host in (h for h in job.hosts if h not in hosts):
            problems.append(Problem(scenario.source, job.line, f"jobs[{i}].hosts",
                                    f"the running lab has no host {host!r}"))
    if problems:
        raise ScenarioError(problems)


def suggest(word: str, candidates: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` for the nearest candidate (a prefix match first), or ``""``."""
    return did_you_mean(word, candidates, prefix=True)


def _span(values: Sequence[str]) -> str:
    return f"{values[0]}..{values[-1]}" if len(values) > 3 else ", ".join(values)


def _bad_for(spec: FaultKind, for_s: float) -> str:
    """Why ``for: for_s`` does not fit a fault of kind ``spec`` (``""``: it fits)."""
    if spec.pulsed:
        return f"{spec.name} ends by itself after count x period_s; drop 'for'"
    if spec.undo is None:
        return f"{spec.name} is instant and has no undo; drop 'for'"
    return "must be more than 0s" if for_s <= 0 else ""


_TOP = ("name", "description", "topology", "duration", "jobs", "timeline")
_ITEM = ("at", "for", "fault", "target", "truth")
_JOB = ("name", "hosts", "command", "ranks_per_host")
_TOPOLOGY_MAX = {"hosts": 240, "racks": 240, "rails": 64, "spines": 127, "gpus": 64}


class _Builder:
    """Builds a `Scenario` from plain values, reporting every problem to the `Doc`."""

    def __init__(self, doc: Doc) -> None:
        self.doc = doc
        self.names: Names | None = None
        self.duration_s = 0.0
        self.job_names: set[str] = set()

    def scenario(self, data: Mapping[str, object]) -> Scenario | None:
        self.doc.keys(data, (), _TOP)
        self.doc.missing(data, (), ("name", "duration", "timeline"))
        name = self.doc.text(data, (), "name") if "name" in data else None
        description = self.doc.text(data, (), "description", required=False) or ""
        topology = self.topology(data.get("topology", {}))
        duration = self.doc.duration(data["duration"], ("duration",)) if "duration" in data else None
        if duration is not None and duration <= 0:
            self.doc.error(("duration",), "must be more than 0s")
        self.duration_s = duration or float("inf")
        jobs = [self.job(raw, i) for i, raw in enumerate(self.doc.listing(data, "jobs"))]
        items = self.doc.listing(data, "timeline")
        if "timeline" in data and not items:
            self.doc.error(("timeline",), "a scenario needs at least one fault")
        faults = [self.fault(raw, i) for i, raw in enumerate(items)]
        valid = [f for f in faults if f is not None]
        if self.names is not None:
            valid = Overlaps(self.doc, self.names, self.duration_s).check(valid)
        if self.doc.problems or name is None or duration is None or self.names is None:
            return None
        return Scenario(name, description, topology, duration, tuple(j for j in jobs if j), tuple(valid),
                        self.names, self.doc.source)

    def topology(self, raw: object) -> Topology:
        path: FieldPath = ("topology",)
        if not isinstance(raw, dict):
            self.doc.error(path, "expected a mapping of hosts, racks, rails, spines, gpus")
            return Topology()
        self.doc.keys(raw, path, tuple(_TOPOLOGY_MAX))
        sizes: dict[str, int] = {}
        for key, most in _TOPOLOGY_MAX.items():
            value = raw.get(key, getattr(Topology(), key))
            least = 0 if key == "gpus" else 1
            if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
                self.doc.error((*path, key), f"expected an integer from {least} to {most}, got {value!r}")
                return Topology()
            sizes[key] = value
        try:
            self.names = names(**sizes)
        except ValueError as exc:
            self.doc.error((*path, "racks"), str(exc))
            return Topology()
        return self.names.topology.spec

    def host(self, raw: object, path: FieldPath) -> str | None:
        if self.names is None:
            return None
        if not isinstance(raw, str) or raw not in self.names.hosts:
            hosts = self.names.hosts
            self.doc.error(path, f"no host {raw!r} (hosts are {_span(hosts)}){suggest(str(raw), hosts)}")
            return None
        return raw

    def job(self, raw: object, i: int) -> Job | None:
        path: FieldPath = ("jobs", i)
        if not isinstance(raw, dict):
            self.doc.error(path, "expected a mapping with name, hosts, command")
            return None
        self.doc.keys(raw, path, _JOB)
        self.doc.missing(raw, path, ("name", "hosts", "command"))
        name = self.doc.text(raw, path, "name") if "name" in raw else None
        good = [self.host(h, (*path, "hosts", k)) for k, h in enumerate(self.job_list(raw, path, "hosts"))]
        command = self.job_list(raw, path, "command")
        ranks = raw.get("ranks_per_host", 1)
        if isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= 1024:
            self.doc.error((*path, "ranks_per_host"), f"expected an integer from 1 to 1024, got {ranks!r}")
        if name in self.job_names:
            self.doc.error((*path, "name"), f"a job named {name!r} is already listed")
        self.job_names.add(name or "")
        if name is None or not good or None in good or not command:
            return None
        return Job(name, tuple(h for h in good if h), tuple(str(c) for c in command), int(ranks), self.doc.line(path))

    def job_list(self, raw: Mapping[str, object], path: FieldPath, key: str) -> list[object]:
        """A job's non-empty ``hosts`` or ``command`` (a list of strings); empty if bad or absent."""
        value = raw.get(key)
        strings = key == "hosts" or (isinstance(value, list) and all(isinstance(c, str) for c in value))
        if isinstance(value, list) and value and strings:
            return value
        if key in raw:
            what = "hosts" if key == "hosts" else "strings (argv)"
            self.doc.error((*path, key), f"expected a non-empty list of {what}")
        return []

    def fault(self, raw: object, i: int) -> Fault | None:
        path: FieldPath = ("timeline", i)
        if not isinstance(raw, dict):
            self.doc.error(path, "expected a mapping with at, fault, target")
            return None
        self.doc.missing(raw, path, ("at", "fault", "target"))
        kind_name = raw.get("fault")
        spec = KINDS.get(kind_name) if isinstance(kind_name, str) else None
        if spec is None:
            if "fault" in raw:
                hint = suggest(str(kind_name), list(KINDS))
                self.doc.error((*path, "fault"), f"unknown fault kind {kind_name!r}{hint}")
            return None
        at_s = self.doc.duration(raw.get("at"), (*path, "at")) if "at" in raw else None
        for_s = self.doc.duration(raw["for"], (*path, "for")) if "for" in raw else None
        if for_s is not None and (why := _bad_for(spec, for_s)):
            self.doc.error((*path, "for"), why)
        target = self.target(spec, raw, path)
        params = self.params(spec, raw, path, target)
        if at_s is None or target is None or params is None or self.names is None:
            if isinstance(raw.get("truth"), dict):  # still report what is wrong in it
                self.truths().overrides(Truth("", EntityType.HOST, ""), raw["truth"], (*path, "truth"), at_s or 0.0)
            return None
        line = self.doc.line(path)
        truth = spec.truth(Call(target, params, self.names, at_s))
        fault = Fault(i, line, spec.name, target, at_s, for_s, params, truth)
        return self.truth(fault, raw.get("truth"), path)

    def target(self, spec: FaultKind, raw: Mapping[str, object], path: FieldPath) -> str | None:
        if "target" not in raw or self.names is None:
            return None
        target = raw["target"]
        if spec.target is Target.HOST:
            return self.host(target, (*path, "target"))
        links = self.names.links
        if not isinstance(target, str) or target not in links:
            lower = str(target).split("-", 1)[0]
            own = [link for link in links if link.startswith(f"{lower}-")]
            hint = f" ({lower}'s links are {', '.join(own)})" if own else suggest(str(target), links)
            self.doc.error((*path, "target"), f"no link {target!r} (links are like {links[0]}, {links[-1]}){hint}")
            return None
        return target

    def params(self, spec: FaultKind, raw: Mapping[str, object], path: FieldPath,
               target: str | None) -> dict[str, ParamValue] | None:
        wanted = spec.params_for(raw)
        if spec.variant_param and str(raw.get(spec.variant_param)) not in spec.variants:
            wanted += tuple(p for ps in spec.variants.values() for p in ps)  # unknown variant: accept all
        self.doc.keys(raw, path, _ITEM + tuple(dict.fromkeys(p.name for p in wanted)))
        values: dict[str, ParamValue] = {}
        ok = True
        for param in spec.params_for(raw):
            if param.name not in raw:
                if param.required:
                    self.doc.error(path, f"missing required parameter {param.name!r} of {spec.name}")
                    ok = False
                values[param.name] = param.default
                continue
            if self.names is None or (target is None and param.name == "end"):
                ok = False
                continue
            try:
                values[param.name] = coerce(param, raw[param.name], names=self.names, target=target or "")
            except ValueError as exc:
                self.doc.error((*path, param.name), str(exc))
                ok = False
        return values if ok else None

    def truth(self, fault: Fault, raw: object, path: FieldPath) -> Fault | None:
        ends = [end for _, end in fault.windows(self.names) if end is not None] if self.names else []
        truth = self.truths().resolve(fault.truth, raw, path, fault.at_s, max(ends) if ends else None)
        return None if truth is None else replace(fault, truth=truth)

    def truths(self) -> TruthReader:
        return TruthReader(self.doc, self.names, self.duration_s)
