"""Fake InfiniBand (and netdev) sysfs trees for lab hosts, driven by real veth traffic.

Each lab host gets a tree shaped like ``/sys`` that its agent reads with
``--sysfs-root``. The `CounterPump` rewrites it from two inputs:

* the real statistics of the host's NIC veths (read over netlink by the lab), so octet
  and packet counters follow real traffic (``port_xmit_data`` in 4-byte words, as mlx5
  reports it) and ``class/net/nicR`` mirrors the veth's own counters and state;
* a script of error-counter ramps (``nic_faults.json``), written by the fault injector,
  so symbol errors, link recoveries and the like climb as a failing optic's would.

Counter values are a pure function of (veth stats, script, now): a restarted pump
writes the same numbers.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ridethrough.lab.control import LabError

IB_COUNTERS = (
    "symbol_error", "link_error_recovery", "link_downed", "port_rcv_errors", "port_rcv_remote_physical_errors",
    "port_rcv_switch_relay_errors", "port_xmit_discards", "port_xmit_constraint_errors",
    "port_rcv_constraint_errors", "local_link_integrity_errors", "excessive_buffer_overrun_errors",
    "VL15_dropped", "port_xmit_wait",
)
TRAFFIC_COUNTERS = ("port_xmit_data", "port_rcv_data", "port_xmit_packets", "port_rcv_packets",
                    "unicast_xmit_packets", "unicast_rcv_packets", "multicast_xmit_packets",
                    "multicast_rcv_packets")
HW_COUNTERS = (
    "out_of_sequence", "packet_seq_err", "local_ack_timeout_err", "np_cnp_sent", "rp_cnp_handled",
    "np_ecn_marked_roce_packets", "rnr_nak_retry_err", "duplicate_request", "implied_nak_seq_err",
)
RAMPABLE = frozenset(IB_COUNTERS) | frozenset(HW_COUNTERS)
_NETDEV_STATS = ("rx_bytes", "tx_bytes", "rx_packets", "tx_packets", "rx_errors", "tx_errors",
                 "rx_dropped", "tx_dropped")


@dataclass(frozen=True, slots=True)
class NicStats:
    """What netlink says about one NIC veth."""

    rx_bytes: int
    tx_bytes: int
    rx_packets: int
    tx_packets: int
    rx_errors: int = 0
    tx_errors: int = 0
    rx_dropped: int = 0
    tx_dropped: int = 0
    up: bool = True
    mtu: int = 1500
    carrier_changes: int = 0


StatsSource = Callable[[], Mapping[str, "NicStats | tuple[int, int, int, int]"]]


def _nic_index(nic: str) -> int:
    if not nic.startswith("nic") or not nic[3:].isdigit():
        raise LabError(f"no NIC {nic!r} (NICs are nic0, nic1, ...)")
    return int(nic[3:])


def _write(path: Path, text: str) -> None:
    # Readers (the agent) must never see a half-written counter: write, then rename.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".w-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _write_own(path: Path, text: str) -> None:
    """`_write` for a file only this process writes (the pump's counters): a temporary name of its own, no
    file object. The pump writes hundreds of counters a second; mkstemp's random names and a text file
    per write were most of the lab supervisor's CPU."""
    tmp = path.with_name(f".w-{os.getpid()}-{path.name}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _port_dir(root: Path, nic: int) -> Path:
    return root / "class" / "infiniband" / f"mlx5_{nic}" / "ports" / "1"


def create_tree(sysfs_root: Path, nics: int, *, rate: str = "200 Gb/sec (4X HDR)") -> None:
    """Lay out ``nics`` mlx5 devices (one port each) and matching ``class/net/nicR`` folders."""
    for r in range(nics):
        port = _port_dir(sysfs_root, r)
        (port / "counters").mkdir(parents=True, exist_ok=True)
        (port / "hw_counters").mkdir(exist_ok=True)
        for name in (*TRAFFIC_COUNTERS, *IB_COUNTERS):
            _write(port / "counters" / name, "0\n")
        for name in HW_COUNTERS:
            _write(port / "hw_counters" / name, "0\n")
        _write(port / "rate", rate + "\n")
        _write(port / "link_layer", "InfiniBand\n")
        _set_state(port, up=True)
        net = sysfs_root / "class" / "net" / f"nic{r}"
        (net / "statistics").mkdir(parents=True, exist_ok=True)


def _set_state(port: Path, *, up: bool) -> None:
    _write(port / "state", "4: ACTIVE\n" if up else "1: DOWN\n")
    _write(port / "phys_state", "5: LinkUp\n" if up else "3: Disabled\n")


@dataclass(frozen=True, slots=True)
class Ramp:
    """One error counter climbing on one NIC from ``start_ns`` until ``end_ns`` (0: still going)."""

    nic: str
    counter: str
    rate_per_s: float
    start_ns: int
    end_ns: int = 0

    def value(self, now_ns: int) -> int:
        """How much this ramp has added by ``now_ns``."""
        stop = min(now_ns, self.end_ns) if self.end_ns else now_ns
        return max(0, int(self.rate_per_s * (stop - self.start_ns) / 1e9))


class NicScript:
    """The fault injector's side: the ramps of one host, in ``nic_faults.json``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def ramps(self) -> list[Ramp]:
        """Every ramp, ended or not; ValueError naming the file if it is malformed."""
        try:
            data = json.loads(self.path.read_text())
            return [Ramp(**r) for r in data.get("ramps", [])]
        except FileNotFoundError:
            return []
        except (OSError, ValueError, TypeError) as exc:
            raise ValueError(f"NIC fault script {self.path}: {exc}") from exc

    def ramp(self, nic: str, counter: str, rate_per_s: float, *, start_ns: int) -> None:
        """Start ``counter`` climbing on ``nic``."""
        _nic_index(nic)
        if counter not in RAMPABLE:
            raise LabError(f"no IB counter {counter!r}; rampable: {', '.join(sorted(RAMPABLE))}")
        if rate_per_s <= 0:
            raise LabError(f"rate_per_s must be positive, got {rate_per_s}")
        self._save([*self.ramps(), Ramp(nic, counter, float(rate_per_s), start_ns)])

    def clear(self, nic: str, *, at_ns: int) -> None:
        """End every running ramp on ``nic`` (totals stay, as on real hardware)."""
        self._save([Ramp(r.nic, r.counter, r.rate_per_s, r.start_ns, at_ns)
                    if r.nic == nic and not r.end_ns else r for r in self.ramps()])

    def _save(self, ramps: list[Ramp]) -> None:
        data = {"ramps": [{"nic": r.nic, "counter": r.counter, "rate_per_s": r.rate_per_s,
                           "start_ns": r.start_ns, "end_ns": r.end_ns} for r in ramps]}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _write(self.path, json.dumps(data))


class CounterPump:
    """Rewrites one host's tree from its veth stats and its ramp script."""

    def __init__(self, sysfs_root: Path, script_path: Path, stats: StatsSource) -> None:
        self.root = sysfs_root
        self.script = NicScript(script_path)
        self._stats = stats
        self._was_up: dict[str, bool] = {}
        self._downs: dict[str, int] = {}
        self._written: dict[Path, str] = {}

    def _put(self, path: Path, text: str) -> None:
        # Most counters do not move between ticks: skip the write (and the rename) then.
        if self._written.get(path) != text:
            _write_own(path, text)
            self._written[path] = text

    def tick(self, now_ns: int) -> None:
        """Read the inputs once and write every counter."""
        stats = {nic: _as_stats(s) for nic, s in self._stats().items()}
        try:
            ramps = self.script.ramps()
        except ValueError:
            ramps = []  # a broken script stops the ramps, not the traffic counters
        for nic, st in stats.items():
            added = {c: 0 for c in RAMPABLE}
            for r in ramps:
                if r.nic == nic:
                    added[r.counter] += r.value(now_ns)
            self._write_nic(nic, st, added)

    def _write_nic(self, nic: str, st: NicStats, added: Mapping[str, int]) -> None:
        port = _port_dir(self.root, _nic_index(nic))
        if not port.is_dir():
            return
        if self._was_up.get(nic, True) and not st.up:
            self._downs[nic] = self._downs.get(nic, 0) + 1
        self._was_up[nic] = st.up
        values = {"port_xmit_data": st.tx_bytes // 4, "port_rcv_data": st.rx_bytes // 4,
                  "port_xmit_packets": st.tx_packets, "port_rcv_packets": st.rx_packets,
                  "unicast_xmit_packets": st.tx_packets, "unicast_rcv_packets": st.rx_packets,
                  "multicast_xmit_packets": 0, "multicast_rcv_packets": 0}
        for name in IB_COUNTERS:
            values[name] = added[name] + (self._downs.get(nic, 0) if name == "link_downed" else 0)
        for name, value in values.items():
            self._put(port / "counters" / name, f"{value}\n")
        for name in HW_COUNTERS:
            self._put(port / "hw_counters" / name, f"{added[name]}\n")
        if self._written.get(port / "state") != str(st.up):
            _set_state(port, up=st.up)
            self._written[port / "state"] = str(st.up)
        self._write_netdev(nic, st)

    def _write_netdev(self, nic: str, st: NicStats) -> None:
        net = self.root / "class" / "net" / nic
        (net / "statistics").mkdir(parents=True, exist_ok=True)
        for name in _NETDEV_STATS:
            self._put(net / "statistics" / name, f"{getattr(st, name)}\n")
        self._put(net / "operstate", "up\n" if st.up else "down\n")
        self._put(net / "carrier", "1\n" if st.up else "0\n")
        self._put(net / "mtu", f"{st.mtu}\n")
        self._put(net / "carrier_changes", f"{st.carrier_changes}\n")


def _as_stats(value: NicStats | tuple[int, int, int, int]) -> NicStats:
    return value if isinstance(value, NicStats) else NicStats(*value)
