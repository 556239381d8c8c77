"""A real OTLP metrics receiver on port 0 for tests that export once and read what arrived."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent import futures
from typing import Protocol

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc

Request = metrics_service_pb2.ExportMetricsServiceRequest


class Provider(Protocol):
    """What the exporting side needs of an SDK meter provider."""

    def force_flush(self, timeout_millis: float = ...) -> bool: ...

    def shutdown(self) -> None: ...


class _Receiver(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self) -> None:
        self.requests: list[Request] = []

    def Export(self, request: Request, context: grpc.ServicerContext,
               ) -> metrics_service_pb2.ExportMetricsServiceResponse:
        self.requests.append(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()


def export_once(build: Callable[[str], Iterable[Provider]]) -> list[Request]:
    """Start a receiver, ``build`` meter providers pointed at its endpoint, flush each once and shut them
    down; the export requests that arrived."""
    receiver, server = _Receiver(), grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    providers: list[Provider] = []
    try:
        providers = list(build(f"127.0.0.1:{port}"))
        for p in providers:
            p.force_flush(10_000)
    finally:
        for p in providers:
            p.shutdown()
        server.stop(1)
    return receiver.requests
