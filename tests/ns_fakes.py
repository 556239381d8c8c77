"""A fake of a per-namespace reader (a netlink dump, an nft listing) for the lab's switch telemetry tests."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Generic, TypeVar

from ridethrough.lab.control import LabError

V = TypeVar("V")


class PerNamespace(Generic[V]):
    """Per namespace, per interface, what the reader answers; a namespace in ``broken`` fails to answer."""

    def __init__(self, what: str) -> None:
        self.answers: dict[str, dict[str, V]] = {}
        self.broken: set[str] = set()
        self.reads = 0
        self._what = what

    def __call__(self, ns: str) -> Mapping[str, V]:
        self.reads += 1
        if ns in self.broken:
            raise LabError(f"{self._what} in {ns}: no answer")
        return dict(self.answers.get(ns, {}))
