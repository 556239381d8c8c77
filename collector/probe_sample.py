"""One two-way probe exchange: the contract between the prober and the clock estimators.

The prober on node A sends probe ``seq`` from its NIC to node B's NIC at A-clock time
``t1_ns``; B receives it at B-clock ``t2_ns`` and replies at B-clock ``t3_ns``; A receives
the reply at A-clock ``t4_ns``. Each clock is the node's own (offset and drift unknown).
Probes are sent as *coded pairs*: two probes ``pair_gap_ns`` apart (``pair_index`` 0 and 1
of pair ``pair_id``); a pair whose probes arrive (nearly) the same gap apart met no queue
on the way and is *pure*, in that direction.

    forward one-way delay (A→B) = t2 - t1 - (offset_B - offset_A)
    reverse one-way delay (B→A) = t4 - t3 + (offset_B - offset_A)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class TimestampKind(enum.Enum):
    """Where a timestamp was taken, best first."""

    HARDWARE = "hardware"
    KERNEL = "kernel"
    """Kernel software timestamp (SO_TIMESTAMPNS / SO_TIMESTAMPING software)."""
    USER = "user"
    """Read in user space around the socket call: the fallback."""


@dataclass(frozen=True, slots=True)
class ProbeSample:
    """A completed exchange (a lost probe or reply produces no sample; it is counted instead)."""

    src_node: str
    src_nic: str
    dst_node: str
    dst_nic: str
    seq: int
    pair_id: int
    pair_index: int
    """0 or 1: which probe of its coded pair this is."""
    t1_ns: int
    t2_ns: int
    t3_ns: int
    t4_ns: int
    rx_kind: TimestampKind = TimestampKind.KERNEL
    """How t2 and t4 (the receive times) were taken."""
    tx_kind: TimestampKind = TimestampKind.USER
    """How t1 and t3 (the send times) were taken."""

    @property
    def path(self) -> tuple[str, str, str, str]:
        """(src node, src NIC, dst node, dst NIC)."""
        return self.src_node, self.src_nic, self.dst_node, self.dst_nic

    @property
    def rtt_ns(self) -> int:
        """Round-trip time minus the responder's turnaround: free of both clocks' offsets."""
        return (self.t4_ns - self.t1_ns) - (self.t3_ns - self.t2_ns)
