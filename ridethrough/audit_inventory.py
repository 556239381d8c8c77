"""The audit's inventory phase: every expected host, NIC and GPU present, up, at the expected speed and MTU.

Facts come from the store, as the agents export them (`facts`): per host, ``ridethrough.nic.up``
and ``ridethrough.nic.mtu`` per interface, ``ridethrough.ib.port.state`` and ``.rate`` per RDMA
device, the IB error counters' increase over the window (errors at rest), ``hw.gpu.memory.limit``
per GPU (with its model), and the clock service's ``ridethrough.clock.node.uncertainty``.
`judge` compares them with the `Expected` inventory; where the inventory leaves a value open
(``mtu``, ``ib_rate_gbit``: None), the value most hosts report is the expected one, so one odd
host stands out (config consistency). `judge` is pure: it is tested on crafted facts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from ridethrough.audit_model import Expected, Issue, Symptom
from ridethrough.detectors import sql
from ridethrough.detectors.contract import Window

PHASE = "inventory"
IB_ACTIVE = 4.0
CLOCK_MAX_UNCERTAINTY_S = 1e-3
"""A clock correction less certain than this is not a synchronised clock."""
NOT_EXPORTED = ("NIC firmware and driver versions, GPU driver version: the agents do not export them, "
                "so they are not compared")
Facts = dict[str, dict[str, Any]]
"""Host → {"last_ns", "nics": {name: {up, mtu}}, "ib": {dev: {state, rate_gbit, errors}}, "gpus": {i: {...}},
"clock_uncertainty_s"}."""
_LAST_SEEN = f"""
    SELECT {sql.NODE} AS node, max({sql.T_NS}) AS last_ns FROM otel_metrics_gauge
    WHERE {sql.T_NS} >= {{start:Int64}} AND {sql.CLUSTER} GROUP BY node
"""
_LATEST = f"""
    SELECT {sql.NODE} AS node, MetricName AS metric, Attributes AS attrs, argMax(Value, {sql.T_NS}) AS latest
    FROM otel_metrics_gauge
    WHERE MetricName IN {{metrics:Array(String)}} AND {sql.IN_WINDOW} AND {sql.CLUSTER}
    GROUP BY node, metric, attrs
"""
# The clock service's rows name no cluster (one service per store): they are matched by host name instead.
_CLOCK = f"""
    SELECT Attributes['clock.node'] AS host, argMax(Value, {sql.T_NS}) AS latest FROM otel_metrics_gauge
    WHERE MetricName = 'ridethrough.clock.node.uncertainty' AND {sql.IN_WINDOW}
      AND Attributes['clock.node'] IN {{hosts:Array(String)}}
    GROUP BY host
"""
_GAUGES = {"ridethrough.nic.up": ("nics", "network.interface.name", "up"),
           "ridethrough.nic.mtu": ("nics", "network.interface.name", "mtu"),
           "ridethrough.ib.port.state": ("ib", "ib.device", "state"),
           "ridethrough.ib.port.rate": ("ib", "ib.device", "rate_gbit")}
"""Metric → (section of a host's facts, the attribute naming the port, the fact's name)."""


def last_seen(window: Window) -> dict[str, int]:
    """Per node with gauge points since the window's start, its newest one (ns)."""
    return {r["node"]: int(r["last_ns"]) for r in sql.run(window, _LAST_SEEN, sql.params(window)) if r["node"]}


def facts(window: Window) -> Facts:
    """What the store says about every host over the window (see the module docstring)."""
    out: Facts = {}

    def host(node: str) -> dict[str, Any]:
        return out.setdefault(node, {"last_ns": 0, "nics": {}, "ib": {}, "gpus": {}})

    for node, ns in last_seen(window).items():
        host(node)["last_ns"] = ns
    metrics = [*_GAUGES, "hw.gpu.memory.limit"]
    for r in sql.run(window, _LATEST, sql.params(window, metrics=metrics)):
        attrs = r["attrs"]
        if r["metric"] in _GAUGES:
            section, port, name = _GAUGES[r["metric"]]
            host(r["node"])[section].setdefault(attrs.get(port, ""), {})[name] = r["latest"]
        else:
            host(r["node"])["gpus"][attrs.get("gpu.index", "")] = {"model": attrs.get("hw.model", ""),
                                                                   "memory_bytes": r["latest"]}
    for r in sql.counter_series(window, "ridethrough.ib.port.errors", ("ib.device", "ib.counter")):
        if r["increase"] > 0:
            errors = host(r["node"])["ib"].setdefault(r["ib.device"], {}).setdefault("errors", {})
            errors[r["ib.counter"]] = r["increase"]
    for r in sql.run(window, _CLOCK, sql.params(window, hosts=sorted(out))):
        out[r["host"]]["clock_uncertainty_s"] = r["latest"]
    return out


def _majority(values: list[Any]) -> Any:
    return Counter(values).most_common(1)[0][0] if values else None


def judge(expected: Expected, found: Facts, *, at_s: float, window_s: float,
          ) -> tuple[list[Issue], dict[str, str]]:
    """Issues found in the facts, and what could not be checked (entity → why)."""
    issues: list[Issue] = []
    not_covered: dict[str, str] = {"versions": NOT_EXPORTED}

    def add(etype: str, entity: str, kind: str, summary: str, **evidence: Any) -> None:
        issues.append(Issue(etype, entity, kind, Symptom(PHASE, kind, summary, evidence, at_s)))

    seen = {h.name: found[h.name] for h in expected.hosts if h.name in found}
    for h in expected.hosts:
        if h.name not in seen:
            add("host", h.name, "no_telemetry", f"{h.name}: no telemetry from its agent in the last {window_s:g} s; "
                "its NICs, GPUs and clock could not be checked", window_s=window_s)
            not_covered[h.name] = "no telemetry from its agent"
    mtu = expected.mtu or _majority([n.get("mtu") for f in seen.values() for n in f["nics"].values()
                                     if n.get("mtu") is not None])
    rate = expected.ib_rate_gbit or _majority([d.get("rate_gbit") for f in seen.values() for d in f["ib"].values()
                                               if d.get("rate_gbit") is not None])
    for name, f in seen.items():
        want = expected.host(name)
        assert want is not None  # seen holds expected hosts only
        _nics(want.nics, f, mtu, add, name)
        _ib(expected, want.ib_devices, f, rate, add, name)
        _gpus(want.gpus, f, add, name, seen)
    _clock(seen, add, not_covered)
    return issues, not_covered


def _nics(nics: Mapping[str, str], f: Mapping[str, Any], mtu: Any, add: Any, host: str) -> None:
    for nic, link in nics.items():
        got = f["nics"].get(nic)
        entity = f"{host}/{nic}"
        if got is None:
            add("nic", entity, "nic_missing", f"{entity} (cabled to {link}) is not reported by the agent", link=link)
            continue
        if got.get("up") != 1.0:
            add("nic", entity, "nic_down", f"{entity} is down (link {link})", link=link, up=got.get("up"))
        if mtu is not None and got.get("mtu") is not None and got["mtu"] != mtu:
            add("link", link, "mtu_mismatch", f"{link}: {entity} has MTU {got['mtu']:g}, the fabric's is {mtu:g}",
                end=host, nic=entity, mtu=got["mtu"], expected_mtu=mtu)


def _ib(expected: Expected, devices: tuple[str, ...], f: Mapping[str, Any], rate: Any, add: Any, host: str) -> None:
    for dev in devices:
        got = f["ib"].get(dev)
        entity, link = f"{host}/{dev}", expected.nic_link(host, dev)
        if got is None or "state" not in got:
            add("nic", entity, "nic_missing", f"RDMA device {entity} is not reported by the agent", link=link)
            continue
        if got["state"] != IB_ACTIVE:
            add("nic", entity, "ib_port_not_active", f"{entity} port state {got['state']:g} (ACTIVE is 4)",
                link=link, state=got["state"])
        if rate is not None and got.get("rate_gbit") is not None and got["rate_gbit"] != rate:
            add("link", link or entity, "wrong_speed", f"{entity} runs at {got['rate_gbit']:g} Gb/s, "
                f"expected {rate:g} Gb/s", nic=entity, rate_gbit=got["rate_gbit"], expected_gbit=rate)
        if got.get("errors"):
            add("nic", entity, "nic_errors_at_rest", f"{entity} error counters rose with no audit load: "
                + ", ".join(f"{k} +{v:g}" for k, v in sorted(got["errors"].items())), link=link, errors=got["errors"])


def _gpus(count: int, f: Mapping[str, Any], add: Any, host: str, seen: Mapping[str, Any]) -> None:
    gpus = f["gpus"]
    if count and len(gpus) < count:
        missing = [f"gpu{i}" for i in range(count) if str(i) not in gpus]
        add("host", host, "gpu_missing", f"{host}: {len(gpus)} of {count} GPUs reported (missing {', '.join(missing)})",
            expected=count, found=len(gpus), missing=missing)
    model = _majority([g["model"] for s in seen.values() for g in s["gpus"].values()])
    memory = _majority([g["memory_bytes"] for s in seen.values() for g in s["gpus"].values()])
    for index, g in sorted(gpus.items()):
        if g["model"] != model or g["memory_bytes"] != memory:
            entity = f"{host}/gpu{index}"
            add("gpu", entity, "gpu_config_mismatch", f"{entity} is a {g['model']} with {g['memory_bytes']:.0f} bytes; "
                f"most GPUs are a {model} with {memory:.0f}", model=g["model"], memory_bytes=g["memory_bytes"])


def _clock(seen: Mapping[str, Any], add: Any, not_covered: dict[str, str]) -> None:
    if not any("clock_uncertainty_s" in f for f in seen.values()):
        not_covered["clock"] = "the store has no clock-service corrections (is the clock service running?)"
        return
    for name, f in seen.items():
        u = f.get("clock_uncertainty_s")
        if u is None or not u <= CLOCK_MAX_UNCERTAINTY_S:
            why = "no correction from the clock service" if u is None else f"offset uncertain by {u * 1e3:.3g} ms"
            add("host", name, "clock_unsynced", f"{name}: clock not synchronised ({why})", uncertainty_s=u,
                max_uncertainty_s=CLOCK_MAX_UNCERTAINTY_S)
