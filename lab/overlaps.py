"""The overlap check of a scenario's timeline: one fault at a time on each resource.

A recovery kind (``link-up``, ``restore``, ``thaw``, ``unstraggle``) ends the open-ended faults
it clears on the same target; open-ended faults whose kind has a ``stack_param`` may overlap
when that parameter differs (a failing GPU shows several symptoms). Anything else that shares a
slot (`ridethrough.lab.faults.FaultKind.slots`) while both are on is a contradiction.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from ridethrough.lab.faults import Names
from ridethrough.lab.scenario_yaml import Doc, fmt_s

if TYPE_CHECKING:
    from ridethrough.lab.scenario import Fault


@dataclass
class _Span:
    fault: Fault
    slots: tuple[str, ...]
    start: float
    end: float
    bounded: bool
    closes: list[int] = field(default_factory=list)


class Overlaps:
    """Ends open-ended faults at the recovery that clears them; rejects contradictory overlaps."""

    def __init__(self, doc: Doc, lab_names: Names, duration_s: float) -> None:
        self.doc, self.names, self.duration_s = doc, lab_names, duration_s

    def check(self, faults: list[Fault]) -> list[Fault]:
        """``faults`` with the open-ended ones each recovery ends in its ``closes``; problems go to the doc."""
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
                               f"overlaps timeline[{e.index}] ({e.kind} of {e.target} from {fmt_s(earlier.start)} "
                               f"to {fmt_s(earlier.end)}): one fault at a time on {self.shared(earlier, later)}")
        return [replace(s.fault, closes=tuple(s.closes)) for s in spans]

    def span(self, f: Fault) -> _Span:
        windows = f.windows(self.names)
        last = windows[-1][1]
        instant = f.spec.undo is None or (not f.spec.lasting and f.for_s is None)
        end = windows[0][0] if instant else (self.duration_s if last is None else last)
        return _Span(f, f.spec.slots(f.call(self.names)), windows[0][0], end, last is not None)

    def windows_fit(self, spans: list[_Span]) -> None:
        run_end = f"(duration {fmt_s(self.duration_s)})"
        for s in spans:
            f = s.fault
            if f.at_s >= self.duration_s:
                self.doc.error(("timeline", f.index, "at"), f"{fmt_s(f.at_s)} is not before the run ends {run_end}")
            elif s.bounded and s.end > self.duration_s:
                key = "for" if f.for_s is not None else "count"
                self.doc.error(("timeline", f.index, key),
                               f"the fault ends at {fmt_s(s.end)}, after the run ends {run_end}")

    def close(self, recovery: _Span, spans: list[_Span]) -> None:
        t = recovery.start
        for other in spans:
            f = other.fault
            if f.kind not in recovery.fault.spec.clears or not set(other.slots) & set(recovery.slots):
                continue
            if other.start <= t < other.end and (other.bounded or other.start == t):
                why = "it is undone by the runner itself" if other.bounded else "it starts at the same time"
                self.doc.error(("timeline", recovery.fault.index),
                               f"{recovery.fault.kind} at {fmt_s(t)} contradicts timeline[{f.index}] ({f.kind} of "
                               f"{f.target} from {fmt_s(other.start)} to {fmt_s(other.end)}): {why}")
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
