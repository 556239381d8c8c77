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
loss           link    percent (5, in (0, 100]), direction (both)  lose_packets / restore_link; random
                                                                   drops whatever the load (a bad optic);
                                                                   degradation
restore        link    -                                           restore_link; recovery, ends open
                                                                   link-down/degrade/loss/mtu/congest
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

import enum
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ridethrough.lab import fault_actions as act
from ridethrough.lab.control import Direction, GpuFault
from ridethrough.lab.fake_ib import HW_COUNTERS, IB_COUNTERS
from ridethrough.lab.fault_actions import Start, Undo, num
from ridethrough.lab.fault_params import (
    GPU_PARAMS,
    LOSS_PERCENT,
    RATE_MBIT,
    Param,
    ParamType,
    ParamValue,
    coerce,
    parse_duration,
)
from ridethrough.lab.topology import Topology, TopologySpec

__all__ = [
    "GPU_PARAMS", "GPU_TRUTH", "IB_ERROR_COUNTERS", "KINDS", "XID_PRECURSORS", "Call", "Effect", "EntityType",
    "FaultKind", "Names", "Param", "ParamType", "ParamValue", "Start", "Target", "Truth", "Undo", "coerce", "names",
    "parse_duration",
]


# -- topology names ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Names:
    """The names of a lab's `Topology`, as the catalogue checks targets and entities against them."""

    hosts: tuple[str, ...]
    leaves: tuple[str, ...]
    spines: tuple[str, ...]
    links: tuple[str, ...]
    nics: tuple[str, ...]
    """NIC names of one host (every host has the same): ``nic0`` … ``nic{rails-1}``."""
    gpus: int
    topology: Topology = field(compare=False, repr=False)

    @classmethod
    def of(cls, topology: Topology) -> Names:
        """The names of ``topology``'s hosts, switches, links and NICs."""
        spec = topology.spec
        return cls(tuple(topology.hosts), tuple(topology.leaves), tuple(topology.spines),
                   tuple(link.name for link in topology.links), tuple(f"nic{r}" for r in range(spec.rails)),
                   spec.gpus, topology)

    @property
    def hosts_per_rack(self) -> int:
        """Hosts in each rack."""
        return self.topology.per_rack

    def nic_link(self, host: str, nic: str) -> str:
        """The link a host's NIC is cabled to: NIC ``r`` goes to its rack's leaf of rail ``r``."""
        return self.topology.nic_link(host, nic).name

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
    """The names of a rail-optimised leaf-spine lab of these sizes (see `ridethrough.lab.topology`).

    Raises ValueError for sizes that do not make a lab (hosts not divisible by racks, ...).
    """
    return Names.of(Topology(TopologySpec(hosts, racks, rails, spines, gpus)))


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
            period, count = num(call, "period_s"), int(num(call, "count"))
            return tuple((call.at_s + i * period, call.at_s + (i + 0.5) * period) for i in range(count))
        return ((call.at_s, None if for_s is None else call.at_s + for_s),)


_P = ParamType
_END = Param("end", _P.END)
IB_ERROR_COUNTERS = (*IB_COUNTERS, *HW_COUNTERS)
"""IB counters (``counters/`` and ``hw_counters/``) a NIC ramp can drive."""
_LINK, _HOST = Target.LINK, Target.HOST
_LINK_FAULTS = frozenset({"link-down", "flap", "degrade", "loss", "mtu", "congest"})
_DIRS = tuple(d.value for d in Direction)

KINDS: Mapping[str, FaultKind] = {k.name: k for k in (
    FaultKind("link-down", _LINK, (_END,), act.link_down, act.link_up,
              _truth(EntityType.LINK, "link_down", Effect.FAILURE), "link"),
    FaultKind("link-up", _LINK, (_END,), act.link_up, None,
              _truth(EntityType.LINK, "link_up", Effect.RECOVERY), "link", clears=frozenset({"link-down", "flap"})),
    FaultKind("flap", _LINK, (Param("period_s", _P.DURATION, 2.0, lo=0.01), Param("count", _P.INT, 5, lo=1, hi=10_000),
                              _END),
              act.link_down, act.link_up, _truth(EntityType.LINK, "link_flap", Effect.FAILURE), "link", pulsed=True),
    FaultKind("degrade", _LINK, (RATE_MBIT, Param("burst_kbit", _P.FLOAT, 32.0, lo=0, hi=1e6, open_lo=True),
                                 Param("latency_ms", _P.FLOAT, 20.0, lo=0, hi=1e5, open_lo=True),
                                 Param("direction", _P.CHOICE, "both", choices=_DIRS)),
              act.degrade, act.restore, _truth(EntityType.LINK, "link_degraded", Effect.DEGRADATION), "link"),
    FaultKind("loss", _LINK, (LOSS_PERCENT, Param("direction", _P.CHOICE, "both", choices=_DIRS)),
              act.lose, act.restore, _truth(EntityType.LINK, "link_degraded", Effect.DEGRADATION), "link"),
    FaultKind("restore", _LINK, (), act.restore, None,
              _truth(EntityType.LINK, "link_restored", Effect.RECOVERY), "link", clears=_LINK_FAULTS),
    FaultKind("mtu", _LINK, (Param("end", _P.END, required=True), Param("mtu", _P.INT, required=True, lo=68, hi=65535)),
              act.set_mtu, act.restore,
              _truth(EntityType.LINK, "mtu_mismatch", Effect.DEGRADATION), "link"),
    FaultKind("congest", _LINK, (Param("direction", _P.CHOICE, "forward", choices=("forward", "reverse")), RATE_MBIT,
                                 Param("load_mbit", _P.FLOAT, lo=0, hi=1_000_000, open_lo=True)),
              act.congest, act.uncongest, _truth(EntityType.LINK, "link_congested", Effect.DEGRADATION), "link"),
    FaultKind("clock-step", _HOST, (Param("step_ms", _P.FLOAT, required=True, lo=-1e7, hi=1e7),),
              act.step_clock, act.step_back,
              _truth(EntityType.CLOCK, "clock_step", Effect.DEGRADATION), "clock", lasting=False),
    FaultKind("gpu", _HOST, (Param("gpu_fault", _P.CHOICE, required=True, choices=tuple(f.value for f in GpuFault)),
                             Param("gpu", _P.GPU, required=True)),
              act.gpu, act.clear_gpu, _gpu_truth, "gpu",
              stack_param="gpu_fault", variant_param="gpu_fault",
              variants={f.value: ps for f, ps in GPU_PARAMS.items()}),
    FaultKind("nic-ramp", _HOST, (Param("nic", _P.NIC, "nic0"),
                                  Param("counter", _P.CHOICE, "symbol_error", choices=IB_ERROR_COUNTERS),
                                  Param("rate_per_s", _P.FLOAT, 10.0, lo=0, hi=1e9, open_lo=True),
                                  Param("link_down_after_s", _P.DURATION, lo=0, open_lo=True)),
              act.nic_ramp, act.nic_clear, _nic_truth, "nic", stack_param="counter"),
    FaultKind("freeze", _HOST, (), act.freeze, act.thaw,
              _truth(EntityType.HOST, "host_frozen", Effect.FAILURE), "freeze"),
    FaultKind("thaw", _HOST, (), act.thaw, None,
              _truth(EntityType.HOST, "host_thawed", Effect.RECOVERY), "freeze", clears=frozenset({"freeze"})),
    FaultKind("straggle", _HOST, (Param("cpu_fraction", _P.FLOAT, 0.25, lo=0, hi=1, open_lo=True, open_hi=True),),
              act.straggle, act.unstraggle, _truth(EntityType.HOST, "straggler", Effect.DEGRADATION),
              "cpu"),
    FaultKind("unstraggle", _HOST, (), act.unstraggle, None,
              _truth(EntityType.HOST, "straggler_cleared", Effect.RECOVERY), "cpu", clears=frozenset({"straggle"})),
)}
"""Every fault kind, by the name scenarios and ``ridethrough lab inject`` use."""
