"""A scenario fault's ground truth: the catalogue's default, the overrides its ``truth:`` gives,
and the checks that its times fall inside the fault and the run."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace

from ridethrough.lab.faults import EntityType, Names, Truth
from ridethrough.lab.scenario_yaml import Doc, FieldPath
from ridethrough.lab.scenario_yaml import fmt_s as _s

_TRUTH = ("entity", "entity_type", "kind", "precursor_at", "failure_at")
_TRUTH_KIND = re.compile(r"[a-z][a-z0-9_]*")


class TruthReader:
    """Reads ``truth:`` overrides, reporting every problem to the `Doc`."""

    def __init__(self, doc: Doc, lab_names: Names | None, duration_s: float) -> None:
        self.doc, self.names, self.duration_s = doc, lab_names, duration_s

    def resolve(self, truth: Truth, raw: object, path: FieldPath, at_s: float, end_s: float | None) -> Truth | None:
        """A fault's ``truth`` with the overrides in ``raw`` (None: absent), checked against the
        fault's start ``at_s``, its end ``end_s`` (None: open-ended) and the run's; None if ``raw``
        is not a mapping."""
        tpath = (*path, "truth")
        if raw is not None:
            if not isinstance(raw, dict):
                self.doc.error(tpath, "expected a mapping of " + ", ".join(_TRUTH))
                return None
            truth = self.overrides(truth, raw, tpath, at_s)
        for key, t in (("precursor_at", truth.precursor_at_s), ("failure_at", truth.failure_at_s)):
            where = (*tpath, key) if isinstance(raw, dict) and key in raw else path
            if t is not None and end_s is not None and t > end_s:
                self.doc.error(where, f"{key} {_s(t)} is after the fault ends at {_s(end_s)}")
            elif t is not None and t > self.duration_s:
                self.doc.error(where, f"{key} {_s(t)} is after the run ends (duration {_s(self.duration_s)})")
        return truth

    def overrides(self, truth: Truth, raw: Mapping[str, object], path: FieldPath, at_s: float) -> Truth:
        """``truth`` with the ``entity``, ``entity_type``, ``kind`` and times given in ``raw``."""
        self.doc.keys(raw, path, _TRUTH)
        if "entity" in raw and self.names is not None:
            truth = self._entity(truth, raw["entity"], (*path, "entity"))
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
        return self._times(truth, raw, path, at_s)

    def _entity(self, truth: Truth, entity: object, path: FieldPath) -> Truth:
        found = self.names.entity_type(entity) if self.names and isinstance(entity, str) else None
        if found is None:
            self.doc.error(path, f"no entity {entity!r} in the topology (a host, link, switch, host/nicN or host/gpuN)")
            return truth
        keep_clock = found is EntityType.HOST and truth.entity_type is EntityType.CLOCK
        return replace(truth, entity=str(entity), entity_type=truth.entity_type if keep_clock else found)

    def _times(self, truth: Truth, raw: Mapping[str, object], path: FieldPath, at_s: float) -> Truth:
        times = {}
        for key in ("precursor_at", "failure_at"):
            if key in raw:
                t = None if raw[key] is None else self.doc.duration(raw[key], (*path, key))
                if t is not None and t < at_s:
                    self.doc.error((*path, key), f"{_s(t)} is before the fault starts at {_s(at_s)}")
                times[key] = t
        truth = replace(truth, precursor_at_s=times.get("precursor_at", truth.precursor_at_s),
                        failure_at_s=times.get("failure_at", truth.failure_at_s))
        if truth.precursor_at_s is not None and truth.failure_at_s is not None \
                and truth.precursor_at_s > truth.failure_at_s:
            self.doc.error(path, "precursor_at is after failure_at")
        return truth
