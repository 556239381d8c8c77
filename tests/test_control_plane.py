"""The agent's control plane over real gRPC: auth refusals, idempotency, commands, TLS, and trace continuity."""

from __future__ import annotations

import ipaddress
import json
import logging
import secrets
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from ridethrough.actuators.command_auth import (
    KEY_ID_HEADER,
    SIGNATURE_HEADER,
    Command,
    KeyRing,
    KeyRingError,
    Reason,
    Refused,
    ReplayCache,
    load_keyring,
)
from ridethrough.actuators.commands import Args, BadArgs, CommandRegistry, Outcome, Param, Route, builtin_registry
from ridethrough.actuators.control_client import (
    ControlCallError,
    ControlClient,
    ControlClientConfig,
    Reply,
    build_control_client,
)
from ridethrough.actuators.control_plane import (
    PATH,
    REFUSAL_HEADER,
    ControlPlaneConfig,
    ControlPlaneMetrics,
    ControlPlaneServer,
    ReplyCache,
    build_control_plane,
)
from ridethrough.actuators.tracing import ActionTrace, SpanData, activate
from tests.conftest import read_ready, wait_for

NODE = "h3"
K1, K2 = bytes(range(32)), bytes(range(100, 132))
ENV = "RIDETHROUGH_CONTROL_KEYS"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


class FakeRoutes:
    """A routing table in memory, honouring `RouteOps`: one route per (destination, table)."""

    def __init__(self, *routes: Route) -> None:
        self.table = {(r.destination, r.table): r for r in routes}
        self.changes: list[str] = []

    def get(self, destination: str, *, table: int) -> Route | None:
        return self.table.get((destination, table))

    def replace(self, route: Route) -> None:
        self.changes.append(f"replace {route.destination} dev {route.dev}")
        self.table[(route.destination, route.table)] = route

    def delete(self, destination: str, *, table: int) -> None:
        self.changes.append(f"delete {destination}")
        self.table.pop((destination, table), None)

    def lookup(self, destination: str, *, own: bool) -> tuple[tuple[str, str], ...]:
        """The nexthops of the longest main-table prefix holding the destination's first address (``own``:
        counting routes with a metric, which stand for ridethrough's here)."""
        address = ipaddress.ip_network(destination).network_address
        held = [r for (d, t), r in self.table.items()
                if t == 254 and address in ipaddress.ip_network(d) and (own or not r.metric)]
        best = max(held, key=lambda r: ipaddress.ip_network(r.destination).prefixlen, default=None)
        return () if best is None else ((best.dev, best.via), *best.more)


@dataclass
class Agent:
    address: str
    server: ControlPlaneServer
    spans: InMemorySpanExporter
    metrics: ControlPlaneMetrics
    routes: FakeRoutes
    ran: list[str] = field(default_factory=list)
    gate: threading.Event = field(default_factory=threading.Event)

    def refusals(self, reason: str) -> float:
        return self.metrics.registry.get_sample_value("ridethrough_control_refusals_total", {"reason": reason}) or 0

    def finished(self) -> list[ReadableSpan]:
        return list(self.spans.get_finished_spans())


def _registry(agent: Agent) -> CommandRegistry:
    registry = builtin_registry(node_id=NODE, clock=time.time_ns, route_ops=agent.routes)

    def echo(args: Args) -> Outcome:
        agent.ran.append(str(args["text"]))
        if args["wait"]:
            agent.gate.wait(10)
        return Outcome(True, "echoed", {"text": args["text"], "n": len(agent.ran)})

    def boom(args: Args) -> Outcome:
        raise RuntimeError("the handler broke")

    registry.register("test.echo", echo, params={"text": Param(str), "wait": Param(bool, False)})
    registry.register("test.boom", boom, params={})
    return registry


def _env(**keys: bytes) -> dict[str, str]:
    return {ENV: ",".join(f"{k}={v.hex()}" for k, v in keys.items())}


@pytest.fixture
def start_agent() -> Iterator[Callable[..., Agent]]:
    """Start control planes on 127.0.0.1:0 (keys k1 by default); all stop when the test ends."""
    agents: list[Agent] = []

    def start(*, env: Mapping[str, str] | None = None, clock: Callable[[], int] = time.time_ns,
              **cfg: object) -> Agent:
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        config = ControlPlaneConfig(**{"listen": "127.0.0.1:0", **cfg})
        agent = Agent("", None, exporter, ControlPlaneMetrics.create(), FakeRoutes())
        agent.server = build_control_plane(config, node_id=NODE, registry=_registry(agent),
                                           tracer=provider.get_tracer("test"), environ=env or _env(k1=K1),
                                           metrics=agent.metrics, clock=clock)
        agent.address = agent.server.start()
        agents.append(agent)
        return agent

    yield start
    for a in agents:
        a.gate.set()
        a.server.stop(1.0)


def _client(key: bytes = K1, key_id: str = "k1", **kw: object) -> ControlClient:
    return ControlClient(keys=KeyRing({key_id: key}), key_id=key_id, **kw)


def _raw_call(address: str, payload: bytes, metadata: list[tuple[str, str]]) -> tuple[grpc.StatusCode, bytes, str]:
    """One Execute call with exactly these bytes and metadata: (status, body, refusal reason)."""
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(PATH, request_serializer=None, response_deserializer=None)
        try:
            return grpc.StatusCode.OK, call(payload, metadata=metadata, timeout=10), ""
        except grpc.RpcError as err:
            return err.code(), b"", dict(err.trailing_metadata() or ()).get(REFUSAL_HEADER, "")


def _signed(payload: bytes, key: bytes = K1, key_id: str = "k1") -> list[tuple[str, str]]:
    return [(KEY_ID_HEADER, key_id), (SIGNATURE_HEADER, KeyRing({key_id: key}).sign(key_id, payload))]


def _command(command: str = "test.echo", *, key: str = "key-1", node: str = NODE, args: Args | None = None,
             issued_ns: int | None = None, lifetime_s: float = 30.0) -> Command:
    issued = time.time_ns() if issued_ns is None else issued_ns
    return Command(key, node, command, dict(args if args is not None else {"text": "hi"}), issued,
                   issued + int(lifetime_s * 1e9), secrets.token_hex(16))


# --- calls that are authentic run, and their span continues the caller's trace ----------------------------------


def test_ping_runs_and_its_span_is_a_child_of_the_callers_traceparent(start_agent) -> None:
    agent = start_agent()
    with _client() as client:
        reply = client.call(target=agent.address, node=NODE, command="ping", key="p1",
                            traceparent=f"00-{TRACE_ID}-{PARENT}-01")
    assert reply.ok and reply.outcome == "ok" and not reply.duplicate
    assert reply.data["node"] == NODE and abs(int(reply.data["time_unix_nano"]) - time.time_ns()) < 60e9
    [span] = agent.finished()
    assert span.name == "agent.ping" and span.kind is SpanKind.SERVER
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert span.parent is not None and format(span.parent.span_id, "016x") == PARENT
    assert dict(span.attributes or {}) == {"command.name": "ping", "command.key": "p1", "command.outcome": "ok",
                                          "command.duplicate": False, "ridethrough.node.id": NODE}
    assert span.status.status_code is StatusCode.OK


@pytest.mark.parametrize("traceparent", [None, "00-zz-nonsense-01", f"00-{'0' * 32}-{PARENT}-01"])
def test_without_a_valid_traceparent_the_agent_starts_a_new_trace(start_agent, traceparent) -> None:
    agent = start_agent()
    payload = _command("ping", args={}).encode()
    metadata = _signed(payload) + ([("traceparent", traceparent)] if traceparent else [])
    assert _raw_call(agent.address, payload, metadata)[0] is grpc.StatusCode.OK
    [span] = agent.finished()
    assert span.parent is None and format(span.context.trace_id, "032x") != "0" * 32


def test_a_step_of_an_action_is_the_parent_of_the_agent_span(start_agent) -> None:
    agent = start_agent()
    action = ActionTrace(trace_id=TRACE_ID, action_id="a-1", clock=time.time_ns)
    phase = action.start("action.apply")
    steps: list[SpanData] = []
    with activate(action, phase, steps), _client() as client:
        reply = client.call(target=agent.address, node=NODE, command="ping", key="p2")
    assert reply.ok
    [step] = steps
    assert step.name == "action.step" and step.attributes["step.name"] == f"control ping on {NODE}"
    assert step.parent_span_id == phase.context.span_id and step.error is None
    [span] = agent.finished()
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert span.parent is not None and format(span.parent.span_id, "016x") == step.context.span_id


def test_a_handler_that_raises_is_an_error_reply_and_the_agent_keeps_serving(start_agent) -> None:
    agent = start_agent()
    with _client() as client:
        reply = client.call(target=agent.address, node=NODE, command="test.boom", key="b1")
        assert not reply.ok and reply.outcome == "error" and "RuntimeError: the handler broke" in reply.detail
        assert not reply.to_result().ok
        assert client.call(target=agent.address, node=NODE, command="ping", key="b2").ok
    boom = next(s for s in agent.finished() if s.name == "agent.test.boom")
    assert boom.status.status_code is StatusCode.ERROR and boom.attributes["command.outcome"] == "error"
    assert agent.metrics.registry.get_sample_value(
        "ridethrough_control_commands_total", {"command": "test.boom", "outcome": "error"}) == 1


# --- refusals: no token, wrong token, replayed, expired, wrong node, malformed --------------------------------------


@pytest.mark.parametrize("metadata", [[], [(KEY_ID_HEADER, "k1")], [(SIGNATURE_HEADER, "ab" * 32)]])
def test_a_call_without_a_signature_is_refused_logged_and_counted(start_agent, caplog, metadata) -> None:
    agent = start_agent()
    with caplog.at_level(logging.WARNING, "ridethrough.actuators.control_plane"):
        code, _, reason = _raw_call(agent.address, _command().encode(), metadata)
    assert (code, reason) == (grpc.StatusCode.UNAUTHENTICATED, "missing_signature")
    assert agent.ran == [] and agent.finished() == [], "nothing runs, and no span for an unauthenticated call"
    assert agent.refusals("missing_signature") == 1
    assert "refused" in caplog.text and "missing_signature" in caplog.text


def test_a_wrong_secret_is_refused_and_no_secret_is_logged(start_agent, caplog) -> None:
    agent = start_agent()
    with caplog.at_level(logging.DEBUG), _client(key=K2) as client, pytest.raises(ControlCallError) as err:
        client.call(target=agent.address, node=NODE, command="test.echo", args={"text": "x"}, key="w1")
    assert (err.value.code, err.value.reason) == ("UNAUTHENTICATED", "bad_signature")
    assert not err.value.retryable
    assert agent.ran == [] and agent.refusals("bad_signature") == 1
    assert K1.hex() not in caplog.text and K2.hex() not in caplog.text and "bad_signature" in caplog.text


def test_an_unknown_key_id_and_a_tampered_payload_are_refused(start_agent) -> None:
    agent = start_agent()
    payload = _command().encode()
    assert _raw_call(agent.address, payload, _signed(payload, K1, "k9"))[::2] == (
        grpc.StatusCode.UNAUTHENTICATED, "unknown_key")
    other = _command(args={"text": "rm -rf"}).encode()
    assert _raw_call(agent.address, other, _signed(payload))[::2] == (grpc.StatusCode.UNAUTHENTICATED,
                                                                       "bad_signature")
    assert agent.ran == []


def test_a_replayed_command_is_refused_and_runs_once(start_agent, caplog) -> None:
    agent = start_agent()
    payload = _command(key="r1").encode()
    metadata = [*_signed(payload), ("traceparent", f"00-{TRACE_ID}-{PARENT}-01")]
    assert _raw_call(agent.address, payload, metadata)[0] is grpc.StatusCode.OK
    with caplog.at_level(logging.WARNING):
        assert _raw_call(agent.address, payload, metadata)[::2] == (grpc.StatusCode.PERMISSION_DENIED, "replayed")
    assert agent.ran == ["hi"] and agent.refusals("replayed") == 1 and "replayed" in caplog.text
    refused = [s for s in agent.finished() if s.attributes.get("command.outcome") == "refused"]
    assert len(refused) == 1 and refused[0].attributes["refusal.reason"] == "replayed", "authentic: in its trace"
    assert refused[0].parent is not None and format(refused[0].parent.span_id, "016x") == PARENT


def test_expiry_future_issue_and_lifetime_are_checked_against_the_agent_clock(start_agent) -> None:
    now = 1_800_000_000 * 10**9
    agent = start_agent(clock=lambda: now, max_clock_skew_s=5.0, replay_window_s=120.0)
    cases = [(_command(issued_ns=now - 100 * 10**9, lifetime_s=90), grpc.StatusCode.PERMISSION_DENIED, "expired"),
             (_command(issued_ns=now + 10 * 10**9), grpc.StatusCode.PERMISSION_DENIED, "not_yet_valid"),
             (_command(issued_ns=now, lifetime_s=121), grpc.StatusCode.INVALID_ARGUMENT, "lifetime_too_long"),
             (_command(issued_ns=now - 33 * 10**9, lifetime_s=30, key="skew-a"), grpc.StatusCode.OK, ""),
             (_command(issued_ns=now + 4 * 10**9, key="skew-b"), grpc.StatusCode.OK, "")]
    for cmd, code, reason in cases:
        payload = cmd.encode()
        assert _raw_call(agent.address, payload, _signed(payload))[::2] == (code, reason), cmd
    assert len(agent.ran) == 2, "only the two within the skew allowance ran"


def test_a_command_for_another_node_is_refused(start_agent) -> None:
    agent = start_agent()
    payload = _command(node="h4").encode()
    assert _raw_call(agent.address, payload, _signed(payload))[::2] == (grpc.StatusCode.PERMISSION_DENIED,
                                                                       "wrong_node")


def _doc(**changes: object) -> dict[str, object]:
    doc: dict[str, object] = json.loads(_command().encode())
    return {**doc, **changes}


def _canon(doc: object) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


MALFORMED = {
    "not json": b"\xff{",
    "an array": b"[1,2]",
    "missing nonce": _canon({k: v for k, v in _doc().items() if k != "nonce"}),
    "extra field": _canon(_doc(extra=1)),
    "version 2": _canon(_doc(v=2)),
    "bool issued_at": _canon(_doc(issued_at=True)),
    "float expires_at": _canon(_doc(expires_at=1.5e18)),
    "expires before issue": _canon(_doc(expires_at=1)),
    "short nonce": _canon(_doc(nonce="abcd")),
    "nested arg": _canon(_doc(args={"text": {"x": 1}})),
    "bad arg name": _canon(_doc(args={"Text": "x"})),
    "bad key": _canon(_doc(key=" spaces ")),
    "not canonical": json.dumps(_doc(), indent=1).encode(),
    "duplicate field": _canon(_doc())[:-1] + b',"key":"other"}',
    "NaN": _canon(_doc())[:-1].replace(b'"args":{', b'"args":{"n":NaN,'),
}


@pytest.mark.parametrize("payload", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_payloads_are_refused_even_when_signed(start_agent, payload) -> None:
    agent = start_agent()
    assert _raw_call(agent.address, payload, _signed(payload))[::2] == (grpc.StatusCode.INVALID_ARGUMENT, "malformed")
    assert agent.ran == [] and agent.refusals("malformed") == 1


BAD_ARGS = {
    "unknown command": ("route.sett", {}, "unknown_command"),
    "missing dev": ("route.set", {"destination": "10.0.2.0/24"}, "bad_args"),
    "metric as text": ("route.set", {"destination": "10.0.2.0/24", "dev": "eth1", "metric": "1"}, "bad_args"),
    "bool for table": ("route.set", {"destination": "10.0.2.0/24", "dev": "eth1", "table": True}, "bad_args"),
    "unexpected arg": ("route.set", {"destination": "10.0.2.0/24", "dev": "eth1", "mtu": 9000}, "bad_args"),
    "host bits set": ("route.set", {"destination": "10.0.2.1/24", "dev": "eth1"}, "bad_args"),
    "bad interface": ("route.set", {"destination": "10.0.2.0/24", "dev": "eth1; reboot"}, "bad_args"),
    "mixed families": ("route.set", {"destination": "10.0.2.0/24", "dev": "eth1", "via": "fe80::1"}, "bad_args"),
    "both previous": ("route.restore", {"destination": "10.0.2.0/24", "previous_dev": "eth0",
                                        "previous_absent": True}, "bad_args"),
}


@pytest.mark.parametrize(("command", "args", "reason"), BAD_ARGS.values(), ids=BAD_ARGS.keys())
def test_bad_arguments_are_refused_before_anything_runs(start_agent, command, args, reason) -> None:
    agent = start_agent()
    with _client() as client, pytest.raises(ControlCallError) as err:
        client.call(target=agent.address, node=NODE, command=command, args=args, key="a1")
    assert (err.value.code, err.value.reason) == ("INVALID_ARGUMENT", reason)
    assert agent.routes.changes == []


# --- idempotency ----------------------------------------------------------------------------------------------------


def test_a_key_that_already_ran_returns_the_stored_reply_without_running(start_agent) -> None:
    agent = start_agent()
    with _client() as client:
        first = client.call(target=agent.address, node=NODE, command="test.echo", args={"text": "a"}, key="i1")
        again = client.call(target=agent.address, node=NODE, command="test.echo", args={"text": "a"}, key="i1")
        with pytest.raises(ControlCallError) as err:
            client.call(target=agent.address, node=NODE, command="test.echo", args={"text": "b"}, key="i1")
    assert agent.ran == ["a"]
    assert again.duplicate and not first.duplicate and again.data == first.data == {"text": "a", "n": 1}
    assert (err.value.code, err.value.reason) == ("ALREADY_EXISTS", "key_conflict")


def test_concurrent_calls_with_one_key_run_it_once(start_agent) -> None:
    agent = start_agent()
    replies: list[Reply] = []

    def call() -> None:
        with _client() as client:
            replies.append(client.call(target=agent.address, node=NODE, command="test.echo",
                                       args={"text": "c", "wait": True}, key="c1", timeout_s=20))

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    wait_for(lambda: agent.ran, what="the first call to run")
    agent.gate.set()
    for t in threads:
        t.join(20)
    assert agent.ran == ["c"] and len(replies) == 3
    assert sorted(r.duplicate for r in replies) == [False, True, True]


def test_reply_cache_waits_for_a_running_key_within_the_timeout() -> None:
    cache = ReplyCache(capacity=2)
    cmd = _command(key="w1")
    assert cache.begin(cmd, timeout_s=1) is None
    with pytest.raises(Refused) as busy:
        cache.begin(_command(key="w1"), timeout_s=0.05)
    assert busy.value.reason is Reason.IN_PROGRESS
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(cache.begin(_command(key="w1"), timeout_s=10)))
    waiter.start()
    cache.finish(cmd, {"ok": True})
    waiter.join(10)
    assert got == [{"ok": True}]


def test_the_reply_cache_is_bounded_least_recently_used_first(start_agent) -> None:
    agent = start_agent(results_cache_size=2)
    with _client() as client:
        for key in ("a", "b", "a", "c", "a", "b"):
            client.call(target=agent.address, node=NODE, command="test.echo", args={"text": key}, key=key)
    assert agent.ran == ["a", "b", "c", "b"], "b was least recently used when c came, so b ran again"


def test_the_replay_cache_is_bounded_and_forgets_only_expired_nonces() -> None:
    cache = ReplayCache(capacity=2)
    assert cache.admit("n1", keep_until_ns=100, now_ns=0) is None
    assert cache.admit("n2", keep_until_ns=200, now_ns=0) is None
    assert cache.admit("n3", keep_until_ns=300, now_ns=50) is Reason.REPLAY_CACHE_FULL
    assert cache.admit("n1", keep_until_ns=100, now_ns=100) is Reason.REPLAYED
    assert cache.admit("n3", keep_until_ns=300, now_ns=101) is None, "n1 expired and made room"
    assert len(cache) == 2


# --- keys -----------------------------------------------------------------------------------------------------------


def test_rotation_accepts_every_configured_key_and_only_those(start_agent) -> None:
    both = start_agent(env=_env(k1=K1, k2=K2))
    only_new = start_agent(env=_env(k1=K1, k2=K2), key_ids=("k2",))
    with _client(K1, "k1") as old, _client(K2, "k2") as new:
        assert old.call(target=both.address, node=NODE, command="ping", key="r1").ok
        assert new.call(target=both.address, node=NODE, command="ping", key="r2").ok
        assert new.call(target=only_new.address, node=NODE, command="ping", key="r3").ok
        with pytest.raises(ControlCallError) as err:
            old.call(target=only_new.address, node=NODE, command="ping", key="r4")
    assert err.value.reason == "unknown_key"


def test_keys_load_from_a_file_and_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"# control keys\nk1={K1.hex()}\n\nk2 = {K2.hex()}  # next\n")
    ring = load_keyring(file=str(path), env_var=ENV, environ={ENV: f"k3={bytes(32).hex()}"})
    assert ring.ids == ("k1", "k2", "k3")
    assert K1.hex() not in repr(ring) and "k1" in repr(ring)
    assert ring.only(["k2"]).ids == ("k2",)
    with pytest.raises(KeyRingError, match="not loaded"):
        ring.only(["k7"])


@pytest.mark.parametrize(("text", "message"), [
    ("k1=abcd", "at least 32"), ("k1=zz", "not hex"), ("nonsense", "KEY_ID=HEX"),
    (f"k1={K1.hex()}\nk1={K2.hex()}", "appears twice"), ("# nothing", "no control keys"),
    (f"bad id={K1.hex()}", "does not match")])
def test_bad_key_files_fail_with_a_message_that_holds_no_secret(tmp_path: Path, text, message) -> None:
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(KeyRingError, match=message) as err:
        load_keyring(file=str(path), environ={})
    assert "abcd" not in str(err.value) and K1.hex() not in str(err.value) and K2.hex() not in str(err.value)


def test_missing_key_file_and_clashing_ids_fail(tmp_path: Path) -> None:
    with pytest.raises(KeyRingError, match="cannot read"):
        load_keyring(file=str(tmp_path / "absent"), environ={})
    (tmp_path / "keys").write_text(f"k1={K1.hex()}")
    with pytest.raises(KeyRingError, match="both in"):
        load_keyring(file=str(tmp_path / "keys"), env_var=ENV, environ=_env(k1=K2))


# --- route commands over a RouteOps -----------------------------------------------------------------------------------


def test_route_set_and_restore_put_the_original_route_back(start_agent) -> None:
    agent = start_agent()
    original = Route("10.0.2.0/24", "eth0", "10.0.0.1")
    agent.routes.table[("10.0.2.0/24", 254)] = original
    with _client() as client:
        def call(command: str, key: str, **args: str) -> Reply:
            return client.call(target=agent.address, node=NODE, command=command, key=key,
                               args={"destination": "10.0.2.0/24", **args})
        first = call("route.set", "s1", dev="eth1", via="10.0.1.1")
        call("route.set", "s2", dev="eth2")
        assert agent.routes.table[("10.0.2.0/24", 254)] == Route("10.0.2.0/24", "eth2")
        restored = call("route.restore", "s3")
        again = call("route.restore", "s4")
    assert first.data == {"previous_absent": False, "previous_dev": "eth0", "previous_via": "10.0.0.1",
                          "previous_metric": 0, "previous_more": ""}
    assert restored.ok and agent.routes.table[("10.0.2.0/24", 254)] == original
    assert not again.ok and "previous_dev" in again.detail, "nothing saved any more: says what to pass"


def test_route_set_with_ecmp_nexthops_is_read_back_and_restored_from_its_data(start_agent) -> None:
    agent = start_agent()
    agent.routes.table[("10.200.0.0/16", 254)] = Route("10.200.0.0/16", "nic0", "10.64.0.0",
                                                       more=(("nic1", "10.65.0.0"), ("nic2", "10.66.0.0")))
    args = {"destination": "10.200.1.1/32", "dev": "nic0", "via": "10.64.0.0", "more": "nic2@10.66.0.0",
            "metric": 100}
    with _client() as client:
        def call(command: str, key: str, **extra: object) -> Reply:
            return client.call(target=agent.address, node=NODE, command=command, key=key,
                               args={"destination": "10.200.1.1/32", **extra})  # type: ignore[dict-item]
        before = call("route.get", "g1")
        put = client.call(target=agent.address, node=NODE, command="route.set", key="s1", args=args)
        after = call("route.get", "g2")
        installed = agent.routes.table.get(("10.200.1.1/32", 254))
        with pytest.raises(ControlCallError) as bad:
            call("route.set", "s2", dev="nic0", more="nic1@not-an-ip")
        back = call("route.restore", "r1", **{k: v for k, v in put.data.items()})
        gone = call("route.get", "g3")
    base = "nic0@10.64.0.0,nic1@10.65.0.0,nic2@10.66.0.0"
    assert before.data == {"present": False, "lookup": "nic0,nic1,nic2", "base": base}, "the covering /16"
    assert put.ok and put.data["previous_absent"] is True
    assert installed == Route("10.200.1.1/32", "nic0", "10.64.0.0", metric=100, more=(("nic2", "10.66.0.0"),))
    assert after.data == {"present": True, "lookup": "nic0,nic2", "base": base, "dev": "nic0", "via": "10.64.0.0",
                          "metric": 100, "more": "nic2@10.66.0.0"}
    assert bad.value.reason == "bad_args" and "not-an-ip" in bad.value.detail
    assert back.ok and ("10.200.1.1/32", 254) not in agent.routes.table
    assert gone.data["present"] is False and gone.data["lookup"] == "nic0,nic1,nic2"


def test_route_set_refuses_malformed_nexthops_before_running() -> None:
    registry = builtin_registry(node_id=NODE, clock=time.time_ns, route_ops=FakeRoutes())
    for more in ("nic1@10.0.0.300", "bad name with spaces", "nic1@::1"):
        with pytest.raises(BadArgs):
            registry.bind("route.set", {"destination": "10.0.0.0/24", "dev": "nic0", "more": more})


def test_route_restore_with_an_explicit_previous_route_after_an_agent_restart(start_agent) -> None:
    agent = start_agent()
    agent.routes.table[("10.0.3.0/24", 254)] = Route("10.0.3.0/24", "eth1")
    agent.routes.table[("10.0.4.0/24", 254)] = Route("10.0.4.0/24", "eth1")
    with _client() as client:
        put = client.call(target=agent.address, node=NODE, command="route.restore", key="x1",
                          args={"destination": "10.0.3.0/24", "previous_dev": "eth0", "previous_via": "10.0.0.1"})
        gone = client.call(target=agent.address, node=NODE, command="route.restore", key="x2",
                           args={"destination": "10.0.4.0/24", "previous_absent": True})
    assert put.ok and agent.routes.table[("10.0.3.0/24", 254)] == Route("10.0.3.0/24", "eth0", "10.0.0.1")
    assert gone.ok and ("10.0.4.0/24", 254) not in agent.routes.table


def test_registry_rejects_bad_registrations() -> None:
    registry = CommandRegistry()
    registry.register("a.b", lambda args: Outcome(True), params={})
    with pytest.raises(ValueError, match="already registered"):
        registry.register("a.b", lambda args: Outcome(True), params={})
    with pytest.raises(ValueError, match="lower_snake_case"):
        registry.register("Route Set", lambda args: Outcome(True), params={})
    with pytest.raises(ValueError, match="must be int"):
        registry.register("c", lambda args: Outcome(True), params={"n": Param(int, "1")})


# --- config ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"tls_cert_file": "c.pem"}, "go together"), ({"tls_client_ca_file": "ca.pem"}, "needs tls_cert_file"),
    ({"listen": "nowhere"}, "HOST:PORT"), ({"replay_window_s": 0}, "positive"), ({"max_clock_skew_s": -1}, "negative")])
def test_control_plane_config_errors(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        ControlPlaneConfig(**kwargs)


def test_client_config_errors_and_key_choice() -> None:
    with pytest.raises(ValueError, match="need tls_ca_file"):
        ControlClientConfig(tls_cert_file="c", tls_key_file="k")
    with pytest.raises(KeyRingError, match="set key_id"):
        build_control_client(ControlClientConfig(), environ=_env(k1=K1, k2=K2))
    with pytest.raises(KeyRingError, match="no control key 'k3'"):
        build_control_client(ControlClientConfig(key_id="k3"), environ=_env(k1=K1, k2=K2))
    build_control_client(ControlClientConfig(), environ=_env(k1=K1)).close()


def test_an_unreachable_agent_is_a_retryable_error() -> None:
    with _client() as client, pytest.raises(ControlCallError) as err:
        client.call(target="127.0.0.1:1", node=NODE, command="ping", key="u1", timeout_s=0.5)
    assert err.value.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED") and err.value.retryable


# --- mutual TLS -----------------------------------------------------------------------------------------------------


def _certs_with_cryptography(out: Path) -> None:
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def issue(name: str, key: ec.EllipticCurvePrivateKey, issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
              usage: x509.ObjectIdentifier | None) -> x509.Certificate:
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        issuer_name, signer = issuer or (subject, key)
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer_name).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=usage is None, path_length=None), critical=True))
        if usage is not None:
            builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False).add_extension(
                x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address(
                    "127.0.0.1"))]), critical=False)
        return builder.sign(signer, hashes.SHA256())

    def write(name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
        (out / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (out / f"{name}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat
                                                            .PKCS8, serialization.NoEncryption()))

    for ca_name, leaves in (("ca", ("server", "client")), ("rogue-ca", ("rogue",))):
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca = issue(ca_name, ca_key, None, None)
        write(ca_name, ca, ca_key)
        for leaf in leaves:
            key = ec.generate_private_key(ec.SECP256R1())
            usage = ExtendedKeyUsageOID.SERVER_AUTH if leaf == "server" else ExtendedKeyUsageOID.CLIENT_AUTH
            write(leaf, issue(leaf, key, (ca.subject, ca_key), usage), key)


def _certs_with_openssl(out: Path) -> None:
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=out, check=True, capture_output=True, timeout=60)

    ec_key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for ca_name, leaves in (("ca", ("server", "client")), ("rogue-ca", ("rogue",))):
        run("req", "-x509", *ec_key, "-keyout", f"{ca_name}.key", "-out", f"{ca_name}.pem", "-days", "1",
            "-subj", f"/CN={ca_name}", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign")
        for leaf in leaves:
            usage = "serverAuth" if leaf == "server" else "clientAuth"
            (out / f"{leaf}.ext").write_text(f"subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage={usage}\n"
                                             "basicConstraints=critical,CA:FALSE\n")
            run("req", *ec_key, "-keyout", f"{leaf}.key", "-out", f"{leaf}.csr", "-subj", f"/CN={leaf}")
            run("x509", "-req", "-in", f"{leaf}.csr", "-CA", f"{ca_name}.pem", "-CAkey", f"{ca_name}.key",
                "-CAcreateserial", "-out", f"{leaf}.pem", "-days", "1", "-extfile", f"{leaf}.ext")


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    """A CA with a server and a client certificate, and a rogue CA with a client certificate of its own."""
    out = tmp_path / "certs"
    out.mkdir()
    try:
        import cryptography  # noqa: F401 - only asks whether it is there
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor the openssl CLI is available to make certificates")
        _certs_with_openssl(out)
    else:
        _certs_with_cryptography(out)
    return out


def _tls_client(certs: Path, leaf: str | None) -> ControlClient:
    cfg = ControlClientConfig(tls_ca_file=str(certs / "ca.pem"), tls_server_name="localhost",
                              tls_cert_file=str(certs / f"{leaf}.pem") if leaf else "",
                              tls_key_file=str(certs / f"{leaf}.key") if leaf else "")
    return build_control_client(cfg, environ=_env(k1=K1))


def test_mutual_tls_admits_only_clients_with_a_certificate_from_the_ca(start_agent, certs: Path) -> None:
    agent = start_agent(tls_cert_file=str(certs / "server.pem"), tls_key_file=str(certs / "server.key"),
                        tls_client_ca_file=str(certs / "ca.pem"))
    with _tls_client(certs, "client") as client:
        assert client.call(target=agent.address, node=NODE, command="ping", key="t1").ok
    for leaf in (None, "rogue"):
        with _tls_client(certs, leaf) as client, pytest.raises(ControlCallError) as err:
            client.call(target=agent.address, node=NODE, command="ping", key=f"t-{leaf}", timeout_s=1.0)
        assert err.value.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"), leaf
    with _client() as plaintext, pytest.raises(ControlCallError):
        plaintext.call(target=agent.address, node=NODE, command="ping", key="t2", timeout_s=1.0)
    assert [s.attributes["command.key"] for s in agent.finished()] == ["t1"]


# --- end to end: incident → action → step → agent span, read back from otel_traces ---------------------------------

TRACES_EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


@pytest.fixture
def gateway(spawn, tmp_path: Path) -> dict[str, str]:
    """A real ``ridethrough server`` (gateway and chDB store) on free ports."""
    ready = tmp_path / "server.json"
    proc = spawn("server", "--store", f"chdb://{tmp_path}/store", "--spool", str(tmp_path / "spool"),
                 "--otlp-listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                 "--store-http-listen", "127.0.0.1:0", "--ready-file", str(ready), name="server")
    return read_ready(ready, proc)


@pytest.mark.integration
@pytest.mark.e2e
def test_trace_continues_from_the_incident_to_the_agent_span_in_the_store(start_agent, gateway) -> None:
    import clickhouse_connect
    from opentelemetry.sdk.resources import Resource

    from ridethrough.actuators.control_plane import agent_tracer_provider
    from ridethrough.actuators.tracing import SpanContext, spans_request
    from ridethrough.detectors.incident_events import root_span_id

    trace_id = secrets.token_hex(16)
    provider = agent_tracer_provider(resource=Resource.create({"service.name": "ridethrough-agent",
                                                               "ridethrough.node.id": NODE}),
                                     gateway=gateway["otlp"], timeout_s=10)
    config = ControlPlaneConfig(listen="127.0.0.1:0")
    routes = FakeRoutes(Route("10.0.2.0/24", "eth0"))
    server = build_control_plane(config, node_id=NODE, tracer=provider.get_tracer("ridethrough.agent"),
                                 registry=builtin_registry(node_id=NODE, clock=time.time_ns, route_ops=routes),
                                 environ=_env(k1=K1))
    address = server.start()
    try:
        action = ActionTrace(trace_id=trace_id, action_id="reroute-1", clock=time.time_ns)
        root = SpanData("incident", SpanContext(trace_id, root_span_id(trace_id).hex()), "", time.time_ns())
        apply = action.start("action.apply", {"action.plugin": "reroute"})
        steps: list[SpanData] = []
        with activate(action, apply, steps), _client() as client:
            reply = client.call(target=address, node=NODE, command="route.set", key="reroute-1:h3",
                                args={"destination": "10.0.2.0/24", "dev": "eth1"})
        assert reply.ok and routes.table[("10.0.2.0/24", 254)].dev == "eth1"
        for span in (root, apply):
            span.end(time.time_ns())
        assert provider.force_flush(10_000)
    finally:
        server.stop(1.0)
        provider.shutdown()
    with grpc.insecure_channel(gateway["otlp"]) as channel:  # the controller's spans, as the runner ships them
        channel.unary_unary(TRACES_EXPORT, request_serializer=None, response_deserializer=None)(
            spans_request([root, apply, *steps]).SerializeToString(), timeout=30)

    host, port = gateway["store_http"].removeprefix("http://").rsplit(":", 1)
    db = clickhouse_connect.get_client(host=host, port=int(port))

    def spans() -> list[tuple[str, str, str, str, dict[str, str]]]:
        found = db.query("SELECT SpanName, SpanId, ParentSpanId, ServiceName, SpanAttributes FROM otel_traces "
                         "WHERE TraceId = {t:String}", parameters={"t": trace_id}).result_rows
        return [tuple(r) for r in found] if len(found) >= 4 else []

    rows = wait_for(spans, what="4 spans of the trace")
    by_name = {r[0]: r for r in rows}
    assert set(by_name) == {"incident", "action.apply", "action.step", "agent.route.set"}
    agent_row, step_row = by_name["agent.route.set"], by_name["action.step"]
    assert agent_row[2] == step_row[1], "the agent span is a child of the step that called it"
    assert step_row[2] == by_name["action.apply"][1] and by_name["action.apply"][2] == by_name["incident"][1]
    assert agent_row[3] == "ridethrough-agent" and step_row[3] == "ridethrough-controller"
    assert agent_row[4]["command.key"] == "reroute-1:h3" and agent_row[4]["command.outcome"] == "ok"
    assert agent_row[4]["ridethrough.node.id"] == NODE
