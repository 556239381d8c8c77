"""The metric catalogue: every metric ridethrough emits, listed once.

Each row gives the OpenTelemetry name, unit (UCUM, as OTel writes it), kind,
the exact attribute keys every sample carries, a description, the source that
emits it, and the names of the Prometheus node_exporter (or DCGM) series that
carry the same data, for dashboards and alerts migrating from them. Where one
ridethrough metric splits into several exporter series by an attribute value
(``network.io.direction``, ``ib.counter``), all of them are listed.

Tests hold the sources to this table in both directions: a source emits only
catalogued names with the catalogued unit, kind and attribute keys, and every
catalogued metric is emitted by at least one fixture.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from ridethrough.collector.sample import MetricKind

_COUNTER = MetricKind.COUNTER
_GAUGE = MetricKind.GAUGE

_NIC = ("network.interface.name",)
_NIC_DIRECTION = ("network.interface.name", "network.io.direction")
_IB_PORT = ("ib.device", "ib.port")


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


METRICS: tuple[MetricSpec, ...] = (
    # --- netdev: <sysfs>/class/net/<interface>/ ------------------------------------------------
    MetricSpec(
        name="system.network.io",
        unit="By",
        kind=_COUNTER,
        attributes=_NIC_DIRECTION,
        description="Bytes received/transmitted by the interface (statistics/rx_bytes, tx_bytes).",
        source="netdev",
        equivalents=("node_network_receive_bytes_total", "node_network_transmit_bytes_total"),
    ),
    MetricSpec(
        name="system.network.packet.count",
        unit="{packet}",
        kind=_COUNTER,
        attributes=_NIC_DIRECTION,
        description="Packets received/transmitted (statistics/rx_packets, tx_packets).",
        source="netdev",
        equivalents=("node_network_receive_packets_total", "node_network_transmit_packets_total"),
    ),
    MetricSpec(
        name="system.network.errors",
        unit="{error}",
        kind=_COUNTER,
        attributes=_NIC_DIRECTION,
        description="Receive/transmit errors, all causes (statistics/rx_errors, tx_errors).",
        source="netdev",
        equivalents=("node_network_receive_errs_total", "node_network_transmit_errs_total"),
    ),
    MetricSpec(
        name="system.network.packet.dropped",
        unit="{packet}",
        kind=_COUNTER,
        attributes=_NIC_DIRECTION,
        description="Packets dropped on receive/transmit (statistics/rx_dropped, tx_dropped).",
        source="netdev",
        equivalents=("node_network_receive_drop_total", "node_network_transmit_drop_total"),
    ),
    MetricSpec(
        name="ridethrough.nic.stat",
        unit="1",
        kind=_COUNTER,
        attributes=(*_NIC, "nic.counter"),
        description=(
            "Every other statistics/ file (rx_crc_errors, rx_missed_errors, tx_carrier_errors, "
            "collisions, multicast, ...); nic.counter is the file name."
        ),
        source="netdev",
        equivalents=(
            "node_network_receive_fifo_total",
            "node_network_receive_frame_total",
            "node_network_receive_compressed_total",
            "node_network_receive_multicast_total",
            "node_network_transmit_fifo_total",
            "node_network_transmit_colls_total",
            "node_network_transmit_carrier_total",
            "node_network_transmit_compressed_total",
        ),
    ),
    MetricSpec(
        name="ridethrough.nic.carrier_changes",
        unit="{change}",
        kind=_COUNTER,
        attributes=_NIC,
        description="Physical link up/down transitions (carrier_changes): a flapping cable or port.",
        source="netdev",
        equivalents=("node_network_carrier_changes_total",),
    ),
    MetricSpec(
        name="ridethrough.nic.up",
        unit="1",
        kind=_GAUGE,
        attributes=_NIC,
        description="1 when operstate is 'up' and carrier is 1, else 0 ('unknown', as on lo, counts as 0).",
        source="netdev",
        equivalents=("node_network_up",),
    ),
    MetricSpec(
        name="ridethrough.nic.mtu",
        unit="By",
        kind=_GAUGE,
        attributes=_NIC,
        description="Interface MTU (mtu).",
        source="netdev",
        equivalents=("node_network_mtu_bytes",),
    ),
    MetricSpec(
        name="ridethrough.nic.speed",
        unit="Mbit/s",
        kind=_GAUGE,
        attributes=_NIC,
        description="Negotiated link speed (speed); omitted while unknown (-1 or EINVAL).",
        source="netdev",
        equivalents=("node_network_speed_bytes",),
    ),
    # --- infiniband: <sysfs>/class/infiniband/<device>/ports/<port>/ ---------------------------
    MetricSpec(
        name="ridethrough.ib.port.io",
        unit="By",
        kind=_COUNTER,
        attributes=(*_IB_PORT, "network.io.direction"),
        description=(
            "Data bytes received/transmitted on the port (counters/port_rcv_data, port_xmit_data, "
            "which count 4-byte words, times 4)."
        ),
        source="infiniband",
        equivalents=(
            "node_infiniband_port_data_received_bytes_total",
            "node_infiniband_port_data_transmitted_bytes_total",
        ),
    ),
    MetricSpec(
        name="ridethrough.ib.port.packets",
        unit="{packet}",
        kind=_COUNTER,
        attributes=(*_IB_PORT, "network.io.direction"),
        description=(
            "Packets received/transmitted on all VLs, errors included (counters/port_rcv_packets, "
            "port_xmit_packets)."
        ),
        source="infiniband",
        equivalents=(
            "node_infiniband_port_packets_received_total",
            "node_infiniband_port_packets_transmitted_total",
        ),
    ),
    MetricSpec(
        name="ridethrough.ib.port.cast_packets",
        unit="{packet}",
        kind=_COUNTER,
        attributes=(*_IB_PORT, "network.io.direction", "ib.cast"),
        description=(
            "Packets by cast (counters/{unicast,multicast}_{rcv,xmit}_packets): a breakdown of "
            "ridethrough.ib.port.packets, kept apart so that neither metric double counts."
        ),
        source="infiniband",
        equivalents=(
            "node_infiniband_unicast_packets_received_total",
            "node_infiniband_unicast_packets_transmitted_total",
            "node_infiniband_multicast_packets_received_total",
            "node_infiniband_multicast_packets_transmitted_total",
        ),
    ),
    MetricSpec(
        name="ridethrough.ib.port.errors",
        unit="{error}",
        kind=_COUNTER,
        attributes=(*_IB_PORT, "ib.counter"),
        description=(
            "IB PMA error counters; ib.counter is the counters/ file name (symbol_error, "
            "link_error_recovery, link_downed, port_rcv_errors, port_xmit_discards, VL15_dropped, ...). "
            "The narrow ones saturate at their maximum instead of wrapping."
        ),
        source="infiniband",
        equivalents=(
            "node_infiniband_symbol_error_total",
            "node_infiniband_link_error_recovery_total",
            "node_infiniband_link_downed_total",
            "node_infiniband_port_errors_received_total",
            "node_infiniband_port_receive_remote_physical_errors_total",
            "node_infiniband_port_receive_switch_relay_errors_total",
            "node_infiniband_port_discards_transmitted_total",
            "node_infiniband_port_constraint_errors_transmitted_total",
            "node_infiniband_port_constraint_errors_received_total",
            "node_infiniband_local_link_integrity_errors_total",
            "node_infiniband_excessive_buffer_overrun_errors_total",
            "node_infiniband_vl15_dropped_total",
        ),
    ),
    MetricSpec(
        name="ridethrough.ib.port.xmit_wait",
        unit="{tick}",
        kind=_COUNTER,
        attributes=_IB_PORT,
        description=(
            "Ticks during which the port had data to send but no flow-control credit "
            "(counters/port_xmit_wait): fabric congestion, not an error."
        ),
        source="infiniband",
        equivalents=("node_infiniband_port_transmit_wait_total",),
    ),
    MetricSpec(
        name="ridethrough.ib.port.hw_counter",
        unit="1",
        kind=_COUNTER,
        attributes=(*_IB_PORT, "ib.counter"),
        description=(
            "Driver hw_counters/ (mlx5: out_of_sequence, packet_seq_err, local_ack_timeout_err, "
            "np_cnp_sent, rp_cnp_handled, ...); ib.counter is the file name. lifespan is skipped."
        ),
        source="infiniband",
        equivalents=(
            "node_infiniband_out_of_sequence_packets_received_total",
            "node_infiniband_packet_sequence_errors_total",
            "node_infiniband_local_ack_timeout_errors_total",
            "node_infiniband_np_cnp_packets_sent_total",
            "node_infiniband_rp_cnp_packets_handled_total",
        ),
    ),
    MetricSpec(
        name="ridethrough.ib.port.state",
        unit="1",
        kind=_GAUGE,
        attributes=(*_IB_PORT, "ib.link_layer"),
        description=(
            "Logical port state (state): 1 DOWN, 2 INIT, 3 ARMED, 4 ACTIVE, 5 ACTIVE_DEFER; "
            "ib.link_layer is InfiniBand or Ethernet (RoCE)."
        ),
        source="infiniband",
        equivalents=("node_infiniband_state_id",),
    ),
    MetricSpec(
        name="ridethrough.ib.port.phys_state",
        unit="1",
        kind=_GAUGE,
        attributes=_IB_PORT,
        description="Physical port state (phys_state): 2 Polling, 3 Disabled, 5 LinkUp, 6 LinkErrorRecovery.",
        source="infiniband",
        equivalents=("node_infiniband_physical_state_id",),
    ),
    MetricSpec(
        name="ridethrough.ib.port.rate",
        unit="Gbit/s",
        kind=_GAUGE,
        attributes=_IB_PORT,
        description="Active link rate (rate, e.g. '200 Gb/sec (4X HDR)').",
        source="infiniband",
        equivalents=("node_infiniband_rate_bytes_per_second",),
    ),
)


def metric(name: str) -> MetricSpec:
    """The catalogue row for ``name``.

    Raises:
        KeyError: ``name`` is not catalogued; the message names the closest
            catalogued names.
    """
    for spec in METRICS:
        if spec.name == name:
            return spec
    close = difflib.get_close_matches(name, [spec.name for spec in METRICS], n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise KeyError(f"metric {name!r} is not in ridethrough.catalogue.METRICS{hint}")


def metrics_of(source: str) -> tuple[MetricSpec, ...]:
    """Every catalogued metric emitted by the source named ``source``."""
    return tuple(spec for spec in METRICS if spec.source == source)
