"""A generated fleet in a store: N hosts x T hours of the agents' metrics, jobs, incidents, actions and traces.

For the dashboard's browser tests and its load benchmark. The rows have the shape real agents,
the clock service, the controller and the actuator runner write (metric names, attributes and
resources from the catalogue; incidents, actions and spans through their own row and span
builders), at a coarser interval than an agent's 1 s. Metric rows are generated inside ClickHouse
(``INSERT ... SELECT FROM numbers()``, values from a hash of host, series and time: the same
spec gives the same fleet). Faults are placed at fixed roles (`roles`):

* ``gpu_failing``: one GPU heats up, throttles, counts rising corrected ECC errors and XID 63;
* ``gpu_failed``: one GPU falls off the bus (XID 79, two uncorrected errors), in a job that restarts;
* ``link_down``: a host's ``nic1`` is down for 15 minutes (rerouted, resolved);
* ``link_degrading``: a host's ``nic0`` counts ever more receive errors;
* ``clock``: a node's clock uncertainty jumps; ``silent``: an agent stops reporting;
* congestion: forward one-way delays into one rack rise in the last hour.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ridethrough.dashboards import fake_fleet_events
from ridethrough.detectors.fabric_map import RouteMap
from ridethrough.exporters.store import Store

S_NS = 1_000_000_000
H_NS = 3600 * S_NS


@dataclass(frozen=True, slots=True)
class FleetSpec:
    """The size and density of a generated fleet (hosts split evenly into racks, lab naming ``h{i}``)."""

    hosts: int = 64
    racks: int = 8
    rails: int = 2
    spines: int = 4
    gpus: int = 8
    hours: float = 24.0
    interval_s: float = 60.0
    step_s: float = 120.0
    """Training step length of the generated jobs."""
    peers: int = 4
    """Peers each host probes on every rail."""
    cluster: str = "fake"
    seed: int = 1

    def __post_init__(self) -> None:
        if self.hosts < 8 or self.hosts % self.racks or self.gpus < 6 or self.rails < 2 or self.peers < 1:
            raise ValueError("a fake fleet needs at least 8 hosts (split evenly into racks), 6 GPUs, 2 rails, "
                             "1 probed peer")
        if not (0 < self.hours <= 24 * 31 and self.interval_s >= 1 and self.step_s >= self.interval_s):
            raise ValueError("hours must be in (0, 744], interval_s >= 1 and step_s >= interval_s")

    @property
    def points(self) -> int:
        """Points per series."""
        return max(2, int(self.hours * 3600 / self.interval_s))


def roles(spec: FleetSpec) -> dict[str, int]:
    """The host index of each fault (distinct for any fleet of 8 hosts or more)."""
    names = ("gpu_failing", "gpu_failed", "link_down", "link_degrading", "clock", "silent")
    return {name: (i + 1) * spec.hosts // 8 for i, name in enumerate(names)}


def fabric_map(spec: FleetSpec) -> RouteMap:
    """The fleet's cabling and design routes (the lab's topology and naming; ``mlx5_r`` aliases ``nic{r}``)."""
    from ridethrough.lab.topology import Topology, TopologySpec

    topo = Topology(TopologySpec(hosts=spec.hosts, racks=spec.racks, rails=spec.rails, spines=spec.spines,
                                 gpus=spec.gpus))
    return RouteMap.from_fabric(topo, aliases=lambda r: (f"mlx5_{r}",))


# --- metrics, generated in SQL ----------------------------------------------------------------------

_AGENT = ("map('service.name', 'ridethrough-agent', 'host.name', host, 'ridethrough.node.id', host, "
          "'ridethrough.cluster', {cluster:String}, "
          "'ridethrough.rack', concat('rack', toString(intDiv(h, {rack:UInt32}))))")
_CLOCK = "map('service.name', 'ridethrough-clock', 'host.name', 'rt-server')"
_GPU_ID = ("'hw.id', concat('GPU-', lower(hex(cityHash64(host, g)))), 'hw.type', 'gpu', 'hw.vendor', 'NVIDIA', "
           "'hw.model', 'NVIDIA H100 80GB HBM3', 'hw.serial_number', toString(1650000000000 + h * 8 + g), "
           "'gpu.index', toString(g), 'gpu.pci_bus_id', concat('00000000:', hex(toUInt8(24 + g * 16)), ':00.0')")
# NOT: a GPU that fell off the bus reports nothing more (the agent can no longer read it).
_GONE = "NOT (h = {gpu_failed:UInt32} AND g = 5 AND t >= {failed_at:Int64})"
_INSERT = """
INSERT INTO {table} (ResourceAttributes, ServiceName, ScopeName, MetricName, MetricUnit, Attributes, StartTimeUnix,
                     TimeUnix, Value{sum_cols})
SELECT {resource}, res['service.name'], 'ridethrough', {metric:String}, {unit:String}, attrs,
       fromUnixTimestamp64Nano({start:Int64}), fromUnixTimestamp64Nano(t), value{sum_vals}
FROM (
    SELECT {hosts:UInt32} AS n_hosts, intDiv(number, {series:UInt32} * {points:UInt32}) AS h0, {h} AS h,
           intDiv(number, {points:UInt32}) % {series:UInt32} AS s, number % {points:UInt32} AS k,
           {start:Int64} + toInt64(k) * {interval:Int64} AS t, concat('h', toString(h)) AS host, {g} AS g,
           (cityHash64(h, s, k, {seed:UInt32}) % 10000) / 10000.0 AS u, {resource} AS res, {attrs} AS attrs,
           {value} AS value
    FROM numbers({rows:UInt64})
)
WHERE NOT (h = {silent:UInt32} AND t >= {silent_at:Int64}) AND {where}
"""


@dataclass(frozen=True, slots=True)
class _Metric:
    name: str
    unit: str
    series: str  # series per host: 1, gpu, gpu*4, gpu*2, rail, rail*2 or probe
    attrs: str
    value: str
    counter: bool = False
    g: str = "s"  # SQL: the GPU index of series s (or anything the expressions want as g)
    where: str = "1"
    h: str = "h0"  # SQL: the host of row block h0 (a metric of a few hosts maps them here)
    resource: str = _AGENT


_METRICS = (
    _Metric("ridethrough.agent.export.buffered", "{batch}", "1", "map()", "0"),
    _Metric("hw.temperature", "Cel", "gpu", f"map({_GPU_ID})",
            "52 + 6 * sin(t / 1e9 / 13751 + h) + 3 * u + if(h = {gpu_failing:UInt32} AND g = 2, "
            "30 * least(1, greatest(0, (t - {failing_at:Int64}) / 2.16e13)), 0)", where=_GONE),
    _Metric("ridethrough.gpu.clock_event_reasons", "1", "gpu", f"map({_GPU_ID})",
            "if(h = {gpu_failing:UInt32} AND g = 2 AND t >= {failing_at:Int64} + 1.44e13, 64, if(u < 0.004, 4, 0))",
            where=_GONE),
    _Metric("hw.status", "1", "gpu*4",
            f"map({_GPU_ID}, 'hw.state', ['ok', 'degraded', 'predicted_failure', 'failed'][s % 4 + 1])",
            "s % 4 = multiIf(h = {gpu_failed:UInt32} AND g = 5 AND t >= {failed_at:Int64}, 3, "
            "h = {gpu_failing:UInt32} AND g = 2 AND t >= {failing_at:Int64} + 1.44e13, 2, 0)", g="intDiv(s, 4)"),
    _Metric("hw.errors", "{error}", "gpu*2",
            f"map({_GPU_ID}, 'error.type', ['corrected', 'uncorrected'][s % 2 + 1])",
            "if(s % 2 = 0, floor(k / (400 + cityHash64(h, g) % 900)) + if(h = {gpu_failing:UInt32} AND g = 2, "
            "floor(20 * pow(greatest(0, (t - {failing_at:Int64}) / 3.6e12), 2)), 0), "
            "if(h = {gpu_failed:UInt32} AND g = 5 AND t >= {failed_at:Int64} - 6e10, 2, 0))",
            counter=True, g="intDiv(s, 2)"),
    _Metric("ridethrough.gpu.xid", "{event}", "1",
            f"map({_GPU_ID}, 'gpu.xid', if(h0 = 0, '63', '79'), 'gpu.xid.class', if(h0 = 0, 'precursor', "
            "'node_reboot'))",
            "if(h0 = 0, floor(greatest(0, (t - {failing_at:Int64}) / 3.6e12)), toFloat64(t >= {failed_at:Int64}))",
            counter=True, g="if(h0 = 0, 2, 5)", h="if(h0 = 0, {gpu_failing:UInt32}, {gpu_failed:UInt32})"),
    _Metric("ridethrough.nic.up", "1", "rail", "map('network.interface.name', concat('nic', toString(s)))",
            "if(h = {link_down:UInt32} AND s = 1 AND t BETWEEN {down_from:Int64} AND {down_to:Int64}, 0, 1)"),
    _Metric("system.network.errors", "{error}", "rail*2",
            "map('network.interface.name', concat('nic', toString(g)), 'network.io.direction', "
            "['receive', 'transmit'][s % 2 + 1])",
            "floor(k * (cityHash64(h, s, {seed:UInt32}) % 4) / 1500) + if(h = {link_degrading:UInt32} AND s = 0, "
            "floor(60 * pow(greatest(0, (t - {degrading_at:Int64}) / 3.6e12), 2)), 0) "
            "+ if(h = {link_down:UInt32} AND g = 1 AND t >= {down_from:Int64}, 400, 0)",
            counter=True, g="intDiv(s, 2)"),
    # Series s = ((quantile * 2 + direction) * rails + rail) * peers + peer; the peer is h + offsets[peer].
    _Metric("ridethrough.probe.owd", "s", "probe",
            "map('probe.src.node', host, 'probe.src.nic', nic, 'probe.dst.node', concat('h', toString(g)), "
            "'probe.dst.nic', nic, 'probe.direction', ['forward', 'reverse'][intDiv(s, {peers:UInt32} * "
            "{rails:UInt32}) % 2 + 1], 'probe.quantile', ['p50', 'p99'][intDiv(s, {peers:UInt32} * {rails:UInt32} "
            "* 2) + 1], 'probe.clock.corrected', 'true', 'probe.timestamp.kind', 'kernel')",
            "(6e-6 + if(intDiv(h, {rack:UInt32}) != intDiv(g, {rack:UInt32}), 4e-6, 0) + 1.5e-6 * u "
            "+ if(intDiv(s, {peers:UInt32} * {rails:UInt32}) % 2 = 0 AND intDiv(g, {rack:UInt32}) = {hot_rack:UInt32} "
            "AND t >= {hot_at:Int64}, 35e-6, 0)) * if(intDiv(s, {peers:UInt32} * {rails:UInt32} * 2) = 1, 1.8, 1)",
            g="(h + {offsets:Array(UInt32)}[s % {peers:UInt32} + 1]) % n_hosts",
            where="NOT (g = {silent:UInt32} AND t >= {silent_at:Int64}) AND NOT ((h = {link_down:UInt32} OR "
                  "g = {link_down:UInt32}) AND nic = 'nic1' AND t BETWEEN {down_from:Int64} AND {down_to:Int64})"),
    _Metric("ridethrough.clock.node.offset", "s", "1", "map('clock.node', host, 'clock.reference', 'h0')",
            "if(h = 0, 0, (h - n_hosts / 2) * 2.5e-6 + 1e-7 * u)", resource=_CLOCK),
    _Metric("ridethrough.clock.node.uncertainty", "s", "1", "map('clock.node', host, 'clock.reference', 'h0')",
            "1.5e-6 + 1e-6 * u + if(h = {clock:UInt32} AND t >= {clock_at:Int64}, 150e-6, 0)", resource=_CLOCK),
)


def _statement(m: _Metric) -> str:
    sql = _INSERT.replace("{table}", "otel_metrics_sum" if m.counter else "otel_metrics_gauge")
    sql = sql.replace("{sum_cols}", ", AggregationTemporality, IsMonotonic" if m.counter else "")
    sql = sql.replace("{sum_vals}", ", 2, true" if m.counter else "")
    if "probe" in m.name:  # the rail of a probe series, named once for attributes and filters
        sql = sql.replace("{g} AS g,", "{g} AS g, concat('nic', toString(intDiv(s, {peers:UInt32}) % {rails:UInt32})) "
                                       "AS nic,")
    for marker, text in (("{resource}", m.resource), ("{attrs}", m.attrs), ("{value}", m.value), ("{g}", m.g),
                         ("{h}", m.h), ("{where}", m.where)):
        sql = sql.replace(marker, text)
    return sql


def _series(m: _Metric, spec: FleetSpec) -> int:
    return {"1": 1, "gpu": spec.gpus, "gpu*4": spec.gpus * 4, "gpu*2": spec.gpus * 2, "rail": spec.rails,
            "rail*2": spec.rails * 2, "probe": spec.peers * spec.rails * 4}[m.series]


def params(spec: FleetSpec, start_ns: int, end_ns: int) -> dict[str, Any]:
    """The bound parameters of every generating statement: sizes, fault roles and fault times."""
    rack = spec.hosts // spec.racks
    offsets = [1 + (i * (spec.hosts - 2)) // spec.peers for i in range(spec.peers)]
    return {**roles(spec), "cluster": spec.cluster, "rack": rack, "gpus": spec.gpus, "rails": spec.rails,
            "peers": spec.peers, "offsets": offsets, "hot_rack": (spec.racks - 1) // 2, "seed": spec.seed,
            "start": start_ns, "interval": round(spec.interval_s * S_NS), "points": spec.points,
            "failing_at": end_ns - 6 * H_NS, "failed_at": end_ns - 3 * H_NS, "down_from": end_ns - 40 * 60 * S_NS,
            "down_to": end_ns - 25 * 60 * S_NS, "degrading_at": end_ns - 4 * H_NS, "clock_at": end_ns - 30 * 60 * S_NS,
            "silent_at": end_ns - 10 * 60 * S_NS, "hot_at": end_ns - H_NS}


def write_metrics(store: Store, spec: FleetSpec, bound: Mapping[str, Any]) -> int:
    """Generate every metric's rows; returns how many were asked for (before the silent host's gap)."""
    total = 0
    for m in _METRICS:
        hosts = 2 if m.name == "ridethrough.gpu.xid" else spec.hosts
        n = hosts * _series(m, spec) * spec.points
        p = {**bound, "metric": m.name, "unit": m.unit, "hosts": spec.hosts, "series": _series(m, spec), "rows": n}
        with store.lock:
            store.client().command(_statement(m), parameters=p)
        total += n
    return total


@dataclass(frozen=True, slots=True)
class FakeFleet:
    """What `generate` wrote: the period, the row count, the fault roles and the incidents' ids."""

    spec: FleetSpec
    start_ns: int
    end_ns: int
    rows: int
    roles: Mapping[str, int]
    incidents: Mapping[str, str]
    """Incident kind → id."""
    traces: Mapping[str, str]
    """Incident kind → trace id."""


def generate(store: Store, spec: FleetSpec, *, end_ns: int) -> FakeFleet:
    """Write ``spec``'s fleet for the hours up to ``end_ns`` (creating the tables it needs)."""
    start_ns = end_ns - round(spec.hours * H_NS)
    store.init_schema()
    bound = params(spec, start_ns, end_ns)
    total = write_metrics(store, spec, bound)
    total += fake_fleet_events.write_jobs(store, spec, bound, end_ns=end_ns)
    made = fake_fleet_events.write_incidents(store, spec, fabric_map(spec), bound, end_ns=end_ns)
    return FakeFleet(spec, start_ns, end_ns, total, roles(spec), {k: i.incident_id for k, i in made.items()},
                     {k: i.trace_id for k, i in made.items()})
