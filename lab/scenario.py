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

import difflib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from ridethrough.lab.faults import KINDS, Call, EntityType, FaultKind, Names, ParamValue, Target, Truth, coerce, names
from ridethrough.lab.faults import parse_duration as _parse_duration

FieldPath = tuple[str | int, ...]


@dataclass(frozen=True, slots=True)
class Topology:
    """Lab sizes; the defaults are the default lab."""

    hosts: int = 8
    racks: int = 2
    rails: int = 2
    spines: int = 2
    gpus: int = 8


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


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with a scenario, located."""

    source: str
    line: int
    field: str
    message: str

    def __str__(self) -> str:
        where = f"{self.source}:{self.line}:"
        return f"{where} {self.field}: {self.message}" if self.field else f"{where} {self.message}"


class ScenarioError(ValueError):
    """A scenario was rejected; ``problems`` lists every reason, one per line of the message."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        self.problems = tuple(sorted(problems, key=lambda p: p.line))
        super().__init__("\n".join(str(p) for p in self.problems))


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file; raises `ScenarioError` (or OSError if unreadable)."""
    return parse_scenario(Path(path).read_text(encoding="utf-8"), source=str(path))


def parse_scenario(text: str, *, source: str = "<scenario>") -> Scenario:
    """Validate scenario YAML text; ``source`` names it in error messages."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 1
        raise ScenarioError([Problem(source, line, "", f"invalid YAML: {exc.problem or exc.context}")]) from None
    doc = _Doc(source)
    data = doc.value(node, ()) if node is not None else None
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


# -- YAML with line numbers ----------------------------------------------------------------


def field_name(path: FieldPath) -> str:
    """``("timeline", 2, "target")`` → ``timeline[2].target``."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


class _Doc:
    """Plain values from a YAML node tree, with the line of every field, and the problems found."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.lines: dict[FieldPath, int] = {}
        self.problems: list[Problem] = []
        self._scalars = yaml.constructor.SafeConstructor()

    def value(self, node: yaml.Node, path: FieldPath) -> object:
        self.lines.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            out: dict[str, object] = {}
            for key_node, value_node in node.value:
                key = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else "?"
                self.lines[(*path, key)] = key_node.start_mark.line + 1
                if key in out:
                    self.error((*path, key), "duplicate key")
                out[key] = self.value(value_node, (*path, key))
            return out
        if isinstance(node, yaml.SequenceNode):
            return [self.value(item, (*path, i)) for i, item in enumerate(node.value)]
        return self._scalars.construct_object(node)

    def line(self, path: FieldPath) -> int:
        while path and path not in self.lines:
            path = path[:-1]
        return self.lines.get(path, 1)

    def error(self, path: FieldPath, message: str) -> None:
        self.problems.append(Problem(self.source, self.line(path), field_name(path), message))


def suggest(word: str, candidates: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` for the nearest candidate (a prefix match first), or ``""``."""
    prefixed = [c for c in candidates if word and (c.startswith(word) or word.startswith(c))]
    match = prefixed[:1] or difflib.get_close_matches(word, list(candidates), n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _span(values: Sequence[str]) -> str:
    return f"{values[0]}..{values[-1]}" if len(values) > 3 else ", ".join(values)


def _s(seconds: float) -> str:
    return f"{seconds:g}s"


_TOP = ("name", "description", "topology", "duration", "jobs", "timeline")
_ITEM = ("at", "for", "fault", "target", "truth")
_TRUTH = ("entity", "entity_type", "kind", "precursor_at", "failure_at")
_JOB = ("name", "hosts", "command", "ranks_per_host")
_TOPOLOGY_MAX = {"hosts": 240, "racks": 240, "rails": 64, "spines": 127, "gpus": 64}
_TRUTH_KIND = re.compile(r"[a-z][a-z0-9_]*")


class _Builder:
    """Builds a `Scenario` from plain values, reporting every problem to the `_Doc`."""

    def __init__(self, doc: _Doc) -> None:
        self.doc = doc
        self.names: Names | None = None
        self.duration_s = 0.0
        self.job_names: set[str] = set()

    def keys(self, data: Mapping[str, object], path: FieldPath, allowed: Sequence[str]) -> None:
        for key in data:
            if key not in allowed:
                self.doc.error((*path, key), f"unknown key{suggest(key, allowed)}")

    def missing(self, data: Mapping[str, object], path: FieldPath, required: Sequence[str]) -> None:
        for key in required:
            if key not in data:
                self.doc.error(path, f"missing required key {key!r}")

    def text(self, data: Mapping[str, object], path: FieldPath, key: str, *, required: bool = True) -> str | None:
        raw = data.get(key)
        if raw is None and not required:
            return ""
        if not isinstance(raw, str) or (required and not raw.strip()):
            self.doc.error((*path, key), f"expected a non-empty string, got {raw!r}")
            return None
        return raw

    def duration(self, raw: object, path: FieldPath) -> float | None:
        try:
            return _parse_duration(raw)
        except ValueError as exc:
            self.doc.error(path, str(exc))
            return None

    def listing(self, data: Mapping[str, object], key: str) -> list[object]:
        raw = data.get(key, [])
        if not isinstance(raw, list):
            self.doc.error((key,), f"expected a list, got {type(raw).__name__}")
            return []
        return raw

    def scenario(self, data: Mapping[str, object]) -> Scenario | None:
        self.keys(data, (), _TOP)
        self.missing(data, (), ("name", "duration", "timeline"))
        name = self.text(data, (), "name") if "name" in data else None
        description = self.text(data, (), "description", required=False) or ""
        topology = self.topology(data.get("topology", {}))
        duration = self.duration(data["duration"], ("duration",)) if "duration" in data else None
        if duration is not None and duration <= 0:
            self.doc.error(("duration",), "must be more than 0s")
        self.duration_s = duration or float("inf")
        jobs = [self.job(raw, i) for i, raw in enumerate(self.listing(data, "jobs"))]
        items = self.listing(data, "timeline")
        if "timeline" in data and not items:
            self.doc.error(("timeline",), "a scenario needs at least one fault")
        faults = [self.fault(raw, i) for i, raw in enumerate(items)]
        valid = [f for f in faults if f is not None]
        if self.names is not None:
            valid = _Overlaps(self.doc, self.names, self.duration_s).check(valid)
        if self.doc.problems or name is None or duration is None or self.names is None:
            return None
        return Scenario(name, description, topology, duration, tuple(j for j in jobs if j), tuple(valid),
                        self.names, self.doc.source)

    def topology(self, raw: object) -> Topology:
        path: FieldPath = ("topology",)
        if not isinstance(raw, dict):
            self.doc.error(path, "expected a mapping of hosts, racks, rails, spines, gpus")
            return Topology()
        self.keys(raw, path, tuple(_TOPOLOGY_MAX))
        sizes: dict[str, int] = {}
        for key, most in _TOPOLOGY_MAX.items():
            value = raw.get(key, getattr(Topology(), key))
            least = 0 if key == "gpus" else 1
            if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
                self.doc.error((*path, key), f"expected an integer from {least} to {most}, got {value!r}")
                return Topology()
            sizes[key] = value
        topology = Topology(**sizes)
        try:
            self.names = names(topology.hosts, topology.racks, topology.rails, topology.spines, topology.gpus)
        except ValueError as exc:
            self.doc.error((*path, "racks"), str(exc))
        return topology

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
        self.keys(raw, path, _JOB)
        self.missing(raw, path, ("name", "hosts", "command"))
        name = self.text(raw, path, "name") if "name" in raw else None
        hosts, command = raw.get("hosts"), raw.get("command")
        ranks = raw.get("ranks_per_host", 1)
        if not isinstance(hosts, list) or not hosts:
            if "hosts" in raw:
                self.doc.error((*path, "hosts"), "expected a non-empty list of hosts")
            hosts = []
        good = [self.host(h, (*path, "hosts", k)) for k, h in enumerate(hosts)]
        if not isinstance(command, list) or not command or not all(isinstance(c, str) for c in command):
            if "command" in raw:
                self.doc.error((*path, "command"), "expected a non-empty list of strings (argv)")
            command = []
        if isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= 1024:
            self.doc.error((*path, "ranks_per_host"), f"expected an integer from 1 to 1024, got {ranks!r}")
        if name in self.job_names:
            self.doc.error((*path, "name"), f"a job named {name!r} is already listed")
        self.job_names.add(name or "")
        if name is None or not good or None in good or not command:
            return None
        return Job(name, tuple(h for h in good if h), tuple(str(c) for c in command), int(ranks), self.doc.line(path))

    def fault(self, raw: object, i: int) -> Fault | None:
        path: FieldPath = ("timeline", i)
        if not isinstance(raw, dict):
            self.doc.error(path, "expected a mapping with at, fault, target")
            return None
        self.missing(raw, path, ("at", "fault", "target"))
        kind_name = raw.get("fault")
        spec = KINDS.get(kind_name) if isinstance(kind_name, str) else None
        if spec is None:
            if "fault" in raw:
                hint = suggest(str(kind_name), list(KINDS))
                self.doc.error((*path, "fault"), f"unknown fault kind {kind_name!r}{hint}")
            return None
        at_s = self.duration(raw.get("at"), (*path, "at")) if "at" in raw else None
        for_s = self.duration(raw["for"], (*path, "for")) if "for" in raw else None
        if for_s is not None and (for_s <= 0 or spec.undo is None or spec.pulsed):
            why = "must be more than 0s" if spec.undo else f"{spec.name} is instant and has no undo; drop 'for'"
            if spec.pulsed:
                why = f"{spec.name} ends by itself after count x period_s; drop 'for'"
            self.doc.error((*path, "for"), why)
        target = self.target(spec, raw, path)
        params = self.params(spec, raw, path, target)
        if at_s is None or target is None or params is None or self.names is None:
            if isinstance(raw.get("truth"), dict):  # still report what is wrong in it
                self.truth_overrides(Truth("", EntityType.HOST, ""), raw["truth"], (*path, "truth"), at_s or 0.0)
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
        self.keys(raw, path, _ITEM + tuple(dict.fromkeys(p.name for p in wanted)))
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
        tpath = (*path, "truth")
        truth = fault.truth
        if raw is not None:
            if not isinstance(raw, dict):
                self.doc.error(tpath, "expected a mapping of " + ", ".join(_TRUTH))
                return None
            truth = self.truth_overrides(truth, raw, tpath, fault.at_s)
        ends = [end for _, end in fault.windows(self.names) if end is not None] if self.names else []
        end = max(ends) if ends else None
        for key, t in (("precursor_at", truth.precursor_at_s), ("failure_at", truth.failure_at_s)):
            where = (*tpath, key) if isinstance(raw, dict) and key in raw else path
            if t is not None and end is not None and t > end:
                self.doc.error(where, f"{key} {_s(t)} is after the fault ends at {_s(end)}")
            elif t is not None and t > self.duration_s:
                self.doc.error(where, f"{key} {_s(t)} is after the run ends (duration {_s(self.duration_s)})")
        return replace(fault, truth=truth)

    def truth_overrides(self, truth: Truth, raw: Mapping[str, object], path: FieldPath, at_s: float) -> Truth:
        self.keys(raw, path, _TRUTH)
        if "entity" in raw and self.names is not None:
            entity = raw["entity"]
            found = self.names.entity_type(entity) if isinstance(entity, str) else None
            if found is None:
                self.doc.error((*path, "entity"), f"no entity {entity!r} in the topology (a host, link, switch, "
                                                  "host/nicN or host/gpuN)")
            else:
                keep_clock = found is EntityType.HOST and truth.entity_type is EntityType.CLOCK
                truth = replace(truth, entity=str(entity), entity_type=truth.entity_type if keep_clock else found)
        if "entity_type" in raw:
            try:
                truth = replace(truth, entity_type=EntityType(str(raw["entity_type"])))
            except ValueError:
                self.doc.error((*path, "entity_type"), f"expected one of {', '.join(EntityType)}")
        if "kind" in raw:
            kind = raw["kind"]
            if isinstance(kind, str) and _TRUTH_KIND.fullmatch(kind):
                truth = replace(truth, kind=kind)
            else:
                self.doc.error((*path, "kind"), f"expected a snake_case name, got {kind!r}")
        times = {}
        for key in ("precursor_at", "failure_at"):
            if key in raw:
                t = None if raw[key] is None else self.duration(raw[key], (*path, key))
                if t is not None and t < at_s:
                    self.doc.error((*path, key), f"{_s(t)} is before the fault starts at {_s(at_s)}")
                times[key] = t
        truth = replace(truth, precursor_at_s=times.get("precursor_at", truth.precursor_at_s),
                        failure_at_s=times.get("failure_at", truth.failure_at_s))
        if truth.precursor_at_s is not None and truth.failure_at_s is not None \
                and truth.precursor_at_s > truth.failure_at_s:
            self.doc.error(path, "precursor_at is after failure_at")
        return truth


@dataclass
class _Span:
    fault: Fault
    slots: tuple[str, ...]
    start: float
    end: float
    bounded: bool
    closes: list[int] = field(default_factory=list)


class _Overlaps:
    """Ends open-ended faults at the recovery that clears them; rejects contradictory overlaps."""

    def __init__(self, doc: _Doc, lab_names: Names, duration_s: float) -> None:
        self.doc, self.names, self.duration_s = doc, lab_names, duration_s

    def check(self, faults: list[Fault]) -> list[Fault]:
        spans = [self.span(f) for f in faults]
        self.windows_fit(spans)
        for span in sorted(spans, key=lambda s: (s.fault.at_s, s.fault.index)):
            if span.fault.spec.clears:
                self.close(span, spans)
        lasting = [s for s in spans if s.end > s.start]
        for j, later in enumerate(lasting):
            earlier = next((e for e in lasting[:j] if self.conflict(e, later)), None)
            if earlier is not None:
                e = earlier.fault
                self.doc.error(("timeline", later.fault.index),
                               f"overlaps timeline[{e.index}] ({e.kind} of {e.target} from {_s(earlier.start)} to "
                               f"{_s(earlier.end)}): one fault at a time on {self.shared(earlier, later)}")
        return [replace(s.fault, closes=tuple(s.closes)) for s in spans]

    def span(self, f: Fault) -> _Span:
        windows = f.windows(self.names)
        last = windows[-1][1]
        instant = f.spec.undo is None or (not f.spec.lasting and f.for_s is None)
        end = windows[0][0] if instant else (self.duration_s if last is None else last)
        return _Span(f, f.spec.slots(f.call(self.names)), windows[0][0], end, last is not None)

    def windows_fit(self, spans: list[_Span]) -> None:
        for s in spans:
            f = s.fault
            if f.at_s >= self.duration_s:
                self.doc.error(("timeline", f.index, "at"), f"{_s(f.at_s)} is not before the run ends "
                                                           f"(duration {_s(self.duration_s)})")
            elif s.bounded and s.end > self.duration_s:
                key = "for" if f.for_s is not None else "count"
                self.doc.error(("timeline", f.index, key), f"the fault ends at {_s(s.end)}, after the run ends "
                                                          f"(duration {_s(self.duration_s)})")

    def close(self, recovery: _Span, spans: list[_Span]) -> None:
        t = recovery.start
        for other in spans:
            f = other.fault
            if f.kind not in recovery.fault.spec.clears or not set(other.slots) & set(recovery.slots):
                continue
            if other.start <= t < other.end and (other.bounded or other.start == t):
                why = "it is undone by the runner itself" if other.bounded else "it starts at the same time"
                self.doc.error(("timeline", recovery.fault.index),
                               f"{recovery.fault.kind} at {_s(t)} contradicts timeline[{f.index}] ({f.kind} of "
                               f"{f.target} from {_s(other.start)} to {_s(other.end)}): {why}")
            elif other.start < t < other.end:
                other.end = t
                recovery.closes.append(f.index)

    @staticmethod
    def conflict(a: _Span, b: _Span) -> bool:
        if not set(a.slots) & set(b.slots) or not (a.start < b.end and b.start < a.end):
            return False
        key = a.fault.spec.stack_param  # open-ended symptoms of one GPU or NIC stack
        stacks = bool(key) and a.fault.kind == b.fault.kind and not a.bounded and not b.bounded \
            and a.fault.params.get(key) != b.fault.params.get(key)
        return not stacks

    @staticmethod
    def shared(a: _Span, b: _Span) -> str:
        slot = sorted(set(a.slots) & set(b.slots))[0]
        what, _, name = slot.partition(":")
        return {"cpu": f"{name}'s CPU cap", "freeze": f"{name}'s processes", "clock": f"{name}'s clock"}.get(
            what, f"{what} {name}")
