"""The job step protocol: what a training process may say to the agent's job socket, and its checks.

One message is one JSON object in one Unix datagram of at most `MAX_DATAGRAM_BYTES`, UTF-8.
Every message names who is speaking::

    {"v": 1, "type": "step", "job": "llama-70b-run3", "customer": "acme", "rank": 3, "world_size": 64,
     "step": 1200, "start_ns": 1718000000000000000, "end_ns": 1718000001250000000,
     "tokens": 4194304, "samples": 1024,
     "phases": {"compute_s": 1.05, "checkpoint_s": 0.0, "wait_s": 0.2}}
    {"v": 1, "type": "start", ..., "time_ns": 1718000000000000000}
    {"v": 1, "type": "end", ..., "time_ns": 1718009000000000000, "reason": "completed",
     "detail": "optional free text, up to 256 printable characters"}

Validation is strict, because these values become metric attributes (cardinality) and the
books goodput is computed from: a field this version does not know is an error rather than
silently ignored (a typo such as ``token`` would otherwise lose data unnoticed); a new field
means a new ``v``. Times are ns since the epoch on the sender's clock (``time.time_ns()``).
Phase seconds need not add up to the step's duration (phases may overlap or be partial).

A message that fails is dropped with a `DropReason`: a small fixed set, so that counting
drops by reason cannot itself grow without bound.
"""

from __future__ import annotations

import enum
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

VERSION = 1
"""The protocol version this module speaks (the ``v`` field)."""
MAX_DATAGRAM_BYTES = 4096
"""Largest message, in bytes; the agent drops longer datagrams as ``oversized``."""
PHASES = ("compute", "checkpoint", "wait")
"""Phases a step may report, as ``<phase>_s`` keys of ``phases``: the time computing, stalled on a
checkpoint, and waiting (on peers, data, the network)."""
MAX_WORLD_SIZE = 1 << 20
_MAX_INT = (1 << 63) - 1  # counts and ns timestamps must fit an Int64/UInt64 column
_MAX_PHASE_S = 1e9
_MAX_DETAIL_CHARS = 256

# Identifiers become metric attributes: a short ASCII alphabet (Kubernetes names, Slurm ids,
# "team/run:7") and a length cap, so one message cannot carry quotes, markup or 10 kB of text.
_JOB_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+/-]{0,127}", re.ASCII)
_CUSTOMER_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+/-]{0,63}", re.ASCII)
_REASON_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}", re.ASCII)

_IDENTITY_FIELDS = frozenset({"v", "type", "job", "customer", "rank", "world_size"})
_REQUIRED: Mapping[str, frozenset[str]] = {
    "step": frozenset({"step", "start_ns", "end_ns"}),
    "start": frozenset({"time_ns"}),
    "end": frozenset({"time_ns", "reason"}),
}
_OPTIONAL: Mapping[str, frozenset[str]] = {
    "step": frozenset({"tokens", "samples", "phases"}),
    "start": frozenset(),
    "end": frozenset({"detail"}),
}
_PHASE_KEYS = {f"{p}_s": p for p in PHASES}


class DropReason(enum.StrEnum):
    """Why a message was dropped: the ``reason`` attribute of ``ridethrough.job.messages.dropped``."""

    OVERSIZED = "oversized"
    NOT_JSON = "not_json"
    NOT_OBJECT = "not_object"
    BAD_VERSION = "bad_version"
    UNKNOWN_TYPE = "unknown_type"
    UNKNOWN_FIELD = "unknown_field"
    MISSING_FIELD = "missing_field"
    WRONG_TYPE = "wrong_type"
    NOT_FINITE = "not_finite"
    OUT_OF_RANGE = "out_of_range"
    BAD_STRING = "bad_string"
    TOO_MANY_SERIES = "too_many_series"
    INTERNAL = "internal"
    """The agent failed handling a message that passed validation (a bug; logged)."""


class ProtocolError(ValueError):
    """A message is malformed: ``reason`` says which way, the text says where."""

    def __init__(self, reason: DropReason, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Identity:
    """Who sent a message: one rank of one job of one customer."""

    job: str
    customer: str
    rank: int
    world_size: int


@dataclass(frozen=True, slots=True)
class StepReport:
    """A training step finished on one rank."""

    who: Identity
    step: int
    start_ns: int
    end_ns: int
    tokens: int | None = None
    samples: int | None = None
    phases_s: Mapping[str, float] = field(default_factory=dict)
    """Seconds per phase name (a subset of `PHASES`)."""

    @property
    def duration_s(self) -> float:
        """Wall time of the step, in seconds."""
        return (self.end_ns - self.start_ns) / 1e9


@dataclass(frozen=True, slots=True)
class Lifecycle:
    """A rank started or ended (``reason`` says why it ended: ``completed``, ``failed``, ...)."""

    who: Identity
    kind: Literal["start", "end"]
    time_ns: int
    reason: str = ""
    detail: str = ""


Message = StepReport | Lifecycle


def _reject_constant(name: str) -> Any:
    # json accepts NaN and Infinity by default; they are not JSON and not a number a counter can add
    raise ProtocolError(DropReason.NOT_FINITE, f"{name} is not a finite number")


def decode(data: bytes) -> Message:
    """Parse and check one datagram.

    Raises:
        ProtocolError: with the `DropReason` for the counter.
    """
    if len(data) > MAX_DATAGRAM_BYTES:
        raise ProtocolError(DropReason.OVERSIZED, f"{len(data)} bytes > {MAX_DATAGRAM_BYTES}")
    try:
        obj = json.loads(data.decode("utf-8"), parse_constant=_reject_constant)
    except ProtocolError:
        raise
    except (ValueError, RecursionError) as exc:  # bad UTF-8, bad JSON, nesting too deep, huge int
        raise ProtocolError(DropReason.NOT_JSON, str(exc)[:200]) from None
    return validate(obj)


def validate(obj: object) -> Message:
    """Check a decoded message and build its typed form.

    Raises:
        ProtocolError: with the `DropReason` for the counter.
    """
    if not isinstance(obj, dict):
        raise ProtocolError(DropReason.NOT_OBJECT, f"expected a JSON object, got {type(obj).__name__}")
    version = obj.get("v")
    if type(version) is not int or version != VERSION:  # `is int`: True == 1 and 1.0 == 1 are not versions
        raise ProtocolError(DropReason.BAD_VERSION, f"v must be {VERSION}, got {version!r:.40}")
    kind = obj.get("type")
    if not isinstance(kind, str) or kind not in _REQUIRED:
        raise ProtocolError(DropReason.UNKNOWN_TYPE, f"type must be one of {sorted(_REQUIRED)}, got {kind!r:.40}")
    required = _IDENTITY_FIELDS | _REQUIRED[kind]
    if unknown := obj.keys() - required - _OPTIONAL[kind]:
        raise ProtocolError(DropReason.UNKNOWN_FIELD, f"unknown field(s) {sorted(unknown)!r:.100}")
    if missing := required - obj.keys():
        raise ProtocolError(DropReason.MISSING_FIELD, f"missing field(s) {sorted(missing)}")
    who = _identity(obj)
    if kind == "step":
        return _step(obj, who)
    time_ns = _int(obj, "time_ns", 1, _MAX_INT)
    if kind == "start":
        return Lifecycle(who, "start", time_ns)
    detail = _text(obj, "detail") if "detail" in obj else ""
    return Lifecycle(who, "end", time_ns, _token(obj, "reason", _REASON_RE), detail)


def _identity(obj: Mapping[str, Any]) -> Identity:
    world_size = _int(obj, "world_size", 1, MAX_WORLD_SIZE)
    rank = _int(obj, "rank", 0, _MAX_INT)
    if rank >= world_size:
        raise ProtocolError(DropReason.OUT_OF_RANGE, f"rank {rank} is not below world_size {world_size}")
    return Identity(_token(obj, "job", _JOB_RE), _token(obj, "customer", _CUSTOMER_RE), rank, world_size)


def _step(obj: Mapping[str, Any], who: Identity) -> StepReport:
    start_ns = _int(obj, "start_ns", 1, _MAX_INT)
    end_ns = _int(obj, "end_ns", 1, _MAX_INT)
    if end_ns < start_ns:
        raise ProtocolError(DropReason.OUT_OF_RANGE, f"end_ns {end_ns} is before start_ns {start_ns}")
    tokens = _int(obj, "tokens", 0, _MAX_INT) if "tokens" in obj else None
    samples = _int(obj, "samples", 0, _MAX_INT) if "samples" in obj else None
    return StepReport(who, _int(obj, "step", 0, _MAX_INT), start_ns, end_ns, tokens, samples,
                      _phases(obj.get("phases", {})))


def _phases(raw: object) -> dict[str, float]:
    if not isinstance(raw, dict):
        raise ProtocolError(DropReason.WRONG_TYPE, f"phases must be an object, got {type(raw).__name__}")
    if unknown := raw.keys() - _PHASE_KEYS.keys():
        raise ProtocolError(DropReason.UNKNOWN_FIELD, f"unknown phase(s) {sorted(unknown)!r:.100}")
    return {_PHASE_KEYS[key]: _seconds(raw, key) for key in raw}


def _int(obj: Mapping[str, Any], key: str, low: int, high: int) -> int:
    value = obj[key]
    if type(value) is not int:  # bool is an int subclass; 1.0 is not a count
        raise ProtocolError(DropReason.WRONG_TYPE, f"{key} must be an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise ProtocolError(DropReason.OUT_OF_RANGE, f"{key} must be in [{low}, {high}], got {str(value)[:40]}")
    return value


def _seconds(obj: Mapping[str, Any], key: str) -> float:
    value = obj[key]
    if type(value) not in (int, float):
        raise ProtocolError(DropReason.WRONG_TYPE, f"{key} must be a number, got {type(value).__name__}")
    try:
        seconds = float(value)
    except OverflowError:  # an int beyond float's range (JSON has no size limit on integers)
        raise ProtocolError(DropReason.OUT_OF_RANGE, f"{key} is too large") from None
    if not math.isfinite(seconds):
        raise ProtocolError(DropReason.NOT_FINITE, f"{key} is not finite")
    if not 0.0 <= seconds <= _MAX_PHASE_S:
        raise ProtocolError(DropReason.OUT_OF_RANGE, f"{key} must be in [0, {_MAX_PHASE_S:g}], got {seconds:g}")
    return seconds


def _token(obj: Mapping[str, Any], key: str, pattern: re.Pattern[str]) -> str:
    value = obj[key]
    if not isinstance(value, str):
        raise ProtocolError(DropReason.WRONG_TYPE, f"{key} must be a string, got {type(value).__name__}")
    if pattern.fullmatch(value) is None:
        raise ProtocolError(DropReason.BAD_STRING, f"{key} must match {pattern.pattern}, got {value!r:.60}")
    return value


def _text(obj: Mapping[str, Any], key: str) -> str:
    value = obj[key]
    if not isinstance(value, str):
        raise ProtocolError(DropReason.WRONG_TYPE, f"{key} must be a string, got {type(value).__name__}")
    if len(value) > _MAX_DETAIL_CHARS or not value.isprintable():
        raise ProtocolError(DropReason.BAD_STRING, f"{key} must be at most {_MAX_DETAIL_CHARS} printable characters")
    return value


def encode(fields: Mapping[str, object]) -> bytes:
    """The datagram for one message, checked first (the client uses this).

    Raises:
        ProtocolError: the message would be dropped by the agent.
    """
    validate(dict(fields))
    data = json.dumps(fields, separators=(",", ":"), allow_nan=False).encode("utf-8")
    if len(data) > MAX_DATAGRAM_BYTES:
        raise ProtocolError(DropReason.OVERSIZED, f"{len(data)} bytes > {MAX_DATAGRAM_BYTES}")
    return data
