"""The metric catalogue: every metric ridethrough emits, listed once.

The catalogue is data: one YAML file per source under ``ridethrough/metrics/``, each
``{source: NAME, metrics: [...]}``. Each entry gives the OpenTelemetry name, unit (UCUM,
as OTel writes it), kind (``gauge`` or ``counter``), the exact attribute keys every
sample carries, a description, and the names of the Prometheus node_exporter (or DCGM)
series that carry the same data, for dashboards and alerts migrating from them. Where
one ridethrough metric splits into several exporter series by an attribute value
(``network.io.direction``, ``ib.counter``), all of them are listed.

Tests hold the sources to the catalogue in both directions: a source emits only
catalogued names with the catalogued unit, kind and attribute keys, and every
catalogued metric is emitted by at least one fixture.
"""

from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass
from importlib import resources
from typing import Any

import yaml

from ridethrough.collector.sample import MetricKind

_FIELDS = {"name", "unit", "kind", "attributes", "description", "equivalents"}


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricSpec:
    """One catalogued metric."""

    name: str
    """OpenTelemetry metric name (semantic-convention name where one exists)."""
    unit: str
    """UCUM unit as OTel writes it: ``By``, ``{packet}``, ``1``, ``Gbit/s``."""
    kind: MetricKind
    """Gauge or monotonic counter."""
    attributes: tuple[str, ...]
    """Exactly the attribute keys every sample of this metric carries."""
    description: str
    """What the metric means and where it comes from."""
    source: str
    """The `Source.name` that emits it."""
    equivalents: tuple[str, ...] = ()
    """node_exporter/DCGM series carrying the same data; empty when there is none."""


class CatalogueError(ValueError):
    """A catalogue file is malformed; the message names the file and the entry."""


def _spec(entry: Any, source: str, where: str) -> MetricSpec:
    if not isinstance(entry, dict) or not {"name", "unit", "kind", "description"} <= entry.keys():
        raise CatalogueError(f"{where}: an entry needs name, unit, kind and description: {entry!r}")
    if unknown := entry.keys() - _FIELDS:
        raise CatalogueError(f"{where}: {entry['name']}: unknown field(s) {sorted(unknown)}")
    try:
        kind = MetricKind(entry["kind"])
    except ValueError:
        raise CatalogueError(f"{where}: {entry['name']}: kind must be gauge or counter") from None
    return MetricSpec(name=str(entry["name"]), unit=str(entry["unit"]), kind=kind,
                      attributes=tuple(entry.get("attributes") or ()), description=str(entry["description"]),
                      source=source, equivalents=tuple(entry.get("equivalents") or ()))


@functools.cache
def metrics() -> tuple[MetricSpec, ...]:
    """Every catalogued metric, read once from the package's data files."""
    out: list[MetricSpec] = []
    folder = resources.files("ridethrough") / "metrics"
    for item in sorted(folder.iterdir(), key=lambda p: p.name):
        if not item.name.endswith(".yaml"):
            continue
        data = yaml.safe_load(item.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or "source" not in data:
            raise CatalogueError(f"{item.name}: expected {{source: NAME, metrics: [...]}}")
        out += [_spec(e, str(data["source"]), item.name) for e in data.get("metrics") or ()]
    names = [m.name for m in out]
    if dupes := {n for n in names if names.count(n) > 1}:
        raise CatalogueError(f"metric(s) catalogued twice: {sorted(dupes)}")
    return tuple(out)


def metric(name: str) -> MetricSpec:
    """The catalogue entry for ``name``.

    Raises:
        KeyError: no such metric, with the closest catalogued names.
    """
    by_name = {m.name: m for m in metrics()}
    try:
        return by_name[name]
    except KeyError:
        close = difflib.get_close_matches(name, by_name, n=3)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise KeyError(f"metric {name!r} is not in the catalogue{hint}") from None


def metrics_of(source: str) -> tuple[MetricSpec, ...]:
    """The catalogued metrics of one source, in catalogue order."""
    return tuple(m for m in metrics() if m.source == source)
