"""The fleet audit without a lab: its schedule, each phase on crafted inputs, the report, the store, the CLI.

Telemetry is written into an embedded store as the agents would write it; traffic comes from
`SimFabric`, a driver that honours the audit's driver contract on a simulated fabric (routes from
the lab's topology, a capacity and an MTU per link), so the orchestrator is tested end to end
without root. `tests/test_audit_lab.py` runs the same audit on a real namespace lab.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import time
from collections import Counter
from collections.abc import Collection, Iterator, Mapping, Sequence
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ridethrough import audit_gpu, audit_load
from ridethrough.audit import Audit, AuditConfig, store_query
from ridethrough.audit_checks import judge_flows
from ridethrough.audit_cli import app as audit_app
from ridethrough.audit_inventory import judge
from ridethrough.audit_model import Expected, FlowResult, FlowSpec, Status
from ridethrough.audit_plan import LinkEnds, fit, link_rounds, path_cover
from ridethrough.audit_report import SECTIONS, render_html
from ridethrough.audit_store import read_audit, write_audit
from ridethrough.audit_verdict import anomalies, statuses
from ridethrough.exporters import schema
from ridethrough.exporters.store import Store
from ridethrough.lab.topology import Topology, TopologySpec

S = 10**9
TOPO = Topology(TopologySpec())
EXPECTED = Expected.from_topology(TOPO, rails=2, gpus=8)
ENDS = [LinkEnds(link.name, link.lower, link.upper) for link in TOPO.links]
_tokens = itertools.count()


# -- the schedule -------------------------------------------------------------------------------


def test_link_rounds_load_every_link_once_node_disjoint_in_as_few_rounds_as_the_busiest_node() -> None:
    rounds = link_rounds(ENDS, parallel=4)
    names = [lk.name for r in rounds for lk in r]
    assert sorted(names) == sorted(lk.name for lk in ENDS)
    for r in rounds:
        ends = [n for lk in r for n in (lk.lower, lk.upper)]
        assert len(ends) == len(set(ends)) and len(r) <= 4
    assert len(rounds) == 6  # a leaf has 4 hosts and 2 spines: no schedule does it in fewer
    assert len(link_rounds(ENDS, parallel=1)) == len(ENDS)
    with pytest.raises(ValueError, match="parallel"):
        link_rounds(ENDS, parallel=0)


def test_path_cover_crosses_every_link_a_route_can_reach() -> None:
    sim = SimFabric(TOPO)
    flows, missed = path_cover(TOPO.hosts, [lk.name for lk in ENDS], sim.path_route)
    assert missed == set()
    assert {x for f in flows for x in f.links} == {lk.name for lk in ENDS}
    assert all(f.links == sim.path_route(f.src, f.dst, f.sport) for f in flows)
    one_rack = Topology(TopologySpec(hosts=2, racks=1, rails=1, spines=1))
    _, missed = path_cover(one_rack.hosts, [x.name for x in one_rack.links], SimFabric(one_rack).path_route)
    assert missed == {"leaf0r0-spine0"}  # no host-to-host route climbs to a spine inside one rack


@pytest.mark.parametrize("budget_s", [600.0, 60.0, 40.0, 30.0, 20.0, 5.0])
def test_the_schedule_fits_the_budget_and_names_every_link_it_leaves_out(budget_s: float) -> None:
    rounds = link_rounds(ENDS, parallel=4)
    paths, _ = path_cover(TOPO.hosts, [lk.name for lk in ENDS], SimFabric(TOPO).path_route)
    plan = fit(rounds, paths, budget_s=budget_s, load_s=2.0)
    assert plan.estimated_s <= budget_s or not plan.rounds
    every = {lk.name for lk in ENDS}
    loaded = {lk.name for r in plan.rounds for lk in r}
    assert loaded | (set(plan.dropped) - {"paths"}) == every and not loaded & set(plan.dropped)
    assert all("budget" in why for why in plan.dropped.values())
    if budget_s >= 60:
        assert loaded == every and plan.paths and plan.load_s == 2.0
    if budget_s == 40:
        assert loaded == every and plan.paths and plan.load_s < 2.0  # shorter loads first
    if budget_s <= 30:
        assert "paths" in plan.dropped and loaded < every  # then no path round, then fewer link rounds


# -- judgements on crafted inputs --------------------------------------------------------------------


def _flow(fid: int, links: tuple[str, ...], *, sent: int = 1000, received: int = 1000, mtu_ok: bool | None = True,
          refused: bool = False, scope: str = "link", src: str = "a", dst: str = "b", drops: float = 0.0) -> FlowResult:
    spec = FlowSpec(fid, src, dst, "10.0.0.1", "10.0.0.2", 29100 + fid, 29000, 50.0, links, scope)
    return FlowResult(spec, 2.0, sent, 0, received, (0.2, 1.0, 2.0), mtu_ok, refused, host_drops=drops)


def test_link_flows_name_their_link_and_the_end_that_refuses_big_packets() -> None:
    results = [_flow(1, ("h0-leaf0r0",)), _flow(2, ("h0-leaf0r0",)),
               _flow(3, ("leaf1r0-spine1",), received=300), _flow(4, ("leaf1r0-spine1",), received=310),
               _flow(5, ("h2-leaf0r1",), mtu_ok=False), _flow(6, ("h2-leaf0r1",), mtu_ok=False, refused=True,
                                                           src="leaf0r1"),
               _flow(7, ("h3-leaf0r0",), received=600, drops=400)]  # the receiver's own drops are not loss
    issues = judge_flows(results, phase="links", at_s=3.0, mtu=1500)
    assert {(i.entity, i.kind) for i in issues} == {("leaf1r0-spine1", "fails_under_load"),
                                                    ("h2-leaf0r1", "mtu_mismatch")}
    mtu = next(i for i in issues if i.kind == "mtu_mismatch")
    assert mtu.symptom.evidence["ends_refusing"] == ["leaf0r1"] and "leaf0r1 refuses" in mtu.symptom.summary
    assert results[6].loss == 0.0 and results[2].loss == pytest.approx(0.7)


def test_bad_paths_are_localised_with_the_link_rounds_evidence() -> None:
    """Two bad paths share two spine links; alone they cannot tell which; the link round's flows settle it."""
    a = ("h0-leaf0r0", "leaf0r0-spine1", "leaf1r0-spine1", "h4-leaf1r0")
    b = ("h3-leaf0r0", "leaf0r0-spine1", "leaf1r0-spine1", "h7-leaf1r0")
    paths = [_flow(1, a, received=500, scope="path"), _flow(2, b, received=400, scope="path")]
    alone = judge_flows(paths, phase="paths", at_s=1.0, mtu=1500)
    assert [(i.entity, i.candidates) for i in alone] == [("leaf0r0-spine1", ("leaf1r0-spine1",))]
    known = [_flow(10, ("leaf0r0-spine1",)), _flow(11, ("leaf0r0-spine1",)),
             _flow(12, ("leaf1r0-spine1",), received=400), _flow(13, ("leaf1r0-spine1",), received=400)]
    settled = judge_flows(paths, phase="paths", at_s=1.0, mtu=1500, known=known)
    assert [(i.entity, i.candidates) for i in settled] == [("leaf1r0-spine1", ())]
    # one lossy path whose every link passed its own, heavier test blames none of them (a busy end host)
    c = ("h2-leaf0r0", "leaf0r0-spine0", "leaf1r0-spine0", "h6-leaf1r0")
    passed = [_flow(1 + i % 2, (x,), received=990) for x in c for i in range(2)]  # ids repeat, as across rounds
    assert judge_flows([_flow(3, c, received=920, scope="path")], phase="paths", at_s=1.0, mtu=1500,
                       known=passed) == []
    assert judge_flows([_flow(3, c, received=920, scope="path")], phase="paths", at_s=1.0, mtu=1500) != []


def _healthy_facts(expected: Expected) -> dict[str, dict[str, Any]]:
    out = {}
    for h in expected.hosts:
        out[h.name] = {"last_ns": 1, "nics": {n: {"up": 1.0, "mtu": 1500.0} for n in h.nics},
                       "ib": {d: {"state": 4.0, "rate_gbit": 200.0} for d in h.ib_devices},
                       "gpus": {str(i): {"model": "H100", "memory_bytes": 8e10} for i in range(h.gpus)},
                       "clock_uncertainty_s": 2e-6}
    return out


def test_inventory_judges_presence_speed_mtu_consistency_and_clocks() -> None:
    facts = _healthy_facts(EXPECTED)
    issues, gaps = judge(EXPECTED, facts, at_s=1.0, window_s=15)
    assert issues == [] and set(gaps) == {"versions"}
    del facts["h7"]
    facts["h1"]["nics"]["nic1"]["mtu"] = 9000.0
    facts["h2"]["nics"]["nic0"]["up"] = 0.0
    facts["h3"]["ib"]["mlx5_1"]["rate_gbit"] = 100.0
    del facts["h4"]["gpus"]["7"]
    facts["h5"]["gpus"]["2"]["model"] = "H800"
    facts["h6"]["clock_uncertainty_s"] = 0.05
    facts["h0"]["ib"]["mlx5_0"]["errors"] = {"symbol_error": 12.0}
    issues, gaps = judge(EXPECTED, facts, at_s=1.0, window_s=15)
    assert {(i.entity, i.kind) for i in issues} == {
        ("h7", "no_telemetry"), ("h1-leaf0r1", "mtu_mismatch"), ("h2/nic0", "nic_down"),
        ("h3-leaf0r1", "wrong_speed"), ("h4", "gpu_missing"), ("h5/gpu2", "gpu_config_mismatch"),
        ("h6", "clock_unsynced"), ("h0/mlx5_0", "nic_errors_at_rest")}
    assert "h7" in gaps
    for f in facts.values():
        f.pop("clock_uncertainty_s", None)
    _, gaps = judge(EXPECTED, facts, at_s=1.0, window_s=15)
    assert "clock" in gaps  # no clock service at all is a gap, not six unsynchronised hosts


def test_issues_fold_into_one_anomaly_per_entity_and_a_bad_nic_fails_its_link_and_host() -> None:
    flows = [_flow(1, ("h2-leaf0r1",), mtu_ok=False), _flow(2, ("h2-leaf0r1",), received=100, mtu_ok=False)]
    issues = judge_flows(flows, phase="links", at_s=2.0, mtu=1500)
    facts = _healthy_facts(EXPECTED)
    facts["h5"]["nics"]["nic0"]["up"] = 0.0
    issues += judge(EXPECTED, facts, at_s=1.0, window_s=15)[0]
    found = anomalies(issues)
    assert [(a.entity, a.kind) for a in found] == [("h5/nic0", "nic_down"), ("h2-leaf0r1", "mtu_mismatch")]
    assert all(a.action for a in found)
    hosts, links = statuses(EXPECTED, found, links_checked=["h2-leaf0r1", "h0-leaf0r0"], hosts_not_covered=["h7"])
    assert hosts["h5"] is Status.FAIL and hosts["h2"] is Status.FAIL and hosts["h7"] is Status.NOT_COVERED
    assert links["h5-leaf1r0"] is Status.FAIL and links["h0-leaf0r0"] is Status.PASS
    assert links["h1-leaf0r0"] is Status.NOT_COVERED


def test_inventory_files_are_checked_with_errors_that_name_the_file(tmp_path: Path) -> None:
    good = tmp_path / "fleet.yaml"
    good.write_text("mtu: 4200\ngpus: 8\nhosts:\n  n1: {nics: {eth2: n1-leafA}, ib_devices: [mlx5_0]}\n"
                    "  n2: {nics: {eth2: n2-leafA}, gpus: 4}\n")
    exp = Expected.load(good)
    assert exp.mtu == 4200 and exp.host("n2") is not None and exp.links == ("n1-leafA", "n2-leafA")
    assert exp.nic_link("n1", "mlx5_0") == "n1-leafA" and exp.host("n2").gpus == 4  # type: ignore[union-attr]
    for text, why in (("[1, 2]", "hosts"), ("hosts: {n1: {}}\ncolour: red", "unknown keys"),
                      ("hosts: {n1: {gpus: -1}}", "gpus"), ("hosts: {n1: {ib_devices: mlx5_0}}", "ib_devices"),
                      ("hosts: {n1: {}}\nib_rate_gbit: fast", "ib_rate_gbit"), ("hosts: {n1: [", "fleet")):
        good.write_text(text)
        with pytest.raises(ValueError, match=why) as info:
            Expected.load(good)
        assert "fleet.yaml" in str(info.value)


# -- the traffic endpoint, over loopback -----------------------------------------------------------------


def test_endpoint_counts_what_arrives_probes_the_mtu_and_reads_its_drops(tmp_path: Path) -> None:
    import threading

    flows = [audit_load.Flow(1, "127.0.0.3", 29500, 29501, 20.0, 1000)]
    back = [audit_load.Flow(2, "127.0.0.2", 29500, 29502, 20.0, 1000)]
    out: dict[str, Any] = {}
    runs = [threading.Thread(target=lambda k=k, ip=ip, f=f: out.__setitem__(k, audit_load.run(
        ip, 29500, f, duration_s=0.5, mtu=1500, grace_s=0.3, wait_go=False)))
        for k, ip, f in (("a", "127.0.0.2", flows), ("b", "127.0.0.3", back))]
    for t in runs:
        t.start()
    for t in runs:
        t.join(20)
    a, b = out["a"], out["b"]
    assert a["sent"]["1"]["mtu"] == {"ok": True, "refused": False}
    assert a["sent"]["1"]["sent"] == pytest.approx(1250, rel=0.2) == b["recv"]["1"]["packets"]
    assert b["sent"]["2"]["sent"] == a["recv"]["2"]["packets"] and len(a["recv"]["2"]["owd_ns"]) == 3
    huge = audit_load.run("127.0.0.4", 29510, [audit_load.Flow(3, "127.0.0.5", 29510, 29511, 1.0, 100)],
                          duration_s=0.1, mtu=70_000, grace_s=0.0, wait_go=False)
    assert huge["sent"]["3"]["mtu"] == {"ok": False, "refused": True}  # bigger than any UDP datagram: refused here
    dev = tmp_path / "dev"
    dev.write_text("Inter-|   Receive                            |  Transmit\n"
                   " face |bytes packets errs drop fifo frame compressed multicast|bytes packets errs drop fifo\n"
                   "    lo: 10 1 0 2 0 0 0 0 10 1 0 0 0 0 0 0\n  nic0: 100 9 0 3 0 0 0 0 900 90 0 17 0 0 0 0\n")
    assert audit_load.interface_drops(str(dev)) == (5, 17) and audit_load.interface_drops(str(tmp_path)) == (0, 0)
    assert set(a["drops"]) == {"rcvbuf", "rx", "tx"}
    snmp = tmp_path / "snmp"
    snmp.write_text("Ip: Forwarding\nIp: 1\nUdp: InDatagrams NoPorts InErrors OutDatagrams RcvbufErrors\n"
                    "Udp: 10 0 7 12 7\n")
    assert audit_load.udp_rcvbuf_errors(str(snmp)) == 7 and audit_load.udp_rcvbuf_errors(str(tmp_path / "x")) == 0
    with pytest.raises(ValueError, match="--flows"):
        audit_load.parse_flows('[{"id": 1}]')


def test_the_gpu_burn_passes_a_sound_device_and_says_when_there_is_no_gpu() -> None:
    pytest.importorskip("torch")
    got = audit_gpu.burn(0.3, device="cpu", size=128)
    assert got["gpus"]["0"]["ok"] and got["gpus"]["0"]["tflops"] > 0 and got["gpus"]["0"]["iterations"] > 0
    import torch

    if not torch.cuda.is_available():
        assert "no CUDA GPU" in audit_gpu.burn(0.1)["skipped"]


# -- the whole audit on a simulated fabric and crafted telemetry -----------------------------------------


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    st = Store(f"chdb://{tmp_path_factory.mktemp('audit') / 'store'}")
    st.init_schema()
    yield st
    st.close()


def _insert(store: Store, table: schema.Table, rows: Sequence[dict[str, Any]]) -> None:
    cols = [c for c in table.columns if c.insert]

    def default(typ: str) -> Any:
        return {} if typ.startswith("Map") else [] if typ.startswith("Array") else "" if "String" in typ else 0
    store.insert_columns(table, [[r.get(c.name, default(c.type)) for r in rows] for c in cols],
                         token=f"audit-test-{next(_tokens)}")


def _telemetry(store: Store, cluster: str, expected: Expected, **kw: Any) -> None:
    gauges, sums = fleet_rows(cluster, expected, now_ns=time.time_ns(), **kw)
    _insert(store, schema.GAUGE, gauges)
    _insert(store, schema.SUM, sums)


def test_audit_covers_every_link_and_localises_each_fault_exactly(store: Store) -> None:
    topo = Topology(TopologySpec(hosts=4, racks=2, rails=1, spines=1, gpus=2))
    expected = Expected.from_topology(topo, rails=1, gpus=2)
    _telemetry(store, "sim1", expected, remap_pending={"h3/gpu1"})
    sim = SimFabric(topo, caps_mbit={"leaf1r0-spine0": 20.0}, small_mtu={"h1-leaf0r0": "leaf0r0"})
    cfg = AuditConfig(budget_s=120, cluster="sim1", errors_pad_s=0.2, fresh_timeout_s=5)
    burned: list[str] = []

    def burner(host: str) -> dict[str, Any]:
        burned.append(host)
        return {"gpus": {"0": {"ok": True, "tflops": 1.0}, "1": {"ok": host != "h2", "error": "results differ"}}}
    result = Audit(expected, store_query(store), driver=sim, config=cfg, burner=burner).run()
    assert burned == topo.hosts
    assert [(a.entity, a.kind, a.candidates) for a in sorted(result.anomalies, key=lambda a: a.entity)] == [
        ("h1-leaf0r0", "mtu_mismatch", ()), ("h2/gpu1", "gpu_failed", ()), ("h3/gpu1", "gpu_failing", ()),
        ("leaf1r0-spine0", "fails_under_load", ())]
    assert set(result.links) == {x.name for x in topo.links} and Status.NOT_COVERED not in result.links.values()
    assert {x for r in sim.rounds for f in r for x in f.links} == set(result.links)
    assert result.hosts == {"h0": Status.PASS, "h1": Status.FAIL, "h2": Status.FAIL, "h3": Status.FAIL}
    doc = json.loads(result.dumps())
    assert doc["status"] == "fail" and doc["anomalies"][0]["action"]
    assert doc["not_covered"] == {"inventory: versions": doc["not_covered"]["inventory: versions"]}


def test_an_unreachable_host_and_a_store_that_does_not_answer_give_partial_results(store: Store) -> None:
    topo = Topology(TopologySpec(hosts=2, racks=1, rails=1, spines=1, gpus=1))
    expected = Expected.from_topology(topo, rails=1, gpus=1)
    _telemetry(store, "sim2", expected.only(["h0"]))
    sim = SimFabric(topo, unreachable={"h1"})
    cfg = AuditConfig(budget_s=60, cluster="sim2", errors_pad_s=0.2, fresh_timeout_s=2)
    result = Audit(expected, store_query(store), driver=sim, config=cfg, unknown_hosts=["h9"]).run()
    assert {(a.entity, a.kind) for a in result.anomalies} == {("h1", "no_telemetry"), ("h9", "unknown_host")}
    assert result.status is Status.PARTIAL and result.hosts["h0"] is Status.PASS
    assert result.hosts["h9"] is Status.NOT_COVERED
    assert result.hosts["h1"] is Status.NOT_COVERED and result.links["h1-leaf0r0"] is Status.NOT_COVERED
    assert "did not start" in result.not_covered()["links: h1-leaf0r0"]
    dead = Store("http://127.0.0.1:9", timeout_s=1.0)
    result = Audit(expected, store_query(dead), config=AuditConfig(budget_s=3, fresh_timeout_s=1)).run()
    assert result.status is Status.PARTIAL and not result.anomalies
    assert "store did not answer" in result.not_covered()["inventory: *"]
    assert set(result.hosts.values()) == {Status.NOT_COVERED}


def test_the_report_renders_every_section_and_the_store_keeps_the_audit(store: Store, tmp_path: Path) -> None:
    topo = Topology(TopologySpec(hosts=2, racks=1, rails=1, spines=1, gpus=1))
    expected = Expected.from_topology(topo, rails=1, gpus=1)
    _telemetry(store, "sim3", expected, nic_down={"h1/nic0"})
    cfg = AuditConfig(budget_s=60, cluster="sim3", errors_pad_s=0.2, fresh_timeout_s=2)
    result = Audit(expected, store_query(store), driver=SimFabric(topo), config=cfg).run()
    page = render_html(result)
    path = tmp_path / "audit.html"
    path.write_text(page)
    check_report_sections(path, SECTIONS, anomalies=["h1/nic0"], hosts=["h0", "h1"])
    assert "<script" not in page and "http" not in page.split("<body>")[1]  # nothing to fetch
    write_audit(store, result, page)
    write_audit(store, result, page)  # a retry is a no-op
    assert read_audit(store, result.audit_id) == json.loads(result.dumps())
    _, rows = store.query("SELECT count(), any(Status), any(Entities) FROM audits WHERE AuditId = {i:String}",
                          parameters={"i": result.audit_id})
    assert rows == [(1, "fail", ["h1/nic0"])]
    assert read_audit(store, "nope") is None


# -- the command line --------------------------------------------------------------------------------


def test_cli_refuses_bad_input_with_one_line_and_audits_real_hosts_from_an_inventory(tmp_path: Path,
                                                                                        store: Store) -> None:
    runner = CliRunner()
    bad = runner.invoke(audit_app, ["--budget", "soon", "--inventory", str(tmp_path / "none.yaml")])
    assert bad.exit_code == 2 and "--budget" in bad.output
    both = runner.invoke(audit_app, ["--lab", "x", "--inventory", "y"])
    assert both.exit_code == 2 and "exactly one" in both.output
    missing = runner.invoke(audit_app, ["--inventory", str(tmp_path / "none.yaml")])
    assert missing.exit_code == 2 and "none.yaml" in missing.output
    inv = tmp_path / "fleet.json"
    inv.write_text(json.dumps({"mtu": 1500, "hosts": {"n1": {"nics": {"eth0": "n1-sw"}}}}))
    dead = runner.invoke(audit_app, ["--inventory", str(inv), "--store", "http://127.0.0.1:9", "--budget", "3s",
                                     "--out", str(tmp_path / "out")])
    assert dead.exit_code == 3, dead.output  # partial: the store did not answer; nothing failed, nothing crashed
    assert "NOT recorded" in dead.output and len(list((tmp_path / "out").glob("audit-*.html"))) == 1


# -- helpers (tests/test_audit_lab.py uses them too) -------------------------------------------------------


class SimFabric:
    """The audit's driver contract on a simulated fabric: the lab topology's routes (the ECMP member picked
    by source port), a capacity per link that the flows crossing it share, a link end with a smaller MTU,
    and hosts where no endpoint starts."""

    def __init__(self, topo: Topology, *, caps_mbit: Mapping[str, float] | None = None,
                 small_mtu: Mapping[str, str] | None = None, unreachable: set[str] | None = None) -> None:
        self.topo, self.caps = topo, dict(caps_mbit or {})
        self.small_mtu, self.unreachable = dict(small_mtu or {}), set(unreachable or ())
        self.rounds: list[list[FlowSpec]] = []

    def link_ends(self, names: Sequence[str]) -> list[LinkEnds]:
        return [LinkEnds(n, self.topo.link(n).lower, self.topo.link(n).upper) for n in names]

    def link_flows(self, link: LinkEnds, *, first_id: int, rate_mbit: float) -> list[FlowSpec]:
        lk = self.topo.link(link.name)
        return [FlowSpec(first_id, lk.lower, lk.upper, lk.lower_ip, lk.upper_ip, 29100 + first_id, 29000, rate_mbit,
                         (lk.name,)),
                FlowSpec(first_id + 1, lk.upper, lk.lower, lk.upper_ip, lk.lower_ip, 29101 + first_id, 29000,
                         rate_mbit, (lk.name,))]

    def path_route(self, src: str, dst: str, sport: int) -> tuple[str, ...] | None:
        paths = self.topo.paths(src, dst)
        return paths[sport % len(paths)] if paths and paths[0] else None

    def path_flow(self, src: str, dst: str, sport: int, links: tuple[str, ...], *, flow_id: int,
                  rate_mbit: float) -> FlowSpec:
        return FlowSpec(flow_id, src, dst, self.topo.stable_ip(src), self.topo.stable_ip(dst), sport, 29000,
                        rate_mbit, links, "path")

    def run_flows(self, flows: Sequence[FlowSpec], *, duration_s: float, mtu: int) -> list[FlowResult]:
        self.rounds.append(list(flows))
        offered: Counter[str] = Counter()
        for f in flows:
            for x in f.links:
                offered[x] += f.rate_mbit
        now = time.time_ns()
        out = []
        for f in flows:
            down = {f.src, f.dst} & self.unreachable
            if down:
                out.append(FlowResult(f, duration_s, error=f"endpoint on {min(down)} did not start: unreachable"))
                continue
            share = min([1.0, *(self.caps.get(x, 1e9) / offered[x] for x in f.links)])
            sent = int(f.rate_mbit * 1e6 * duration_s / 8 / f.size)
            mtu_ok = not any(x in self.small_mtu for x in f.links)
            refused = self.small_mtu.get(f.links[0]) == f.src
            out.append(FlowResult(f, duration_s, sent, 0, int(sent * share), (0.1, 0.5, 1.0), mtu_ok, refused,
                                  started_ns=now, ended_ns=now))
        return out


def fleet_rows(cluster: str, expected: Expected, *, now_ns: int, remap_pending: Collection[str] = (),
               nic_down: Collection[str] = ()) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Gauge and counter rows of a healthy fleet's agents (and the clock service) from 10 s ago to 20 s ahead,
    as the store holds them; ``remap_pending`` GPUs and ``nic_down`` NICs (``h3/gpu1``, ``h1/nic0``) are not."""
    gauges: list[dict[str, Any]] = []
    sums: list[dict[str, Any]] = []
    for t in range(now_ns - 10 * S, now_ns + 20 * S, 2 * S):
        for h in expected.hosts:
            res = {"ridethrough.node.id": h.name, "host.name": h.name, "ridethrough.cluster": cluster}

            def row(metric: str, attrs: dict[str, str], value: float, h: str = h.name,
                    res: dict[str, str] = res, t: int = t) -> dict[str, Any]:
                return {"ResourceAttributes": res, "ServiceName": "ridethrough-agent", "MetricName": metric,
                        "Attributes": attrs, "StartTimeUnix": now_ns - 3600 * S, "TimeUnix": t, "Value": value,
                        "AggregationTemporality": 2, "IsMonotonic": True}
            for nic in h.nics:
                gauges.append(row("ridethrough.nic.up", {"network.interface.name": nic},
                                  0.0 if f"{h.name}/{nic}" in nic_down else 1.0))
                gauges.append(row("ridethrough.nic.mtu", {"network.interface.name": nic}, 1500.0))
            for dev in h.ib_devices:
                gauges.append(row("ridethrough.ib.port.state", {"ib.device": dev, "ib.port": "1"}, 4.0))
                gauges.append(row("ridethrough.ib.port.rate", {"ib.device": dev, "ib.port": "1"}, 200.0))
                sums.append(row("ridethrough.ib.port.errors", {"ib.device": dev, "ib.port": "1",
                                                                "ib.counter": "symbol_error"}, 0.0))
            for i in range(h.gpus):
                gpu = {"gpu.index": str(i), "hw.id": f"GPU-{h.name}-{i}", "hw.model": "NVIDIA H100 80GB HBM3"}
                gauges.append(row("hw.gpu.memory.limit", gpu, 85520809984.0))
                gauges.append(row("ridethrough.gpu.memory.remap_pending", gpu,
                                  1.0 if f"{h.name}/gpu{i}" in remap_pending else 0.0))
            clock = {"service.name": "ridethrough-clock"}
            gauges.append({"ResourceAttributes": clock, "ServiceName": "ridethrough-clock",
                           "MetricName": "ridethrough.clock.node.uncertainty", "TimeUnix": t, "Value": 2e-6,
                           "Attributes": {"clock.node": h.name, "clock.reference": expected.hosts[0].name}})
    return gauges, sums


class _Sections(HTMLParser):
    """Section ids with their headings, anomaly entities, and the first cell of each row of the hosts table."""

    def __init__(self) -> None:
        super().__init__()
        self.sections: list[str] = []
        self.anomalies: list[str] = []
        self.hosts: list[str] = []
        self._section, self._cell, self._first = "", False, False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "section":
            self._section = a.get("id") or ""
            self.sections.append(self._section)
        if a.get("class") == "anomaly":
            self.anomalies.append(a.get("data-entity") or "")
        if tag == "tr":
            self._first = True
        self._cell = tag == "td" and self._section == "hosts" and self._first
        if tag == "td":
            self._first = False

    def handle_data(self, data: str) -> None:
        if self._cell:
            self.hosts.append(data)
            self._cell = False


def check_report_sections(path: Path, sections: Sequence[str], *, anomalies: Sequence[str],
                          hosts: Sequence[str]) -> None:
    """The report holds each section, these anomalies and hosts: parsed, and in the browser when there is one
    (Debian chromium driven by Playwright)."""
    parsed = _Sections()
    parsed.feed(path.read_text())
    assert parsed.sections == list(sections) and parsed.anomalies == list(anomalies) and parsed.hosts == list(hosts)
    if not (Path("/usr/bin/chromium").exists() and importlib.util.find_spec("playwright")):
        return
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(path.as_uri())
            for s in sections:
                assert page.locator(f"section#{s} > h2").is_visible(), s
            got = page.locator("#anomalies .anomaly").evaluate_all("els => els.map(e => e.dataset.entity)")
            assert got == list(anomalies)
            assert page.locator("#hosts tr td:first-child").all_inner_texts() == list(hosts)
            assert page.locator("#anomalies .action").count() == len(anomalies)
        finally:
            browser.close()
