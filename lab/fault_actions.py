"""The `LabControl` calls that start each fault kind and the inverse calls that undo it.

`ridethrough.lab.faults.KINDS` pairs them up; every function takes a validated `Call`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ridethrough.lab.control import Direction, GpuFault, LabControl, LabError
from ridethrough.lab.fault_params import GPU_PARAMS, ParamValue

if TYPE_CHECKING:
    from ridethrough.lab.faults import Call

Start = Callable[[LabControl, "Call"], str | None]
"""Applies a fault; returns a handle its undo needs (a load handle), or None."""
Undo = Callable[[LabControl, "Call", str | None], None]


def _opt_str(value: ParamValue) -> str | None:
    return None if value is None else str(value)


def num(call: Call, name: str) -> float:
    """A parameter validated as a number, as a float."""
    value = call.params[name]
    assert isinstance(value, int | float), f"{name} was validated as a number"
    return float(value)


def link_down(lab: LabControl, c: Call) -> None:
    lab.set_link(c.target, up=False, end=_opt_str(c.params.get("end")))


def link_up(lab: LabControl, c: Call, _handle: str | None = None) -> None:
    lab.set_link(c.target, up=True, end=_opt_str(c.params.get("end")))


def degrade(lab: LabControl, c: Call) -> None:
    lab.degrade_link(c.target, rate_mbit=num(c, "rate_mbit"), burst_kbit=num(c, "burst_kbit"),
                     latency_ms=num(c, "latency_ms"), direction=Direction(c.params["direction"]))


def lose(lab: LabControl, c: Call) -> None:
    lab.lose_packets(c.target, percent=num(c, "percent"), direction=Direction(c.params["direction"]))


def restore(lab: LabControl, c: Call, _handle: str | None = None) -> None:
    lab.restore_link(c.target)


def set_mtu(lab: LabControl, c: Call) -> None:
    lab.set_mtu(c.target, end=str(c.params["end"]), mtu=int(num(c, "mtu")))


def congest(lab: LabControl, c: Call) -> str:
    direction = Direction(c.params["direction"])
    rate = num(c, "rate_mbit")
    load = c.params.get("load_mbit")
    lab.degrade_link(c.target, rate_mbit=rate, direction=direction)
    try:
        return lab.start_load(c.target, direction=direction, rate_mbit=2 * rate if load is None else float(load))
    except LabError:
        lab.restore_link(c.target)  # nothing half applied
        raise


def uncongest(lab: LabControl, c: Call, handle: str | None) -> None:
    try:
        if handle is not None:
            lab.stop_load(handle)
    finally:
        lab.restore_link(c.target)


def step_clock(lab: LabControl, c: Call) -> None:
    lab.step_clock(c.target, step_ns=round(num(c, "step_ms") * 1_000_000))


def step_back(lab: LabControl, c: Call, _handle: str | None) -> None:
    lab.step_clock(c.target, step_ns=-round(num(c, "step_ms") * 1_000_000))


def gpu(lab: LabControl, c: Call) -> None:
    fault = GpuFault(c.params["gpu_fault"])
    extra = {p.name: num(c, p.name) for p in GPU_PARAMS[fault] if c.params.get(p.name) is not None}
    lab.gpu_fault(c.target, int(num(c, "gpu")), fault, extra)


def clear_gpu(lab: LabControl, c: Call, _handle: str | None) -> None:
    lab.clear_gpu(c.target, int(num(c, "gpu")))


def nic_ramp(lab: LabControl, c: Call) -> None:
    after = c.params.get("link_down_after_s")
    lab.nic_error_ramp(c.target, str(c.params["nic"]), counter=str(c.params["counter"]),
                       rate_per_s=num(c, "rate_per_s"), link_down_after_s=None if after is None else float(after))


def nic_clear(lab: LabControl, c: Call, _handle: str | None) -> None:
    lab.clear_nic(c.target, str(c.params["nic"]))
    if c.params.get("link_down_after_s") is not None:  # the ramp may have taken the link down
        lab.set_link(c.names.nic_link(c.target, str(c.params["nic"])), up=True, end=c.target)


def freeze(lab: LabControl, c: Call) -> None:
    lab.freeze_host(c.target)


def thaw(lab: LabControl, c: Call, _handle: str | None = None) -> None:
    lab.thaw_host(c.target)


def straggle(lab: LabControl, c: Call) -> None:
    lab.straggle(c.target, cpu_fraction=num(c, "cpu_fraction"))


def unstraggle(lab: LabControl, c: Call, _handle: str | None = None) -> None:
    lab.unstraggle(c.target)
