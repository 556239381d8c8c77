"""The central reroute's verify from the probes: the agents' probe counters in a real (embedded) store.

The plugin runs against the lab-shaped fake agents of `tests.test_reroute_plugin` (real route commands
over in-memory tables). Probe metrics are what an agent's probe source reports (the catalogue's names and
attributes), encoded by the agent's own `SampleEncoder` and written through the gateway's conversion
(`write_requests`), one collection per call, each stamped with its time. Every test uses its own cluster,
so the tests share one store without seeing each other's rows.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.sdk.resources import Resource

from ridethrough.actuators.contract import Deadline, FleetState, Plan, Result
from ridethrough.actuators.reroute_plan import decode_changes
from ridethrough.actuators.reroute_plugin import RerouteConfig, ReroutePlugin
from ridethrough.actuators.reroute_verify import ProbeVerifyConfig, too_lossy
from ridethrough.collector.otlp_encode import SampleEncoder
from ridethrough.collector.sample import MetricKind, Sample
from ridethrough.controller_wiring import build_controller
from ridethrough.detectors.contract import Severity
from ridethrough.detectors.controller import ControllerMetrics
from ridethrough.detectors.fabric_map import RouteMap
from ridethrough.detectors.incidents import Incident, State
from ridethrough.exporters.gateway_metrics import GatewayMetrics
from ridethrough.exporters.pipeline import write_requests
from ridethrough.exporters.signals import Signal
from ridethrough.exporters.store import Store
from ridethrough.lab.topology import Topology, TopologySpec
from ridethrough.settings import ActuatorConfig, ControllerConfig
from tests.test_reroute_plugin import FakeAgents

LINK = "leaf0r1-spine0"
TOPO = Topology(TopologySpec(hosts=4, racks=2, rails=2, spines=2, gpus=0))
FMAP = RouteMap.from_fabric(TOPO)
ADDRESSES = {h: TOPO.stable_ip(h) for h in TOPO.hosts}
CROSS = [(a, b) for a in TOPO.hosts for b in TOPO.hosts if TOPO.rack_of(a) != TOPO.rack_of(b)]
"""The pairs a spine link's plan moves (cross-rack), each now on nic0 only."""
QUICK = ProbeVerifyConfig(poll_s=0.2, margin_s=0.5, settle_s=0.0, min_probes=4)
"""The tests stamp their probes a few ms after the apply: no settling time; a few rounds of them judge a rail."""
MS = 1_000_000
_clusters = itertools.count()
_tokens = itertools.count()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    s = Store(f"chdb://{tmp_path_factory.mktemp('reroute-verify') / 'store'}")
    s.init_schema()
    yield s
    s.close()


class Agents:
    """Each host's probe counters, as its probe source keeps them, sent to the store one collection at a time."""

    def __init__(self, store: Store, cluster: str) -> None:
        self.store, self.cluster = store, cluster
        self.encoders = {h: SampleEncoder(resource=Resource.create({
            "service.name": "ridethrough-agent", "host.name": h, "ridethrough.node.id": h,
            "ridethrough.cluster": cluster}), scope="ridethrough.collector") for h in TOPO.hosts}
        # path -> [sent, received, lost fwd, lost rev, unknown]
        self.counts: dict[tuple[str, str, str, str], list[int]] = {}
        self.suspended: set[tuple[str, str, str, str]] = set()
        self.stalled: dict[str, float] = {}
        """Seconds each host's probe threads were held off so far (``ridethrough.probe.stalled``)."""

    def probe(self, src: str, dst: str, nic: str, *, sent: int, lost: int = 0, unknown: int = 0) -> None:
        """``src``'s prober sends ``sent`` probes from its ``nic`` to ``dst``'s, ``lost`` of them never answered
        while ``dst`` answered others, ``unknown`` never answered while ``dst`` answered nothing."""
        c = self.counts.setdefault((src, nic, dst, nic), [0, 0, 0, 0, 0])
        c[0], c[1], c[2], c[4] = c[0] + sent, c[1] + sent - lost - unknown, c[2] + lost, c[4] + unknown

    def stop(self, src: str, dst: str) -> None:
        """``src``'s prober no longer reports its paths to ``dst`` (the peer was drawn out of its probed set)."""
        self.counts = {k: v for k, v in self.counts.items() if (k[0], k[2]) != (src, dst)}

    def everyone(self, nic: str, *, sent: int = 4, lost: int = 0, pairs: Sequence[tuple[str, str]] = CROSS) -> None:
        for src, dst in pairs:
            self.probe(src, dst, nic, sent=sent, lost=lost)

    def collect(self, t_ns: int) -> None:
        """Every host's collection at ``t_ns``, through the agent's encoder and the gateway's conversion."""
        for host, encoder in self.encoders.items():
            groups: dict[str, list[Sample]] = {}
            if host in self.stalled:
                groups["ridethrough.probe.stalled"] = [Sample("ridethrough.probe.stalled", self.stalled[host],
                                                              MetricKind.COUNTER, "s", {"probe.role": "responder"})]
            for (src, nic, dst, dnic), (sent, received, fwd, rev, unknown) in self.counts.items():
                if src != host:
                    continue
                attrs = {"probe.src.node": src, "probe.src.nic": nic, "probe.dst.node": dst, "probe.dst.nic": dnic}
                for name, value, extra in (("sent", sent, {}), ("received", received, {}), ("unknown", unknown, {}),
                                           ("lost", fwd, {"probe.direction": "forward"}),
                                           ("lost", rev, {"probe.direction": "reverse"})):
                    groups.setdefault(f"ridethrough.probe.{name}", []).append(
                        Sample(f"ridethrough.probe.{name}", value, MetricKind.COUNTER, "{probe}", attrs | extra))
                suspended = float((src, nic, dst, dnic) in self.suspended)
                groups.setdefault("ridethrough.probe.path.suspended", []).append(
                    Sample("ridethrough.probe.path.suspended", suspended, MetricKind.GAUGE, "1", attrs))
            if not groups:
                continue
            encoded = encoder.encode(groups.items(), start_ns=t_ns - 3600 * 10**9, now_ns=t_ns)
            request = ExportMetricsServiceRequest.FromString(encoded.payload)
            write_requests(self.store, [(Signal.METRICS, request)], token=f"probes{next(_tokens)}",
                           metrics=GatewayMetrics.create())

    def rounds(self, t0_ns: int, n: int, *, nic: str = "nic0", lost: int = 0,
               pairs: Sequence[tuple[str, str]] = CROSS) -> None:
        """``n`` collections 1 ms apart from ``t0_ns``, each after a round of probes on ``nic``."""
        for i in range(n):
            self.everyone(nic, lost=lost, pairs=pairs)
            self.collect(t0_ns + (i + 1) * MS)


def incident(cluster: str, opened_ns: int = 1) -> Incident:
    return Incident(f"inc-{cluster}", f"link_down:link:{LINK}", "link_down", "link", LINK, cluster, "link_down",
                    Severity.ERROR, State.OPEN, opened_ns, opened_ns, 0, opened_ns, 1, 0, "", "{}", "ab" * 16, 1)


def plugin(*, fmap: list[RouteMap] | None = None, probes: ProbeVerifyConfig = QUICK,
           agents: FakeAgents | None = None) -> ReroutePlugin:
    """The plugin over fake agents; ``fmap`` (a one-element list) lets a test swap the fabric map it reads."""
    maps = fmap or [FMAP]
    return ReroutePlugin(agents or FakeAgents(TOPO), target=lambda node: f"{node}.mgmt:7450", fabric=lambda: maps[0],
                         addresses=lambda: ADDRESSES, config=RerouteConfig(probes=probes))


def applied(p: ReroutePlugin, store: Store, *, opened_ns: int = 1,
            before_lost: int = 0) -> tuple[Plan, Agents, int]:
    """A plan for the cut ``LINK`` applied, probe checks on ``store``; the agents' probes and the instant after.

    The probes 20 s before the apply lose ``before_lost`` of 4 a round; they are the rails' baseline when the
    incident opened (``opened_ns``) 60 s or more after them (the plugin's default ``fault_lead_s``).
    """
    cluster = f"c{next(_clusters)}"
    p.use_store(store)
    plan = p.plan(incident(cluster, opened_ns), FleetState(taken_at_ns=1))
    assert isinstance(plan, Plan)
    agents = Agents(store, cluster)
    agents.rounds(time.time_ns() - 20_000 * MS, 3, lost=before_lost)  # before the change: they prove nothing of it
    done = p.apply(plan, Deadline.after(30))
    assert done.ok, done.detail
    return plan, agents, time.time_ns()


def test_fresh_good_probes_on_the_rail_in_use_confirm_every_pair(store: Store) -> None:
    p = plugin()
    plan, agents, after = applied(p, store)
    agents.rounds(after, 3)
    for i in range(3):  # the cut rail loses everything: it carries none of the moved traffic
        agents.everyone("nic1", lost=4)
        agents.collect(after + (4 + i) * MS)
    verified = p.verify(plan, Deadline.after(60))
    assert verified.ok, verified.detail
    pairs = len(decode_changes(plan.params["changes"]))
    assert "none leaves through" in verified.detail, "the route readback ran first"
    assert f"probes since the apply confirm all {pairs} pairs: {pairs * 2 * 8} probes judged" in verified.detail
    assert f"0 lost (0 not judged: a peer stalled), none of those rails crosses {LINK}" in verified.detail
    assert verified.timings_s["probes_s"] >= 0


def test_probes_lost_on_the_rail_in_use_fail_naming_the_pair(store: Store) -> None:
    p = plugin()
    plan, agents, after = applied(p, store)
    healthy = [pair for pair in CROSS if set(pair) != {"h0", "h2"}]
    agents.rounds(after, 3, pairs=healthy)
    agents.rounds(after + 10 * MS, 3, pairs=[("h0", "h2"), ("h2", "h0")], lost=2)
    started = time.monotonic()
    verified = p.verify(plan, Deadline.after(120))
    assert not verified.ok
    assert "probes: 2 of 8 pair rails not confirmed" in verified.detail, verified.detail
    assert "h0 -> h2 over nic0: 50% of 24 probes lost since the apply" in verified.detail
    assert "h2 -> h0 over nic0: 50% of 24 probes lost since the apply" in verified.detail
    assert "h1 ->" not in verified.detail and "h3 ->" not in verified.detail
    assert time.monotonic() - started < 60, "loss is a verdict: no waiting for the deadline"


def test_a_path_its_prober_suspended_fails_naming_the_pair_at_once(store: Store) -> None:
    p = plugin()
    plan, agents, after = applied(p, store)
    agents.rounds(after, 3, pairs=[pair for pair in CROSS if pair != ("h1", "h2")])
    agents.suspended.add(("h1", "nic0", "h2", "nic0"))  # it lost ten in a row: no more probes, the gauge says so
    agents.collect(after + 5 * MS)
    started = time.monotonic()
    verified = p.verify(plan, Deadline.after(120))
    assert not verified.ok
    assert "h1 -> h2 over nic0: its probes go unanswered (the prober suspended the path" in verified.detail
    assert "h2 -> h1 over nic0: its probes go unanswered" in verified.detail, "the same rail, the other way"
    assert time.monotonic() - started < 60


def test_probes_settling_just_after_the_apply_were_sent_before_it_and_do_not_count(store: Store) -> None:
    p = plugin(probes=ProbeVerifyConfig(poll_s=0.2, margin_s=0.5, settle_s=1.0, min_probes=4))
    plan, agents, after = applied(p, store)
    agents.rounds(after, 3, lost=2)  # declared lost within the prober's timeout: they left over the old route
    agents.rounds(after + 1_100 * MS, 3)
    verified = p.verify(plan, Deadline.after(60))
    assert verified.ok and "0 lost" in verified.detail, verified.detail


def test_rails_without_fresh_probes_leave_the_action_unverified_at_the_deadline(store: Store) -> None:
    p = plugin()
    plan, agents, after = applied(p, store)
    quiet = {("h1", "h3"), ("h3", "h1")}
    for src, dst in quiet:
        agents.stop(src, dst)
    agents.rounds(after, 3, pairs=[pair for pair in CROSS if pair not in quiet])
    verified = p.verify(plan, Deadline.after(4))
    assert verified.ok and verified.inconclusive, "no evidence either way: left in place, said unverified"
    assert "probes: 2 of 8 pair rails had too few judged probes by the deadline" in verified.detail, verified.detail
    assert "h1 -> h3 over nic0: no probe data since the apply" in verified.detail
    assert "h3 -> h1 over nic0: no probe data since the apply" in verified.detail, "h1's older probes do not count"


def test_one_collection_since_the_apply_is_only_a_baseline(store: Store) -> None:
    p = plugin()
    plan, agents, after = applied(p, store)
    agents.rounds(after, 1)
    verified = p.verify(plan, Deadline.after(4))
    assert verified.inconclusive and "h0 -> h2 over nic0: only 0 probes judged since the apply (needs 4)" in \
        verified.detail, verified.detail


def test_probes_that_still_cross_the_link_fail_naming_the_pair(store: Store) -> None:
    maps = [FMAP]
    p = plugin(fmap=maps)
    plan, agents, after = applied(p, store)
    agents.rounds(after, 3)
    routes = FMAP.to_json()["routes"]
    bad = "h0/nic0->h2/nic0:forward"
    routes[bad] = [["h0-leaf0r0", "leaf0r0-spine0", LINK, "leaf1r0-spine0", "h2-leaf1r0"]]  # miscabled rail
    maps[0] = RouteMap(routes)
    verified = p.verify(plan, Deadline.after(60))
    assert not verified.ok
    assert f"h0 -> h2 over nic0: its probes cross {LINK} ({bad})" in verified.detail, verified.detail
    assert "probes: 1 of 8 pair rails not confirmed" in verified.detail


def test_a_wrong_route_fails_before_any_probe_is_read(store: Store) -> None:
    agents = FakeAgents(TOPO)
    p = plugin(agents=agents)
    plan, _, _ = applied(p, store)
    del agents.tables["h0"].table[(f"{ADDRESSES['h2']}/32", 254)]
    started = time.monotonic()
    verified = p.verify(plan, Deadline.after(60))
    assert not verified.ok and "h0 -> h2: the route is gone" in verified.detail and "probes" not in verified.detail
    assert time.monotonic() - started < 30


def test_probe_checks_configured_off_leave_the_route_readback(store: Store) -> None:
    p = plugin(probes=ProbeVerifyConfig(enabled=False))
    plan, _, _ = applied(p, store)
    verified = p.verify(plan, Deadline.after(10))
    assert verified.ok and verified.detail.endswith("every pair keeps a path") and "probes" not in verified.detail


def test_the_controller_hands_its_store_to_the_plugin(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    p = plugin()
    monkeypatch.setattr("ridethrough.controller_wiring.load_plugins", lambda: [p])
    build_controller(ControllerConfig(cluster="wired"), store=store, metrics=ControllerMetrics.create(),
                     event_metrics=GatewayMetrics.create(), actuators=ActuatorConfig(enabled=True))
    plan = p.plan(incident(f"c{next(_clusters)}"), FleetState(taken_at_ns=1))
    assert plan is not None and p.apply(plan, Deadline.after(30)).ok
    verified: Result = p.verify(plan, Deadline.after(3))
    assert verified.inconclusive and "no probe data since the apply" in verified.detail, verified.detail


def test_without_a_store_the_routes_alone_verify() -> None:
    p = plugin()
    plan = p.plan(incident("nostore"), FleetState(taken_at_ns=1))
    assert plan is not None and p.apply(plan, Deadline.after(30)).ok
    assert p.verify(plan, Deadline.after(10)).ok


def test_probe_settings_from_the_environment() -> None:
    cfg = RerouteConfig.from_environ({"RIDETHROUGH_REROUTE_PROBE_VERIFY": "false",
                                      "RIDETHROUGH_REROUTE_PROBE_MAX_LOSS_RATIO": "0.2",
                                      "RIDETHROUGH_REROUTE_PROBE_MIN_PROBES": "10"}).probes
    assert (cfg.enabled, cfg.max_loss_ratio, cfg.min_probes) == (False, 0.2, 10)
    assert RerouteConfig.from_environ({}).probes.enabled, "on by default"
    with pytest.raises(ValueError, match="RIDETHROUGH_REROUTE_PROBE_VERIFY"):
        ProbeVerifyConfig.from_environ({"RIDETHROUGH_REROUTE_PROBE_VERIFY": "maybe"})
    with pytest.raises(ValueError, match="RIDETHROUGH_REROUTE_PROBE_MIN_PROBES"):
        ProbeVerifyConfig.from_environ({"RIDETHROUGH_REROUTE_PROBE_MIN_PROBES": "many"})
    with pytest.raises(ValueError, match="max_loss_ratio"):
        ProbeVerifyConfig.from_environ({"RIDETHROUGH_REROUTE_PROBE_MAX_LOSS_RATIO": "1.5"})


@pytest.mark.parametrize(("lost", "settled", "lossy"), [
    (0, 17, False), (1, 17, False), (2, 17, False),  # a loaded prober's noise on a healthy rail
    (5, 17, True), (12, 24, True), (4, 4, True),  # far more than 5 % would lose
    (130, 2000, True), (100, 2000, False),  # thousands of probes: 6.5 % is significant, 5 % is not
])
def test_a_rail_fails_only_on_loss_significantly_above_the_threshold(lost: int, settled: int, lossy: bool) -> None:
    assert too_lossy(lost, settled, 0.05, 0.01) is lossy


def test_with_no_loss_allowed_any_loss_fails() -> None:
    assert too_lossy(1, 300, 0.0, 0.01) and not too_lossy(0, 300, 0.0, 0.01)


def test_a_rail_is_judged_against_its_own_loss_before_the_fault(store: Store) -> None:
    """A rail that lost a quarter of its probes before the fault (a starved responder, a noisy host) and loses as
    many after the apply is as it was: confirmed. Without a baseline the same counts fail against 5 %."""
    opened = time.time_ns() + 50_000 * MS  # the baseline ends 60 s before: 10 s ago, after the lossy rounds
    for baseline, ok in ((opened, True), (1, False)):
        p = plugin()
        plan, agents, after = applied(p, store, opened_ns=baseline, before_lost=1)
        agents.rounds(after, 4, lost=1)
        verified = p.verify(plan, Deadline.after(20))
        assert verified.ok is ok and not verified.inconclusive, verified.detail
        if not ok:
            assert "25% of 24 probes lost since the apply, against 5% (too few probes before the fault" in \
                verified.detail, verified.detail


def test_no_verdict_is_taken_on_a_handful_of_probes(store: Store) -> None:
    """43 % lost of a rail's first probes after the apply (6 of 14: each end's prober lost 3 of 7), as in the CI
    run this guards against, where losses of probes that left before the apply reached the store after it, is no
    verdict at the default 20: the rail waits, then stays unverified."""
    p = plugin(probes=ProbeVerifyConfig(poll_s=0.2, margin_s=0.5, settle_s=0.0))
    plan, agents, after = applied(p, store)
    agents.rounds(after, 1)
    agents.everyone("nic0", sent=7, lost=3)
    agents.collect(after + 5 * MS)
    verified = p.verify(plan, Deadline.after(3))
    assert verified.ok and verified.inconclusive, verified.detail
    assert "only 14 probes judged since the apply (needs 20)" in verified.detail, verified.detail


@pytest.mark.parametrize("stalled", [False, True])
def test_probes_a_silent_peer_left_unjudged_fail_the_rail_unless_a_host_stalled(store: Store, stalled: bool) -> None:
    """h2 answered nothing over rail 0 since the apply: its peers' probers could not judge their probes. Unless h0
    or h2 says its probe threads were held off, that silence is the rail's: it fails. If h2 stalled, the probes
    count neither way, and the rail waits for judged ones (unverified at the deadline)."""
    p = plugin()
    plan, agents, after = applied(p, store)
    silent = [("h0", "h2"), ("h2", "h0")]
    agents.rounds(after, 3, pairs=[pair for pair in CROSS if pair not in silent])
    for i in range(3):
        for src, dst in silent:
            agents.probe(src, dst, "nic0", sent=4, unknown=4)
        if stalled:
            agents.stalled["h2"] = 2.0 * (i + 1)
        agents.collect(after + (10 + i) * MS)
    verified = p.verify(plan, Deadline.after(4))
    if stalled:
        assert verified.ok and verified.inconclusive, verified.detail
        assert "h0 -> h2 over nic0: 24 probes sent since the apply, none judged yet (24 unanswered while a host's " \
               "probe threads stalled)" in verified.detail, verified.detail
    else:
        assert not verified.ok, verified.detail
        assert "h0 -> h2 over nic0: 100% of 24 probes lost since the apply" in verified.detail, verified.detail
