"""Hostile input, bounded: the OTLP receiver, the probe responder and the job endpoint under generated traffic.

Each target runs a few seconds (a ``max_examples`` budget, no deadline); ``bench/fuzz.py`` runs the
same strategies for longer. What must hold: no crash and no INTERNAL answer, every input gets the
status its content calls for, nothing accepted is lost, and state stays bounded.
"""

from __future__ import annotations

import json
import shutil
import socket
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from ridethrough.collector.job_protocol import MAX_DATAGRAM_BYTES, DropReason, ProtocolError, decode
from ridethrough.collector.probe_responder import Responder
from ridethrough.collector.probe_sample import TimestampKind
from ridethrough.collector.probe_wire import PACKET_BYTES, Endpoint, Probe, Reply, encode
from ridethrough.collector.probe_wire import DropReason as ProbeDrop
from ridethrough.collector.probe_wire import decode as decode_probe
from ridethrough.collector.sources.job import JobSource
from ridethrough.collector.timestamps import Received
from ridethrough.exporters.signals import Signal
from ridethrough.exporters.store import Store
from tests.otlp_util import gauge_request
from tests.test_ingest_auth import export, serving

FUZZ = settings(deadline=None, max_examples=120, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
ALLOWED = {"OK", "INVALID_ARGUMENT"}

# -- OTLP message strategies (bench/fuzz.py uses them too) ----------------------------------------------------------

_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)  # protobuf strings are valid UTF-8
_U64 = st.integers(0, 2**64 - 1)
# Timestamps stay below 2**63 ns (the year 2262, DateTime64(9)'s end) until the converters reject later ones:
# see test_a_timestamp_past_2262_is_rejected_alone_and_does_not_poison_its_batch; then use _U64 here.
_TIME = st.integers(0, 2**64 - 1)
_FLOAT = st.floats(allow_nan=True, allow_infinity=True)
_ID = st.binary(max_size=20)


def _any_value() -> st.SearchStrategy[AnyValue]:
    scalar = st.one_of(_TEXT.map(lambda s: AnyValue(string_value=s)),
                       st.booleans().map(lambda b: AnyValue(bool_value=b)),
                       st.integers(-2**63, 2**63 - 1).map(lambda i: AnyValue(int_value=i)),
                       _FLOAT.map(lambda f: AnyValue(double_value=f)), st.binary(max_size=8).map(
                           lambda b: AnyValue(bytes_value=b)), st.just(AnyValue()))

    def nest(inner: st.SearchStrategy[AnyValue]) -> st.SearchStrategy[AnyValue]:
        def array(values: list[AnyValue]) -> AnyValue:
            v = AnyValue()
            v.array_value.values.extend(values)
            return v

        def kvlist(pairs: list[tuple[str, AnyValue]]) -> AnyValue:
            v = AnyValue()
            v.kvlist_value.values.extend(KeyValue(key=k, value=x) for k, x in pairs)
            return v
        return st.one_of(st.lists(inner, max_size=3).map(array),
                         st.lists(st.tuples(_TEXT, inner), max_size=3).map(kvlist))
    return st.recursive(scalar, nest, max_leaves=6)


ATTRS = st.lists(st.tuples(_TEXT, _any_value()), max_size=4).map(lambda kvs: [KeyValue(key=k, value=v) for k, v in kvs])


@st.composite
def metrics_requests(draw: st.DrawFn, service: str = "fuzz") -> ExportMetricsServiceRequest:
    """Any shape of metrics request: every kind, odd values, mismatched histograms, bad exemplars."""
    req = ExportMetricsServiceRequest()
    for _ in range(draw(st.integers(0, 2))):
        rm = req.resource_metrics.add()
        rm.resource.attributes.extend(draw(ATTRS))
        rm.resource.attributes.add(key="service.name").value.string_value = service
        for _ in range(draw(st.integers(0, 2))):
            sm = rm.scope_metrics.add()
            sm.scope.name, sm.scope.version = draw(_TEXT), draw(_TEXT)
            for _ in range(draw(st.integers(0, 3))):
                _metric(draw, sm.metrics.add(name=draw(_TEXT), unit=draw(_TEXT)))
    return req


def _metric(draw: st.DrawFn, m: Any) -> None:
    kind = draw(st.sampled_from(["gauge", "sum", "histogram", "exponential_histogram", "summary", "none"]))
    if kind == "none":
        return
    data = getattr(m, kind)
    for _ in range(draw(st.integers(0, 3))):
        p = data.data_points.add(time_unix_nano=draw(_TIME), start_time_unix_nano=draw(_TIME))
        p.attributes.extend(draw(ATTRS))
        if kind in ("gauge", "sum"):
            if draw(st.booleans()):
                p.as_double = draw(_FLOAT)
            else:
                p.as_int = draw(st.integers(-2**63, 2**63 - 1))
            if draw(st.booleans()):
                p.exemplars.add(time_unix_nano=draw(_TIME), as_double=draw(_FLOAT), span_id=draw(_ID),
                                trace_id=draw(_ID))
        elif kind == "histogram":
            p.count, p.sum = draw(_U64), draw(_FLOAT)
            p.bucket_counts.extend(draw(st.lists(_U64, max_size=4)))
            p.explicit_bounds.extend(draw(st.lists(_FLOAT, max_size=4)))
        elif kind == "exponential_histogram":
            p.count, p.scale, p.zero_count = draw(_U64), draw(st.integers(-2**31, 2**31 - 1)), draw(_U64)
            p.positive.offset = draw(st.integers(-2**31, 2**31 - 1))
            p.positive.bucket_counts.extend(draw(st.lists(_U64, max_size=4)))
        else:
            p.count, p.sum = draw(_U64), draw(_FLOAT)
            for _ in range(draw(st.integers(0, 2))):
                p.quantile_values.add(quantile=draw(_FLOAT), value=draw(_FLOAT))
    if kind in ("sum", "histogram", "exponential_histogram"):
        data.aggregation_temporality = draw(st.integers(0, 5))  # open enum: unknown values are legal
    if kind == "sum":
        data.is_monotonic = draw(st.booleans())


@st.composite
def trace_requests(draw: st.DrawFn, service: str = "fuzz") -> ExportTraceServiceRequest:
    """Spans with ids of any length, unknown kinds and status codes, events and links."""
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.add(key="service.name").value.string_value = service
    ss = rs.scope_spans.add()
    for _ in range(draw(st.integers(0, 3))):
        span = ss.spans.add(trace_id=draw(_ID), span_id=draw(_ID), parent_span_id=draw(_ID), name=draw(_TEXT),
                            kind=draw(st.integers(0, 9)), start_time_unix_nano=draw(_TIME),
                            end_time_unix_nano=draw(_TIME), trace_state=draw(_TEXT))
        span.attributes.extend(draw(ATTRS))
        span.status.code, span.status.message = draw(st.integers(0, 5)), draw(_TEXT)
        for _ in range(draw(st.integers(0, 2))):
            span.events.add(name=draw(_TEXT), time_unix_nano=draw(_TIME)).attributes.extend(draw(ATTRS))
        for _ in range(draw(st.integers(0, 2))):
            span.links.add(trace_id=draw(_ID), span_id=draw(_ID)).attributes.extend(draw(ATTRS))
    return req


@st.composite
def log_requests(draw: st.DrawFn, service: str = "fuzz") -> ExportLogsServiceRequest:
    """Log records with any body, severity and ids."""
    req = ExportLogsServiceRequest()
    rl = req.resource_logs.add()
    rl.resource.attributes.add(key="service.name").value.string_value = service
    sl = rl.scope_logs.add()
    for _ in range(draw(st.integers(0, 3))):
        rec = sl.log_records.add(time_unix_nano=draw(_TIME), observed_time_unix_nano=draw(_TIME),
                                 severity_number=draw(st.integers(0, 30)), severity_text=draw(_TEXT),
                                 trace_id=draw(_ID), span_id=draw(_ID), flags=draw(st.integers(0, 2**32 - 1)))
        rec.body.CopyFrom(draw(_any_value()))
        rec.attributes.extend(draw(ATTRS))
    return req


def mutations(valid: bytes) -> st.SearchStrategy[bytes]:
    """``valid`` truncated, with a byte changed, or with bytes spliced in."""
    n = len(valid)
    return st.one_of(
        st.integers(0, n).map(lambda i: valid[:i]),
        st.tuples(st.integers(0, max(0, n - 1)), st.integers(0, 255)).map(
            lambda c: valid[:c[0]] + bytes([c[1]]) + valid[c[0] + 1:]),
        st.tuples(st.integers(0, n), st.binary(min_size=1, max_size=8)).map(
            lambda c: valid[:c[0]] + c[1] + valid[c[0]:]))


def items_of(signal: Signal, request: Any) -> int:
    """Data points, spans or log records in a request."""
    if signal is Signal.METRICS:
        return sum(len(getattr(m, k).data_points) for rm in request.resource_metrics for sm in rm.scope_metrics
                   for m in sm.metrics if (k := m.WhichOneof("data")))
    if signal is Signal.TRACES:
        return sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
    return sum(len(sl.log_records) for rl in request.resource_logs for sl in rl.scope_logs)


# -- the OTLP receiver ----------------------------------------------------------------------------------------------

METHODS = {s: f"/{s.service}/Export" for s in Signal}
STRATEGIES = {Signal.METRICS: metrics_requests, Signal.TRACES: trace_requests, Signal.LOGS: log_requests}
_COUNT_SQL = {
    Signal.METRICS: " + ".join(f"(SELECT count() FROM otel_metrics_{t} WHERE ServiceName = {{s:String}})"
                               for t in ("gauge", "sum", "histogram", "exponential_histogram", "summary")),
    Signal.TRACES: "SELECT count() FROM otel_traces WHERE ServiceName = {s:String}",
    Signal.LOGS: "SELECT count() FROM otel_logs WHERE ServiceName = {s:String}",
}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    s = Store(f"chdb://{tmp_path_factory.mktemp('fuzz') / 'store'}")
    s.init_schema()
    yield s
    s.close()


def stored(store: Store, signal: Signal, service: str) -> int:
    """Rows of ``service`` in ``signal``'s tables."""
    sql = _COUNT_SQL[signal] if signal is not Signal.METRICS else f"SELECT {_COUNT_SQL[signal]}"
    return int(store.query(sql, parameters={"s": service})[1][0][0])


def _response(signal: Signal, target: str, raw: bytes) -> tuple[str, int]:
    """(status, rejected items) of one Export of ``raw``."""
    import grpc

    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary(METHODS[signal], request_serializer=None,
                                   response_deserializer=signal.response_type.FromString)
        try:
            response = call(raw, timeout=30)
        except grpc.RpcError as err:
            return err.code().name, 0
    ps = response.partial_success
    return "OK", getattr(ps, {Signal.METRICS: "rejected_data_points", Signal.TRACES: "rejected_spans",
                              Signal.LOGS: "rejected_log_records"}[signal])


class OtlpOracle:
    """Exports to a gateway and holds it to its answers: the status, the partial success, the stored count."""

    def __init__(self, target: str, store: Store) -> None:
        self.target, self.store = target, store
        self.accepted: Counter[tuple[Signal, str]] = Counter()
        self.statuses: Counter[str] = Counter()

    def request(self, signal: Signal, request: Any, service: str) -> None:
        """A well-formed request: OK, at most its items rejected, and the rest stored (once) soon after."""
        status, rejected = _response(signal, self.target, request.SerializeToString())
        self.statuses[status] += 1
        items = items_of(signal, request)
        assert status == "OK" and 0 <= rejected <= items, (status, rejected, items)
        self.accepted[signal, service] += items - rejected
        # OK means stored or spooled: a spooled batch lands within the replayer's backoff
        deadline = time.monotonic() + 3
        while stored(self.store, signal, service) != self.accepted[signal, service] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stored(self.store, signal, service) == self.accepted[signal, service], "stored once, all of it"

    def raw(self, signal: Signal, raw: bytes) -> None:
        """Any bytes: OK or INVALID_ARGUMENT, never INTERNAL or a dead server."""
        status = export(self.target, raw, method=METHODS[signal])[0]
        self.statuses[status] += 1
        assert status in ALLOWED, status


@pytest.mark.integration
@pytest.mark.parametrize("signal", list(Signal), ids=lambda s: s.name.lower())
def test_generated_requests_are_answered_ok_and_every_accepted_item_is_stored(
        store: Store, tmp_path: Path, signal: Signal) -> None:
    with serving(store, tmp_path / "spool") as gw:
        oracle = OtlpOracle(gw.target, store)
        service = f"fuzz-{signal.name.lower()}"

        @FUZZ
        @given(request=STRATEGIES[signal](service))
        def check(request: Any) -> None:
            oracle.request(signal, request, service)
        check()


def _valid(signal: Signal) -> bytes:
    """A small valid request of ``signal`` with a little of everything, as the base for mutations."""
    request = signal.request_type()
    if signal is Signal.METRICS:
        request = gauge_request(3, service="fuzz-raw")
    elif signal is Signal.TRACES:
        span = request.resource_spans.add().scope_spans.add().spans.add(
            trace_id=b"t" * 16, span_id=b"s" * 8, name="op", start_time_unix_nano=1, end_time_unix_nano=2)
        span.attributes.add(key="k").value.string_value = "v"
    else:
        rec = request.resource_logs.add().scope_logs.add().log_records.add(time_unix_nano=1, severity_number=9)
        rec.body.string_value = "hello"
    return bytes(request.SerializeToString())


def raw_requests() -> st.SearchStrategy[tuple[Signal, bytes]]:
    """(signal, bytes): random bytes, or a valid request of the signal truncated or altered."""
    return st.sampled_from(list(Signal)).flatmap(
        lambda signal: st.tuples(st.just(signal), st.binary(max_size=200) | mutations(_valid(signal))))


@pytest.mark.integration
def test_raw_and_mutated_bytes_get_ok_or_invalid_argument_never_a_crash(store: Store, tmp_path: Path) -> None:
    with serving(store, tmp_path / "spool") as gw:
        oracle = OtlpOracle(gw.target, store)

        @FUZZ
        @given(case=raw_requests())
        def check(case: tuple[Signal, bytes]) -> None:
            oracle.raw(*case)
        check()
    assert oracle.statuses["INVALID_ARGUMENT"] > 0, "the generator reaches the decoder's errors"
    with serving(store, tmp_path / "spool") as gw:
        valid = _valid(Signal.METRICS)
        assert export(gw.target, valid, method=METHODS[Signal.METRICS])[0] == "OK", "still serving"


@pytest.mark.integration
def test_a_burst_of_row_heavy_requests_meets_backpressure_not_a_growing_heap(store: Store, tmp_path: Path) -> None:
    """Bare gauge points are 11 bytes on the wire and ~45x that as rows: admission is by bytes in flight."""
    req = ExportMetricsServiceRequest()
    rm = req.resource_metrics.add()
    rm.resource.attributes.add(key="service.name").value.string_value = "heavy"
    points = rm.scope_metrics.add().metrics.add(name="bare").gauge.data_points
    for i in range(40_000):
        points.add(time_unix_nano=1_700_000_000_000_000_000 + i)
    raw = req.SerializeToString()
    results: list[str] = []
    with serving(store, tmp_path / "spool", max_inflight_bytes=len(raw) * 2) as gw:
        threads = [threading.Thread(target=lambda: results.append(export(gw.target, raw)[0])) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        backpressure = gw.metrics.backpressure._value.get()
    assert set(results) <= {"OK", "UNAVAILABLE"} and "OK" in results and len(results) == 8
    assert backpressure == results.count("UNAVAILABLE")
    assert stored(store, Signal.METRICS, "heavy") == 40_000 * results.count("OK")


def _far_future(signal: Signal) -> Any:
    """One good item and one stamped 2**64 - 1 ns (fixed64 allows it; DateTime64(9) ends at 2**63 - 1)."""
    request = signal.request_type.FromString(_valid(signal))
    if signal is Signal.METRICS:
        items = request.resource_metrics[0].scope_metrics[0].metrics[0].gauge.data_points
    elif signal is Signal.TRACES:
        items = request.resource_spans[0].scope_spans[0].spans
    else:
        items = request.resource_logs[0].scope_logs[0].log_records
    items.add().CopyFrom(items[0])
    for field in ("time_unix_nano", "start_time_unix_nano", "end_time_unix_nano"):
        if field in type(items[1]).DESCRIPTOR.fields_by_name:
            setattr(items[1], field, 2**64 - 1)
    return request


@pytest.mark.integration
@pytest.mark.parametrize("signal", list(Signal), ids=lambda s: s.name.lower())
def test_a_timestamp_past_2262_is_rejected_alone_and_does_not_poison_its_batch(
        store: Store, tmp_path: Path, signal: Signal) -> None:
    request = _far_future(signal)
    service = f"far-future-{signal.name.lower()}"
    for rs in getattr(request, request.DESCRIPTOR.fields_by_number[1].name):
        rs.resource.attributes.add(key="service.name").value.string_value = service
    good = items_of(signal, request) - 1
    with serving(store, tmp_path / "spool") as gw:
        assert _response(signal, gw.target, request.SerializeToString()) == ("OK", 1)
        deadline = time.monotonic() + 5
        while stored(store, signal, service) < good and time.monotonic() < deadline:
            time.sleep(0.05)
    assert stored(store, signal, service) == good


@pytest.mark.integration
def test_a_call_with_too_little_deadline_left_is_refused_before_its_rows_are_queued(
        store: Store, tmp_path: Path) -> None:
    """Storing rows its sender has given up on would store them twice (the sender retries)."""
    raw = gauge_request(3, service="hopeless").SerializeToString()
    with serving(store, tmp_path / "spool", min_time_left_s=3.0) as gw:
        assert export(gw.target, raw, timeout_s=2.0)[0] == "UNAVAILABLE"
        assert export(gw.target, raw, timeout_s=20)[0] == "OK"
        refused = gw.metrics.backpressure._value.get()
    assert refused == 1 and stored(store, Signal.METRICS, "hopeless") == 3


class SlowStore(Store):
    """A fault injector: every insert into ``inner`` takes ``delay_s`` longer (a loaded ClickHouse)."""

    def __init__(self, inner: Store, delay_s: float) -> None:
        super().__init__(inner.dsn)  # never connects: every call the pipeline makes goes to ``inner``
        self.inner, self.delay_s = inner, delay_s

    def insert_columns(self, table: Any, columns: Any, *, token: str) -> None:
        time.sleep(self.delay_s)
        self.inner.insert_columns(table, columns, token=token)


@pytest.mark.integration
def test_a_slow_store_makes_the_gateway_refuse_calls_it_could_not_answer_in_time(
        store: Store, tmp_path: Path) -> None:
    with serving(SlowStore(store, 1.5), tmp_path / "spool") as gw:
        assert export(gw.target, gauge_request(3, service="slow").SerializeToString(), timeout_s=20)[0] == "OK"
        late = gauge_request(3, service="slow", start_seq=3).SerializeToString()
        assert export(gw.target, late, timeout_s=1.2)[0] == "UNAVAILABLE", "refused, not stored after its deadline"
        refused = gw.metrics.backpressure._value.get()
    assert refused == 1 and stored(store, Signal.METRICS, "slow") == 3


# -- the probe responder --------------------------------------------------------------------------------------------

B0 = Endpoint("b", "nic0")


class Mono:
    """Monotonic seconds moved on by the test (so rate limits never hide a check)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _probe_strategy() -> st.SearchStrategy[bytes]:
    names = st.sampled_from(["a", "b", "c", "x" * 48])
    nics = st.sampled_from(["nic0", "nic1"])
    endpoint = st.builds(Endpoint, names, nics)
    probe = st.builds(Probe, st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.integers(0, 1),
                      st.integers(0, 2**64 - 1), st.integers(-3 * 10**9, 3 * 10**9),
                      st.sampled_from(list(TimestampKind)), endpoint, endpoint | st.just(B0))
    return probe.map(lambda p: encode(Probe(p.seq, p.pair_id, p.pair_index, p.cookie, time.time_ns() + p.t1_ns,
                                            p.tx_kind, p.src, p.dst)))


class ResponderOracle:
    """A responder of node b on 127.0.0.2 fed datagrams through the per-packet path its thread runs."""

    def __enter__(self) -> ResponderOracle:
        self.mono = Mono()
        self.responder = Responder(node="b", listen={"nic0": ("127.0.0.2", 0)}, monotonic=self.mono)
        self.responder.open()
        self.sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sink.bind(("127.0.0.9", 0))
        self.sink.settimeout(5)
        self.sock = self.responder._sockets["nic0"]  # handle() is what the thread calls per datagram
        return self

    def __exit__(self, *exc: object) -> None:
        self.sink.close()
        self.responder.close()

    def check(self, payload: bytes) -> None:
        """One outcome per datagram; an answer is a reply to exactly that probe, of the same size."""
        self.mono.now += 1.0  # the per-source bucket refills: every check after it is reached
        responder = self.responder
        before = (sum(responder.answered().values()), sum(responder.dropped().values()))
        responder.handle("nic0", self.sock, Received(payload, self.sink.getsockname(), time.time_ns(),
                                                     TimestampKind.USER))
        after = (sum(responder.answered().values()), sum(responder.dropped().values()))
        assert after[0] + after[1] == before[0] + before[1] + 1, "exactly one outcome per datagram"
        assert responder.dropped()[ProbeDrop.INTERNAL] == 0
        if after[0] > before[0]:
            reply = self.sink.recv(4096)
            assert len(reply) == PACKET_BYTES == len(payload), "a reply is never larger than its probe"
            parsed, probe = decode_probe(reply), decode_probe(payload)
            assert isinstance(parsed, Reply) and isinstance(probe, Probe)
            assert (parsed.seq, parsed.cookie, parsed.dst) == (probe.seq, probe.cookie, B0)


def probe_datagrams() -> st.SearchStrategy[bytes]:
    """Well-formed probes (right and wrong addressee, any time), their mutations, and random bytes."""
    return _probe_strategy() | st.binary(max_size=PACKET_BYTES + 8) | _probe_strategy().flatmap(mutations)


@pytest.mark.integration
def test_the_probe_responder_answers_or_counts_every_datagram_and_replies_never_grow() -> None:
    with ResponderOracle() as oracle:
        @FUZZ
        @given(payload=probe_datagrams())
        def check(payload: bytes) -> None:
            oracle.check(payload)
        check()
        assert sum(oracle.responder.answered().values()) > 0, "the generator reaches the answering path"


# -- the job endpoint -----------------------------------------------------------------------------------------------

_WHO = {"v": 1, "job": "j1", "customer": "c", "rank": 0, "world_size": 4}
_JSONISH = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | _TEXT,
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
                        max_leaves=10)
_FIELDS = st.sampled_from(["v", "type", "job", "customer", "rank", "world_size", "step", "start_ns", "end_ns",
                           "time_ns", "reason", "tokens", "phases", "detail", "extra"])


def job_datagrams() -> st.SearchStrategy[bytes]:
    """Step/start/end messages with fields replaced by anything JSON holds, raw bytes and oversized ones."""
    base = st.sampled_from([{**_WHO, "type": "step", "step": 1, "start_ns": 1, "end_ns": 2},
                            {**_WHO, "type": "start", "time_ns": 5}, {**_WHO, "type": "end", "time_ns": 6,
                                                                      "reason": "completed"}])
    edited = st.tuples(base, st.dictionaries(_FIELDS, _JSONISH, max_size=3),
                       st.integers(0, 7)).map(lambda t: json.dumps({**t[0], **t[1], "rank": t[2]}).encode())
    return edited | st.binary(max_size=64) | st.integers(MAX_DATAGRAM_BYTES - 2, MAX_DATAGRAM_BYTES + 64).map(
        lambda n: (b'{"v":1' + b" " * n)[:n] + b"}")


def _counts(source: JobSource) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in source.collect(0):
        if s.name in ("ridethrough.job.messages.dropped", "ridethrough.job.messages.received"):
            out[s.attributes.get("reason") or s.attributes["type"]] = s.value
        if s.name == "ridethrough.job.series":
            out["series"] = s.value
    return out


class JobOracle:
    """A job source on a real Unix socket, holding each datagram's outcome to what the protocol says."""

    def __enter__(self) -> JobOracle:
        self.folder = Path(tempfile.mkdtemp(prefix="rtfuzz-", dir="/tmp"))  # AF_UNIX paths are short
        self.path = str(self.folder / "job.sock")
        self.source = JobSource(socket_path=self.path, max_series=3)
        self.source.start(emit=lambda event: None)
        self.tx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        return self

    def __exit__(self, *exc: object) -> None:
        self.tx.close()
        self.source.stop(timeout_s=5)
        shutil.rmtree(self.folder, ignore_errors=True)

    def check(self, data: bytes) -> None:
        """Handled once, under the reason `decode` gives (or its type), with the series capped."""
        source = self.source
        before, handled = _counts(source), source.handled
        self.tx.sendto(data, self.path)
        deadline = time.monotonic() + 5
        while source.handled == handled and time.monotonic() < deadline:
            time.sleep(0.001)
        after = _counts(source)
        moved = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0) and k != "series"}
        try:
            message = decode(data)
        except ProtocolError as exc:
            expected = str(exc.reason)
        else:
            full = moved.get(str(DropReason.TOO_MANY_SERIES))
            expected = str(DropReason.TOO_MANY_SERIES) if full else getattr(message, "kind", "step")
        assert moved == {expected: 1}, (data[:80], moved)
        assert after["series"] <= 3 and after[str(DropReason.INTERNAL)] == 0


@pytest.mark.integration
def test_the_job_endpoint_counts_each_datagram_once_under_the_reason_the_protocol_gives() -> None:
    with JobOracle() as oracle:
        @FUZZ
        @given(data=job_datagrams())
        def check(data: bytes) -> None:
            oracle.check(data)
        check()
