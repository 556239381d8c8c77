"""The audit's values: what the fleet should be, the traffic it drives, what it found, and the result.

Entity names follow the rest of ridethrough: links ``h3-leaf1r0``, NICs ``h3/nic1``, GPUs
``h3/gpu2``, hosts ``h3``. An expected inventory comes from the lab's topology
(`Expected.from_topology`) or, for real hosts, from a JSON or YAML file (`Expected.load`)::

    {"mtu": 4200, "ib_rate_gbit": 400, "gpus": 8,
     "hosts": {"node01": {"nics": {"eth2": "node01-leafA", "eth3": "node01-leafB"},
                          "ib_devices": ["mlx5_0", "mlx5_1"]}},
     "links": ["node01-leafA", "node01-leafB", "leafA-spine1"]}

A host entry may set its own ``gpus``; ``links`` defaults to the NICs' links.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

COVERAGE_KINDS = frozenset({"no_telemetry", "unknown_host"})
"""Anomaly kinds that say what the audit could not check: they make it partial, not failed."""


class Status(enum.StrEnum):
    """The verdict on an entity, or on the whole audit."""

    PASS = "pass"
    FAIL = "fail"
    PARTIAL = "partial"
    """Nothing failed, but something was not covered."""
    NOT_COVERED = "not_covered"


@dataclass(frozen=True, slots=True)
class ExpectedHost:
    """One host as it should be: its NICs (name → the link it is cabled to), IB devices, GPU count."""

    name: str
    nics: Mapping[str, str]
    ib_devices: tuple[str, ...] = ()
    gpus: int = 0


@dataclass(frozen=True, slots=True)
class Expected:
    """The fleet as it should be; ``None`` fields are judged by consistency across hosts instead."""

    hosts: tuple[ExpectedHost, ...]
    links: tuple[str, ...]
    mtu: int | None = None
    ib_rate_gbit: float | None = None

    def host(self, name: str) -> ExpectedHost | None:
        """The expected host of that name, or None."""
        return next((h for h in self.hosts if h.name == name), None)

    def nic_link(self, host: str, nic: str) -> str | None:
        """The link ``host``'s NIC (netdev or IB device) is cabled to, if known."""
        h = self.host(host)
        if h is None:
            return None
        if nic in h.nics:
            return h.nics[nic]
        if nic in h.ib_devices:  # mlx5_r is the RDMA side of the r-th NIC
            names = list(h.nics)
            r = h.ib_devices.index(nic)
            return h.nics[names[r]] if r < len(names) else None
        return None

    def only(self, hosts: Sequence[str]) -> Expected:
        """The part of the inventory about ``hosts`` (and links with an end in one of them, or between switches)."""
        keep = set(hosts)
        mine = {link for h in self.hosts if h.name not in keep for link in h.nics.values()}
        return Expected(tuple(h for h in self.hosts if h.name in keep), tuple(x for x in self.links if x not in mine),
                        self.mtu, self.ib_rate_gbit)

    @classmethod
    def from_topology(cls, topo: Any, *, rails: int, gpus: int, mtu: int = 1500,
                      ib_rate_gbit: float | None = 200.0) -> Expected:
        """The lab's inventory: NIC ``r`` of each host is ``nic{r}`` (RDMA ``mlx5_{r}``) on its rail's leaf."""
        hosts = tuple(ExpectedHost(h, {f"nic{r}": topo.nic_link(h, f"nic{r}").name for r in range(rails)},
                                   tuple(f"mlx5_{r}" for r in range(rails)), gpus) for h in topo.hosts)
        return cls(hosts, tuple(link.name for link in topo.links), mtu, ib_rate_gbit)

    @classmethod
    def parse(cls, data: object, *, source: str = "inventory") -> Expected:
        """An inventory from its JSON/YAML form; ValueError naming the file and what is wrong."""
        def bad(why: str) -> ValueError:
            return ValueError(f"{source}: {why}")
        if not isinstance(data, Mapping) or not isinstance(data.get("hosts"), Mapping) or not data["hosts"]:
            raise bad('expected a mapping with "hosts": {name: {"nics": {nic: link}, ...}}')
        unknown = set(data) - {"hosts", "links", "mtu", "ib_rate_gbit", "gpus"}
        if unknown:
            raise bad(f"unknown keys {sorted(unknown)} (known: hosts, links, mtu, ib_rate_gbit, gpus)")
        default_gpus = _int(data.get("gpus", 0), "gpus", bad)
        hosts = []
        for name, raw in data["hosts"].items():
            if not isinstance(raw, Mapping) or not isinstance(raw.get("nics", {}), Mapping):
                raise bad(f'host {name!r}: expected {{"nics": {{nic: link}}, "ib_devices": [...], "gpus": N}}')
            nics = {str(k): str(v) for k, v in raw.get("nics", {}).items()}
            ib = raw.get("ib_devices", [])
            if not isinstance(ib, list) or not all(isinstance(x, str) for x in ib):
                raise bad(f"host {name!r}: ib_devices must be a list of device names")
            hosts.append(ExpectedHost(str(name), nics, tuple(ib), _int(raw.get("gpus", default_gpus), "gpus", bad)))
        links = data.get("links") or sorted({x for h in hosts for x in h.nics.values()})
        if not isinstance(links, list) or not all(isinstance(x, str) and x for x in links):
            raise bad("links must be a list of link names")
        mtu = data.get("mtu")
        rate = data.get("ib_rate_gbit")
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, int | float) or rate <= 0):
            raise bad(f"ib_rate_gbit must be a positive number, got {rate!r}")
        return cls(tuple(hosts), tuple(links), None if mtu is None else _int(mtu, "mtu", bad),
                   None if rate is None else float(rate))

    @classmethod
    def load(cls, path: str | Path) -> Expected:
        """Read an inventory file (JSON or YAML); ValueError naming the file."""
        try:
            text = Path(path).read_text(encoding="utf-8")
            data = yaml.safe_load(text)
        except (OSError, yaml.YAMLError) as exc:
            raise ValueError(f"inventory {path}: {exc}") from None
        return cls.parse(data, source=f"inventory {path}")


def _int(value: object, what: str, bad: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise bad(f"{what} must be a whole number >= 0, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class FlowSpec:
    """One paced UDP flow of a load round; ``links`` are the links it crosses, in order."""

    id: int
    src: str
    dst: str
    src_ip: str
    dst_ip: str
    sport: int
    dport: int
    rate_mbit: float
    links: tuple[str, ...]
    scope: str = "link"
    """``link`` (the two ends of one link) or ``path`` (host to host across the fabric)."""
    size: int = 1200


@dataclass(frozen=True, slots=True)
class FlowResult:
    """What one flow measured; ``error`` set (and the rest zero) when it could not run."""

    spec: FlowSpec
    duration_s: float
    sent: int = 0
    send_errors: int = 0
    received: int = 0
    owd_ms: tuple[float, ...] = ()
    """[p50, p99, max] one-way delay in ms (empty: nothing arrived)."""
    mtu_ok: bool | None = None
    mtu_refused: bool = False
    """The sending end's own interface refused the probe: its MTU is the smaller one."""
    error: str = ""
    started_ns: int = 0
    ended_ns: int = 0
    host_drops: float = 0.0
    """Datagrams the end hosts dropped themselves (a full socket buffer, a backlog their CPU did not drain):
    theirs, not the link's."""

    @property
    def loss(self) -> float:
        """Share of sent datagrams lost on the way (what the end hosts dropped themselves is not the link's)."""
        if self.sent <= 0:
            return 0.0
        return max(0.0, 1.0 - (self.received + self.host_drops) / self.sent)

    @property
    def delivered_mbit(self) -> float:
        """What arrived, as a rate over the load's duration."""
        return 0.0 if self.duration_s <= 0 else self.received * self.spec.size * 8 / self.duration_s / 1e6


@dataclass(frozen=True, slots=True)
class Symptom:
    """One check that failed on one entity, with its evidence."""

    phase: str
    check: str
    summary: str
    evidence: Mapping[str, Any] = field(default_factory=dict)
    at_s: float = 0.0
    """Seconds from the audit's start when the check concluded."""


@dataclass(frozen=True, slots=True)
class Issue:
    """A symptom a phase pinned on one entity, before the symptoms of each entity are folded into an `Anomaly`."""

    entity_type: str
    entity: str
    kind: str
    symptom: Symptom
    candidates: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Anomaly:
    """A problem localised to one entity (link, NIC, GPU or host), its symptoms and what to do."""

    entity_type: str
    entity: str
    kind: str
    summary: str
    action: str
    symptoms: tuple[Symptom, ...]
    candidates: tuple[str, ...] = ()
    """Other entities the evidence cannot tell apart from this one (empty: localised exactly)."""

    @property
    def localised_at_s(self) -> float:
        """When the first symptom concluded (seconds from the audit's start)."""
        return min((s.at_s for s in self.symptoms), default=0.0)


@dataclass(frozen=True, slots=True)
class PhaseRecord:
    """One phase as it ran: how long, what it covered, what it left out and why."""

    name: str
    started_s: float
    ended_s: float
    covered: tuple[str, ...] = ()
    not_covered: Mapping[str, str] = field(default_factory=dict)
    """Entity (or ``*``) → the reason it was not checked."""
    note: str = ""


@dataclass(frozen=True, slots=True)
class AuditResult:
    """Everything one audit found (`to_json` is the machine-readable result)."""

    audit_id: str
    cluster: str
    started_ns: int
    ended_ns: int
    budget_s: float
    hosts: Mapping[str, Status]
    links: Mapping[str, Status]
    anomalies: tuple[Anomaly, ...]
    phases: tuple[PhaseRecord, ...]
    facts: Mapping[str, Any] = field(default_factory=dict)
    """Per host (inventory) and per link (load figures), for the report."""

    @property
    def status(self) -> Status:
        """fail if anything failed; partial if something was not covered (an unreachable or unknown host
        included: what could not be checked has not failed); else pass."""
        if any(a.kind not in COVERAGE_KINDS for a in self.anomalies):
            return Status.FAIL
        if any(p.not_covered for p in self.phases) or Status.NOT_COVERED in {*self.hosts.values(),
                                                                               *self.links.values()}:
            return Status.PARTIAL
        return Status.PASS

    @property
    def duration_s(self) -> float:
        """Wall-clock seconds the audit took."""
        return (self.ended_ns - self.started_ns) / 1e9

    def not_covered(self) -> dict[str, str]:
        """Everything some phase left out, ``phase: entity`` → reason."""
        return {f"{p.name}: {entity}": why for p in self.phases for entity, why in p.not_covered.items()}

    def to_json(self) -> dict[str, Any]:
        """The result as plain JSON values."""
        return {"audit_id": self.audit_id, "cluster": self.cluster, "status": self.status.value,
                "started_ns": self.started_ns, "ended_ns": self.ended_ns, "duration_s": round(self.duration_s, 3),
                "budget_s": self.budget_s, "hosts": {k: v.value for k, v in self.hosts.items()},
                "links": {k: v.value for k, v in self.links.items()},
                "anomalies": [asdict(a) for a in self.anomalies], "phases": [asdict(p) for p in self.phases],
                "not_covered": self.not_covered(), "facts": self.facts}

    def dumps(self) -> str:
        """`to_json` as indented text."""
        return json.dumps(self.to_json(), indent=1, sort_keys=False, default=str) + "\n"
