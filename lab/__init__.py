"""The lab: an emulated GPU cluster on one machine (namespaces, fake GPUs, scripted faults).

`Lab`, `LoopbackLab`, `TopologySpec` and `attach` load on first use: agents import the
lab's fakes (GPUs, InfiniBand tree) and must not pay for netlink and the fabric builder.
"""

from __future__ import annotations

import importlib
from typing import Any

from ridethrough.lab.control import Direction, GpuFault, LabControl, LabError

_LAZY = {"Lab": "ridethrough.lab.fabric", "attach": "ridethrough.lab.fabric",
         "LoopbackLab": "ridethrough.lab.loopback", "TopologySpec": "ridethrough.lab.topology"}

__all__ = ["Direction", "GpuFault", "Lab", "LabControl", "LabError", "LoopbackLab", "TopologySpec", "attach"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ridethrough.lab' has no attribute {name!r}")
