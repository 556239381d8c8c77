"""``ridethrough audit``: validate every host, link, NIC and GPU of a fleet under load, within a time budget.

    result = Audit(expected, store_query(store), driver=LabDriver(lab), config=AuditConfig(budget_s=600)).run()

Phases, in order; each records what it covered and, plainly, what it did not and why:

1. **inventory**: the agents' telemetry in the store against the expected inventory
   (`ridethrough.audit_inventory`): every host reporting, every NIC up at the expected MTU and
   speed, every GPU present and alike, clocks synchronised, no error counter climbing at rest.
2. **gpu**: GPU health fields over the audit window (the fake GPUs' scripted state in the lab),
   and a compute burn where a burner is given (real GPUs). It needs no load, so it goes first.
3. **links**: every link loaded in turn, both ways, from end to end, with an MTU probe first;
   rounds of node-disjoint links (`ridethrough.audit_plan`), as many as the budget allows.
4. **paths**: host-to-host flows all at once, pinned so that together they cross every link;
   bad paths are localised by tomography, with the link rounds' flows as evidence.
5. **errors**: each loaded NIC's error counters over the load (they reach the store a few
   seconds later, so this waits for fresh telemetry once, after all the load); then the GPU
   health fields once more (a GPU that gave way during the load).
6. **localise**: issues folded into one anomaly per entity with evidence and an action.

Without a driver (real hosts, where nothing can run traffic yet) phases 3-5 say they were not
covered; the store phases still run. Nothing here raises for a fleet problem: it is a finding.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ridethrough import audit_checks as checks
from ridethrough import audit_inventory as inventory
from ridethrough.audit_contract import Burner, Driver, Progress, SilentProgress
from ridethrough.audit_model import AuditResult, Expected, FlowResult, FlowSpec, Issue, PhaseRecord, Status, Symptom
from ridethrough.audit_plan import AFTER_LOAD_S, ROUND_OVERHEAD_S, Schedule, fit, link_rounds, path_cover
from ridethrough.audit_verdict import anomalies, statuses
from ridethrough.detectors.contract import Query, Window
from ridethrough.exporters.store import StoreError, StoreUnavailable

NS = 1_000_000_000
STORE_ERRORS = (StoreUnavailable, StoreError)
ERRORS_FRESH_TIMEOUT_S = 30.0
"""How long the errors phase waits for every loaded host's telemetry from after the load."""


@dataclass(frozen=True, slots=True)
class AuditConfig:
    """How hard and how long the audit pushes (see the CLI for each flag)."""

    budget_s: float = 600.0
    load_mbit: float = 50.0
    path_mbit: float = 20.0
    load_s: float = 2.0
    parallel: int = 4
    max_loss: float = checks.MAX_LOSS
    mtu: int = 1500
    """The MTU probed when the inventory names none."""
    inventory_window_s: float = 15.0
    fresh_timeout_s: float = 30.0
    gpu_window_s: float = 60.0
    errors_pad_s: float = 4.0
    """After the last load: how long error counters take to reach the store (pump, agent sample, export)."""
    cluster: str = ""


def store_query(store: Any) -> Query:
    """A detector-style query over a `ridethrough.exporters.store.Store`."""
    return lambda sql, params: store.query(sql, parameters=dict(params))


class Audit:
    """One audit run (see the module docstring)."""

    def __init__(self, expected: Expected, query: Query, *, driver: Driver | None = None,
                 config: AuditConfig | None = None, progress: Progress | None = None,
                 unknown_hosts: Sequence[str] = (), burner: Burner | None = None) -> None:
        self.expected, self.query, self.driver = expected, query, driver
        self.cfg = config or AuditConfig()
        self.progress: Progress = progress or SilentProgress()
        self.unknown_hosts, self.burner = tuple(unknown_hosts), burner
        self.issues: list[Issue] = []
        self.phases: list[PhaseRecord] = []
        self.link_figures: dict[str, list[dict[str, Any]]] = {}
        self.links_checked: set[str] = set()
        self.link_results: list[FlowResult] = []
        self._t0_ns = time.time_ns()
        self._t0 = time.monotonic()

    # -- time --------------------------------------------------------------------------------

    def at_s(self) -> float:
        """Seconds since the audit started."""
        return time.monotonic() - self._t0

    def left_s(self) -> float:
        """Budget left."""
        return self.cfg.budget_s - self.at_s()

    def _window(self, start_ns: int, end_ns: int) -> Window:
        return Window(start_ns, end_ns, self.query, self.cfg.cluster)

    def _record(self, name: str, started: float, **kw: Any) -> None:
        self.phases.append(PhaseRecord(name, round(started, 3), round(self.at_s(), 3), **kw))

    def wait_fresh(self, hosts: Sequence[str], after_ns: int, timeout_s: float) -> tuple[set[str], str]:
        """Poll until every host has telemetry newer than ``after_ns`` (or the timeout): the hosts that have,
        and why the store could not tell (empty when it answered)."""
        deadline = time.monotonic() + max(0.0, min(timeout_s, self.left_s()))
        failure = ""
        while True:
            try:
                seen = inventory.last_seen(self._window(after_ns, time.time_ns() + 60 * NS))
                failure = ""
            except STORE_ERRORS as exc:  # a busy or restarting store: ask again until the deadline
                seen, failure = {}, f"the store did not answer: {exc}"
            fresh = {h for h in hosts if seen.get(h, 0) > after_ns}
            if fresh >= set(hosts) or time.monotonic() >= deadline:
                return fresh, failure
            time.sleep(0.5)

    # -- phases ------------------------------------------------------------------------------

    def run(self) -> AuditResult:
        """Every phase in order; the result."""
        facts, unseen = self._inventory()
        self._gpu()  # needs no load: its faults are localised first, and the load gets what budget is left
        loaded: dict[str, tuple[int, int]] = {}
        schedule: Schedule | None = None
        if self.driver is None:
            self._record("load", self.at_s(), not_covered={"*": "no load driver for these hosts: links were not "
                                                               "loaded and MTUs not probed"})
        else:
            schedule = self._load(self.driver, loaded)
            self._errors(loaded, unseen)
            self._gpu_again()
        found = anomalies(self.issues)
        hosts, links = statuses(self.expected, found, links_checked=self.links_checked, hosts_not_covered=unseen)
        for h in self.unknown_hosts:
            hosts[h] = Status.NOT_COVERED
        plan = {} if schedule is None else {"rounds": [[lk.name for lk in r] for r in schedule.rounds],
                                            "paths": len(schedule.paths), "load_s": schedule.load_s,
                                            "estimated_s": round(schedule.estimated_s, 1)}
        return AuditResult(uuid.uuid4().hex, self.cfg.cluster, self._t0_ns, time.time_ns(), self.cfg.budget_s, hosts,
                           links, tuple(found), tuple(self.phases),
                           {"hosts": facts, "links": self.link_figures, "schedule": plan})

    def _inventory(self) -> tuple[inventory.Facts, set[str]]:
        started = self.at_s()
        names = [h.name for h in self.expected.hosts]
        self.progress.start("inventory", len(names) + 1)
        for h in self.unknown_hosts:
            self.issues.append(Issue("host", h, "unknown_host", Symptom(
                "inventory", "host_list", f"{h} is not in the inventory the audit checks against", {}, self.at_s())))
        now = time.time_ns()
        fresh, failure = self.wait_fresh(names, now - round(self.cfg.inventory_window_s * NS), self.cfg.fresh_timeout_s)
        self.progress.advance("inventory", len(fresh))
        try:
            if failure:
                raise StoreUnavailable(failure)
            end = time.time_ns()
            found = inventory.facts(self._window(end - round(self.cfg.inventory_window_s * NS), end))
        except STORE_ERRORS as exc:  # no facts is not a fleet fault: every host is left "not covered"
            self._record("inventory", started, not_covered={"*": f"the store did not answer: {exc}"})
            return {}, set(names)
        issues, not_covered = inventory.judge(self.expected, found, at_s=self.at_s(),
                                              window_s=self.cfg.inventory_window_s)
        self.issues += issues
        self.progress.advance("inventory")
        links = [link for h in self.expected.hosts if h.name in fresh for link in h.nics.values()]
        self._record("inventory", started, covered=tuple(sorted(fresh)), not_covered=not_covered,
                     note=f"{len(fresh)} of {len(names)} hosts reporting; {len(links)} host links seen from the hosts")
        return found, set(names) - fresh

    def _load(self, driver: Driver, loaded: dict[str, tuple[int, int]]) -> Schedule:
        started = self.at_s()
        mtu = self.expected.mtu or self.cfg.mtu
        rounds = link_rounds(driver.link_ends(self.expected.links), parallel=self.cfg.parallel)
        hosts = [h.name for h in self.expected.hosts]
        paths, unreached = path_cover(hosts, self.expected.links, driver.path_route)
        schedule = fit(rounds, paths, budget_s=self.left_s(), load_s=self.cfg.load_s)
        self.progress.start("links", len(schedule.rounds))
        not_covered = dict(schedule.dropped)
        for i, rnd in enumerate(schedule.rounds):
            flows = [f for n, lk in enumerate(rnd)
                     for f in driver.link_flows(lk, first_id=2 * n + 1, rate_mbit=self.cfg.load_mbit)]
            if not self._round(driver, flows, "links", schedule.load_s, mtu, loaded, not_covered):
                not_covered |= {lk.name: "the budget ran out before its round" for r in schedule.rounds[i:] for lk in r}
                break
        self._record("links", started, covered=tuple(sorted(loaded)), not_covered=not_covered,
                     note=f"{len(schedule.rounds)} rounds of {schedule.load_s:g} s at {self.cfg.load_mbit:g} Mbit/s "
                          "each way")
        started = self.at_s()
        self.progress.start("paths", 1 if schedule.paths else 0)
        path_gaps = {x: "no host-to-host route crosses it" for x in sorted(unreached)}
        if schedule.paths:
            flows = [driver.path_flow(p.src, p.dst, p.sport, p.links, flow_id=i + 1, rate_mbit=self.cfg.path_mbit)
                     for i, p in enumerate(schedule.paths)]
            if not self._round(driver, flows, "paths", schedule.load_s, mtu, {}, path_gaps):
                path_gaps["*"] = "the budget ran out before the path round"
        elif "paths" in schedule.dropped:
            path_gaps["*"] = schedule.dropped["paths"]
        self._record("paths", started, covered=tuple(f"{p.src}->{p.dst}:{p.sport}" for p in schedule.paths),
                     not_covered=path_gaps, note=f"{len(schedule.paths)} flows at {self.cfg.path_mbit:g} Mbit/s, "
                                                 "all at once")
        return schedule

    def _round(self, driver: Driver, flows: list[FlowSpec], phase: str, load_s: float, mtu: int,
               loaded: dict[str, tuple[int, int]], not_covered: dict[str, str]) -> bool:
        if self.left_s() < load_s + ROUND_OVERHEAD_S + AFTER_LOAD_S:
            return False
        results = driver.run_flows(flows, duration_s=load_s, mtu=mtu)
        for r in results:
            for link in r.spec.links:
                if r.error:
                    not_covered.setdefault(link, r.error)
                    continue
                self.links_checked.add(link)
                self.link_figures.setdefault(link, []).append({"phase": phase, **checks.flow_figures(r)})
                if r.spec.scope == "link":
                    start, end = loaded.get(link, (r.started_ns, r.ended_ns))
                    loaded[link] = (min(start, r.started_ns), max(end, r.ended_ns))
        self.issues += checks.judge_flows(results, phase=phase, at_s=self.at_s(), mtu=mtu, max_loss=self.cfg.max_loss,
                                          known=self.link_results)
        if phase == "links":
            self.link_results += results
        self.progress.advance(phase)
        return True

    def _errors(self, loaded: Mapping[str, tuple[int, int]], unseen: set[str]) -> None:
        started = self.at_s()
        ports = checks.nic_ports(self.expected)
        hosts = sorted({ports[x][0] for x in loaded if x in ports} - unseen)
        self.progress.start("errors", 1)
        not_covered: dict[str, str] = {}
        if loaded:
            last = max(end for _, end in loaded.values()) + round(self.cfg.errors_pad_s * NS)
            time.sleep(max(0.0, min((last - time.time_ns()) / NS, self.left_s())))
            fresh, failure = self.wait_fresh(hosts, last, min(ERRORS_FRESH_TIMEOUT_S, self.left_s() - 5.0))
            at_rest = [i.entity for i in self.issues if i.kind == "nic_errors_at_rest"]
            first = min(start for start, _ in loaded.values())
            try:
                found = checks.errors_under_load(self._window(first, time.time_ns()), loaded, ports,
                                                 at_rest=at_rest, at_s=self.at_s())
            except STORE_ERRORS as exc:
                found, failure = [], f"the store did not answer: {exc}"
            self.issues += found
            # a host whose counters have not all arrived may still hide a rise (unless one was seen already)
            flagged = {i.entity.partition("/")[0] for i in found}
            not_covered = {h: failure or "its telemetry after the load did not all reach the store in time"
                           for h in hosts if h not in fresh and h not in flagged}
        self.progress.advance("errors")
        self._record("errors", started, covered=tuple(hosts), not_covered=not_covered,
                     note="IB error counters of each loaded NIC over its load")

    def _gpu(self) -> None:
        started = self.at_s()
        self.progress.start("gpu", 1)
        now = time.time_ns()
        not_covered: dict[str, str] = {}
        try:
            self.issues += checks.gpu_issues(self._window(self._t0_ns - round(self.cfg.gpu_window_s * NS), now),
                                             at_s=self.at_s())
        except STORE_ERRORS as exc:
            not_covered["*"] = f"GPU health fields: the store did not answer: {exc}"
        note = "health fields from the agents (on fake GPUs, their scripted state)"
        if self.burner is not None:
            note += "; compute burn on every host"
            for h in self.expected.hosts:
                burnt = self.burner(h.name)
                if burnt.get("skipped"):
                    not_covered[f"{h.name} burn"] = str(burnt["skipped"])
                self.issues += checks.burn_issues(h.name, burnt, at_s=self.at_s())
        else:
            note += "; no compute burn (no GPU burner for these hosts)"
        self.progress.advance("gpu")
        covered = () if "*" in not_covered else tuple(h.name for h in self.expected.hosts)
        self._record("gpu", started, covered=covered, not_covered=not_covered, note=note)

    def _gpu_again(self) -> None:
        """The health fields once more after the load: a GPU that gave way while the fabric was busy shows now."""
        started = self.at_s()
        not_covered: dict[str, str] = {}
        try:
            known = {(i.entity, i.kind) for i in self.issues}
            self.issues += [i for i in checks.gpu_issues(self._window(self._t0_ns, time.time_ns()), at_s=self.at_s())
                            if (i.entity, i.kind) not in known]
        except STORE_ERRORS as exc:
            not_covered["*"] = f"GPU health fields: the store did not answer: {exc}"
        self._record("gpu-recheck", started, covered=() if not_covered else tuple(h.name for h in self.expected.hosts),
                     not_covered=not_covered, note="health fields read again after the load")
