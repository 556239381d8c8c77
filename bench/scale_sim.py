"""Scale simulation: a 2,048-node fleet's day of telemetry in chDB, and what its main queries cost.

Three phases, all on the real schema (`schema.ddl` plus the 1-minute rollups and their views):

* **series**: one node's series by source at the agent's defaults (1 s): netdev, infiniband and
  gpu come from the real sources reading the lab's fake host (8 mlx5 NICs, 8 scripted H100s);
  ethtool, probe (``probe_k`` = 10 peers x 8 rails), job (8 ranks) and the agent's own metrics
  are laid out from the metric catalogue, which the real sources follow.
* **lab sample** (compression): ``--sample-nodes`` nodes at full 1 s resolution for
  ``--sample-s`` seconds; the netdev/infiniband/gpu values are the real sources' readings of the
  fake hardware (counters pumped like busy 200G links, the GPU script's load pattern). Compressed
  and uncompressed bytes per row come from ``system.parts``.
* **fleet day**: every series of ``--nodes`` nodes for 24 h, one point each ``--step-s``
  (reduced time resolution), generated inside ClickHouse, with a few lossy paths; then the
  dashboard's main queries (on the rollups and raw tables) and every default detector run on
  it. Each query's time and the rows ClickHouse plans to read (``EXPLAIN ESTIMATE``) are kept.

Progress on stderr; the last stdout line is one JSON object. ``--quick`` runs in under a minute.
Run: ``.venv/bin/python bench/scale_sim.py [--quick]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ridethrough.catalogue import metrics_of
from ridethrough.collector.sample import MetricKind
from ridethrough.detectors.contract import Window
from ridethrough.detectors.controller import default_detectors, read_only_query
from ridethrough.exporters import schema, schema_cluster
from ridethrough.exporters.store import Store
from ridethrough.settings import AgentConfig, ControllerConfig

NICS, GPUS, PEERS, RANKS = 8, 8, 10, 8
DAY_S = 86_400
GATEWAY_POINTS_PER_CORE_S = 52_438
"""bench/ingest.py's measured gateway rate (OTLP in, chDB insert included), datapoints per CPU-second."""
NIC_NAMES = tuple(f"nic{i}" for i in range(NICS))
FLEET_NODES = 2048
# Attribute values for the series the catalogue lays out (the sources' own value sets, abridged).
VALUES: dict[str, tuple[str, ...]] = {
    "network.interface.name": NIC_NAMES, "lane": ("0", "1", "2", "3"),
    "ethtool.counter": ("corrected", "uncorrectable"), "nic.phy.bits_source": ("phy",),
    "optics.threshold": ("high_alarm", "low_alarm", "high_warning", "low_warning"),
    "optics.quantity": ("temperature", "voltage", "tx_bias"), "job.id": ("job-1",), "job.customer": ("acme",),
    "job.rank": tuple(str(r) for r in range(RANKS)), "job.phase": ("compute", "wait", "comm"),
    "type": ("step", "start", "end"), "reason": ("malformed",), "probe.role": ("prober", "responder"),
    "source": ("netdev", "infiniband", "ethtool", "gpu", "job", "probe"), "probe.dst.nic": NIC_NAMES,
}
PATH_ATTRS = ("probe.src.node", "probe.src.nic", "probe.dst.node", "probe.dst.nic")
PATH_EXTRA = {"probe.direction": ("forward", "reverse"), "probe.quantile": ("min", "p50", "p99", "max"),
              "probe.clock.corrected": ("true",), "probe.timestamp.kind": ("kernel",)}


def say(message: str) -> None:
    print(f"[scale_sim {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Series:
    """One series of one node; ``{node}``/``{peer}`` in attribute values name this node and a peer."""

    source: str
    metric: str
    unit: str
    counter: bool
    attrs: Mapping[str, str]
    base: float
    rate: float = 0.0
    peer_step: int = 0


def _rate(unit: str) -> float:
    return {"By": 2.5e9, "{packet}": 5e5, "{probe}": 2.0, "{step}": 1.0}.get(unit, 0.001)


def real_series(tmp: Path) -> tuple[list[Series], Callable[[int], list[Any]]]:
    """The netdev, infiniband and gpu sources on the lab's fake host, and a reader of one tick."""
    from ridethrough.collector.registry import build_sources
    from ridethrough.lab.fake_gpu import create_fake_gpus
    from ridethrough.lab.fake_ib import CounterPump, NicStats, create_tree

    create_tree(tmp / "sys", NICS)
    clock = [0.0]
    pump = CounterPump(tmp / "sys", tmp / "nic_faults.json", lambda: {
        f"nic{i}": NicStats(rx_bytes=int(2.5e9 * (1 + i / 8) * clock[0]), tx_bytes=int(2.4e9 * clock[0]),
                            rx_packets=int(5e5 * clock[0]), tx_packets=int(4.8e5 * clock[0])) for i in range(NICS)})
    create_fake_gpus(tmp / "gpus.json", GPUS, host="sim", seed=7)
    cfg = AgentConfig(sources=("netdev", "infiniband", "gpu"), sysfs_root=str(tmp / "sys"),
                      gpu_script=str(tmp / "gpus.json"), node_id="sim")
    sources = build_sources(cfg)

    def read(now_ns: int) -> list[Any]:
        clock[0] += 1.0
        pump.tick(now_ns)
        return [(src.name, s) for src in sources for s in src.collect(now_ns)]

    read(time.time_ns())
    samples = read(time.time_ns() + 1_000_000_000)
    out = [Series(name, s.name, s.unit, s.kind is MetricKind.COUNTER, dict(s.attributes), float(s.value),
                  _rate(s.unit) if s.kind is MetricKind.COUNTER else 0.0) for name, s in samples]
    return out, read


def catalogue_series() -> list[Series]:
    """ethtool, job, agent (catalogue x value sets) and probe (10 peers x 8 rails) series of one node."""
    out: list[Series] = []
    for source in ("ethtool", "job", "agent"):
        for spec in metrics_of(source):
            combos = itertools.product(*(VALUES[a] for a in spec.attributes))
            counter = spec.kind is MetricKind.COUNTER
            out += [Series(source, spec.name, spec.unit, counter, dict(zip(spec.attributes, c, strict=True)),
                           1.0, _rate(spec.unit) if counter else 0.0) for c in combos]
    for spec in metrics_of("probe"):
        counter = spec.kind is MetricKind.COUNTER
        if spec.attributes[:4] == PATH_ATTRS:
            extra = [PATH_EXTRA[a] for a in spec.attributes[4:]]
            for k, nic, rest in itertools.product(range(1, PEERS + 1), range(NICS), itertools.product(*extra)):
                attrs = dict(zip(PATH_ATTRS, ("{node}", f"nic{nic}", "{peer}", f"nic{nic}"), strict=True))
                attrs.update(zip(spec.attributes[4:], rest, strict=True))
                base = 5e-6 if spec.unit == "s" else 0.0
                out.append(Series("probe", spec.name, spec.unit, counter, attrs, base, _rate(spec.unit) * counter,
                                  peer_step=k * 197))
        elif spec.attributes[:2] == ("clock.src.node", "clock.dst.node"):
            pair = {"clock.src.node": "{node}", "clock.dst.node": "{peer}"}
            out += [Series("probe", spec.name, spec.unit, False, pair, 1e-6, peer_step=k * 197)
                    for k in range(1, PEERS + 1)]
        else:
            combos = itertools.product(*(VALUES[a] for a in spec.attributes))
            out += [Series("probe", spec.name, spec.unit, counter, dict(zip(spec.attributes, c, strict=True)), 0.0,
                           _rate(spec.unit) if counter else 0.0) for c in combos]
    return out


def node_name(i: int) -> str:
    return f"node{i:04d}"


def resource(node: str) -> dict[str, str]:
    return {"service.name": "ridethrough-agent", "host.name": node, "ridethrough.node.id": node,
            "ridethrough.cluster": "fleet", "ridethrough.rack": f"rack{int(node[4:]) // 16:03d}"}


def open_store(path: Path) -> Store:
    store = Store(f"chdb://{path}")
    for statement in (*schema.ddl(), *schema_cluster.rollup_ddl()):
        store.command(statement)
    return store


@dataclass
class Sample:
    """Phase 2's result: rows and bytes by table."""

    rows: dict[str, int] = field(default_factory=dict)
    compressed: dict[str, int] = field(default_factory=dict)
    uncompressed: dict[str, int] = field(default_factory=dict)
    insert_rows_per_cpu_s: float = 0.0


def lab_sample(store: Store, read: Callable[[int], list[Any]], synthetic: list[Series], *, nodes: int,
               seconds: int) -> Sample:
    """Full-resolution rows: the real sources' readings plus the catalogue's series, 1 s apart."""
    t0 = (int(time.time()) - seconds) * 1_000_000_000
    cols = ["ResourceAttributes", "ServiceName", "MetricName", "MetricUnit", "Attributes", "StartTimeUnix",
            "TimeUnix", "Value"]
    for second in range(seconds):
        now = t0 + second * 1_000_000_000
        real = [Series(src, s.name, s.unit, s.kind is MetricKind.COUNTER, dict(s.attributes), float(s.value))
                for src, s in read(now)]
        rows: dict[bool, list[list[Any]]] = {True: [], False: []}
        for n in range(nodes):
            node = node_name(n)
            for s in real:
                rows[s.counter].append([resource(node), "ridethrough-agent", s.metric, s.unit, s.attrs, t0, now,
                                        s.base])
            for i, s in enumerate(synthetic):
                peer = node_name((n + s.peer_step) % FLEET_NODES)
                attrs = {k: v.replace("{node}", node).replace("{peer}", peer) for k, v in s.attrs.items()}
                jitter = ((i * 7919 + second * 104729) % 97) / 97
                value = s.rate * second if s.counter else s.base * (1 + 0.05 * jitter)
                rows[s.counter].append([resource(node), "ridethrough-agent", s.metric, s.unit, attrs, t0, now, value])
        client = store.client()
        client.insert("otel_metrics_gauge", rows[False], column_names=cols)
        client.insert("otel_metrics_sum", [[*r, 2, True] for r in rows[True]],
                      column_names=[*cols, "AggregationTemporality", "IsMonotonic"])
    for table in SAMPLED:
        store.command(f"OPTIMIZE TABLE {table} FINAL")
    out = Sample()
    # system.parts, not system.columns: small (compact) parts, such as the rollups', keep no per-column sizes.
    _, sizes = store.query("SELECT table, sum(rows), sum(data_compressed_bytes), sum(data_uncompressed_bytes) "
                           "FROM system.parts WHERE active AND database = currentDatabase() "
                           "AND table IN {t:Array(String)} GROUP BY table", parameters={"t": list(SAMPLED)})
    for table, count, comp, uncomp in sizes:
        out.rows[table], out.compressed[table], out.uncompressed[table] = int(count), int(comp), int(uncomp)
    out.insert_rows_per_cpu_s = _insert_cost(store, out.rows["otel_metrics_gauge"] + out.rows["otel_metrics_sum"])
    return out


SAMPLED = ("otel_metrics_gauge", "otel_metrics_sum", "otel_metrics_gauge_1m", "otel_metrics_sum_1m")


def _insert_cost(store: Store, rows: int) -> float:
    """Rows a CPU-second inserts into the raw tables, their rollup views included (this process's CPU time:
    chDB runs in it), by inserting the sample again an hour later (new data, so nothing is deduplicated)."""
    before = os.times()
    for table in ("otel_metrics_gauge", "otel_metrics_sum"):
        store.command(f"INSERT INTO {table} SELECT * REPLACE (TimeUnix + INTERVAL 1 HOUR AS TimeUnix) FROM {table}")
    after = os.times()
    cpu_s = (after.user - before.user) + (after.system - before.system)
    return rows / cpu_s if cpu_s > 0 else 0.0


_GENERATE = """
INSERT INTO {table} ({columns})
SELECT map('service.name', 'ridethrough-agent', 'host.name', n.Name, 'ridethrough.node.id', n.Name,
           'ridethrough.cluster', 'fleet', 'ridethrough.rack', concat('rack', toString(intDiv(n.Idx, 16)))),
       'ridethrough-agent', s.MetricName, s.MetricUnit,
       mapApply((k, v) -> (k, replaceAll(replaceAll(v, '{{node}}', n.Name), '{{peer}}',
                concat('node', leftPad(toString((n.Idx + s.PeerStep) % {nodes}), 4, '0')))), s.Attrs),
       toDateTime64({t0}, 9), toDateTime64({t0} + t.number * {step}, 9),
       multiIf(s.Counter = 1, s.Rate * t.number * {step},
               s.MetricName = 'ridethrough.probe.loss.ratio' AND n.Idx % 256 = 7 AND t.number + 2 >= {points}, 0.3,
               s.Base * (1 + 0.05 * sin(t.number / 6 + s.Id))){extra}
FROM sim_templates AS s CROSS JOIN sim_nodes AS n CROSS JOIN numbers({points}) AS t
WHERE s.Counter = {counter}
"""


def fleet_day(store: Store, series: list[Series], *, nodes: int, step_s: int, t0: int) -> dict[str, Any]:
    """Every series of every node for a day, one point per ``step_s``, generated by ClickHouse itself."""
    store.command("CREATE TABLE sim_templates (Id UInt32, Counter UInt8, MetricName String, MetricUnit String, "
                  "Attrs Map(String, String), Base Float64, Rate Float64, PeerStep UInt32) ENGINE = Memory")
    store.command("CREATE TABLE sim_nodes (Idx UInt32, Name String) ENGINE = Memory")
    store.client().insert("sim_templates", [[i, int(s.counter), s.metric, s.unit, dict(s.attrs), s.base, s.rate,
                                             s.peer_step] for i, s in enumerate(series)])
    store.client().insert("sim_nodes", [[i, node_name(i)] for i in range(nodes)])
    head = "ResourceAttributes, ServiceName, MetricName, MetricUnit, Attributes, StartTimeUnix, TimeUnix, Value"
    points = DAY_S // step_s
    started = time.monotonic()
    for table, counter, columns, extra in (("otel_metrics_gauge", 0, head, ""),
                                           ("otel_metrics_sum", 1, f"{head}, AggregationTemporality, IsMonotonic",
                                            ", 2, true")):
        store.command(_GENERATE.format(table=table, columns=columns, nodes=nodes, t0=t0, step=step_s, points=points,
                                       counter=counter, extra=extra))
    insert_s = time.monotonic() - started
    _, counts = store.query("SELECT (SELECT count() FROM otel_metrics_gauge), (SELECT count() FROM otel_metrics_sum), "
                            "(SELECT count() FROM otel_metrics_gauge_1m), (SELECT count() FROM otel_metrics_sum_1m)")
    gauge, total_sum, gauge_1m, sum_1m = (int(v) for v in counts[0])
    return {"nodes": nodes, "step_s": step_s, "points_per_series": points, "raw_rows": gauge + total_sum,
            "rollup_rows": gauge_1m + sum_1m, "insert_s": round(insert_s, 1),
            "insert_rows_per_s": round((gauge + total_sum) / insert_s)}


def _rows_planned(store: Store, sql: str, parameters: Mapping[str, Any]) -> int:
    _, rows = store.query(f"EXPLAIN ESTIMATE {sql}", parameters=dict(parameters))
    return sum(int(r[3]) for r in rows)


def _cpu_s() -> float:
    """This process's CPU time, every thread (chDB's included): steadier than wall time on a busy machine."""
    t = os.times()
    return t.user + t.system


def _measure(run: Callable[[], object], repeat: int) -> tuple[float, float]:
    """Median wall and CPU milliseconds of ``repeat`` runs."""
    wall, cpu = [], []
    for _ in range(repeat):
        started, cpu0 = time.perf_counter(), _cpu_s()
        run()
        wall.append(time.perf_counter() - started)
        cpu.append(_cpu_s() - cpu0)
    return 1000 * statistics.median(wall), 1000 * statistics.median(cpu)


def _timed(store: Store, sql: str, parameters: Mapping[str, Any], repeat: int) -> dict[str, Any]:
    wall_ms, cpu_ms = _measure(lambda: store.query(sql, parameters=dict(parameters)), repeat)
    planned = _rows_planned(store, sql, parameters)
    return {"median_ms": round(wall_ms, 1), "cpu_ms": round(cpu_ms, 1), "rows_planned": planned}


DASHBOARD = {
    "probe_p99_heatmap_24h_rollup": """
        SELECT NodeId, toStartOfTenMinutes(Minute) AS b, max(Max) FROM otel_metrics_gauge_1m
        WHERE MetricName = 'ridethrough.probe.owd' AND Attributes['probe.quantile'] = 'p99' AND Cluster = 'fleet'
          AND Minute >= toDateTime({start:Int64}) GROUP BY NodeId, b""",
    "probe_p99_heatmap_24h_raw": """
        SELECT ResourceAttributes['ridethrough.node.id'] AS node, toStartOfTenMinutes(TimeUnix) AS b, max(Value)
        FROM otel_metrics_gauge WHERE MetricName = 'ridethrough.probe.owd' AND Attributes['probe.quantile'] = 'p99'
          AND TimeUnix >= toDateTime({start:Int64}) GROUP BY node, b""",
    "worst_paths_by_loss_1h_rollup": """
        SELECT NodeId, Attributes['probe.dst.node'] AS dst, Attributes['probe.src.nic'] AS nic,
               sum(Sum) / sum(Count) AS loss
        FROM otel_metrics_gauge_1m WHERE MetricName = 'ridethrough.probe.loss.ratio'
          AND Minute >= toDateTime({end:Int64} - 3600) GROUP BY NodeId, dst, nic ORDER BY loss DESC LIMIT 20""",
    "fleet_nic_throughput_24h_rollup": """
        SELECT b, sum(inc) * 8 / 600 AS bits_per_s FROM (
            SELECT NodeId, Attributes, toStartOfTenMinutes(Minute) AS b, max(Max) - min(Min) AS inc
            FROM otel_metrics_sum_1m WHERE MetricName = 'system.network.io' AND Minute >= toDateTime({start:Int64})
            GROUP BY NodeId, Attributes, b)
        GROUP BY b ORDER BY b""",
    "one_node_gpu_temperature_24h_raw": """
        SELECT Attributes['gpu.index'] AS gpu, toStartOfFiveMinutes(TimeUnix) AS b, avg(Value)
        FROM otel_metrics_gauge WHERE MetricName = 'hw.temperature' AND ResourceAttributes['host.name'] = 'node0042'
          AND TimeUnix >= toDateTime({start:Int64}) GROUP BY gpu, b""",
}
"""The dashboard's main reads: fleet heatmaps and rankings from the rollups, one node's history from raw rows."""


def dashboard_queries(store: Store, *, t0: int, end: int, repeat: int) -> dict[str, Any]:
    return {name: _timed(store, sql, {"start": t0, "end": end}, repeat) for name, sql in DASHBOARD.items()}


def detector_runs(store: Store, *, end_ns: int, repeat: int) -> dict[str, Any]:
    """Every default detector over its own window ending at the day's last point; cost per minute at its interval.

    One untimed run records each query's planned rows (``EXPLAIN ESTIMATE``); the timed runs query plainly."""
    plain = read_only_query(store)
    out: dict[str, Any] = {}
    for detector in default_detectors(ControllerConfig()):
        planned: list[int] = []

        def planning(sql: str, parameters: Mapping[str, Any], *, _planned: list[int] = planned) -> Any:
            _planned.append(_rows_planned(store, sql, parameters))
            return plain(sql, parameters)

        start_ns = end_ns - int(detector.window_s * 1e9)
        findings = len(detector.detect(Window(start_ns, end_ns, planning)))
        window = Window(start_ns, end_ns, plain)

        def run(d: Any = detector, w: Window = window) -> object:
            return d.detect(w)

        wall_ms, cpu_ms = _measure(run, repeat)
        out[detector.name] = {"interval_s": detector.interval_s, "window_s": detector.window_s,
                              "median_ms": round(wall_ms, 1), "cpu_ms": round(cpu_ms, 1),
                              "rows_planned": sum(planned), "queries": len(planned), "findings": findings,
                              "cpu_ms_per_min": round(cpu_ms * 60.0 / detector.interval_s, 1)}
    return out


def summarise(series: list[Series], sample: Sample, day: dict[str, Any], nodes: int) -> dict[str, Any]:
    """Per-source series and the fleet arithmetic (for ``nodes``) that docs/scale.md walks through."""
    by_source = dict(sorted(Counter(s.source for s in series).items()))
    per_node = len(series)
    fleet_points_s = per_node * nodes  # every source samples once a second by default
    raw = ("otel_metrics_gauge", "otel_metrics_sum")
    rows = sum(sample.rows[t] for t in raw)
    comp, uncomp = sum(sample.compressed[t] for t in raw), sum(sample.uncompressed[t] for t in raw)
    bytes_per_row = comp / rows
    rollup = {t: round(sample.compressed[t] / max(1, sample.rows[t]), 1) for t in SAMPLED if t not in raw}
    rolled = sum(1 for s in series if s.counter or s.metric.startswith(schema_cluster.PROBE_PREFIX)) * nodes
    return {"series_per_node": by_source, "counter_series_per_node": sum(s.counter for s in series),
            "datapoints_per_s_per_node": per_node, "fleet_datapoints_per_s": fleet_points_s, "sample_rows": rows,
            "compressed_bytes_per_row": round(bytes_per_row, 2), "compression_ratio": round(uncomp / comp, 1),
            "fleet_tb_per_day": round(fleet_points_s * DAY_S * bytes_per_row / 1e12, 2),
            "rollup_bytes_per_row": rollup, "fleet_rollup_rows_per_day": rolled * 1440,
            "insert_rows_per_cpu_s": round(sample.insert_rows_per_cpu_s),
            "clickhouse_insert_cores": round(fleet_points_s / sample.insert_rows_per_cpu_s, 1),
            "gateway_cores": round(fleet_points_s / GATEWAY_POINTS_PER_CORE_S, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: 128 nodes, 2 points a series, a 15 s sample (under a minute on an idle machine)")
    ap.add_argument("--nodes", type=int, help=f"nodes in the fleet day (default {FLEET_NODES})")
    ap.add_argument("--step-s", type=int, help="seconds between a series' points in the fleet day (default 21600)")
    ap.add_argument("--sample-s", type=int, help="seconds of full-resolution lab sample (default 300)")
    ap.add_argument("--sample-nodes", type=int, default=2)
    ap.add_argument("--repeat", type=int, help="runs of each query (median kept; default 3)")
    args = ap.parse_args()
    nodes = args.nodes or (128 if args.quick else FLEET_NODES)
    step_s = args.step_s or (43_200 if args.quick else 21_600)
    sample_s = args.sample_s or (15 if args.quick else 300)
    load_before = os.getloadavg()[0]
    repeat = args.repeat or (1 if args.quick else 3)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rt-scale-") as tmp:
        real, read = real_series(Path(tmp))
        series = real + catalogue_series()
        say(f"{len(series)} series per node: {dict(Counter(s.source for s in series))}")
        sample_store = open_store(Path(tmp) / "sample")
        sample = lab_sample(sample_store, read, [s for s in series if s.source not in ("netdev", "infiniband", "gpu")],
                            nodes=args.sample_nodes, seconds=sample_s)
        sample_store.close()
        say(f"lab sample: {sample.rows} rows, {sum(sample.compressed.values())} bytes compressed")
        store = open_store(Path(tmp) / "fleet")
        t0 = (int(time.time()) // DAY_S - 1) * DAY_S
        day = fleet_day(store, series, nodes=nodes, step_s=step_s, t0=t0)
        say(f"fleet day: {day}")
        end = t0 + (DAY_S // step_s - 1) * step_s + 1
        queries = dashboard_queries(store, t0=t0, end=end, repeat=repeat)
        detectors = detector_runs(store, end_ns=end * 1_000_000_000, repeat=repeat)
        store.close()
    # Timings depend on what else the machine runs: the load averages say how busy it was.
    out = {"bench": "scale_sim", **summarise(series, sample, day, FLEET_NODES), "fleet_day": day,
           "dashboard": queries, "detectors": detectors,
           "detectors_cpu_ms_per_min": round(sum(d["cpu_ms_per_min"] for d in detectors.values()), 1),
           "sample_s": sample_s, "sample_nodes": args.sample_nodes, "quick": args.quick,
           "load_avg": [round(load_before, 1), round(os.getloadavg()[0], 1)],
           "wall_s": round(time.monotonic() - started, 1)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
