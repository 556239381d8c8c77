"""The gateway's own health, as Prometheus metrics on ``/metrics``."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


@dataclass(frozen=True)
class GatewayMetrics:
    """Every metric the gateway exports about itself, registered in one registry."""

    registry: CollectorRegistry
    received: Counter
    rejected: Counter
    requests: Counter
    inserted: Counter
    spooled_batches: Counter
    replayed_batches: Counter
    quarantined_batches: Counter
    backpressure: Counter
    auth_failures: Counter
    auth_reload_failures: Counter
    spool_bytes: Gauge
    spool_files: Gauge
    batch_seconds: Histogram

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> GatewayMetrics:
        """Metrics in ``registry`` (a fresh one by default: no global state)."""
        reg = registry if registry is not None else CollectorRegistry()
        return cls(
            registry=reg,
            received=Counter("ridethrough_gateway_received_items", "Data points, spans and log records received",
                             ["signal"], registry=reg),
            rejected=Counter("ridethrough_gateway_rejected_items", "Items rejected as invalid (partial success)",
                             ["signal"], registry=reg),
            requests=Counter("ridethrough_gateway_requests", "Export requests by outcome",
                             ["signal", "code"], registry=reg),
            inserted=Counter("ridethrough_gateway_inserted_rows", "Rows inserted into the store",
                             ["table"], registry=reg),
            spooled_batches=Counter("ridethrough_gateway_spooled_batches", "Batches written to the spool",
                                    registry=reg),
            replayed_batches=Counter("ridethrough_gateway_replayed_batches",
                                     "Spooled batches replayed into the store", registry=reg),
            quarantined_batches=Counter("ridethrough_gateway_quarantined_batches",
                                        "Spool files set aside as unreadable or rejected by the store",
                                        registry=reg),
            backpressure=Counter("ridethrough_gateway_backpressure",
                                 "Requests refused with UNAVAILABLE because the gateway was full",
                                 registry=reg),
            auth_failures=Counter("ridethrough_gateway_auth_failures",
                                  "Export requests refused as UNAUTHENTICATED, by reason (missing, malformed, unknown)",
                                  ["reason"], registry=reg),
            auth_reload_failures=Counter("ridethrough_gateway_auth_reload_failures",
                                         "Changes of the ingest tokens file that could not be loaded (old tokens kept)",
                                         registry=reg),
            spool_bytes=Gauge("ridethrough_gateway_spool_bytes", "Bytes waiting in the spool", registry=reg),
            spool_files=Gauge("ridethrough_gateway_spool_files", "Batches waiting in the spool", registry=reg),
            batch_seconds=Histogram("ridethrough_gateway_batch_insert_seconds",
                                    "Time to insert one batch into the store", registry=reg,
                                    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)),
        )
