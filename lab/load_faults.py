"""A fake NIC whose error counters climb only under load: errors in proportion to the bytes it carries.

A marginal optic or a dirty connector passes a link at rest and corrupts symbols when the link
is busy. `LoadErrors` plays that on a lab host's NIC: every ``interval_s`` it reads the NIC
veth's byte counters (over its own netlink socket in the host's namespace) and, when more than
``idle_bytes_per_s`` went through, writes a ramp into the host's ``nic_faults.json`` that adds
``errors_per_mbyte`` errors per megabyte carried, over the next interval. The counter pump turns
ramps into the fake IB counters (`ridethrough.lab.fake_ib`), so the agent exports the errors as
it does any other, and a restarted pump still writes the same totals::

    with LoadErrors(lab, "h5", "nic0", errors_per_mbyte=2.0):
        ...  # traffic through h5's nic0 makes its symbol_error counter climb; idle, it stays put

While it runs it owns the NIC's ramps: each segment ends the ramps still running on that NIC.
"""

from __future__ import annotations

import logging
import threading
import time
from types import TracebackType
from typing import Any

from ridethrough.lab.control import LabError
from ridethrough.lab.fake_ib import RAMPABLE, NicScript
from ridethrough.lab.netns import NsHandle

log = logging.getLogger(__name__)
NS_PER_S = 1_000_000_000


class LoadErrors:
    """Makes one fake IB error counter of a lab host's NIC climb with the traffic through it (see the module)."""

    def __init__(self, lab: Any, host: str, nic: str, *, counter: str = "symbol_error", errors_per_mbyte: float = 2.0,
                 idle_bytes_per_s: float = 1e6, interval_s: float = 0.25) -> None:
        if counter not in RAMPABLE:
            raise LabError(f"no IB counter {counter!r}; rampable: {', '.join(sorted(RAMPABLE))}")
        if errors_per_mbyte <= 0 or idle_bytes_per_s < 0 or interval_s <= 0:
            raise LabError("errors_per_mbyte and interval_s must be positive, idle_bytes_per_s not negative")
        lab.topology.nic_link(host, nic)  # ValueError naming the NICs if there is no such NIC
        self.host, self.nic, self.counter = host, nic, counter
        self.errors_per_mbyte, self.idle_bytes_per_s, self.interval_s = errors_per_mbyte, idle_bytes_per_s, interval_s
        self._namespace = lab.topology.namespace(host)
        self._script = NicScript(lab.host_dir(host) / "nic_faults.json")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors_added = 0.0
        """Errors scripted so far (the counter shows them once the pump has ticked past each segment)."""

    def start(self) -> LoadErrors:
        """Start watching the NIC (in a daemon thread)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"load-errors-{self.host}-{self.nic}", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop adding errors (those added stay, as on real hardware)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None

    def __enter__(self) -> LoadErrors:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def _bytes(self, handle: NsHandle) -> int:
        for m in handle.links():
            if m.get("ifname") == self.nic:
                stats = m.get("stats64") or {}
                return int(stats.get("rx_bytes", 0)) + int(stats.get("tx_bytes", 0))
        raise LabError(f"{self.host} has no interface {self.nic}")

    def _run(self) -> None:
        handle = NsHandle(self._namespace)
        try:
            last, last_t = self._bytes(handle), time.monotonic()
            while not self._stop.wait(self.interval_s):
                now, now_t = self._bytes(handle), time.monotonic()
                self.segment(now - last, now_t - last_t, now_ns=time.time_ns())
                last, last_t = now, now_t
        except Exception:  # a fault injector that dies must say so, not take the bench with it
            log.exception("load errors on %s/%s stopped", self.host, self.nic)
        finally:
            handle.close()

    def segment(self, carried_bytes: int, seconds: float, *, now_ns: int) -> float:
        """Script the errors for ``carried_bytes`` seen over ``seconds`` (none when below the idle rate)."""
        if seconds <= 0 or carried_bytes / seconds <= self.idle_bytes_per_s:
            return 0.0
        errors = carried_bytes / 1e6 * self.errors_per_mbyte
        end_ns = now_ns + round(self.interval_s * NS_PER_S)
        self._script.ramp(self.nic, self.counter, errors / self.interval_s, start_ns=now_ns)
        self._script.clear(self.nic, at_ns=end_ns)
        self.errors_added += errors
        return errors
