"""Parameters of fault kinds: their types, ranges, and how a YAML (or ``--param``) value is read.

`ridethrough.lab.faults` lists which kind takes which; `GPU_PARAMS` lists the extra ones of
each scripted GPU fault.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ridethrough.lab.control import GpuFault
from ridethrough.suggest import did_you_mean

if TYPE_CHECKING:
    from ridethrough.lab.faults import Names

ParamValue = float | int | str | None


class ParamType(enum.Enum):
    """How a parameter's YAML value is read."""

    FLOAT = "number"
    INT = "integer"
    DURATION = "duration"
    """Seconds: a number, or a string like ``500ms``, ``5s``, ``2m``, ``1h``."""
    CHOICE = "choice"
    END = "end"
    """A node at one end of the target link."""
    NIC = "nic"
    """One of the host's NICs."""
    GPU = "gpu"
    """A GPU index below the topology's ``gpus``."""


@dataclass(frozen=True, slots=True)
class Param:
    """One parameter of a fault kind; ``default`` None and not ``required`` means optional."""

    name: str
    type: ParamType
    default: ParamValue = None
    required: bool = False
    lo: float | None = None
    hi: float | None = None
    open_lo: bool = False
    open_hi: bool = False
    choices: tuple[str, ...] = ()


_DURATION = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h)?\s*")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
_DURATION_LIKE = "a duration like '500ms', '5s', '2m' or seconds"


def parse_duration(raw: object) -> float:
    """Seconds from ``500ms``, ``5s``, ``2m``, ``1h`` or a number of seconds; ValueError otherwise."""
    if isinstance(raw, bool) or not isinstance(raw, int | float | str):
        raise ValueError(f"expected {_DURATION_LIKE}, got {raw!r}")
    if isinstance(raw, int | float):
        if raw < 0 or raw != raw or raw == float("inf"):
            raise ValueError(f"expected a duration of zero or more seconds, got {raw!r}")
        return float(raw)
    match = _DURATION.fullmatch(raw)
    if not match:
        raise ValueError(f"expected {_DURATION_LIKE}, got {raw!r}")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


def coerce(param: Param, raw: object, *, names: Names, target: str = "") -> ParamValue:
    """The typed value of ``raw`` for ``param`` on ``target``; ValueError says what is wrong."""
    if param.type in (ParamType.END, ParamType.NIC, ParamType.CHOICE):
        return _choice(param, raw, names=names, target=target)
    value: float | int
    if param.type is ParamType.DURATION:
        value = parse_duration(raw)
    elif param.type in (ParamType.INT, ParamType.GPU):
        value = _integer(param, raw, gpus=names.gpus)
    else:
        if isinstance(raw, bool) or not isinstance(raw, int | float) or raw != raw:
            raise ValueError(f"expected a number, got {raw!r}")
        value = float(raw)
    check_range(param, value)
    return value


def _choice(param: Param, raw: object, *, names: Names, target: str) -> str:
    options = {ParamType.END: tuple(target.split("-", 1)), ParamType.NIC: names.nics}.get(param.type, param.choices)
    if not isinstance(raw, str) or raw not in options:
        raise ValueError(f"expected one of {', '.join(options)}, got {raw!r}{did_you_mean(str(raw), options)}")
    return raw


def _integer(param: Param, raw: object, *, gpus: int) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise ValueError(f"expected an integer, got {raw!r}")
    if param.type is ParamType.GPU and not 0 <= raw < gpus:
        raise ValueError(f"no GPU {raw} (GPUs are 0..{gpus - 1})")
    return raw


def check_range(param: Param, value: float) -> None:
    """ValueError if ``value`` is outside ``param``'s bounds, naming them."""
    low_bad = param.lo is not None and (value <= param.lo if param.open_lo else value < param.lo)
    high_bad = param.hi is not None and (value >= param.hi if param.open_hi else value > param.hi)
    if low_bad or high_bad:
        lo = "" if param.lo is None else f"{'>' if param.open_lo else '>='} {param.lo:g}"
        hi = "" if param.hi is None else f"{'<' if param.open_hi else '<='} {param.hi:g}"
        raise ValueError(f"{value:g} is out of range (must be {' and '.join(p for p in (lo, hi) if p)})")


_P = ParamType
RATE_MBIT = Param("rate_mbit", _P.FLOAT, 100.0, lo=0, hi=1_000_000, open_lo=True)
"""A shaped rate (degrade, congest)."""
LOSS_PERCENT = Param("percent", _P.FLOAT, 5.0, lo=0, hi=100, open_lo=True)
"""The share of a link's packets a lossy end drops (loss), in per cent."""
_PER_S = Param("rate_per_s", _P.FLOAT, 1.0, lo=0, hi=1e9, open_lo=True)
GPU_PARAMS: Mapping[GpuFault, tuple[Param, ...]] = {
    GpuFault.ECC_SBE_RISING: (_PER_S,),
    GpuFault.ROW_REMAP_PENDING: (Param("rows", _P.INT, 1, lo=0, hi=10_000),
                                 Param("rate_per_s", _P.FLOAT, 0.0, lo=0, hi=1e9)),
    GpuFault.ECC_DBE: (Param("count", _P.INT, 1, lo=1, hi=1_000_000),),
    GpuFault.XID: (Param("code", _P.INT, required=True, lo=1, hi=1023),),
    GpuFault.THERMAL: (Param("deg_per_s", _P.FLOAT, 1.0, lo=0, hi=100, open_lo=True),
                       Param("cap_c", _P.FLOAT, 95.0, lo=30, hi=150)),
    GpuFault.PCIE_REPLAY_STORM: (_PER_S,),
    GpuFault.NVLINK_CRC: (_PER_S, Param("link", _P.INT, 0, lo=0, hi=17)),
    GpuFault.FALLEN_OFF_BUS: (),
}
"""Parameters each GPU fault takes besides ``fault`` and ``gpu``."""
