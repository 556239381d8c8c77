"""Realistic OTLP metric requests for the ingest benchmark (GPU and NIC series).

A request is what one node's agent sends: a resource naming the node, then rounds of
samples (every GPU metric for 8 GPUs as gauges, every NIC counter for 8 ports and both
directions as cumulative sums), each round 1 µs after the previous one, until exactly
``points`` data points are in it.
"""

from __future__ import annotations

import random

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.metrics.v1.metrics_pb2 import AggregationTemporality, Metric, ScopeMetrics

from ridethrough.exporters.rows import kv

_GPU_METRICS = ("hw.gpu.utilization", "hw.gpu.memory.usage", "hw.temperature", "hw.power",
                "ridethrough.gpu.sm_clock", "ridethrough.gpu.ecc.sbe_volatile")
_NIC_METRICS = ("ridethrough.ib.port.io", "ridethrough.ib.port.packets", "ridethrough.ib.port.errors")
_GPUS = 8
_NICS = 8
_DIRECTIONS = ("receive", "transmit")
_ROUND_STEP_NS = 1000


def make_request(*, node: int, points: int, t_ns: int, seed: int = 0) -> ExportMetricsServiceRequest:
    """One export of exactly ``points`` data points from one node, shaped like an agent's."""
    rng = random.Random(seed)
    req = ExportMetricsServiceRequest()
    rm = req.resource_metrics.add()
    for k, v in (("service.name", "ridethrough-agent"), ("host.name", f"gpu-node-{node:05d}"),
                 ("ridethrough.node.id", f"node-{node:05d}"), ("ridethrough.cluster", "bench"),
                 ("ridethrough.rack", f"rack-{node // 32:03d}")):
        rm.resource.attributes.append(kv(k, v))
    sm = rm.scope_metrics.add()
    sm.scope.name = "ridethrough.collector"
    made = 0
    while made < points:
        for name in _GPU_METRICS:
            made += _add_gpu_metric(sm, name, node=node, t_ns=t_ns, rng=rng, limit=points - made)
        for name in _NIC_METRICS:
            made += _add_nic_metric(sm, name, t_ns=t_ns, rng=rng, limit=points - made)
        t_ns += _ROUND_STEP_NS
    return req


def _new_metric(sm: ScopeMetrics, name: str, unit: str, limit: int) -> Metric | None:
    return sm.metrics.add(name=name, unit=unit) if limit > 0 else None


def _add_gpu_metric(sm: ScopeMetrics, name: str, *, node: int, t_ns: int, rng: random.Random, limit: int) -> int:
    """One gauge with a point per GPU (at most ``limit``); returns the points added."""
    m = _new_metric(sm, name, "1", limit)
    if m is None:
        return 0
    gpus = min(_GPUS, limit)
    for gpu in range(gpus):
        p = m.gauge.data_points.add(time_unix_nano=t_ns, start_time_unix_nano=t_ns - 10**9,
                                    as_double=rng.random() * 100)
        p.attributes.extend([kv("gpu.index", str(gpu)), kv("gpu.uuid", f"GPU-{node:05d}-{gpu}"),
                             kv("pci.bus_id", f"0000:{gpu + 10:02x}:00.0")])
    return gpus


def _add_nic_metric(sm: ScopeMetrics, name: str, *, t_ns: int, rng: random.Random, limit: int) -> int:
    """One cumulative sum with a point per NIC port and direction (at most ``limit``)."""
    m = _new_metric(sm, name, "By", limit)
    if m is None:
        return 0
    m.sum.aggregation_temporality = AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE
    m.sum.is_monotonic = True
    series = [(nic, direction) for nic in range(_NICS) for direction in _DIRECTIONS][:limit]
    for nic, direction in series:
        p = m.sum.data_points.add(time_unix_nano=t_ns, start_time_unix_nano=t_ns - 10**9,
                                  as_int=rng.randrange(1 << 40))
        p.attributes.extend([kv("ib.device", f"mlx5_{nic}"), kv("ib.port", "1"),
                             kv("network.io.direction", direction)])
    return len(series)
