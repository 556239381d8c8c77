"""Sources by name: each entry builds one source from the agent's config.

A source module is imported only when the config names it, so a host without, say,
NVML never loads the GPU code. Every source module offers
``from_config(cfg: AgentConfig) -> Source``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import MappingProxyType

from ridethrough.collector.sample import Source
from ridethrough.settings import AgentConfig

SOURCES: Mapping[str, str] = MappingProxyType({
    "netdev": "ridethrough.collector.sources.netdev",
    "infiniband": "ridethrough.collector.sources.infiniband",
    "gpu": "ridethrough.collector.sources.gpu",
    "ethtool": "ridethrough.collector.sources.ethtool",
    "job": "ridethrough.collector.sources.job",
    "probe": "ridethrough.collector.sources.probe",
})
"""Source name → the module whose ``from_config`` builds it."""


def build_sources(cfg: AgentConfig) -> list[Source]:
    """The sources ``cfg.sources`` names, in that order; ValueError for an unknown name."""
    unknown = [n for n in cfg.sources if n not in SOURCES]
    if unknown:
        raise ValueError(f"agent.sources: unknown source(s) {unknown}; known: {sorted(SOURCES)}")
    sources: list[Source] = []
    for name in cfg.sources:
        module = importlib.import_module(SOURCES[name])
        sources.append(module.from_config(cfg))
    return sources
