"""What the audit needs from the world around it: a driver that runs traffic, a progress display, a GPU burner.

`ridethrough.audit_lab.LabDriver` is the lab's driver; the CLI shows progress with rich
(`ridethrough.audit_cli.RichProgress`); tests and benches pass their own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from ridethrough.audit_model import FlowResult, FlowSpec
from ridethrough.audit_plan import LinkEnds


class Driver(Protocol):
    """Runs the audit's traffic (`ridethrough.audit_lab.LabDriver` in a lab)."""

    def link_ends(self, names: Sequence[str]) -> list[LinkEnds]:
        """The named links whose two ends can run an endpoint."""
        ...

    def link_flows(self, link: LinkEnds, *, first_id: int, rate_mbit: float) -> list[FlowSpec]:
        """The flows that load one link from end to end."""
        ...

    def path_route(self, src: str, dst: str, sport: int) -> tuple[str, ...] | None:
        """The links a host-to-host flow from ``sport`` crosses (None: no route)."""
        ...

    def path_flow(self, src: str, dst: str, sport: int, links: tuple[str, ...], *, flow_id: int,
                  rate_mbit: float) -> FlowSpec:
        """A pinned host-to-host flow."""
        ...

    def run_flows(self, flows: Sequence[FlowSpec], *, duration_s: float, mtu: int) -> list[FlowResult]:
        """Run one round; a result per flow."""
        ...


class Progress(Protocol):
    """Where the audit says how far it is (a rich progress display in the CLI)."""

    def start(self, phase: str, total: int) -> None:
        """A phase begins with ``total`` steps."""
        ...

    def advance(self, phase: str, steps: int = 1) -> None:
        """Steps of a phase are done."""
        ...

    def note(self, text: str) -> None:
        """One line worth showing."""
        ...


class SilentProgress:
    """Shows nothing."""

    def start(self, phase: str, total: int) -> None:
        """Nothing."""

    def advance(self, phase: str, steps: int = 1) -> None:
        """Nothing."""

    def note(self, text: str) -> None:
        """Nothing."""


Burner = Callable[[str], Mapping[str, Any]]
"""host → a compute burn's result on its GPUs (``{"gpus": {index: {"ok": bool, ...}}}``)."""
