"""The audit's driver for a namespace lab: endpoints in node namespaces, paths pinned by the kernel's routing.

`LabDriver` starts one `ridethrough.audit_load` endpoint per (node, address) of a round inside
the node's namespace (``Lab.exec``), releases them together once every one is listening, and
turns their reports into `FlowResult`\\ s. Link flows run between the two ends' link addresses
(a leaf and a spine are namespaces like a host, so every cable can be loaded on its own); path
flows run between hosts' stable addresses, and `path_route` asks the kernel (``ip route get``,
hop by hop: `ridethrough.lab.pathwalk`) which links a given source port takes.

An endpoint that does not start, or does not report, fails only its own flows, with the reason.
"""

from __future__ import annotations

import dataclasses
import json
import select
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from ridethrough.audit_model import Expected, FlowResult, FlowSpec
from ridethrough.audit_plan import LinkEnds
from ridethrough.lab.control import LabError
from ridethrough.lab.fabric import Lab
from ridethrough.lab.pathwalk import Walker

DATA_PORT = 29000
"""Every endpoint receives on this port; path flows are pinned with it as the destination port. The audit's
ports sit below the kernel's ephemeral range (32768-60999), where no other socket is handed one by chance."""
LINK_SPORT = 29100
"""Link flows send from ``LINK_SPORT + flow id``."""
READY_TIMEOUT_S = 15.0
FINISH_SLACK_S = 20.0
"""Beyond the load's duration, how long endpoints may take to probe, drain and report (a busy machine is slow)."""
GRACE_S = 0.5
Endpoint = tuple[str, str]
"""(node, address)."""


class LabDriver:
    """Runs the audit's traffic in a running `Lab`."""

    def __init__(self, lab: Lab, *, ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        self.lab = lab
        self.topology = lab.topology
        self.ready_timeout_s = ready_timeout_s
        self._walker = Walker(lab)

    def expected(self) -> Expected:
        """The lab's inventory, from its topology (MTU 1500, fake IB at 200 Gb/s)."""
        spec = self.topology.spec
        return Expected.from_topology(self.topology, rails=spec.rails, gpus=spec.gpus)

    def link_ends(self, names: Sequence[str]) -> list[LinkEnds]:
        """The named links with their end nodes (every lab link can be loaded end to end)."""
        out = []
        for name in names:
            link = self.topology.link(name)
            out.append(LinkEnds(name, link.lower, link.upper))
        return out

    def link_flows(self, link: LinkEnds, *, first_id: int, rate_mbit: float) -> list[FlowSpec]:
        """The two flows (up, then down) that load one link from end to end."""
        lk = self.topology.link(link.name)
        up = FlowSpec(first_id, lk.lower, lk.upper, lk.lower_ip, lk.upper_ip, LINK_SPORT + first_id, DATA_PORT,
                      rate_mbit, (lk.name,), "link")
        down = FlowSpec(first_id + 1, lk.upper, lk.lower, lk.upper_ip, lk.lower_ip, LINK_SPORT + first_id + 1,
                        DATA_PORT, rate_mbit, (lk.name,), "link")
        return [up, down]

    def path_route(self, src: str, dst: str, sport: int) -> tuple[str, ...] | None:
        """The links a UDP flow from ``src``'s stable address and ``sport`` to ``dst`` crosses (None: broken)."""
        walk = self._walker.walk(src, dst, sport=sport, dport=DATA_PORT)
        return walk.links if walk.ok else None

    def path_flow(self, src: str, dst: str, sport: int, links: tuple[str, ...], *, flow_id: int,
                  rate_mbit: float) -> FlowSpec:
        """A host-to-host flow between stable addresses, pinned by its source port."""
        return FlowSpec(flow_id, src, dst, self.topology.stable_ip(src), self.topology.stable_ip(dst), sport,
                        DATA_PORT, rate_mbit, links, "path")

    def run_flows(self, flows: Sequence[FlowSpec], *, duration_s: float, mtu: int) -> list[FlowResult]:
        """Run one round: every flow at once; a result per flow (``error`` set where it could not run)."""
        endpoints: dict[Endpoint, list[FlowSpec]] = {}
        for f in flows:
            endpoints.setdefault((f.src, f.src_ip), []).append(f)
            endpoints.setdefault((f.dst, f.dst_ip), [])
        procs: dict[Endpoint, subprocess.Popen[str]] = {}
        failed: dict[Endpoint, str] = {}
        try:
            for ep, sends in endpoints.items():
                try:
                    procs[ep] = self._start(ep, sends, duration_s=duration_s, mtu=mtu)
                except (LabError, OSError) as exc:
                    failed[ep] = f"endpoint on {ep[0]} ({ep[1]}) did not start: {exc}"
            failed |= self._wait_ready(procs)
            started_ns = time.time_ns()
            for ep, proc in procs.items():
                if ep not in failed:
                    self._go(proc)
            reports, lost = self._collect(procs, failed, timeout_s=duration_s + FINISH_SLACK_S)
            failed |= lost
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        ended_ns = time.time_ns()
        out = [self._result(f, reports, failed, duration_s, (started_ns, ended_ns), probed=mtu > 0) for f in flows]
        return _share_drops(out, reports)

    def _start(self, ep: Endpoint, sends: Sequence[FlowSpec], *, duration_s: float,
               mtu: int) -> subprocess.Popen[str]:
        spec = json.dumps([{"id": f.id, "dst": f.dst_ip, "dport": f.dport, "sport": f.sport,
                            "rate_mbit": f.rate_mbit, "size": f.size} for f in sends])
        argv = [sys.executable, "-m", "ridethrough.audit_load", "--bind", ep[1], "--port", str(DATA_PORT),
                "--flows", spec, "--duration-s", f"{duration_s:g}", "--mtu", str(mtu), "--grace-s", f"{GRACE_S:g}"]
        return self.lab.exec(ep[0], argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)

    def _wait_ready(self, procs: dict[Endpoint, subprocess.Popen[str]]) -> dict[Endpoint, str]:
        """Read each endpoint's first line until all are ready or the deadline; the ones that are not."""
        waiting = {ep: p for ep, p in procs.items()}
        deadline = time.monotonic() + self.ready_timeout_s
        failed: dict[Endpoint, str] = {}
        while waiting and (left := deadline - time.monotonic()) > 0:
            by_fd = {p.stdout: ep for ep, p in waiting.items() if p.stdout is not None}
            for out in select.select(list(by_fd), [], [], min(left, 0.5))[0]:
                ep = by_fd[out]
                line = out.readline()
                if '"ready"' not in line:
                    failed[ep] = f"endpoint on {ep[0]} ({ep[1]}) failed: {_tail(line, waiting[ep])}"
                del waiting[ep]
        for ep in waiting:
            failed[ep] = f"endpoint on {ep[0]} ({ep[1]}) not ready within {self.ready_timeout_s:g} s"
        return failed

    @staticmethod
    def _go(proc: subprocess.Popen[str]) -> None:
        assert proc.stdin is not None
        try:
            proc.stdin.write("go\n")
            proc.stdin.flush()  # communicate() closes it
        except OSError:  # it died since it said ready: its report will be missing, and say so
            pass

    @staticmethod
    def _collect(procs: dict[Endpoint, subprocess.Popen[str]], failed: dict[Endpoint, str], *,
                 timeout_s: float) -> tuple[dict[Endpoint, dict[str, Any]], dict[Endpoint, str]]:
        deadline = time.monotonic() + timeout_s
        reports: dict[Endpoint, dict[str, Any]] = {}
        lost: dict[Endpoint, str] = {}
        for ep, proc in procs.items():
            if ep in failed:
                continue
            try:
                out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                lost[ep] = f"endpoint on {ep[0]} ({ep[1]}) did not finish in time"
                continue
            try:
                report = json.loads(out.strip().splitlines()[-1])
                if "error" in report:
                    raise ValueError(report["error"])
                reports[ep] = report
            except (ValueError, IndexError) as exc:
                lost[ep] = f"endpoint on {ep[0]} ({ep[1]}) gave no report: {exc} {err.strip()[-200:]}"
        return reports, lost

    @staticmethod
    def _result(f: FlowSpec, reports: dict[Endpoint, dict[str, Any]], failed: dict[Endpoint, str],
                duration_s: float, span_ns: tuple[int, int], *, probed: bool) -> FlowResult:
        started_ns, ended_ns = span_ns
        src, dst = (f.src, f.src_ip), (f.dst, f.dst_ip)
        for ep in (src, dst):
            if ep in failed or ep not in reports:
                return FlowResult(f, duration_s, error=failed.get(ep, f"no report from {ep[0]}"),
                                  started_ns=started_ns, ended_ns=ended_ns)
        sent = reports[src]["sent"].get(str(f.id), {})
        recv = reports[dst]["recv"].get(str(f.id), {})
        mtu = sent.get("mtu", {})
        return FlowResult(f, duration_s, int(sent.get("sent", 0)), int(sent.get("errors", 0)),
                          int(recv.get("packets", 0)), tuple(v / 1e6 for v in recv.get("owd_ns", [])),
                          bool(mtu.get("ok")) if probed else None, bool(mtu.get("refused")),
                          started_ns=started_ns, ended_ns=ended_ns)


def _tail(line: str, proc: subprocess.Popen[str]) -> str:
    if line.strip():
        return line.strip()[:200]
    proc.kill()
    _, err = proc.communicate()
    return (err or "exited").strip().splitlines()[-1][:200] if (err or "").strip() else "exited"


def _share_drops(results: list[FlowResult], reports: dict[Endpoint, dict[str, Any]]) -> list[FlowResult]:
    """Spread each endpoint's own drops over the flows they can belong to, in proportion to what each is
    short: a receiver's (socket buffer, interfaces' receive side) over the flows arriving there, a sender's
    (interfaces' transmit side) over the flows leaving it."""
    def spread(end: Any, kinds: tuple[str, ...]) -> dict[int, float]:
        short: dict[Endpoint, float] = {}
        for r in results:
            short[end(r)] = short.get(end(r), 0.0) + max(0, r.sent - r.received)
        out = {}
        for r in results:
            drops = sum(float(reports.get(end(r), {}).get("drops", {}).get(k, 0)) for k in kinds)
            mine = max(0, r.sent - r.received)
            out[r.spec.id] = drops * mine / short[end(r)] if drops and mine else 0.0
        return out
    at_rx = spread(lambda r: (r.spec.dst, r.spec.dst_ip), ("rcvbuf", "rx"))
    at_tx = spread(lambda r: (r.spec.src, r.spec.src_ip), ("tx",))
    return [dataclasses.replace(r, host_drops=at_rx[r.spec.id] + at_tx[r.spec.id]) for r in results]
