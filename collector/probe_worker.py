"""What the responder and the prober share: one probe socket per local NIC, served by one thread."""

from __future__ import annotations

import socket
import threading

from ridethrough.collector.probe_paths import Address
from ridethrough.collector.timestamps import ProbeSocket, open_probe_socket


class SocketWorker:
    """A thread serving one `ProbeSocket` per local NIC; subclasses write `_run`.

    `stop` wakes the thread through a socket pair (``_wake[0]`` is readable once stop is
    called), so a thread blocked in poll() leaves at once.
    """

    thread_name = "rt-probe"

    def __init__(self, binds: dict[str, Address], *, want_tx_timestamps: bool, want_hardware: bool = False) -> None:
        self._binds = binds
        self._want = (want_tx_timestamps, want_hardware)
        self._sockets: dict[str, ProbeSocket] = {}
        self._wake: tuple[socket.socket, socket.socket] | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def addresses(self) -> dict[str, Address]:
        """Where each NIC's socket is bound (after `open`)."""
        return {nic: sock.address for nic, sock in self._sockets.items()}

    def open(self) -> None:
        """Bind every NIC's socket (OSError if one cannot be bound; none stays open then)."""
        try:
            for nic, (addr, port) in self._binds.items():
                self._sockets[nic] = open_probe_socket(addr, port, want_tx_timestamps=self._want[0],
                                                       want_hardware=self._want[1])
        except OSError:
            self.close()
            raise

    def start(self) -> None:
        """Open the sockets (unless open) and serve them in a thread until `stop`."""
        if self._thread is not None:
            raise RuntimeError(f"{type(self).__name__}.start called twice")
        if not self._sockets:
            self.open()
        self._wake = socket.socketpair()
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    def stop(self, *, timeout_s: float) -> None:
        """Stop the thread (within ``timeout_s``) and close the sockets."""
        self._stopping.set()
        if self._wake is not None:
            self._wake[1].send(b"x")
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.close()

    def close(self) -> None:
        """Close every socket."""
        for sock in self._sockets.values():
            sock.close()
        self._sockets.clear()
        for end in self._wake or ():
            end.close()
        self._wake = None

    def _run(self) -> None:
        raise NotImplementedError
