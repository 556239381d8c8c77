"""Ingest security: bearer tokens per tenant, hot reload, tenant stamping, mutual TLS, and `ridethrough certs`."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from prometheus_client import generate_latest
from typer.testing import CliRunner

from ridethrough.certs import CertError, certs_command, make_certs
from ridethrough.exporters.gateway import OtlpReceiver, ServerOptions, build_server
from ridethrough.exporters.gateway_metrics import GatewayMetrics
from ridethrough.exporters.ingest_auth import (
    CLUSTER_ATTRIBUTE,
    TENANT_ATTRIBUTE,
    AuthFailure,
    IngestAuth,
    IngestAuthConfig,
    IngestAuthError,
    Principal,
    Unauthenticated,
    bearer_metadata,
    parse_tokens,
    server_credentials,
)
from ridethrough.exporters.otlp_stamp import stamp_request
from ridethrough.exporters.pipeline import BatchPolicy, Pipeline
from ridethrough.exporters.rows import Limits, kv
from ridethrough.exporters.spool import Spool, decode
from ridethrough.exporters.store import Store
from tests.otlp_util import METRICS_EXPORT, gauge_request

ACME = secrets.token_hex(32)
GLOBEX = secrets.token_hex(32)


# --- an in-process gateway (also used by test_fuzz and test_secrets_hidden) -----------------------------------------


@dataclass
class Served:
    """A gateway serving on loopback: its address, metrics, pipeline and receiver."""

    target: str
    metrics: GatewayMetrics
    pipeline: Pipeline
    receiver: OtlpReceiver


@contextlib.contextmanager
def serving(store: Store, spool_dir: Path, *, auth: IngestAuth | None = None,
            credentials: grpc.ServerCredentials | None = None, max_message_bytes: int = 4 << 20,
            spool_max_bytes: int = 64 << 20, max_inflight_bytes: int = 64 << 20,
            min_time_left_s: float = 0.25, convert_slots: int = 2, workers: int = 4) -> Iterator[Served]:
    """The real receiver, pipeline and spool over ``store``, on a free port; stopped on exit."""
    metrics = GatewayMetrics.create()
    pipeline = Pipeline(store=store, spool=Spool(spool_dir, max_bytes=spool_max_bytes), limits=Limits(),
                        policy=BatchPolicy(max_age_s=0.02, replay_initial_backoff_s=0.05, replay_max_backoff_s=0.5),
                        metrics=metrics)
    pipeline.start()
    receiver = OtlpReceiver(pipeline=pipeline, limits=Limits(), metrics=metrics, ack_timeout_s=20, auth=auth,
                            max_inflight_bytes=max_inflight_bytes, min_time_left_s=min_time_left_s,
                            convert_slots=convert_slots)
    server, port = build_server(receiver, listen="127.0.0.1:0", credentials=credentials,
                                options=ServerOptions(max_message_bytes=max_message_bytes, workers=workers))
    try:
        yield Served(f"127.0.0.1:{port}", metrics, pipeline, receiver)
    finally:
        server.stop(0).wait(5)
        pipeline.shutdown(5)


def export(target: str, raw: bytes, *, metadata: tuple[tuple[str, str], ...] = (), method: str = METRICS_EXPORT,
           channel_credentials: grpc.ChannelCredentials | None = None, timeout_s: float = 20) -> tuple[str, str]:
    """One raw Export call: (status code name, details or '')."""
    opts = [("grpc.max_send_message_length", 64 << 20)]
    channel = (grpc.secure_channel(target, channel_credentials, options=opts) if channel_credentials
               else grpc.insecure_channel(target, options=opts))
    with channel:
        call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        try:
            call(raw, timeout=timeout_s, metadata=metadata or None)
        except grpc.RpcError as err:
            return err.code().name, err.details() or ""
        return "OK", ""


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    s = Store(f"chdb://{tmp_path_factory.mktemp('ingest-auth') / 'store'}")
    s.init_schema()
    yield s
    s.close()


def _resource_rows(store: Store, service: str) -> list[dict[str, str]]:
    _, rows = store.query("SELECT ResourceAttributes FROM otel_metrics_gauge WHERE ServiceName = {s:String}",
                          parameters={"s": service})
    return [r[0] for r in rows]


def _auth(tmp_path: Path, text: str, **kw: object) -> IngestAuth:
    path = tmp_path / "tokens"
    path.write_text(text)
    return IngestAuth(tokens_file=str(path), **kw)  # type: ignore[arg-type]


# --- the token table ---------------------------------------------------------------------------------------------


def test_token_entries_name_a_tenant_and_optionally_a_cluster() -> None:
    table = parse_tokens(f"# comment\nacme/lab-a={ACME}\n\nglobex = {GLOBEX}  # any cluster\n", source="t")
    assert sorted(table.values(), key=lambda p: p.tenant) == [Principal("acme", "lab-a"), Principal("globex", "")]
    assert ACME.encode() not in b"".join(table), "held as digests, not as tokens"


@pytest.mark.parametrize(("text", "problem"), [
    ("acme", "expected TENANT"), ("acme/=" + "a" * 40, "expected TENANT"), ("a b=" + "a" * 40, "expected TENANT"),
    ("acme=short", "at least 32"), ("acme=" + "a" * 39 + " x", "at least 32"),
    (f"acme={ACME}\nglobex={ACME}", "already given"),
])
def test_bad_token_entries_are_refused_naming_the_line_never_the_token(text: str, problem: str) -> None:
    with pytest.raises(IngestAuthError, match=problem) as err:
        parse_tokens(text, source="tokens.txt")
    assert "tokens.txt line" in str(err.value)
    assert ACME not in str(err.value) and "a" * 39 not in str(err.value)


def test_config_builds_no_checker_unless_tokens_are_configured_or_required(tmp_path: Path) -> None:
    assert IngestAuth.from_config(IngestAuthConfig(), environ={}) is None
    auth = IngestAuth.from_config(IngestAuthConfig(), environ={"RIDETHROUGH_INGEST_TOKENS": f"acme={ACME}"})
    assert auth is not None and not auth.require_token and auth.token_count == 1
    assert ACME not in repr(auth)
    with pytest.raises(IngestAuthError, match="no ingest token"):
        IngestAuth.from_config(IngestAuthConfig(require_token=True), environ={})
    with pytest.raises(ValueError, match="go together"):
        IngestAuthConfig(tls_cert_file="c.pem")
    with pytest.raises(IngestAuthError, match="cannot read ingest tokens"):
        IngestAuth(tokens_file=str(tmp_path / "missing"))


def test_authenticate_accepts_only_one_well_formed_known_bearer_token(tmp_path: Path) -> None:
    auth = _auth(tmp_path, f"acme/lab-a={ACME}\n")
    assert auth.authenticate(bearer_metadata(ACME)) == Principal("acme", "lab-a")
    assert auth.authenticate([("Authorization", f"bearer {ACME}")]) == Principal("acme", "lab-a")
    cases = {AuthFailure.MISSING: [], AuthFailure.MALFORMED: [("authorization", ACME)],
             AuthFailure.UNKNOWN: bearer_metadata(GLOBEX)}
    for reason, metadata in cases.items():
        with pytest.raises(Unauthenticated) as err:
            auth.authenticate(metadata)
        assert err.value.reason is reason
    with pytest.raises(Unauthenticated, match="malformed"):
        auth.authenticate([*bearer_metadata(ACME), *bearer_metadata(ACME)])
    with pytest.raises(Unauthenticated, match="malformed"):
        auth.authenticate([("authorization", b"binary")])
    optional = _auth(tmp_path, f"acme={ACME}\n", require_token=False)
    assert optional.authenticate([]) is None
    with pytest.raises(Unauthenticated, match="unknown"):
        optional.authenticate(bearer_metadata(GLOBEX))


class Mono:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_tokens_file_is_hot_reloaded_and_a_broken_one_keeps_the_old_tokens(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    mono, metrics = Mono(), GatewayMetrics.create()
    auth = _auth(tmp_path, f"acme={ACME}\n", reload_s=5.0, monotonic=mono, metrics=metrics)
    (tmp_path / "tokens").write_text(f"globex={GLOBEX}\n")
    mono.now += 1.0
    assert auth.authenticate(bearer_metadata(GLOBEX)).tenant == "globex", "an unknown token re-reads at once"
    with pytest.raises(Unauthenticated):
        auth.authenticate(bearer_metadata(ACME))  # revoked with the rotation
    broken = f"globex={GLOBEX}\nacme=tooshort\n"
    (tmp_path / "tokens").write_text(broken)
    with caplog.at_level(logging.ERROR):
        for _ in range(3):
            mono.now += 6.0
            assert auth.authenticate(bearer_metadata(GLOBEX)).tenant == "globex"
    assert metrics.auth_reload_failures._value.get() == 1, "counted (and logged) once per change"
    assert [r.levelname for r in caplog.records] == ["ERROR"] and "tooshort" not in caplog.text
    (tmp_path / "tokens").unlink()
    mono.now += 6.0
    assert auth.authenticate(bearer_metadata(GLOBEX)).tenant == "globex", "a vanished file keeps the tokens"


def test_a_kubernetes_style_secret_swap_is_picked_up(tmp_path: Path) -> None:
    """A Secret volume: tokens -> ..data/tokens, ..data -> a timestamped folder swapped atomically."""
    for version, token in (("v1", ACME), ("v2", GLOBEX)):
        (tmp_path / version).mkdir()
        (tmp_path / version / "tokens").write_text(f"acme={token}\n")
    os.symlink("v1", tmp_path / "..data")
    os.symlink("..data/tokens", tmp_path / "tokens")
    mono = Mono()
    auth = IngestAuth(tokens_file=str(tmp_path / "tokens"), reload_s=1.0, monotonic=mono)
    assert auth.authenticate(bearer_metadata(ACME)).tenant == "acme"
    os.symlink("v2", tmp_path / "..data_tmp")
    os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
    mono.now += 2.0
    assert auth.authenticate(bearer_metadata(GLOBEX)).tenant == "acme"
    with pytest.raises(Unauthenticated):
        auth.authenticate(bearer_metadata(ACME))


# --- stamping ----------------------------------------------------------------------------------------------------


def _resources(raw: bytes, request_type: type = ExportMetricsServiceRequest) -> list[dict[str, str]]:
    req = request_type.FromString(raw)
    field = req.DESCRIPTOR.fields_by_number[1].name
    return [{a.key: a.value.string_value for a in r.resource.attributes} for r in getattr(req, field)]


def test_the_tenant_and_a_pinned_cluster_replace_what_the_sender_claims(tmp_path: Path) -> None:
    auth = _auth(tmp_path, f"acme/lab-a={ACME}\nglobex={GLOBEX}\n", require_token=False)
    req = gauge_request(2)
    req.resource_metrics[0].resource.attributes.extend([kv(TENANT_ATTRIBUTE, "globex"), kv(CLUSTER_ATTRIBUTE, "b")])
    req.resource_metrics.add().resource.attributes.append(kv(TENANT_ATTRIBUTE, "globex"))
    req.resource_metrics.add()  # a resource_metrics without a resource gets one
    raw = req.SerializeToString()
    pinned = auth.stamp(raw, Principal("acme", "lab-a"), request_type=ExportMetricsServiceRequest)
    assert [{k: r.get(k) for k in (TENANT_ATTRIBUTE, CLUSTER_ATTRIBUTE)} for r in _resources(pinned)] == \
        [{TENANT_ATTRIBUTE: "acme", CLUSTER_ATTRIBUTE: "lab-a"}] * 3
    assert _resources(pinned)[0]["service.name"] == "test"
    free = _resources(auth.stamp(raw, Principal("globex"), request_type=ExportMetricsServiceRequest))
    assert [(r[TENANT_ATTRIBUTE], r.get(CLUSTER_ATTRIBUTE)) for r in free] == \
        [("globex", "b"), ("globex", None), ("globex", None)]
    anonymous = _resources(auth.stamp(raw, None, request_type=ExportMetricsServiceRequest))
    assert all(TENANT_ATTRIBUTE not in r for r in anonymous) and anonymous[0][CLUSTER_ATTRIBUTE] == "b"
    points = ExportMetricsServiceRequest.FromString(pinned).resource_metrics[0].scope_metrics[0].metrics[0]
    assert points == req.resource_metrics[0].scope_metrics[0].metrics[0], "everything else is untouched"


_KEYS = st.sampled_from(["service.name", TENANT_ATTRIBUTE, CLUSTER_ATTRIBUTE, "host.name", "x"])
_UNKNOWN = st.sampled_from([b"", b"\x78\x05", b"\x81\x01\x01\x00\x00\x00\x00\x00\x00\x00", b"\xfa\x01\x02hi"])


@st.composite
def _requests(draw: st.DrawFn) -> tuple[type, bytes]:
    request_type = draw(st.sampled_from([ExportMetricsServiceRequest, ExportTraceServiceRequest,
                                         ExportLogsServiceRequest]))
    req = request_type()
    field = req.DESCRIPTOR.fields_by_number[1].name
    for _ in range(draw(st.integers(0, 3))):
        element = getattr(req, field).add()
        element.schema_url = draw(st.text(max_size=5))
        for key, value in draw(st.lists(st.tuples(_KEYS, st.text(max_size=8)), max_size=5)):
            element.resource.attributes.append(kv(key, value))
    # unknown fields (varint 15, fixed64 16, bytes 31) at the top: copied through as the parser keeps them
    return request_type, req.SerializeToString() + draw(_UNKNOWN)


@settings(max_examples=150, deadline=None)
@given(case=_requests(), principal=st.sampled_from([None, Principal("acme"), Principal("acme", "lab-a")]))
def test_the_wire_level_stamp_equals_a_full_parse_and_rewrite(case: tuple[type, bytes],
                                                              principal: Principal | None) -> None:
    request_type, raw = case
    auth = IngestAuth(extra_tokens={b"x": Principal("acme")}, require_token=False)
    fast = request_type.FromString(auth.stamp(raw, principal, request_type=request_type))
    slow = request_type.FromString(raw)
    field = slow.DESCRIPTOR.fields_by_number[1].name
    for element in getattr(slow, field):
        attrs = [a for a in element.resource.attributes if a.key != TENANT_ATTRIBUTE
                 and not (principal is not None and principal.cluster and a.key == CLUSTER_ATTRIBUTE)]
        del element.resource.attributes[:]
        element.resource.attributes.extend(attrs)
        if principal is not None:
            element.resource.attributes.append(kv(TENANT_ATTRIBUTE, principal.tenant))
            if principal.cluster:
                element.resource.attributes.append(kv(CLUSTER_ATTRIBUTE, principal.cluster))
    assert fast == slow


def test_groups_take_the_full_parse_and_garbage_raises_decode_error() -> None:
    raw = gauge_request(1).SerializeToString() + b"\x7b\x7c"  # an empty group, field 15: legal, unusual
    out = stamp_request(raw, strip=frozenset({TENANT_ATTRIBUTE}), add=(kv(TENANT_ATTRIBUTE, "acme"),),
                        request_type=ExportMetricsServiceRequest)
    assert _resources(out)[0][TENANT_ATTRIBUTE] == "acme"
    for garbage in (b"\xff\xff\xff\x0f garbage", b"\x0a\x05ab", b"\x0a\x02\x0a\x7f", b"\x07", b"\x80"):
        with pytest.raises(DecodeError):
            stamp_request(garbage, strip=frozenset({TENANT_ATTRIBUTE}), add=(),
                          request_type=ExportMetricsServiceRequest)


# --- through the gateway -----------------------------------------------------------------------------------------


@pytest.mark.integration
def test_only_token_holders_write_and_rows_carry_the_tokens_tenant(store: Store, tmp_path: Path) -> None:
    auth = _auth(tmp_path, f"acme/lab-a={ACME}\n")
    req = gauge_request(3, service="auth-e2e")
    req.resource_metrics[0].resource.attributes.append(kv(TENANT_ATTRIBUTE, "globex"))
    raw = req.SerializeToString()
    with serving(store, tmp_path / "spool", auth=auth) as gw:
        assert export(gw.target, raw) == ("UNAUTHENTICATED", "missing or invalid bearer token (missing)")
        status, details = export(gw.target, raw, metadata=bearer_metadata(GLOBEX))
        assert status == "UNAUTHENTICATED" and GLOBEX not in details
        assert export(gw.target, b"\xff garbage", metadata=bearer_metadata(GLOBEX))[0] == "UNAUTHENTICATED", \
            "refused before the body is parsed"
        assert export(gw.target, raw, metadata=bearer_metadata(ACME)) == ("OK", "")
        assert export(gw.target, b"\xff garbage", metadata=bearer_metadata(ACME))[0] == "INVALID_ARGUMENT"
        page = generate_latest(gw.metrics.registry).decode()
    rows = _resource_rows(store, "auth-e2e")
    assert len(rows) == 3 and all(r[TENANT_ATTRIBUTE] == "acme" and r[CLUSTER_ATTRIBUTE] == "lab-a" for r in rows)
    assert 'ridethrough_gateway_auth_failures_total{reason="missing"} 1.0' in page
    assert 'ridethrough_gateway_auth_failures_total{reason="unknown"} 2.0' in page
    assert 'ridethrough_gateway_requests_total{code="UNAUTHENTICATED",signal="metrics"} 3.0' in page


@pytest.mark.integration
def test_spooled_batches_keep_the_stamp(tmp_path: Path) -> None:
    away = Store("http://127.0.0.1:9/", timeout_s=1.0)  # port 9 (discard): nothing listens
    auth = _auth(tmp_path, f"acme/lab-a={ACME}\n")
    req = gauge_request(2, service="spooled")
    req.resource_metrics[0].resource.attributes.append(kv(TENANT_ATTRIBUTE, "globex"))
    with serving(away, tmp_path / "spool", auth=auth) as gw:
        assert export(gw.target, req.SerializeToString(), metadata=bearer_metadata(ACME)) == ("OK", "")
    (batch,) = sorted((tmp_path / "spool").glob("*.spool"))
    _, _, requests = decode(batch.read_bytes())
    assert _resources(requests[0][1])[0][TENANT_ATTRIBUTE] == "acme"


# --- mutual TLS and `ridethrough certs` ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pki")
    make_certs(out / "lab", names=["gateway", "agent"])
    make_certs(out / "rogue", names=["agent"])
    return out


def _client_credentials(pki: Path, leaf: str | None) -> grpc.ChannelCredentials:
    read = lambda p: (pki / p).read_bytes()  # noqa: E731 - a local shorthand
    return grpc.ssl_channel_credentials(root_certificates=read("lab/ca.pem"),
                                        private_key=read(f"{leaf}.key") if leaf else None,
                                        certificate_chain=read(f"{leaf}.pem") if leaf else None)


@pytest.mark.integration
def test_mutual_tls_on_the_otlp_listener_admits_only_certificates_from_the_ca(
        store: Store, pki: Path, tmp_path: Path) -> None:
    cfg = IngestAuthConfig(tls_cert_file=str(pki / "lab/gateway.pem"), tls_key_file=str(pki / "lab/gateway.key"),
                           tls_client_ca_file=str(pki / "lab/ca.pem"))
    raw = gauge_request(1, service="mtls").SerializeToString()
    with serving(store, tmp_path / "spool", credentials=server_credentials(cfg)) as gw:
        assert export(gw.target, raw, channel_credentials=_client_credentials(pki, "lab/agent")) == ("OK", "")
        for leaf in (None, "rogue/agent"):
            status, _ = export(gw.target, raw, channel_credentials=_client_credentials(pki, leaf), timeout_s=3)
            assert status == "UNAVAILABLE", leaf
        assert export(gw.target, raw, timeout_s=3)[0] == "UNAVAILABLE", "plaintext is refused"
    assert len(_resource_rows(store, "mtls")) == 1


def test_certs_are_ecdsa_leaves_of_the_ca_for_both_ends_and_keys_are_private(pki: Path) -> None:
    ctx = ssl.create_default_context(cafile=str(pki / "lab/ca.pem"))
    ctx.load_cert_chain(str(pki / "lab/agent.pem"), str(pki / "lab/agent.key"))  # the pair matches
    info = ssl._ssl._test_decode_cert(str(pki / "lab/agent.pem"))  # type: ignore[attr-defined]
    assert ("DNS", "agent") in info["subjectAltName"] and ("IP Address", "127.0.0.1") in info["subjectAltName"]
    assert os.stat(pki / "lab/agent.key").st_mode & 0o777 == 0o600
    assert os.stat(pki / "lab/ca.key").st_mode & 0o777 == 0o600


def test_certs_command_reuses_the_ca_and_refuses_to_overwrite(tmp_path: Path) -> None:
    import typer

    app = typer.Typer()
    app.command()(certs_command)
    runner = CliRunner()
    first = runner.invoke(app, [str(tmp_path), "--name", "h1", "--san", "10.0.0.1"])
    assert first.exit_code == 0, first.output
    assert "(new;" in first.output and (tmp_path / "h1.pem").exists()
    ca = (tmp_path / "ca.pem").read_bytes()
    again = runner.invoke(app, [str(tmp_path), "--name", "h1"])
    assert again.exit_code == 1 and "--force" in again.output
    more = runner.invoke(app, [str(tmp_path), "--name", "h2"])
    assert more.exit_code == 0 and "(reused;" in more.output and (tmp_path / "ca.pem").read_bytes() == ca
    with pytest.raises(CertError, match="must match"):
        make_certs(tmp_path, names=["bad name"])
    (tmp_path / "ca.key").unlink()
    with pytest.raises(CertError, match="without the other"):
        make_certs(tmp_path / ".", names=["h3"])
