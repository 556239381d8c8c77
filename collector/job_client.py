"""Report training steps to the node agent from inside a training process.

::

    reporter = JobReporter(socket_path="/run/ridethrough/job.sock", job="llama-70b-run3",
                           customer="acme", rank=rank, world_size=world_size)
    reporter.started()
    for step in range(first, last):
        t0 = time.time_ns()
        ...  # the step
        reporter.step(step, t0, time.time_ns(), tokens=tokens, phases={"compute_s": 1.05, "wait_s": 0.2})
    reporter.ended("completed")

Reporting never raises into the training loop and never blocks it: each message is one
non-blocking datagram. When the agent is absent, restarting or behind (its socket queue full),
the message is dropped and counted in `JobReporter.dropped` (by reason in
`JobReporter.drops`, the last error kept in `JobReporter.last_error`), so the loop runs on at
full speed with no agent at all. A message the agent would reject is caught here and counted
the same way. Only the constructor raises, at start-up, for an identity the agent would never
accept (a config error is best found before the first step).

This module imports only the standard library and the protocol, so it is cheap to load in a
training process.
"""

from __future__ import annotations

import errno
import operator
import os
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any, SupportsFloat, SupportsIndex

from .job_protocol import VERSION, Identity, ProtocolError, encode, validate

_FULL = (errno.EAGAIN, errno.ENOBUFS)
_INT_FIELDS = frozenset({"step", "start_ns", "end_ns", "tokens", "samples"})


class JobReporter:
    """Sends one rank's step, start and end reports to the agent's job socket."""

    def __init__(self, *, socket_path: str | os.PathLike[str], job: str, customer: str, rank: int,
                 world_size: int) -> None:
        """Check the identity once.

        Raises:
            ValueError: the agent would drop every message with this identity; the text says why.
        """
        self.socket_path = os.fspath(socket_path)
        self._identity: dict[str, object] = {"v": VERSION, "job": job, "customer": customer, "rank": rank,
                                             "world_size": world_size}
        try:
            validate({**self._identity, "type": "start", "time_ns": 1})
        except ProtocolError as exc:
            raise ValueError(f"JobReporter: {exc}") from None
        self.who = Identity(job, customer, rank, world_size)
        self.sent = 0
        """Messages handed to the kernel."""
        self.dropped = 0
        """Messages that did not reach the agent's socket, all reasons together."""
        self.drops: dict[str, int] = {}
        """Messages dropped here, by reason (``no_agent``, ``agent_busy``, a `DropReason`, ...)."""
        self.last_error = ""
        """What went wrong last, for a log line at a safe point."""
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None

    def step(self, step: SupportsIndex, start_ns: SupportsIndex, end_ns: SupportsIndex, *,
             tokens: SupportsIndex | None = None, samples: SupportsIndex | None = None,
             phases: Mapping[str, SupportsFloat] | None = None) -> bool:
        """Report a finished step (times from ``time.time_ns()``); True if it was sent.

        ``phases`` maps ``compute_s``, ``checkpoint_s``, ``wait_s`` to seconds. Integers may be any
        integer scalar (numpy, torch), seconds any real number.
        """
        fields: dict[str, object] = {"type": "step", "step": step, "start_ns": start_ns, "end_ns": end_ns}
        if tokens is not None:
            fields["tokens"] = tokens
        if samples is not None:
            fields["samples"] = samples
        if phases:
            fields["phases"] = dict(phases)
        return self._send(fields)

    def started(self) -> bool:
        """Report that this rank started (or resumed); True if it was sent."""
        return self._send({"type": "start", "time_ns": time.time_ns()})

    def ended(self, reason: str, detail: str = "") -> bool:
        """Report that this rank ended: ``reason`` is a short token (``completed``, ``failed``,
        ``preempted``), ``detail`` up to 256 printable characters; True if it was sent."""
        fields: dict[str, object] = {"type": "end", "time_ns": time.time_ns(), "reason": reason}
        if detail:
            fields["detail"] = detail
        return self._send(fields)

    def close(self) -> None:
        """Close the socket; a later report opens a new one."""
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    def __enter__(self) -> JobReporter:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _send(self, fields: dict[str, object]) -> bool:
        try:
            data = encode({**self._identity, **_plain(fields)})
        except ProtocolError as exc:
            return self._dropped(str(exc.reason), str(exc))
        except Exception as exc:  # no integer where one belongs, say; the training loop must not see it
            return self._dropped("wrong_type", repr(exc))
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                    self._sock.setblocking(False)
                # sendto, not connect: an agent that restarts binds a new socket and we reach it at once
                self._sock.sendto(data, self.socket_path)
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                return self._dropped("no_agent", str(exc))
            except OSError as exc:
                return self._dropped("agent_busy" if exc.errno in _FULL else "send_failed", str(exc))
            self.sent += 1
            return True

    def _dropped(self, reason: str, error: str) -> bool:
        self.dropped += 1
        self.drops[reason] = self.drops.get(reason, 0) + 1
        self.last_error = f"{reason}: {error}"
        return False


def _plain(fields: Mapping[str, Any]) -> dict[str, object]:
    """Counts as ``int`` and phase seconds as ``float``: training code often holds numpy or torch scalars.

    Raises:
        TypeError, ValueError: a value that is no integer or number.
    """
    out = {k: operator.index(v) if k in _INT_FIELDS else v for k, v in fields.items()}
    if isinstance(phases := fields.get("phases"), Mapping):
        out["phases"] = {k: float(v) for k, v in phases.items()}
    return out
