"""The lab: an emulated GPU cluster on one machine (namespaces, fake GPUs, scripted faults)."""

from ridethrough.lab.control import Direction, GpuFault, LabControl, LabError
from ridethrough.lab.fabric import Lab, attach
from ridethrough.lab.loopback import LoopbackLab
from ridethrough.lab.topology import TopologySpec

__all__ = ["Direction", "GpuFault", "Lab", "LabControl", "LabError", "LoopbackLab", "TopologySpec", "attach"]
