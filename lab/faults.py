"""The fault catalogue: every fault kind a scenario (or ``ridethrough lab inject``) can use.

For each kind, listed once in `KINDS`: what it targets (a link or a host), its parameters
(type, default, range), the `LabControl` call that starts it and the inverse call that
undoes it (``None`` for the instant recovery kinds), the resources it occupies (for the
overlap check), and the ground truth it implies by default (entity, truth kind, precursor
and hard-failure times relative to its start).

=============  ======  ==========================================  =========================================
kind           target  params (default)                            start / undo, truth
=============  ======  ==========================================  =========================================
link-down      link    end (both ends)                             set_link(up=False) / set_link(up=True);
                                                                   failure at start
link-up        link    end                                         set_link(up=True); recovery, ends an
                                                                   open link-down
flap           link    period_s (2), count (5), end                ``count`` pulses: down at each period
                                                                   start, up half a period later; failure;
                                                                   no ``for`` (it ends by itself)
degrade        link    rate_mbit (100), burst_kbit (32),           degrade_link / restore_link; degradation
                       latency_ms (20), direction (both)
restore        link    -                                           restore_link; recovery, ends open
                                                                   link-down/degrade/mtu/congest
mtu            link    end (required), mtu (required, 68-65535)    set_mtu / restore_link; degradation
congest        link    direction (forward), rate_mbit (100),       degrade_link one way + start_load /
                       load_mbit (2 x rate_mbit)                   stop_load + restore_link; degradation
clock-step     host    step_ms (required)                          step_clock / step_clock(-step) (only
                                                                   with ``for``); entity clock
gpu            host    gpu_fault (required, a GpuFault value),     gpu_fault / clear_gpu; precursor or
                       gpu (required), and per gpu_fault:          failure by gpu_fault (`GPU_TRUTH`)
                       `GPU_PARAMS` (rate_per_s, rows, count,
                       code, deg_per_s, cap_c, link)
nic-ramp       host    nic (nic0), counter (symbol_error),         nic_error_ramp / clear_nic (+ link up);
                       rate_per_s (10), link_down_after_s          precursor, failure after link_down_after_s
freeze         host    -                                           freeze_host / thaw_host; failure
thaw           host    -                                           thaw_host; recovery, ends an open freeze
straggle       host    cpu_fraction (0.25, in (0, 1))              straggle / unstraggle; degradation
unstraggle     host    -                                           unstraggle; recovery, ends open straggle
=============  ======  ==========================================  =========================================
"""

from __future__ import annotations

import difflib
import enum
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ridethrough.lab.control import Direction, GpuFault, LabControl, LabError
from ridethrough.lab.fake_ib import HW_COUNTERS, IB_COUNTERS

ParamValue = float | int | str | None


# -- topology names ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Names:
    """Every name a lab of given sizes has, following `ridethrough.lab.control`'s naming."""

    hosts: tuple[str, ...]
    leaves: tuple[str, ...]
    spines: tuple[str, ...]
    links: tuple[str, ...]
    nics: tuple[str, ...]
    """NIC names of one host (every host has the same): ``nic0`` … ``nic{rails-1}``."""
    gpus: int = 0
    hosts_per_rack: int = 1

    def nic_link(self, host: str, nic: str) -> str:
        """The link a host's NIC is cabled to: NIC ``r`` goes to its rack's leaf of rail ``r``."""
        rack = self.hosts.index(host) // self.hosts_per_rack
        return f"{host}-leaf{rack}r{nic.removeprefix('nic')}"

    def entity_type(self, entity: str) -> EntityType | None:
        """What an entity name names (a clock is named by its host), or None if nothing."""
        host, _, part = entity.partition("/")
        if not part:
            if entity in self.hosts:
                return EntityType.HOST
            if entity in self.links:
                return EntityType.LINK
            return EntityType.SWITCH if entity in self.leaves or entity in self.spines else None
        if host not in self.hosts:
            return None
        if part in self.nics:
            return EntityType.NIC
        gpu = re.fullmatch(r"gpu(\d+)", part)
        return EntityType.GPU if gpu and int(gpu.group(1)) < self.gpus else None


def names(hosts: int, racks: int, rails: int, spines: int, gpus: int = 8) -> Names:
    """The names of a rail-optimised leaf-spine lab: every leaf is cabled to every spine.

    Raises ValueError for sizes that do not make a lab (hosts not divisible by racks, ...).
    """
    if min(hosts, racks, rails, spines) < 1 or gpus < 0:
        raise ValueError("hosts, racks, rails and spines must be at least 1 (gpus at least 0)")
    if hosts % racks:
        raise ValueError(f"{hosts} hosts do not split evenly into {racks} racks")
    per_rack = hosts // racks
    host_names = tuple(f"h{i}" for i in range(hosts))
    leaves = tuple(f"leaf{k}r{r}" for k in range(racks) for r in range(rails))
    spine_names = tuple(f"spine{s}" for s in range(spines))
    links = [f"h{i}-leaf{i // per_rack}r{r}" for i in range(hosts) for r in range(rails)]
    links += [f"{leaf}-{spine}" for leaf in leaves for spine in spine_names]
    return Names(host_names, leaves, spine_names, tuple(links), tuple(f"nic{r}" for r in range(rails)),
                 gpus, per_rack)


# -- parameters ----------------------------------------------------------------------------


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


def parse_duration(raw: object) -> float:
    """Seconds from ``500ms``, ``5s``, ``2m``, ``1h`` or a number of seconds; ValueError otherwise."""
    if isinstance(raw, bool) or not isinstance(raw, int | float | str):
        raise ValueError(f"expected a duration like '500ms', '5s', '2m' or seconds, got {raw!r}")
    if isinstance(raw, int | float):
        if raw < 0 or raw != raw or raw == float("inf"):
            raise ValueError(f"expected a duration of zero or more seconds, got {raw!r}")
        return float(raw)
    match = _DURATION.fullmatch(raw)
    if not match:
        raise ValueError(f"expected a duration like '500ms', '5s', '2m' or seconds, got {raw!r}")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


def coerce(param: Param, raw: object, *, names: Names, target: str = "") -> ParamValue:
    """The typed value of ``raw`` for ``param`` on ``target``; ValueError says what is wrong."""
    if param.type in (ParamType.END, ParamType.NIC, ParamType.CHOICE):
        options = {ParamType.END: tuple(target.split("-", 1)), ParamType.NIC: names.nics}.get(param.type, param.choices)
        if not isinstance(raw, str) or raw not in options:
            near = difflib.get_close_matches(str(raw), options, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ValueError(f"expected one of {', '.join(options)}, got {raw!r}{hint}")
        return raw
    value: float | int
    if param.type is ParamType.DURATION:
        value = parse_duration(raw)
    elif param.type in (ParamType.INT, ParamType.GPU):
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise ValueError(f"expected an integer, got {raw!r}")
        if param.type is ParamType.GPU and not 0 <= raw < names.gpus:
            raise ValueError(f"no GPU {raw} (GPUs are 0..{names.gpus - 1})")
        value = raw
    else:
        if isinstance(raw, bool) or not isinstance(raw, int | float) or raw != raw:
            raise ValueError(f"expected a number, got {raw!r}")
        value = float(raw)
    _check_range(param, value)
    return value


def _check_range(param: Param, value: float) -> None:
    low_bad = param.lo is not None and (value <= param.lo if param.open_lo else value < param.lo)
    high_bad = param.hi is not None and (value >= param.hi if param.open_hi else value > param.hi)
    if low_bad or high_bad:
        lo = "" if param.lo is None else f"{'>' if param.open_lo else '>='} {param.lo:g}"
        hi = "" if param.hi is None else f"{'<' if param.open_hi else '<='} {param.hi:g}"
        raise ValueError(f"{value:g} is out of range (must be {' and '.join(p for p in (lo, hi) if p)})")


# -- truth ---------------------------------------------------------------------------------


class EntityType(enum.StrEnum):
    """What a truth entity is."""

    LINK = "link"
    NIC = "nic"
    GPU = "gpu"
    HOST = "host"
    CLOCK = "clock"
    SWITCH = "switch"


class Effect(enum.StrEnum):
    """What a fault does to its entity, as a detector should see it."""

    FAILURE = "failure"
    """A hard failure (``failure_at``), possibly announced by a precursor."""
    PRECURSOR = "precursor"
    """Warning signs only (``precursor_at``); no hard failure in this run."""
    DEGRADATION = "degradation"
    """Slower or noisier, not failed (congestion, a straggler, a clock step)."""
    RECOVERY = "recovery"
    """An explicit repair (link-up, restore, thaw, unstraggle)."""


@dataclass(frozen=True, slots=True)
class Truth:
    """The ground truth of one fault; times are seconds on the scenario clock (like ``at``)."""

    entity: str
    entity_type: EntityType
    kind: str
    precursor_at_s: float | None = None
    failure_at_s: float | None = None
    base: Effect = Effect.DEGRADATION
    """The effect when neither a precursor nor a failure is set."""

    @property
    def effect(self) -> Effect:
        """Failure if a failure time is set, else precursor if a precursor time is, else ``base``."""
        if self.failure_at_s is not None:
            return Effect.FAILURE
        return Effect.PRECURSOR if self.precursor_at_s is not None else self.base


@dataclass(frozen=True, slots=True)
class Call:
    """One fault as the catalogue's functions see it."""

    target: str
    params: Mapping[str, ParamValue]
    names: Names
    at_s: float = 0.0


GPU_TRUTH: Mapping[GpuFault, tuple[str, Effect]] = {
    GpuFault.ECC_SBE_RISING: ("gpu_ecc_sbe", Effect.PRECURSOR),
    GpuFault.ROW_REMAP_PENDING: ("gpu_row_remap", Effect.PRECURSOR),
    GpuFault.ECC_DBE: ("gpu_ecc_dbe", Effect.FAILURE),
    GpuFault.XID: ("gpu_xid", Effect.FAILURE),
    GpuFault.THERMAL: ("gpu_thermal", Effect.PRECURSOR),
    GpuFault.PCIE_REPLAY_STORM: ("gpu_pcie_replay", Effect.PRECURSOR),
    GpuFault.NVLINK_CRC: ("gpu_nvlink_crc", Effect.PRECURSOR),
    GpuFault.FALLEN_OFF_BUS: ("gpu_lost", Effect.FAILURE),
}
"""The truth kind and effect of each scripted GPU fault."""
XID_PRECURSORS = frozenset({63, 92})
"""XIDs that warn rather than fail: 63 (row remapping event), 92 (high single-bit ECC rate)."""


def _truth(entity_type: EntityType, kind: str, effect: Effect) -> Callable[[Call], Truth]:
    def make(call: Call) -> Truth:
        entity = call.target
        if entity_type is EntityType.GPU:
            entity = f"{call.target}/gpu{call.params['gpu']}"
        at = call.at_s
        return Truth(entity, entity_type, kind, at if effect is Effect.PRECURSOR else None,
                     at if effect is Effect.FAILURE else None,
                     Effect.RECOVERY if effect is Effect.RECOVERY else Effect.DEGRADATION)
    return make


def _gpu_truth(call: Call) -> Truth:
    kind, effect = GPU_TRUTH[GpuFault(call.params["gpu_fault"])]
    if kind == "gpu_xid" and call.params.get("code") in XID_PRECURSORS:
        effect = Effect.PRECURSOR
    return _truth(EntityType.GPU, kind, effect)(call)


def _nic_truth(call: Call) -> Truth:
    link = call.names.nic_link(call.target, str(call.params["nic"]))
    after = call.params.get("link_down_after_s")
    failure = None if after is None else call.at_s + float(after)
    return Truth(link, EntityType.LINK, "link_errors", call.at_s, failure)


# -- start and undo calls ------------------------------------------------------------------

Start = Callable[[LabControl, Call], str | None]
"""Applies a fault; returns a handle its undo needs (a load handle), or None."""
Undo = Callable[[LabControl, Call, str | None], None]


def _opt_str(value: ParamValue) -> str | None:
    return None if value is None else str(value)


def _num(call: Call, name: str) -> float:
    value = call.params[name]
    assert isinstance(value, int | float), f"{name} was validated as a number"
    return float(value)


def _link_down(lab: LabControl, c: Call) -> None:
    lab.set_link(c.target, up=False, end=_opt_str(c.params.get("end")))


def _link_up(lab: LabControl, c: Call, _handle: str | None = None) -> None:
    lab.set_link(c.target, up=True, end=_opt_str(c.params.get("end")))


def _degrade(lab: LabControl, c: Call) -> None:
    lab.degrade_link(c.target, rate_mbit=_num(c, "rate_mbit"), burst_kbit=_num(c, "burst_kbit"),
                     latency_ms=_num(c, "latency_ms"), direction=Direction(c.params["direction"]))


def _restore(lab: LabControl, c: Call, _handle: str | None = None) -> None:
    lab.restore_link(c.target)


def _congest(lab: LabControl, c: Call) -> str:
    direction = Direction(c.params["direction"])
    rate = _num(c, "rate_mbit")
    load = c.params.get("load_mbit")
    lab.degrade_link(c.target, rate_mbit=rate, direction=direction)
    try:
        return lab.start_load(c.target, direction=direction, rate_mbit=2 * rate if load is None else float(load))
    except LabError:
        lab.restore_link(c.target)  # nothing half applied
        raise


def _uncongest(lab: LabControl, c: Call, handle: str | None) -> None:
    try:
        if handle is not None:
            lab.stop_load(handle)
    finally:
        lab.restore_link(c.target)


def _step_clock(lab: LabControl, c: Call) -> None:
    lab.step_clock(c.target, step_ns=round(_num(c, "step_ms") * 1_000_000))


def _step_back(lab: LabControl, c: Call, _handle: str | None) -> None:
    lab.step_clock(c.target, step_ns=-round(_num(c, "step_ms") * 1_000_000))


def _gpu(lab: LabControl, c: Call) -> None:
    fault = GpuFault(c.params["gpu_fault"])
    extra = {p.name: _num(c, p.name) for p in GPU_PARAMS[fault] if c.params.get(p.name) is not None}
    lab.gpu_fault(c.target, int(_num(c, "gpu")), fault, extra)


def _nic_ramp(lab: LabControl, c: Call) -> None:
    after = c.params.get("link_down_after_s")
    lab.nic_error_ramp(c.target, str(c.params["nic"]), counter=str(c.params["counter"]),
                       rate_per_s=_num(c, "rate_per_s"), link_down_after_s=None if after is None else float(after))


def _nic_clear(lab: LabControl, c: Call, _handle: str | None) -> None:
    lab.clear_nic(c.target, str(c.params["nic"]))
    if c.params.get("link_down_after_s") is not None:  # the ramp may have taken the link down
        lab.set_link(c.names.nic_link(c.target, str(c.params["nic"])), up=True, end=c.target)


def _freeze(lab: LabControl, c: Call) -> None:
    lab.freeze_host(c.target)


def _thaw(lab: LabControl, c: Call, _handle: str | None = None) -> None:
    lab.thaw_host(c.target)


def _unstraggle(lab: LabControl, c: Call, _handle: str | None = None) -> None:
    lab.unstraggle(c.target)


def _clear_gpu(lab: LabControl, c: Call, _handle: str | None) -> None:
    lab.clear_gpu(c.target, int(_num(c, "gpu")))


def _set_mtu(lab: LabControl, c: Call) -> None:
    lab.set_mtu(c.target, end=str(c.params["end"]), mtu=int(_num(c, "mtu")))


def _straggle(lab: LabControl, c: Call) -> None:
    lab.straggle(c.target, cpu_fraction=_num(c, "cpu_fraction"))


# -- the catalogue -------------------------------------------------------------------------


class Target(enum.Enum):
    """What a fault's ``target`` names."""

    LINK = "link"
    HOST = "host"


@dataclass(frozen=True, slots=True)
class FaultKind:
    """One kind of fault: its parameters, its calls, what it occupies and the truth it implies."""

    name: str
    target: Target
    params: tuple[Param, ...]
    start: Start
    undo: Undo | None
    """The inverse call; None for instant recovery kinds (they take no ``for``)."""
    truth: Callable[[Call], Truth]
    slot: str
    """Resource class for the overlap check: two faults on one slot must not overlap."""
    lasting: bool = True
    """Without ``for``, stays until the run ends (False: an instant step, never undone)."""
    pulsed: bool = False
    """Starts and undoes itself ``count`` times, every ``period_s`` (a flap); takes no ``for``."""
    stack_param: str = ""
    """Open-ended faults of this kind on one slot may overlap when this parameter differs."""
    clears: frozenset[str] = frozenset()
    """Kinds whose open-ended faults on the same slot this recovery kind ends."""
    variant_param: str = ""
    """The parameter whose value chooses extra parameters from ``variants``."""
    variants: Mapping[str, tuple[Param, ...]] = field(default_factory=dict)

    def params_for(self, values: Mapping[str, object]) -> tuple[Param, ...]:
        """The parameters that apply, given the (raw) values of the base ones."""
        extra = self.variants.get(str(values.get(self.variant_param)), ()) if self.variant_param else ()
        return self.params + extra

    def slots(self, call: Call) -> tuple[str, ...]:
        """The resources this fault occupies, e.g. ``link:h3-leaf0r0``, ``gpu:h2/gpu3``."""
        if self.slot == "gpu":
            return (f"gpu:{call.target}/gpu{call.params['gpu']}",)
        if self.slot == "nic":
            own = f"nic:{call.target}/{call.params['nic']}"
            if call.params.get("link_down_after_s") is None:
                return (own,)
            return (own, f"link:{call.names.nic_link(call.target, str(call.params['nic']))}")
        return (f"{self.slot}:{call.target}",)

    def windows(self, call: Call, for_s: float | None) -> tuple[tuple[float, float | None], ...]:
        """When the fault is on, as (start, end) on the scenario clock; end None: until stopped."""
        if self.pulsed:
            period, count = _num(call, "period_s"), int(_num(call, "count"))
            return tuple((call.at_s + i * period, call.at_s + (i + 0.5) * period) for i in range(count))
        return ((call.at_s, None if for_s is None else call.at_s + for_s),)


_P = ParamType
_END = Param("end", _P.END)
_RATE = Param("rate_mbit", _P.FLOAT, 100.0, lo=0, hi=1_000_000, open_lo=True)
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
IB_ERROR_COUNTERS = (*IB_COUNTERS, *HW_COUNTERS)
"""IB counters (``counters/`` and ``hw_counters/``) a NIC ramp can drive."""
_LINK, _HOST = Target.LINK, Target.HOST
_LINK_FAULTS = frozenset({"link-down", "flap", "degrade", "mtu", "congest"})
_DIRS = tuple(d.value for d in Direction)

KINDS: Mapping[str, FaultKind] = {k.name: k for k in (
    FaultKind("link-down", _LINK, (_END,), _link_down, _link_up,
              _truth(EntityType.LINK, "link_down", Effect.FAILURE), "link"),
    FaultKind("link-up", _LINK, (_END,), _link_up, None,
              _truth(EntityType.LINK, "link_up", Effect.RECOVERY), "link", clears=frozenset({"link-down", "flap"})),
    FaultKind("flap", _LINK, (Param("period_s", _P.DURATION, 2.0, lo=0.01), Param("count", _P.INT, 5, lo=1, hi=10_000),
                              _END),
              _link_down, _link_up, _truth(EntityType.LINK, "link_flap", Effect.FAILURE), "link", pulsed=True),
    FaultKind("degrade", _LINK, (_RATE, Param("burst_kbit", _P.FLOAT, 32.0, lo=0, hi=1e6, open_lo=True),
                                 Param("latency_ms", _P.FLOAT, 20.0, lo=0, hi=1e5, open_lo=True),
                                 Param("direction", _P.CHOICE, "both", choices=_DIRS)),
              _degrade, _restore, _truth(EntityType.LINK, "link_degraded", Effect.DEGRADATION), "link"),
    FaultKind("restore", _LINK, (), _restore, None,
              _truth(EntityType.LINK, "link_restored", Effect.RECOVERY), "link", clears=_LINK_FAULTS),
    FaultKind("mtu", _LINK, (Param("end", _P.END, required=True), Param("mtu", _P.INT, required=True, lo=68, hi=65535)),
              _set_mtu, _restore,
              _truth(EntityType.LINK, "mtu_mismatch", Effect.DEGRADATION), "link"),
    FaultKind("congest", _LINK, (Param("direction", _P.CHOICE, "forward", choices=("forward", "reverse")), _RATE,
                                 Param("load_mbit", _P.FLOAT, lo=0, hi=1_000_000, open_lo=True)),
              _congest, _uncongest, _truth(EntityType.LINK, "link_congested", Effect.DEGRADATION), "link"),
    FaultKind("clock-step", _HOST, (Param("step_ms", _P.FLOAT, required=True, lo=-1e7, hi=1e7),),
              _step_clock, _step_back,
              _truth(EntityType.CLOCK, "clock_step", Effect.DEGRADATION), "clock", lasting=False),
    FaultKind("gpu", _HOST, (Param("gpu_fault", _P.CHOICE, required=True, choices=tuple(f.value for f in GpuFault)),
                             Param("gpu", _P.GPU, required=True)),
              _gpu, _clear_gpu, _gpu_truth, "gpu",
              stack_param="gpu_fault", variant_param="gpu_fault",
              variants={f.value: ps for f, ps in GPU_PARAMS.items()}),
    FaultKind("nic-ramp", _HOST, (Param("nic", _P.NIC, "nic0"),
                                  Param("counter", _P.CHOICE, "symbol_error", choices=IB_ERROR_COUNTERS),
                                  Param("rate_per_s", _P.FLOAT, 10.0, lo=0, hi=1e9, open_lo=True),
                                  Param("link_down_after_s", _P.DURATION, lo=0, open_lo=True)),
              _nic_ramp, _nic_clear, _nic_truth, "nic", stack_param="counter"),
    FaultKind("freeze", _HOST, (), _freeze, _thaw,
              _truth(EntityType.HOST, "host_frozen", Effect.FAILURE), "freeze"),
    FaultKind("thaw", _HOST, (), _thaw, None,
              _truth(EntityType.HOST, "host_thawed", Effect.RECOVERY), "freeze", clears=frozenset({"freeze"})),
    FaultKind("straggle", _HOST, (Param("cpu_fraction", _P.FLOAT, 0.25, lo=0, hi=1, open_lo=True, open_hi=True),),
              _straggle, _unstraggle, _truth(EntityType.HOST, "straggler", Effect.DEGRADATION),
              "cpu"),
    FaultKind("unstraggle", _HOST, (), _unstraggle, None,
              _truth(EntityType.HOST, "straggler_cleared", Effect.RECOVERY), "cpu", clears=frozenset({"straggle"})),
)}
"""Every fault kind, by the name scenarios and ``ridethrough lab inject`` use."""
