"""From issues to the audit's verdict: one anomaly per entity, what to do about it, pass/fail per host and link.

Every phase pins its issues on the entity its evidence names (a link loaded end to end names
its link; a NIC's counters name the NIC; a GPU's fields name the GPU). `anomalies` folds the
issues of one entity into one `Anomaly` whose kind is the most specific one seen (an MTU
mismatch explains the loss of its big packets, not the other way round), with a suggested
action. `statuses` turns the anomalies and the coverage into pass/fail/not covered per host
and per link: a host fails with any anomaly on it or on its NICs and GPUs; a link fails with
one on it or on a NIC cabled to it. A host the audit could not reach, or one the host list names
but the inventory does not, is "not covered": neither passed nor failed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from ridethrough.audit_model import COVERAGE_KINDS, Anomaly, Expected, Issue, Status

ACTIONS: Mapping[str, str] = {
    "mtu_mismatch": "Set the MTU of the port named in the evidence to the fabric's MTU: every port on a path must "
                    "carry the same MTU, or big packets are dropped silently.",
    "wrong_speed": "The port trained below the expected speed: reseat or replace the cable or optic and check the "
                   "switch port's speed setting.",
    "fails_under_load": "The link passes small packets but not load: check both ports' negotiated speed and any "
                        "shaper or QoS policy on them, then reseat or replace the cable or optics; re-run the audit.",
    "nic_errors_under_load": "Errors grow with traffic (a marginal optic or connector): clean and reseat the "
                             "connector, swap the optic or cable; if the errors follow the NIC, replace the NIC.",
    "nic_errors_at_rest": "Errors climb even at rest: replace the cable or optic now; if they follow the NIC, "
                          "replace the NIC.",
    "nic_down": "Bring the port up and check its cable and the switch port it should reach.",
    "nic_missing": "The NIC is not seen: check that it is seated, its driver loaded, and the agent reads it.",
    "ib_port_not_active": "The RDMA port is not ACTIVE: check the cable, the switch port and the subnet manager.",
    "gpu_failed": "Take the GPU out of service and replace it (RMA), after draining the host.",
    "gpu_failing": "Drain the host and reset the GPU (a pending row remap takes effect at reset); if remaps or "
                   "errors keep coming after the reset, replace the GPU (RMA).",
    "gpu_missing": "A GPU is not seen: reseat it or check its power and the driver; then re-run the audit.",
    "gpu_config_mismatch": "This GPU differs from the rest of the fleet: confirm the order, or replace it.",
    "clock_unsynced": "Check the host's time synchronisation and that its agent probes its peers.",
    "no_telemetry": "Start (or reach) the host's agent, then re-run the audit: nothing on this host was checked.",
    "unknown_host": "This host is not in the inventory the audit checks against: fix the host list.",
}
_PRIORITY = ("unknown_host", "no_telemetry", "gpu_failed", "nic_missing", "nic_down", "ib_port_not_active",
             "mtu_mismatch", "wrong_speed", "nic_errors_at_rest", "nic_errors_under_load", "fails_under_load",
             "gpu_failing", "gpu_missing", "gpu_config_mismatch", "clock_unsynced")
"""Most specific first: the kind an anomaly takes when one entity shows several."""


def anomalies(issues: Iterable[Issue]) -> list[Anomaly]:
    """One anomaly per (entity type, entity), its issues folded in, ordered by when it was localised."""
    grouped: dict[tuple[str, str], list[Issue]] = {}
    for issue in issues:
        grouped.setdefault((issue.entity_type, issue.entity), []).append(issue)
    out = []
    for (etype, entity), group in grouped.items():
        kinds = {i.kind for i in group}
        kind = next((k for k in _PRIORITY if k in kinds), sorted(kinds)[0])
        lead = next(i for i in group if i.kind == kind)
        symptoms = tuple(sorted((i.symptom for i in group), key=lambda s: s.at_s))
        candidates = tuple(sorted({c for i in group for c in i.candidates} - {entity}))
        # evidence of one exact localisation (a link loaded on its own) settles it: no candidates left
        if any(not i.candidates and i.symptom.phase != "paths" for i in group):
            candidates = ()
        out.append(Anomaly(etype, entity, kind, lead.symptom.summary, ACTIONS.get(kind, "Investigate the evidence."),
                           symptoms, candidates))
    return sorted(out, key=lambda a: (a.localised_at_s, a.entity))


def _nic_link(expected: Expected, entity: str) -> str | None:
    host, _, nic = entity.partition("/")
    return expected.nic_link(host, nic)


def statuses(expected: Expected, found: Sequence[Anomaly], *, links_checked: Iterable[str],
             hosts_not_covered: Iterable[str]) -> tuple[dict[str, Status], dict[str, Status]]:
    """Pass/fail/not covered per expected host and per expected link."""
    bad_hosts: set[str] = set()
    bad_links: set[str] = set()
    for a in found:
        if a.kind in COVERAGE_KINDS:
            continue  # what could not be checked has not failed (its hosts are in hosts_not_covered)
        if a.entity_type == "link":
            bad_links.add(a.entity)
            bad_hosts |= {h.name for h in expected.hosts if a.entity in h.nics.values()}
        else:
            bad_hosts.add(a.entity.partition("/")[0])
            if a.entity_type == "nic" and (link := _nic_link(expected, a.entity)):
                bad_links.add(link)
    unseen = set(hosts_not_covered)
    hosts = {h.name: Status.FAIL if h.name in bad_hosts else Status.NOT_COVERED if h.name in unseen else Status.PASS
             for h in expected.hosts}
    checked = set(links_checked)
    links = {x: Status.FAIL if x in bad_links else Status.PASS if x in checked else Status.NOT_COVERED
             for x in expected.links}
    return hosts, links
