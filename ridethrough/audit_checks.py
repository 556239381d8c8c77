"""The audit's judgements: load results, error counters under load, GPU health; from facts to `Issue`\\ s.

* **Load** (`judge_flows`). A link flow loads one cable from end to end, so a failing one names
  its link exactly: loss above ``max_loss`` (it passes a ping, not the load) or a failed MTU
  probe. Path flows cross several links: their verdicts go to tomography's `localise` (the
  fewest links that explain the bad paths, cleared by the good ones that cross them), which
  says when the data cannot tell two links apart (``candidates``).
* **Errors under load** (`errors_under_load`). The increase of each loaded NIC's IB error
  counters while its link carried the audit's traffic; a NIC whose counters also rose at rest
  was already reported by the inventory.
* **GPU** (`gpu_issues`). The controller's own GPU detectors (`GpuFailed`, `GpuFailing`) over
  the audit's window: failed GPUs, and precursors such as a pending row remap. On fake GPUs
  this reads their scripted state, as the agents export it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ridethrough.audit_model import Expected, FlowResult, Issue, Symptom
from ridethrough.detectors import sql
from ridethrough.detectors.contract import Window
from ridethrough.detectors.gpu import GpuFailed, GpuFailing
from ridethrough.detectors.tomography import Observation, localise

MAX_LOSS = 0.02
"""Loss above this under the audit's load fails a flow (a healthy link loses nothing at these rates)."""
GOOD_LOSS = 0.005
"""At most this loss, a path counts as good evidence for every link it crosses."""


def flow_figures(r: FlowResult) -> dict[str, Any]:
    """One flow's figures for the evidence and the report."""
    return {"from": r.spec.src, "to": r.spec.dst, "offered_mbit": r.spec.rate_mbit, "sent": r.sent,
            "received": r.received, "loss": round(r.loss, 4), "delivered_mbit": round(r.delivered_mbit, 2),
            "owd_ms_p50_p99_max": [round(x, 3) for x in r.owd_ms], "mtu_ok": r.mtu_ok,
            "mtu_refused_locally": r.mtu_refused, "host_drops": round(r.host_drops),
            "links": list(r.spec.links),
            **({"error": r.error} if r.error else {})}


def _load_issue(link: str, bad: Sequence[FlowResult], phase: str, at_s: float, max_loss: float) -> Issue:
    worst = max(bad, key=lambda r: r.loss)
    summary = (f"{link} fails under load: {worst.spec.src}->{worst.spec.dst} delivered {worst.delivered_mbit:.1f} "
               f"Mbit/s of the {worst.sent * worst.spec.size * 8 / max(worst.duration_s, 1e-9) / 1e6:.0f} sent "
               f"({worst.loss:.0%} loss)")
    if worst.owd_ms:
        summary += f", one-way delay p50 {worst.owd_ms[0]:.1f} ms"
    evidence = {"max_loss": max_loss, "flows": [flow_figures(r) for r in bad]}
    return Issue("link", link, "fails_under_load", Symptom(phase, "loss_under_load", summary, evidence, at_s))


def _mtu_issue(link: str, bad: Sequence[FlowResult], phase: str, at_s: float, mtu: int) -> Issue:
    refused = sorted({r.spec.src for r in bad if r.mtu_refused})
    where = (f"{', '.join(refused)} refuses to send them (its interface's MTU is smaller)" if refused
             else "they are dropped on the way")
    summary = f"{link}: {mtu}-byte don't-fragment packets do not cross it; {where}"
    evidence = {"probe_mtu": mtu, "ends_refusing": refused, "flows": [flow_figures(r) for r in bad]}
    return Issue("link", link, "mtu_mismatch", Symptom(phase, "mtu_probe", summary, evidence, at_s))


def judge_flows(results: Sequence[FlowResult], *, phase: str, at_s: float, mtu: int, max_loss: float = MAX_LOSS,
                known: Sequence[FlowResult] = ()) -> list[Issue]:
    """Issues from one phase's flow results (link flows directly, path flows through `localise`).

    ``known`` are earlier link flows: they vote in the path localisation too (a link that carried more
    than the paths' load on its own clears itself; one that failed it explains the paths that cross it).
    """
    ran = [r for r in results if not r.error]
    issues: list[Issue] = []
    by_link: dict[str, list[FlowResult]] = {}
    for r in ran:
        if r.spec.scope == "link":
            by_link.setdefault(r.spec.links[0], []).append(r)
    for link, flows in sorted(by_link.items()):
        if bad_mtu := [r for r in flows if r.mtu_ok is False]:
            issues.append(_mtu_issue(link, bad_mtu, phase, at_s, mtu))
        if lossy := [r for r in flows if r.loss > max_loss and r.mtu_ok is not False]:
            issues.append(_load_issue(link, lossy, phase, at_s, max_loss))
    paths = [r for r in ran if r.spec.scope == "path"]
    if not paths:
        return issues
    links = [r for r in known if not r.error and r.spec.scope == "link"]
    issues += _localised(paths, links, lambda r: r.mtu_ok is False, lambda r: r.mtu_ok is not False,
                         lambda link, bad: _mtu_issue(link, bad, phase, at_s, mtu))
    # A link flow that passed its own test (at a higher rate than any path's) clears its link: path loss
    # that no such link explains stays unexplained rather than blaming a link that carried its load.
    issues += _localised([r for r in paths if r.mtu_ok is not False], [r for r in links if r.mtu_ok is not False],
                         lambda r: r.loss > max_loss,
                         lambda r: r.loss <= (max_loss if r.spec.scope == "link" else GOOD_LOSS),
                         lambda link, bad: _load_issue(link, bad, phase, at_s, max_loss))
    return issues


def _localised(paths: Sequence[FlowResult], known: Sequence[FlowResult], is_bad: Any, is_good: Any,
               make: Any) -> list[Issue]:
    """Tomography over path flows (and known link flows): the links that explain the bad paths."""
    flows = {f"{r.spec.scope}:{i}": r for i, r in enumerate((*paths, *known))}  # ids repeat across rounds
    obs = [Observation(pid, (r.spec.links,), is_bad(r), r.loss) for pid, r in flows.items() if is_bad(r) or is_good(r)]
    out = []
    for blame in localise(obs, min_paths=1.0, min_share=0.6):
        bad_paths = [flows[p] for p in blame.explained if p.startswith("path:")]
        if not bad_paths:
            continue  # explains only link flows: the link round has said so already
        issue: Issue = make(blame.link, bad_paths)
        others = tuple(c for c in blame.candidates if c != blame.link)
        out.append(Issue(issue.entity_type, issue.entity, issue.kind, issue.symptom, others))
    return out


def nic_ports(expected: Expected) -> dict[str, tuple[str, str, str]]:
    """Host link → (host, NIC, RDMA device) for every NIC the inventory pairs with a device."""
    out = {}
    for h in expected.hosts:
        for r, (nic, link) in enumerate(h.nics.items()):
            if r < len(h.ib_devices):
                out[link] = (h.name, nic, h.ib_devices[r])
    return out


def errors_under_load(window: Window, loaded: Mapping[str, tuple[int, int]],
                      ports: Mapping[str, tuple[str, str, str]], *, at_rest: Iterable[str], at_s: float) -> list[Issue]:
    """NICs whose IB error counters rose over ``window`` (the audit's load, and the few seconds counters take to
    reach the store), among the NICs of links the audit loaded (``loaded``: link → (start, end) ns of its own load).

    The inventory saw these counters flat at rest just before, so a rise now is a rise under load; NICs in
    ``at_rest`` (already climbing with no load) are left to the inventory's issue.
    """
    mine = {(ports[x][0], ports[x][2]): x for x in loaded if x in ports}
    rest = set(at_rest)
    if not mine:
        return []
    rows = sql.counter_series(window, "ridethrough.ib.port.errors", ("ib.device", "ib.counter"),
                              match={"ib.device": sorted({dev for _, dev in mine})})
    rises: dict[tuple[str, str], dict[str, float]] = {}
    for r in rows:
        if (r["node"], r["ib.device"]) in mine and r["increase"] > 0:
            rises.setdefault((r["node"], r["ib.device"]), {})[r["ib.counter"]] = r["increase"]
    issues = []
    for (host, dev), counts in sorted(rises.items()):
        link = mine[(host, dev)]
        nic = ports[link][1]
        if f"{host}/{dev}" in rest or f"{host}/{nic}" in rest:
            continue
        start, end = loaded[link]
        summary = (f"{host}/{nic} error counters climb under load and stay flat at rest: "
                   + ", ".join(f"{k} +{v:g}" for k, v in sorted(counts.items())))
        issues.append(Issue("nic", f"{host}/{nic}", "nic_errors_under_load", Symptom(
            "errors", "ib_errors_under_load", summary,
            {"link": link, "device": f"{host}/{dev}", "increase": counts, "own_load_s": round((end - start) / 1e9, 2),
             "window_s": round(window.seconds, 1)}, at_s)))
    return issues


def gpu_issues(window: Window, *, at_s: float) -> list[Issue]:
    """Failed and failing GPUs over the window, as the controller's GPU detectors see them."""
    issues = []
    for detector in (GpuFailed(), GpuFailing()):
        for f in detector.detect(window):
            kind = f.kind.value
            issues.append(Issue("gpu", f.entity, kind, Symptom("gpu", detector.name, f.summary, dict(f.evidence),
                                                              at_s)))
    return issues


def burn_issues(host: str, result: Mapping[str, Any], *, at_s: float) -> list[Issue]:
    """GPUs that failed a compute burn (``result``: a `ridethrough.audit_contract.Burner`'s answer)."""
    out = []
    for index, r in sorted(result.get("gpus", {}).items()):
        if not r.get("ok"):
            entity = f"{host}/gpu{index}"
            out.append(Issue("gpu", entity, "gpu_failed", Symptom("gpu", "burn", f"{entity} failed its compute burn: "
                                                                  f"{r.get('error', 'wrong results')}", dict(r), at_s)))
    return out
