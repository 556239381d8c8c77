"""What a running lab lets faults do to it: the seam between scenarios and the fabric.

`ridethrough.lab.fabric.Lab` implements `LabControl` on network namespaces; the scenario
runner and ``ridethrough lab inject`` drive any `LabControl`, so each side is tested
on its own. Names:

* hosts ``h0`` … ``h{N-1}``; leaves ``leaf{rack}r{rail}``; spines ``spine{s}``;
* a link is named by its two ends, lower tier first: ``h3-leaf1r0``, ``leaf1r0-spine1``;
* a host's NIC ``r`` (rail r) is ``nic{r}``; its fake InfiniBand device is ``mlx5_{r}``.

Every method raises `LabError` with a one-line reason for a target that does not exist
or an operation this lab cannot do (for example, link faults in the degraded loopback
mode); nothing is half applied.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Protocol


class LabError(Exception):
    """A lab operation was refused or failed; the message says which and why."""


class Direction(enum.Enum):
    """Which way a one-sided link fault acts: from the link's first end to its second, or back."""

    BOTH = "both"
    FORWARD = "forward"
    """From the lower-tier end (the host, or the leaf) towards the upper one."""
    REVERSE = "reverse"


class GpuFault(enum.Enum):
    """Scripted GPU health faults the fake NVML backend plays."""

    ECC_SBE_RISING = "ecc_sbe_rising"
    """Volatile and aggregate single-bit ECC counts climb at ``rate_per_s``."""
    ROW_REMAP_PENDING = "row_remap_pending"
    """A row remap becomes pending (and correctable remaps climb)."""
    ECC_DBE = "ecc_dbe"
    """A double-bit (uncorrectable) error: counters move and XID 48 fires."""
    XID = "xid"
    """One XID event with code ``code`` (48, 63, 64, 74, 79, 92, 94, 95, 119, ...)."""
    THERMAL = "thermal"
    """Temperature rises ``deg_per_s`` until throttling (clock event reasons set)."""
    PCIE_REPLAY_STORM = "pcie_replay_storm"
    """The PCIe replay counter climbs at ``rate_per_s``."""
    NVLINK_CRC = "nvlink_crc"
    """NVLink CRC error counters climb at ``rate_per_s`` on link ``link``."""
    FALLEN_OFF_BUS = "fallen_off_bus"
    """Every NVML call on the GPU fails with GPU_IS_LOST."""


class LabControl(Protocol):
    """Operations on a running lab (real namespaces or the degraded loopback mode)."""

    @property
    def name(self) -> str:
        """The lab's name (also the prefix of everything it creates)."""
        ...

    def hosts(self) -> list[str]:
        """Host names, in order."""
        ...

    def links(self) -> list[str]:
        """Link names, in order."""
        ...

    def set_link(self, link: str, *, up: bool, end: str | None = None) -> None:
        """Take a link down or up at one end (``end`` is a node name) or both."""
        ...

    def degrade_link(self, link: str, *, rate_mbit: float, burst_kbit: float = 32.0, latency_ms: float = 20.0,
                     direction: Direction = Direction.BOTH) -> None:
        """Cap a link with a ``tbf`` qdisc (a small queue, so it congests and drops under load)."""
        ...

    def lose_packets(self, link: str, *, percent: float, direction: Direction = Direction.BOTH) -> None:
        """Drop ``percent`` % (in (0, 100]) of the packets leaving each sending end, at random, whatever the load.

        A failing optic or a dirty fibre (CRC drops on one cable); `restore_link` ends it.
        """
        ...

    def restore_link(self, link: str) -> None:
        """Remove any qdisc, packet loss and MTU change the lab put on the link, and bring it up."""
        ...

    def set_mtu(self, link: str, *, end: str, mtu: int) -> None:
        """Set the MTU of one end of a link (an MTU mismatch when the ends differ)."""
        ...

    def start_load(self, link: str, *, direction: Direction, rate_mbit: float) -> str:
        """Drive traffic across a link in one direction; returns a handle for `stop_load`."""
        ...

    def stop_load(self, handle: str) -> None:
        """Stop a load started by `start_load`."""
        ...

    def step_clock(self, host: str, *, step_ns: int) -> None:
        """Step a host's clock by ``step_ns`` (negative steps go back in time)."""
        ...

    def gpu_fault(self, host: str, gpu: int, fault: GpuFault, params: Mapping[str, float]) -> None:
        """Start a scripted GPU fault on one fake GPU."""
        ...

    def clear_gpu(self, host: str, gpu: int) -> None:
        """Make a fake GPU healthy again (counters keep their totals, as on real hardware)."""
        ...

    def nic_error_ramp(self, host: str, nic: str, *, counter: str, rate_per_s: float,
                       link_down_after_s: float | None = None) -> None:
        """Make one fake IB error counter climb; optionally take the NIC's link down later."""
        ...

    def clear_nic(self, host: str, nic: str) -> None:
        """Stop every error ramp on a NIC."""
        ...

    def freeze_host(self, host: str) -> None:
        """SIGSTOP every process the lab runs in the host."""
        ...

    def thaw_host(self, host: str) -> None:
        """SIGCONT what `freeze_host` stopped."""
        ...

    def straggle(self, host: str, *, cpu_fraction: float) -> None:
        """Cap the CPU of the host's job processes (cgroup) to make it a straggler."""
        ...

    def unstraggle(self, host: str) -> None:
        """Remove the CPU cap."""
        ...
