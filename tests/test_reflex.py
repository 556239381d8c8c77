"""The reflex: its verdicts and decisions on synthetic probe outcomes, its probes against the real probe
responder, and the whole reflex on loopback over an in-memory route table (no root needed)."""

from __future__ import annotations

import ipaddress
import json
import socket
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from ridethrough.actuators.liveness import (
    MAX_TIMEOUT_S,
    HealthSettings,
    Liveness,
    Outcome,
    PathHealth,
    RoundTrips,
    Target,
    probe_name,
)
from ridethrough.actuators.reflex import Reflex, ReflexSettings, decide, from_config, load_stable
from ridethrough.actuators.routes import BaseRoute, Nexthop, Override, RouteError
from ridethrough.collector.probe_responder import Responder
from ridethrough.collector.probe_sample import TimestampKind
from ridethrough.collector.probe_wire import Endpoint, Probe, decode, reply_bytes
from ridethrough.collector.sample import Event
from ridethrough.config import ConfigError
from ridethrough.settings import AgentConfig, load_component
from tests.conftest import wait_for

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="kernel timestamps are Linux's")

T0 = Target("b", "nic0", "nic0", ("127.0.0.1", 7447))
T1 = Target("b", "nic1", "nic1", ("127.0.0.2", 7447))
S = HealthSettings(losses=2, delay_s=0.010, holddown_s=2.0, holddown_max_s=16.0)


def lost(flow: int, at: float, target: Target = T0) -> Outcome:
    return Outcome(target, flow, at, None)


def ok(flow: int, at: float, rtt_ms: float = 0.1, target: Target = T0) -> Outcome:
    return Outcome(target, flow, at, round(rtt_ms * 1e6))


def health(*outcomes: Outcome, settings: HealthSettings = S) -> PathHealth:
    h = PathHealth(settings)
    for o in outcomes:
        h.observe(o)
    return h


# -- verdicts ----------------------------------------------------------------------------------------


def test_one_lost_probe_is_not_a_failure_two_in_a_row_on_one_port_are() -> None:
    h = PathHealth(S)
    assert not h.observe(lost(3, 1.00)) and h.up
    assert h.suspect(3) and not h.suspect(4)  # worth re-probing port 3 at once, nothing else
    assert h.observe(lost(3, 1.03)) and not h.up and h.failing
    assert (h.reason, h.down_since_s, h.failing_since_s) == ("loss", 1.00, 1.00)  # from the first failed probe
    assert h.suspect(3)  # one more probe tells a dead path from a blip
    h.observe(lost(3, 1.06))
    assert not h.suspect(3) and h.failing  # confirmed: the rotation of ports keeps looking


def test_losses_on_different_ports_or_broken_by_a_reply_do_not_add_up() -> None:
    assert health(lost(1, 1.0), lost(2, 1.01), lost(3, 1.02)).up  # one spine's port each time: not a run
    assert health(lost(1, 1.0), ok(1, 1.01), lost(1, 1.02)).up  # a later probe on that port came through
    # a reply to a probe sent before the run does not end it
    assert not health(lost(1, 1.0), ok(1, 0.99), lost(1, 1.02)).up


def test_a_slow_reply_is_bad_too_and_says_delay() -> None:
    h = health(ok(0, 1.0, rtt_ms=25.0), ok(0, 1.01, rtt_ms=30.0))
    assert (h.up, h.reason) == (False, "delay")
    assert health(ok(0, 1.0, rtt_ms=9.0), ok(0, 1.01, rtt_ms=9.0)).up  # under the threshold


def test_a_failed_path_comes_back_after_its_hold_down_of_good_probes() -> None:
    h = health(lost(0, 10.0), lost(0, 10.03))
    assert not h.tick(11.0) and not h.up  # within the hold-down
    h.observe(ok(1, 11.0))
    h.observe(lost(2, 11.5))  # a bad probe restarts the hold-down
    assert not h.tick(12.1)
    assert not h.tick(13.6)  # 2 s after the last bad probe, but no good one since
    h.observe(ok(3, 13.6))
    assert h.tick(13.6) and h.up and h.reason == ""


def test_the_hold_down_counts_from_when_a_loss_was_known_not_from_its_send() -> None:
    h = PathHealth(S)  # 2 s of hold-down
    h.observe(Outcome(T0, 0, 10.0, None, 11.0))  # a long timeout: known lost a second after it was sent
    h.observe(Outcome(T0, 0, 10.5, None, 11.5))
    h.observe(ok(1, 11.6))
    assert not h.up and not h.tick(12.6)  # 2 s after the send, 1.1 s after it was known
    assert h.tick(13.5)


def test_a_path_that_fails_again_soon_after_coming_back_waits_longer_up_to_the_maximum() -> None:
    h, t = PathHealth(S), 0.0
    waits = []
    for _ in range(5):
        h.observe(lost(0, t))
        h.observe(lost(0, t + 0.03))
        waits.append(h.holddown_s)
        h.observe(ok(1, t + 0.05))
        t += 0.04 + h.holddown_s
        assert h.tick(t)
        t += 1.0  # fails again a second after coming back
    assert waits == [2.0, 4.0, 8.0, 16.0, 16.0]
    h.observe(lost(0, t + 100))  # after a long quiet spell the hold-down is short again
    h.observe(lost(0, t + 100.03))
    assert h.holddown_s == 2.0


def test_an_adopted_override_earns_its_way_back_like_a_failure() -> None:
    h = PathHealth(S)
    h.hold(5.0, "adopted")
    assert (h.up, h.reason) == (False, "adopted")
    h.observe(ok(0, 6.0))
    assert not h.tick(6.5) and h.tick(7.0)


def test_health_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        HealthSettings(losses=0)
    with pytest.raises(ValueError):
        HealthSettings(delay_s=0)
    with pytest.raises(ValueError):
        HealthSettings(holddown_s=5, holddown_max_s=1)


# -- decisions ---------------------------------------------------------------------------------------


def rails(r0: PathHealth, r1: PathHealth) -> dict[str, PathHealth]:
    return {"nic0": r0, "nic1": r1}


DOWN_AT_1 = (lost(0, 1.0), lost(0, 1.03))  # failing; its latest bad probe was sent at 1.03


def test_healthy_rails_change_nothing() -> None:
    assert decide(frozenset(), rails(health(ok(0, 1.0)), health(ok(0, 1.0, target=T1)))) is None


def test_a_failed_rail_is_left_for_one_that_worked_while_it_failed() -> None:
    other = health(ok(0, 0.9, target=T1), ok(1, 1.04, target=T1))  # clean since 0.9, answered after 1.03
    assert decide(frozenset(), rails(health(*DOWN_AT_1), other)) == frozenset({"nic0"})


def test_no_move_before_the_other_rail_answers_a_probe_sent_after_the_last_failure() -> None:
    assert decide(frozenset(), rails(health(*DOWN_AT_1), health(ok(0, 1.02, target=T1)))) is None


def test_a_blip_on_every_rail_moves_nothing_whichever_rail_recovers_first() -> None:
    # a stalled peer agent: the other rail lost a probe too, and came back first
    other = health(ok(0, 0.9, target=T1), lost(1, 1.0, target=T1), ok(1, 1.05, target=T1))
    assert other.clean and other.up
    assert decide(frozenset(), rails(health(*DOWN_AT_1), other)) is None
    blip = health(*DOWN_AT_1, ok(0, 1.06))  # and then the failing port answers again
    assert not blip.up and not blip.failing
    assert decide(frozenset(), rails(blip, other)) is None


def test_an_alternative_with_a_port_in_a_bad_run_proves_nothing() -> None:
    failing = health(*DOWN_AT_1)
    shaky = health(ok(0, 0.9, target=T1), lost(1, 1.02, target=T1))
    assert shaky.up and not shaky.clean
    assert decide(frozenset(), rails(failing, shaky)) is None
    shaky.observe(ok(1, 1.025, target=T1))  # its re-probe came through, before the failing rail's last bad probe
    shaky.observe(ok(2, 1.04, target=T1))
    assert decide(frozenset(), rails(failing, shaky)) == frozenset({"nic0"})


def test_the_last_path_is_never_removed() -> None:
    both = rails(health(*DOWN_AT_1), health(lost(0, 1.0, target=T1), lost(0, 1.03, target=T1)))
    assert decide(frozenset(), both) is None
    assert decide(frozenset({"nic1"}), both) is None  # already off nic1: stays there, the only path left


def test_in_an_emergency_a_rail_still_in_its_hold_down_is_taken_back() -> None:
    recovering = health(lost(0, 1.0, target=T1), lost(0, 1.03, target=T1), ok(0, 2.0, target=T1))
    now_failing = health(lost(0, 2.1), lost(0, 2.13))
    assert not recovering.up and recovering.clean
    assert decide(frozenset({"nic1"}), rails(now_failing, recovering)) is None  # no answer since 2.13 yet
    recovering.observe(ok(1, 2.15, target=T1))
    assert decide(frozenset({"nic1"}), rails(now_failing, recovering)) == frozenset({"nic0"})


def test_a_recovered_rail_is_given_back_even_while_another_fails() -> None:
    back = health(*DOWN_AT_1, ok(1, 1.5))
    assert back.tick(4.0)
    assert decide(frozenset({"nic0"}), rails(back, health(ok(0, 3.9, target=T1)))) == frozenset()
    # and the other rail failing later moves traffic onto the one that came back, which answered since
    failing = health(lost(0, 5.0, target=T1), lost(0, 5.03, target=T1))
    back.observe(ok(2, 5.04))
    assert decide(frozenset({"nic0"}), rails(back, failing)) == frozenset({"nic1"})


# -- the stable-address file and the config --------------------------------------------------------


def test_the_reflex_peers_file_is_checked(tmp_path: Path) -> None:
    good = tmp_path / "stable.json"
    good.write_text(json.dumps({"h0": "10.200.0.1", "h1": "10.200.0.2"}))
    assert load_stable(good) == {"h0": "10.200.0.1", "h1": "10.200.0.2"}
    for content, why in (("[1, 2]", "expected"), ('{"h0": "10.200.0.300"}', "10.200.0.300"),
                         ('{"h 0": "10.200.0.1"}', "node id"), ("{", r"stable\.json")):
        good.write_text(content)
        with pytest.raises(ValueError, match=why):
            load_stable(good)
    with pytest.raises(ValueError, match=r"missing\.json"):
        load_stable(tmp_path / "missing.json")


def test_reflex_config_is_checked_and_reaches_the_reflex() -> None:
    with pytest.raises(ConfigError, match="reflex_holddown_max_s"):
        load_component("agent", env={"RIDETHROUGH_AGENT_REFLEX_HOLDDOWN_S": "5",
                                     "RIDETHROUGH_AGENT_REFLEX_HOLDDOWN_MAX_S": "1"})
    with pytest.raises(ConfigError, match="reflex_watch"):
        load_component("agent", env={"RIDETHROUGH_AGENT_REFLEX_WATCH": "some"})
    cfg = load_component("agent", env={"RIDETHROUGH_AGENT_REFLEX": "true", "RIDETHROUGH_AGENT_REFLEX_INTERVAL_MS": "20",
                                       "RIDETHROUGH_AGENT_REFLEX_LOSSES": "3"}).config
    assert isinstance(cfg, AgentConfig) and cfg.reflex and not AgentConfig().reflex  # off unless asked
    reflex = from_config(cfg, host_time=None, clock=lambda: 0, tracer_provider=None)
    assert (reflex.settings.interval_s, reflex.settings.health.losses, reflex.settings.rto_min_ms) == (0.02, 3, 50)
    assert reflex.name == "reflex" and reflex.collect(0) == []


def test_the_agent_gets_a_reflex_with_its_own_span_exporter() -> None:
    from ridethrough.collector.identity import AgentIdentity
    from ridethrough.wiring import build_reflex

    cfg = AgentConfig(reflex=True, node_id="h0", gateway="127.0.0.1:1", reflex_watch="all")
    reflex = build_reflex(cfg, identity=AgentIdentity(node_id="h0", host_name="x", cluster="c"), clock=lambda: 0)
    try:
        assert reflex.node == "h0" and reflex.settings.watch == "all"
    finally:
        reflex.stop(timeout_s=1.0)  # never started: shuts its span exporter down


# -- probes on the wire ------------------------------------------------------------------------------


def test_probes_go_out_from_rotating_ports_under_their_own_endpoint_name() -> None:
    catcher = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    catcher.bind(("127.0.0.81", 0))
    catcher.settimeout(5)
    live = Liveness(node="a", local={"nic0": "127.0.0.80"}, flows=4, timeout_s=50.0)
    live.open()
    try:
        target = Target("b", "nic0", "eth3", catcher.getsockname())
        live.set_targets([target])
        seen = []  # a long timeout: nothing is lost until the last tick
        for i in range(8):
            live.tick(float(i))  # one round per call: the interval has passed each time
            data, (_, port) = catcher.recvfrom(512)
            probe = decode(data)
            assert isinstance(probe, Probe)
            seen.append((probe.seq, port))
            assert (probe.src, probe.dst) == (Endpoint("a", probe_name("nic0")), Endpoint("b", "eth3"))
        seqs = [s for s, _ in seen]
        assert seqs == sorted(set(seqs)) and len({p for _, p in seen}) == 4  # every port, in turn
        assert len(live.tick(100.0)) == 8 and live.lost == 8  # nobody answered: all lost at once
    finally:
        live.close()
        catcher.close()


def test_many_targets_are_probed_less_often_within_the_rate_budget() -> None:
    live = Liveness(node="a", local={"nic0": "127.0.0.80", "nic1": "127.0.0.81"}, interval_s=0.01, max_rate=100)
    targets = [Target(f"p{i}", nic, nic, ("127.0.0.82", 7447)) for i in range(4) for nic in ("nic0", "nic1")]
    live.set_targets(targets[:2])
    assert live.interval_s == 0.02  # two targets at 100 probes/s: a round every 20 ms
    live.set_targets(targets)
    assert live.interval_s == 0.08 and len(live.targets) == 8
    live.set_targets([Target("p9", "nic7", "nic7", ("127.0.0.82", 7447))])  # a NIC this node has not: ignored
    assert live.targets == [] and live.interval_s == 0.01


def test_the_timeout_follows_the_round_trips_within_its_bounds() -> None:
    rtt = RoundTrips()
    assert rtt.timeout_s(0.03) == 0.03  # nothing seen yet: the floor
    for _ in range(20):
        rtt.sample(0.0005)
    assert rtt.timeout_s(0.03) == 0.03  # a quiet fabric: the floor
    rtt.sample(0.2)  # a busy peer agent answered late
    assert rtt.timeout_s(0.03) > 0.2
    for _ in range(5):
        rtt.sample(5.0)
    assert rtt.timeout_s(0.03) == MAX_TIMEOUT_S
    for _ in range(200):
        rtt.sample(0.0005)
    assert rtt.timeout_s(0.03) == 0.03  # and back


def test_a_late_reply_is_not_an_answer_but_teaches_the_timeout() -> None:
    peer = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    peer.bind(("127.0.0.85", 0))
    peer.settimeout(5)
    live = Liveness(node="a", local={"nic0": "127.0.0.84"}, flows=1, timeout_s=0.05)
    live.open()
    try:
        target = Target("b", "nic0", "nic0", peer.getsockname())
        live.set_targets([target])
        live.tick(time.monotonic())
        data, addr = peer.recvfrom(512)
        assert isinstance(decode(data), Probe)
        [lost_one] = wait_for(lambda: live.tick(time.monotonic()), what="the probe to time out")
        assert lost_one.rtt_ns is None and live.timeout_s_of(target) == 0.05
        t2_ns = time.time_ns()  # this stand-in responder reads the true clock, as the prober does
        peer.sendto(reply_bytes(data, t2_ns=t2_ns, rx_kind=TimestampKind.KERNEL, rx_count=1, epoch=1), addr)
        wait_for(lambda: live.drain() == [] and live.late == 1, what="the late reply")
        assert live.timeout_s_of(target) > 0.05  # it waits longer from now on
        peer.sendto(b"garbage", addr)
        wait_for(lambda: live.drain() == [] and live.dropped == 1, what="garbage to be dropped")
    finally:
        live.close()
        peer.close()


@dataclass
class Peer:
    """Peer ``b``: one probe responder per NIC, so one rail can fail alone."""

    addresses: dict[str, tuple[str, int]]
    responders: dict[str, Responder] = field(default_factory=dict)

    def up(self, nic: str) -> None:
        r = Responder(node="b", listen={nic: self.addresses[nic]})
        r.start()
        self.addresses[nic] = r.addresses[nic]
        self.responders[nic] = r

    def down(self, nic: str) -> None:
        self.responders.pop(nic).stop(timeout_s=2.0)


def test_liveness_against_the_probe_responder_sees_replies_then_losses() -> None:
    peer = Peer({"nic0": ("127.0.0.82", 0)})
    peer.up("nic0")
    live = Liveness(node="a", local={"nic0": "127.0.0.83"}, flows=4, interval_s=0.005, timeout_s=0.2)
    live.open()
    target = Target("b", "nic0", "nic0", peer.addresses["nic0"])
    live.set_targets([target])
    h = PathHealth(HealthSettings(delay_s=0.2))
    got: list[Outcome] = []

    def step() -> list[Outcome]:
        outcomes = live.tick(time.monotonic()) + live.wait(0.01)
        got.extend(outcomes)
        for o in outcomes:
            h.observe(o)
        return got
    try:
        wait_for(lambda: len([o for o in step() if o.rtt_ns is not None]) >= 10, interval_s=0, what="replies")
        good = [o for o in got if o.rtt_ns is not None]
        assert {o.flow for o in good} == {0, 1, 2, 3} and all(0 <= (o.rtt_ns or 0) < 200_000_000 for o in good)
        assert h.up
        peer.down("nic0")
        wait_for(lambda: step() and not h.up, interval_s=0, what="the path to go down")
        assert h.reason == "loss"
    finally:
        live.close()
        for nic in list(peer.responders):
            peer.down(nic)


# -- the whole reflex on loopback ---------------------------------------------------------------------


class MemoryRoutes:
    """A main table in memory that honours `RouteTable`: one base route and our /32 overrides."""

    def __init__(self, base: BaseRoute, interfaces: dict[str, str]) -> None:
        self.base, self.interfaces = base, interfaces
        self.table: dict[str, Override] = {}
        self.writes: list[tuple[str, str, tuple[str, ...]]] = []
        self._lock = threading.Lock()

    def interface_of(self, address: str) -> str | None:
        return self.interfaces.get(address)

    def base_route(self, address: str) -> BaseRoute | None:
        return self.base if ipaddress.ip_address(address) in ipaddress.ip_network(self.base.prefix) else None

    def overrides(self) -> dict[str, Override]:
        with self._lock:
            return dict(self.table)

    def foreign(self, address: str) -> bool:
        return False

    def tcp_peers(self) -> set[str]:
        return set()

    def replace(self, address: str, base: BaseRoute, nexthops: Sequence[Nexthop], *, rto_min_ms: int) -> None:
        if not nexthops:
            raise RouteError(f"override of {address}: no nexthop left")
        with self._lock:
            self.table[address] = Override(address, tuple(nexthops), rto_min_ms)
            self.writes.append(("replace", address, tuple(nh.ifname for nh in nexthops)))

    def remove(self, address: str) -> None:
        with self._lock:
            self.table.pop(address, None)
            self.writes.append(("remove", address, ()))

    def close(self) -> None:
        pass


BASE = BaseRoute("10.200.0.0/16", (Nexthop("10.64.0.0", "nic0"), Nexthop("10.65.0.0", "nic1")), "10.200.0.1")
FAST = ReflexSettings(interval_s=0.005, timeout_s=0.1, flows=4, watch="all", refresh_s=0.1,
                      health=HealthSettings(losses=2, delay_s=0.1, holddown_s=0.3, holddown_max_s=0.3))


@dataclass
class Rig:
    reflex: Reflex
    routes: MemoryRoutes
    peer: Peer
    events: list[Event]
    spans: InMemorySpanExporter

    def names(self) -> list[str]:
        return [e.name for e in self.events]

    def span(self, name: str) -> ReadableSpan:
        return next(s for s in self.spans.get_finished_spans() if s.name == name)


@pytest.fixture
def rig(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Rig]:
    """Node a's reflex (NICs on 127.0.0.84/85) watching peer b (127.0.0.86/87), one responder per NIC."""
    peer = Peer({"nic0": ("127.0.0.86", 0), "nic1": ("127.0.0.87", 0)})
    for nic in ("nic0", "nic1"):
        peer.up(nic)
    (tmp_path / "peers.json").write_text(json.dumps({
        "a": {"nic0": "127.0.0.84", "nic1": "127.0.0.85"},
        "b": {nic: f"{ip}:{port}" for nic, (ip, port) in peer.addresses.items()}}))
    (tmp_path / "stable.json").write_text(json.dumps({"a": "10.200.0.1", "b": "10.200.1.1"}))
    routes = MemoryRoutes(BASE, {"127.0.0.84": "nic0", "127.0.0.85": "nic1"})
    for address, override in getattr(request, "param", {}).items():
        routes.table[address] = override
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    events: list[Event] = []
    reflex = Reflex(node="a", settings=FAST, peers_file=str(tmp_path / "peers.json"),
                    stable_file=str(tmp_path / "stable.json"), port=7447, routes=routes, tracer_provider=provider)
    reflex.start(emit=events.append)
    try:
        wait_for(lambda: set(reflex.verdicts().get("b", {})) == {"nic0", "nic1"}, what="the rails to be watched")
        yield Rig(reflex, routes, peer, events, spans)
    finally:
        reflex.stop(timeout_s=2.0)
        for nic in list(peer.responders):
            peer.down(nic)


def via(rig: Rig) -> list[str] | None:
    """The interfaces of the override for b's stable address (None: none)."""
    override = rig.routes.overrides().get("10.200.1.1")
    return None if override is None else [nh.ifname for nh in override.nexthops]


def test_a_dead_rail_is_left_and_taken_back_once_healthy(rig: Rig) -> None:
    rig.peer.down("nic0")
    wait_for(lambda: via(rig) == ["nic1"], what="the override onto nic1")
    assert rig.routes.overrides()["10.200.1.1"].rto_min_ms == 50
    assert rig.reflex.avoided == {"b": frozenset({"nic0"})}
    event = next(e for e in rig.events if e.name == "reflex.reroute" and e.attributes["reflex.rails.avoided"] == "nic0")
    assert event.attributes["reflex.peer"] == "b" and event.attributes["reflex.rails.used"] == "nic1"
    assert event.attributes["reflex.reason"] == "loss"
    span = next(s for s in rig.spans.get_finished_spans()
                if s.name == "reflex.reroute" and (s.attributes or {}).get("reflex.rails.avoided") == "nic0")
    assert span.status.status_code is StatusCode.OK and span.start_time is not None and span.end_time is not None
    assert span.end_time - span.start_time >= 0.1e9  # from the first failed probe: at least one timeout
    assert span.attributes is not None and span.attributes["reflex.peer.address"] == "10.200.1.1"

    rig.peer.up("nic0")  # same address and port: the rail is back
    wait_for(lambda: via(rig) is None, what="the return")
    assert rig.routes.writes[-1] == ("remove", "10.200.1.1", ()) and rig.names()[-1] == "reflex.return"
    assert rig.reflex.avoided == {} and rig.span("reflex.return").status.status_code is StatusCode.OK


def test_with_every_rail_dead_the_last_path_stays(rig: Rig) -> None:
    rig.peer.down("nic0")
    wait_for(lambda: via(rig) == ["nic1"], what="the override onto nic1")
    writes = len(rig.routes.writes)
    rig.peer.down("nic1")
    wait_for(lambda: rig.reflex.verdicts()["b"] == {"nic0": False, "nic1": False}, what="both rails down")
    assert via(rig) == ["nic1"] and rig.routes.writes[writes:] == []  # nothing removed, emptied or moved


@pytest.mark.parametrize("rig", [{"10.200.1.1": Override("10.200.1.1", (BASE.nexthops[1],), 50)}], indirect=True)
def test_an_override_left_by_an_earlier_run_is_adopted_and_returned_when_healthy(rig: Rig) -> None:
    wait_for(lambda: via(rig) is None, what="the return")
    assert rig.routes.writes[0] == ("remove", "10.200.1.1", ()) and rig.names()[0] == "reflex.return"
    span = rig.span("reflex.return")  # from the adoption, a hold-down of good probes
    assert span.start_time is not None and span.end_time is not None
    assert span.end_time - span.start_time >= FAST.health.holddown_s * 1e9


def test_a_route_that_leaves_by_no_probed_rail_is_never_touched(rig: Rig) -> None:
    # e.g. rails that share the host's own address (the lab's loopback mode): the peer's route is the
    # default route by the management port, and an override would send the host's traffic off the host
    rig.routes.base = BaseRoute("0.0.0.0/0", (Nexthop("192.0.2.1", "eth0"),), None)
    rig.peer.down("nic0")
    wait_for(lambda: "reflex.held" in rig.names(), what="the reflex to hold")
    held = next(e for e in rig.events if e.name == "reflex.held")
    assert "leaves by eth0, not by a probed rail" in held.body and rig.routes.writes == []
