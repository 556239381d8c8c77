"""Who an agent is: the OTel resource every signal it sends carries."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry.sdk.resources import Resource


@dataclass(frozen=True, slots=True)
class AgentIdentity:
    """Who this agent is: the resource attributes every signal carries."""

    node_id: str
    host_name: str
    cluster: str
    rack: str = ""
    pod: str = ""
    labels: Mapping[str, str] | None = None

    def resource(self) -> Resource:
        """The OTel resource for this node."""
        attrs = {"service.name": "ridethrough-agent", "host.name": self.host_name,
                 "ridethrough.node.id": self.node_id, "ridethrough.cluster": self.cluster}
        if self.rack:
            attrs["ridethrough.rack"] = self.rack
        if self.pod:
            attrs["ridethrough.pod"] = self.pod
        attrs.update(self.labels or {})
        return Resource.create(attrs)
