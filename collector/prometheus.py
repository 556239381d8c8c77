"""The agent's metrics at ``/metrics``, named as OpenTelemetry maps OTLP metrics to Prometheus.

`SnapshotCollector` is a prometheus_client collector over the agent's current samples:
each scrape reads them once and keeps nothing (there is no second copy of the data).
Names follow the OTel specification, "Prometheus and OpenMetrics Compatibility":

* characters outside ``[a-zA-Z0-9_:]`` become ``_`` and runs of ``_`` collapse to one
  (``system.network.io`` → ``system_network_io``);
* the UCUM unit is spelled out (``By`` → ``bytes``, ``s`` → ``seconds``, ``Gbit/s`` →
  ``Gbit_per_second``), ``{packet}``-style annotations are dropped, and the unit is
  appended unless the name already ends with it;
* unit ``1`` becomes ``ratio`` on gauges only, as the Collector's translator does: the
  counters catalogued with unit ``1`` count events, they are not ratios;
* monotonic counters end in ``_total``;
* attribute keys are sanitised like names (values of keys that collide are joined with
  ``;`` in the order of the original keys), every point carries ``otel_scope_name``, and
  the resource becomes one ``target_info``.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from ridethrough.collector.sample import MetricKind, Sample
from ridethrough.settings import parse_hostport

log = logging.getLogger(__name__)

_UNITS: Mapping[str, str] = {
    "d": "days", "h": "hours", "min": "minutes", "s": "seconds", "ms": "milliseconds",
    "us": "microseconds", "ns": "nanoseconds",
    "By": "bytes", "KiBy": "kibibytes", "MiBy": "mebibytes", "GiBy": "gibibytes", "TiBy": "tebibytes",
    "KBy": "kilobytes", "MBy": "megabytes", "GBy": "gigabytes", "TBy": "terabytes",
    "m": "meters", "V": "volts", "A": "amperes", "J": "joules", "W": "watts", "g": "grams",
    "Cel": "celsius", "Hz": "hertz", "%": "percent",
}
"""UCUM unit → Prometheus word: the Collector translator's table."""
_PER_UNITS: Mapping[str, str] = {"s": "second", "m": "minute", "h": "hour", "d": "day", "w": "week",
                                 "mo": "month", "y": "year"}
"""The denominator of ``foo/bar`` units, in the singular."""
_BAD_NAME = re.compile(r"[^a-zA-Z0-9_:]")
_BAD_LABEL = re.compile(r"[^a-zA-Z0-9_]")
_RUNS = re.compile(r"__+")
_MAX_CACHED = 200_000
"""Attribute sets whose labels a collector keeps between scrapes; past that it starts afresh."""


def _collapse(text: str) -> str:
    return _RUNS.sub("_", text)


def _unit_word(unit: str, kind: MetricKind) -> str:
    """The Prometheus spelling of a UCUM unit; empty when the name gets no unit suffix."""
    if unit == "1":
        return "ratio" if kind is MetricKind.GAUGE else ""
    main, _, per = unit.partition("/")
    words = []
    for part, table in ((main.strip(), _UNITS), (per.strip(), _PER_UNITS)):
        # an annotation ({packet}) names what is counted: Prometheus calls that unitless
        word = "" if "{" in part or "}" in part else _BAD_LABEL.sub("", table.get(part, part))
        words.append(word)
    main_word, per_word = words
    if per_word:
        return f"{main_word}_per_{per_word}" if main_word else f"per_{per_word}"
    return main_word


@functools.lru_cache(maxsize=4096)
def prometheus_name(name: str, unit: str, kind: MetricKind) -> str:
    """The Prometheus name of an OTel metric, with its unit suffix and, on counters, ``_total``.

    >>> prometheus_name("system.network.io", "By", MetricKind.COUNTER)
    'system_network_io_bytes_total'
    """
    base = _collapse(_BAD_NAME.sub("_", name))
    if base[:1].isdigit():
        base = "_" + base
    word = _unit_word(unit, kind)
    if word and not base.endswith("_" + word):
        base = _collapse(f"{base}_{word}")
    if kind is MetricKind.COUNTER and not base.endswith("_total"):
        base += "_total"
    return base


@functools.lru_cache(maxsize=4096)
def label_name(key: str) -> str:
    """A Prometheus label name for an OTel attribute key (``network.io.direction`` → ``network_io_direction``)."""
    out = _collapse(_BAD_LABEL.sub("_", key))
    if not out:
        return "key_"
    return "key_" + out if out[0].isdigit() else out


def labels_of(attributes: Mapping[str, Any]) -> dict[str, str]:
    """Attributes as Prometheus labels; values of keys that sanitise alike are joined with ``;``."""
    out: dict[str, str] = {}
    for key in sorted(attributes):
        label = label_name(key)
        value = str(attributes[key])
        out[label] = f"{out[label]};{value}" if label in out else value
    return out


class SnapshotCollector(Collector):
    """Converts the samples ``read`` returns into metric families at every scrape."""

    def __init__(self, *, read: Callable[[], Iterable[Sample]], resource: Mapping[str, Any], scope: str,
                 descriptions: Mapping[str, str] | None = None) -> None:
        self._read = read
        self._target = labels_of(resource)
        self._scope = scope
        self._descriptions = dict(descriptions or {})
        self._clashes: set[tuple[str, str]] = set()
        self._labels: dict[tuple[tuple[str, Any], ...], tuple[tuple[str, ...], tuple[str, ...]]] = {}

    def describe(self) -> list[Metric]:
        """Nothing up front: the families depend on what the sources see."""
        return []

    def collect(self) -> Iterator[Metric]:
        """One family per metric name, then ``target_info``."""
        grouped: dict[str, list[Sample]] = {}
        for sample in self._read():
            grouped.setdefault(sample.name, []).append(sample)
        families: dict[str, tuple[str, Metric]] = {}
        for name, samples in grouped.items():
            first = samples[0]
            prom = prometheus_name(name, first.unit, first.kind)
            if prom in families:
                self._clash(prom, families[prom][0], name)
                continue
            families[prom] = (name, self._family(prom, name, first, samples))
        for _, family in families.values():
            yield family
        target = InfoMetricFamily("target", "Target metadata")
        target.add_metric([], self._target)
        yield target

    def _family(self, prom: str, name: str, first: Sample, samples: list[Sample]) -> Metric:
        rows = [self._label_row(s.attributes) for s in samples]
        shapes = {names for names, _ in rows}
        if len(shapes) == 1:  # the usual case: every sample of a metric has the same keys
            keys, values = next(iter(shapes)), [row for _, row in rows]
        else:
            keys = tuple(sorted(set().union(*shapes)))
            values = [tuple(dict(zip(names, row, strict=True)).get(k, "") for k in keys) for names, row in rows]
        help_text = self._descriptions.get(name, name)
        word = _unit_word(first.unit, first.kind)
        unit = word if prom.removesuffix("_total").endswith("_" + word) else ""
        family: CounterMetricFamily | GaugeMetricFamily
        if first.kind is MetricKind.COUNTER:
            family = CounterMetricFamily(prom, help_text, labels=keys, unit=unit)
        else:
            family = GaugeMetricFamily(prom, help_text, labels=keys, unit=unit)
        seen: set[tuple[str, ...]] = set()
        for sample, row in zip(samples, values, strict=True):
            if row in seen:  # Prometheus refuses a series twice in one scrape; keep the first
                continue
            seen.add(row)
            family.add_metric(row, sample.value)
        return family

    def _label_row(self, attributes: Mapping[str, Any]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(label names, values) of an attribute set, ``otel_scope_name`` included; cached across scrapes."""
        key = tuple(attributes.items())
        row = self._labels.get(key)
        if row is None:
            labels = {**labels_of(attributes), "otel_scope_name": self._scope}
            names = tuple(sorted(labels))
            row = (names, tuple(labels[n] for n in names))
            if len(self._labels) >= _MAX_CACHED:
                self._labels.clear()
            self._labels[key] = row
        return row

    def _clash(self, prom: str, kept: str, dropped: str) -> None:
        if (kept, dropped) not in self._clashes:
            self._clashes.add((kept, dropped))
            log.warning("metrics %s and %s are both %s in Prometheus; serving only %s", kept, dropped, prom, kept)


def format_address(host: str, port: int) -> str:
    """``HOST:PORT``, with IPv6 hosts in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class MetricsEndpoint:
    """``/metrics`` over one collector, served from a registry of its own (no global state)."""

    def __init__(self, *, collector: Collector, listen: str) -> None:
        self._collector = collector
        self._listen = listen
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> str:
        """Bind and serve in a daemon thread; returns the bound ``HOST:PORT`` (port 0 picks one)."""
        host, port = parse_hostport(self._listen)
        registry = CollectorRegistry()
        registry.register(self._collector)
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        return format_address(host, int(self._server.server_port))

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving and release the port."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._server = None
