"""YAML with line numbers: a scenario's plain values, the line of every field, and its problems.

Every problem found while validating is kept (not raised at once), so `ScenarioError` can list
them all, each as ``file:line: field: problem``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import yaml

from ridethrough.lab.fault_params import parse_duration
from ridethrough.suggest import did_you_mean

FieldPath = tuple[str | int, ...]
"""Where a value sits in the document: ``("timeline", 2, "target")``."""


def field_name(path: FieldPath) -> str:
    """``("timeline", 2, "target")`` → ``timeline[2].target``."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def fmt_s(seconds: float) -> str:
    """Seconds as problems show them: ``12.5`` → ``12.5s``."""
    return f"{seconds:g}s"


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


class Doc:
    """Plain values from a YAML node tree, with the line of every field, and the problems found."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.lines: dict[FieldPath, int] = {}
        self.problems: list[Problem] = []
        self._scalars = yaml.constructor.SafeConstructor()

    def value(self, node: yaml.Node, path: FieldPath) -> object:
        """The plain value of ``node`` (dicts, lists, scalars), noting the line of each field under it."""
        self.lines.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            return self._mapping(node, path)
        if isinstance(node, yaml.SequenceNode):
            return [self.value(item, (*path, i)) for i, item in enumerate(node.value)]
        return self._scalars.construct_object(node)

    def _mapping(self, node: yaml.MappingNode, path: FieldPath) -> dict[str, object]:
        out: dict[str, object] = {}
        for key_node, value_node in node.value:
            key = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else "?"
            self.lines[(*path, key)] = key_node.start_mark.line + 1
            if key in out:
                self.error((*path, key), "duplicate key")
            out[key] = self.value(value_node, (*path, key))
        return out

    def line(self, path: FieldPath) -> int:
        """The line of ``path``, or of the nearest field above it that has one."""
        while path and path not in self.lines:
            path = path[:-1]
        return self.lines.get(path, 1)

    def error(self, path: FieldPath, message: str) -> None:
        """Record a problem at ``path``."""
        self.problems.append(Problem(self.source, self.line(path), field_name(path), message))

    # -- field checks: each records a problem and returns None (or an empty value) when bad ---

    def keys(self, data: Mapping[str, object], path: FieldPath, allowed: Sequence[str]) -> None:
        """An "unknown key" problem, with the nearest allowed one, for each key not in ``allowed``."""
        for key in data:
            if key not in allowed:
                self.error((*path, key), f"unknown key{did_you_mean(key, allowed, prefix=True)}")

    def missing(self, data: Mapping[str, object], path: FieldPath, required: Sequence[str]) -> None:
        """A problem for each ``required`` key that ``data`` lacks."""
        for key in required:
            if key not in data:
                self.error(path, f"missing required key {key!r}")

    def text(self, data: Mapping[str, object], path: FieldPath, key: str, *, required: bool = True) -> str | None:
        """A non-empty string (``""`` for an absent optional one)."""
        raw = data.get(key)
        if raw is None and not required:
            return ""
        if not isinstance(raw, str) or (required and not raw.strip()):
            self.error((*path, key), f"expected a non-empty string, got {raw!r}")
            return None
        return raw

    def duration(self, raw: object, path: FieldPath) -> float | None:
        """Seconds, from a number or a string like ``5s`` (see `parse_duration`)."""
        try:
            return parse_duration(raw)
        except ValueError as exc:
            self.error(path, str(exc))
            return None

    def listing(self, data: Mapping[str, object], key: str) -> list[object]:
        """The top-level list ``key`` (empty if absent or not a list)."""
        raw = data.get(key, [])
        if not isinstance(raw, list):
            self.error((key,), f"expected a list, got {type(raw).__name__}")
            return []
        return raw


def read(text: str, source: str) -> tuple[Doc, object]:
    """The document of ``text`` and its plain value (None if empty); `ScenarioError` if not YAML."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 1
        raise ScenarioError([Problem(source, line, "", f"invalid YAML: {exc.problem or exc.context}")]) from None
    doc = Doc(source)
    return doc, (doc.value(node, ()) if node is not None else None)
