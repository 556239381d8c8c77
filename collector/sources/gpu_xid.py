"""XID events: a thread that waits on NVML's critical-XID event set, and what each XID means.

`XidWatcher` calls ``backend.wait_xid`` in a loop on a thread of its own (NVML's
``nvmlEventSetWait`` blocks). A backend error is logged and counted, and the thread
backs off (exponentially, with jitter, in a wait that `stop` interrupts) and goes on;
``NOT_SUPPORTED`` (no GPU can deliver XID events) ends the thread for good. `xid_event`
turns one XID into the `Event` the agent exports as an OTel log record.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Mapping
from typing import Final

from ridethrough.collector.nvml import NvmlNotSupported, XidClass, XidEvent, xid_info
from ridethrough.collector.sample import Event

_log = logging.getLogger(__name__)

XID_EVENT: Final = "gpu.xid"
"""The event name of an XID."""
SEVERITY: Final[Mapping[XidClass, str]] = {
    XidClass.NODE_REBOOT: "ERROR",
    XidClass.GPU_RESET: "ERROR",
    XidClass.PRECURSOR: "WARN",
    XidClass.APPLICATION_ERROR: "WARN",
    XidClass.UNKNOWN: "WARN",
    XidClass.INFORMATIONAL: "INFO",
}
"""The OTel severity of an XID event, by what the XID asks of the operator."""


def xid_class_name(xid_class: XidClass) -> str:
    """The class as an attribute value: ``gpu_reset``, ``precursor``, ``application_error``..."""
    return xid_class.name.lower()


def xid_event(xid: XidEvent, gpu_attributes: Mapping[str, str]) -> Event:
    """The ``gpu.xid`` event of one XID on the GPU that ``gpu_attributes`` describe."""
    info = xid_info(xid.xid)
    where = f"GPU {gpu_attributes.get('gpu.index', xid.gpu_index)} ({gpu_attributes.get('hw.id', xid.uuid)})"
    return Event(
        name=XID_EVENT,
        body=f"XID {xid.xid} on {where}: {info.meaning} ({info.xid_class.value})",
        time_ns=xid.timestamp_ns,
        severity=SEVERITY[info.xid_class],
        attributes={**gpu_attributes, "gpu.xid": str(xid.xid), "gpu.xid.class": xid_class_name(info.xid_class),
                    "gpu.xid.meaning": info.meaning},
    )


class XidWatcher:
    """Waits for XIDs on a daemon thread and hands each one to ``on_xid``."""

    def __init__(self, wait_xid: Callable[[int], XidEvent | None], on_xid: Callable[[XidEvent], None], *,
                 wait_ms: int = 500, backoff_initial_s: float = 0.5, backoff_max_s: float = 30.0) -> None:
        """Watch with ``wait_xid`` (an `NvmlBackend.wait_xid`), waiting at most ``wait_ms`` per call.

        ``wait_ms`` bounds how long `stop` waits for a call in progress; after a failed call the
        thread waits ``backoff_initial_s``, doubling up to ``backoff_max_s`` while calls keep failing.
        """
        if wait_ms < 0 or not 0 < backoff_initial_s <= backoff_max_s:
            raise ValueError(f"need wait_ms >= 0 and 0 < backoff_initial_s <= backoff_max_s, got "
                             f"{wait_ms}, {backoff_initial_s}, {backoff_max_s}")
        self._wait_xid = wait_xid
        self._on_xid = on_xid
        self._wait_ms = wait_ms
        self._backoff = (backoff_initial_s, backoff_max_s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors_total = 0
        """Failed ``wait_xid`` calls (each followed by a back-off)."""
        self.xids_total = 0
        """XIDs handed to ``on_xid``."""
        self.unsupported = False
        """True once NVML said no GPU can deliver XID events: the thread has ended for good."""

    @property
    def running(self) -> bool:
        """Whether the thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the thread; a second call while it runs does nothing."""
        if self.running:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="rt-gpu-xid", daemon=True)
        self._thread.start()

    def stop(self, *, timeout_s: float) -> bool:
        """Ask the thread to end and join it for up to ``timeout_s``; True if it has ended."""
        self._stop.set()
        if self._thread is None:
            return True
        self._thread.join(max(0.0, timeout_s))
        return not self._thread.is_alive()

    def _run(self) -> None:
        backoff = self._backoff[0]
        while not self._stop.is_set():
            try:
                xid = self._wait_xid(self._wait_ms)
            except NvmlNotSupported as err:
                self.unsupported = True
                _log.warning("gpu: XID events are not supported here (%s); not watching for them", err)
                return
            except Exception as err:  # the watcher outlives any backend failure: log, back off, go on
                self.errors_total += 1
                delay = backoff * random.uniform(0.5, 1.0)
                _log.warning("gpu: waiting for XIDs failed (%s); retrying in %.1f s", err, delay)
                self._stop.wait(delay)
                backoff = min(backoff * 2, self._backoff[1])
                continue
            backoff = self._backoff[0]
            if xid is not None:
                self._deliver(xid)

    def _deliver(self, xid: XidEvent) -> None:
        self.xids_total += 1
        try:
            self._on_xid(xid)
        except Exception:  # a failing consumer must not end the watch
            _log.exception("gpu: handling XID %d on GPU %d failed", xid.xid, xid.gpu_index)
