"""Realistic OTLP metric requests for the ingest benchmark (GPU and NIC series)."""

from __future__ import annotations

import random

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import AggregationTemporality

_GPU_METRICS = ("hw.gpu.utilization", "hw.gpu.memory.usage", "hw.temperature", "hw.power",
                "ridethrough.gpu.sm_clock", "ridethrough.gpu.ecc.sbe_volatile")
_NIC_METRICS = ("ridethrough.ib.port.io", "ridethrough.ib.port.packets", "ridethrough.ib.port.errors")


def _kv(key: str, value: str) -> KeyValue:
    return KeyValue(key=key, value=AnyValue(string_value=value))


def make_request(*, node: int, points: int, t_ns: int, seed: int = 0) -> ExportMetricsServiceRequest:
    """One export of ``points`` data points from one node, shaped like an agent's."""
    rng = random.Random(seed)
    req = ExportMetricsServiceRequest()
    rm = req.resource_metrics.add()
    for k, v in (("service.name", "ridethrough-agent"), ("host.name", f"gpu-node-{node:05d}"),
                 ("ridethrough.node.id", f"node-{node:05d}"), ("ridethrough.cluster", "bench"),
                 ("ridethrough.rack", f"rack-{node // 32:03d}")):
        rm.resource.attributes.append(_kv(k, v))
    sm = rm.scope_metrics.add()
    sm.scope.name = "ridethrough.collector"
    made = 0
    while made < points:
        for name in _GPU_METRICS:
            m = sm.metrics.add(name=name, unit="1")
            for gpu in range(8):
                p = m.gauge.data_points.add(time_unix_nano=t_ns, start_time_unix_nano=t_ns - 10**9,
                                            as_double=rng.random() * 100)
                p.attributes.extend([_kv("gpu.index", str(gpu)), _kv("gpu.uuid", f"GPU-{node:05d}-{gpu}"),
                                     _kv("pci.bus_id", f"0000:{gpu + 10:02x}:00.0")])
                made += 1
        for name in _NIC_METRICS:
            m = sm.metrics.add(name=name, unit="By")
            m.sum.aggregation_temporality = AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE
            m.sum.is_monotonic = True
            for nic in range(8):
                for direction in ("receive", "transmit"):
                    p = m.sum.data_points.add(time_unix_nano=t_ns, start_time_unix_nano=t_ns - 10**9,
                                              as_int=rng.randrange(1 << 40))
                    p.attributes.extend([_kv("ib.device", f"mlx5_{nic}"), _kv("ib.port", "1"),
                                         _kv("network.io.direction", direction)])
                    made += 1
        t_ns += 1000
    return req
