"""Actions in their incident's trace: spans, the current step, and W3C ``traceparent``.

Every action continues the trace its incident opened: ``action.decide``, ``action.approval``,
``action.apply``, ``action.verify``, ``action.rollback`` and ``action.recover`` (a restarted runner
taking over an action left in flight) are children of the incident's root
span (whose id derives from the trace id, see `root_span_id`), and each `step` a plugin opens
inside apply (or verify, rollback) is a child of that phase. The runner opens the phases, so a
plugin cannot forget them; a plugin that calls a remote agent sends `current_traceparent` in
the call's metadata, and the agent's spans become children of the step that made the call.

Spans reach ``otel_traces`` through the gateway's own conversion and columnar insert
(`write_requests`), exactly like incident spans.
"""

from __future__ import annotations

import contextvars
import hashlib
import itertools
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from ridethrough.actuators.actions import ActionRecord
from ridethrough.actuators.contract import Deadline, Result
from ridethrough.actuators.plugins import invoke
from ridethrough.detectors.incident_events import SERVICE, root_span_id
from ridethrough.exporters.gateway_metrics import GatewayMetrics
from ridethrough.exporters.pipeline import write_requests
from ridethrough.exporters.rows import Limits, kv, strict
from ridethrough.exporters.signals import Signal
from ridethrough.exporters.store import Store

SCOPE = "ridethrough.actuators"
SPAN_NAMES = ("action.decide", "action.approval", "action.apply", "action.verify", "action.rollback", "action.step",
              "action.recover")
"""Every span name an action writes, listed once (tests hold the runner to it)."""
_LIMITS = Limits(max_attribute_value_bytes=16384)
_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")
Attr = str | int


@dataclass(frozen=True, slots=True)
class SpanContext:
    """A span's identity: trace id (32 hex) and span id (16 hex)."""

    trace_id: str
    span_id: str

    def traceparent(self) -> str:
        """The W3C ``traceparent`` header value (version 00, sampled)."""
        return f"00-{self.trace_id}-{self.span_id}-01"


def parse_traceparent(header: str) -> SpanContext:
    """A ``traceparent`` value back into its ids; ValueError if it is malformed or all-zero."""
    match = _TRACEPARENT.match(header.strip())
    if match is None or set(match.group(1)) == {"0"} or set(match.group(2)) == {"0"}:
        raise ValueError(f"malformed traceparent {header!r}; expected 00-<32 hex>-<16 hex>-<2 hex>")
    return SpanContext(match.group(1), match.group(2))


@dataclass(slots=True)
class SpanData:
    """One span being recorded; `end` closes it."""

    name: str
    context: SpanContext
    parent_span_id: str
    start_ns: int
    attributes: dict[str, Attr] = field(default_factory=dict)
    end_ns: int = 0
    error: str | None = None
    """None: the span's work succeeded (status Ok); else the error message (status Error)."""

    def end(self, end_ns: int, *, error: str | None = None, attributes: Mapping[str, Attr] | None = None) -> None:
        """Close the span (its end is never before its start), adding ``attributes``."""
        self.end_ns = max(end_ns, self.start_ns)
        self.error = error
        self.attributes.update(attributes or {})


class ActionTrace:
    """Makes the spans of one action, in its incident's trace, with ids derived from the action id."""

    def __init__(self, *, trace_id: str, action_id: str, clock: Callable[[], int], epoch: int = 0) -> None:
        """``epoch``: how many runners took the action over before (each numbers its spans afresh, so a
        restarted runner's span ids must not repeat the ones its predecessor wrote)."""
        bytes.fromhex(trace_id)  # a malformed trace id fails here, before any span is made
        self.trace_id = trace_id
        self.root_span_id = root_span_id(trace_id).hex()
        self.clock = clock
        self._seed = f"action:{action_id}" if epoch == 0 else f"action:{action_id}:epoch{epoch}"
        self._seq = itertools.count()

    def start(self, name: str, attributes: Mapping[str, Attr] | None = None, *,
              parent: SpanData | None = None) -> SpanData:
        """A new span, child of ``parent`` (default: the incident's root span)."""
        n = next(self._seq)
        span_id = hashlib.sha256(f"{self._seed}:{n}".encode()).hexdigest()[:16]
        parent_id = parent.context.span_id if parent is not None else self.root_span_id
        return SpanData(name, SpanContext(self.trace_id, span_id), parent_id, self.clock(), dict(attributes or {}))


@dataclass(frozen=True, slots=True)
class _Scope:
    trace: ActionTrace
    span: SpanData
    sink: list[SpanData]


_CURRENT: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("ridethrough_action_span", default=None)


@contextmanager
def activate(trace: ActionTrace, span: SpanData, sink: list[SpanData]) -> Iterator[None]:
    """Make ``span`` the current one (for `step` and `current_traceparent`) while a plugin runs."""
    token = _CURRENT.set(_Scope(trace, span, sink))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current_traceparent() -> str | None:
    """The ``traceparent`` of the current phase or step, for a remote call's metadata (None outside one)."""
    scope = _CURRENT.get()
    return scope.span.context.traceparent() if scope is not None else None


@contextmanager
def step(name: str, attributes: Mapping[str, Attr] | None = None) -> Iterator[SpanContext | None]:
    """Record one step of a plugin's apply/verify/rollback as a child span of the current phase.

    Yields the step's context (None when no action is running, e.g. a plugin called directly:
    then nothing is recorded). An exception marks the span as failed and propagates.
    """
    scope = _CURRENT.get()
    if scope is None:
        yield None
        return
    span = scope.trace.start("action.step", {"step.name": name, **(attributes or {})}, parent=scope.span)
    token = _CURRENT.set(_Scope(scope.trace, span, scope.sink))
    try:
        yield span.context
    except BaseException as exc:
        span.end(scope.trace.clock(), error=f"{type(exc).__name__}: {exc}")
        raise
    else:
        span.end(scope.trace.clock())
    finally:
        _CURRENT.reset(token)
        scope.sink.append(span)


def spans_request(spans: Sequence[SpanData]) -> ExportTraceServiceRequest:
    """The finished ``spans`` as one OTLP request from the controller."""
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.append(kv("service.name", SERVICE))
    ss = rs.scope_spans.add()
    ss.scope.name = SCOPE
    for s in spans:
        span = ss.spans.add()
        span.trace_id = bytes.fromhex(s.context.trace_id)
        span.span_id = bytes.fromhex(s.context.span_id)
        span.parent_span_id = bytes.fromhex(s.parent_span_id)
        span.name = s.name
        span.kind = Span.SPAN_KIND_INTERNAL
        span.start_time_unix_nano = s.start_ns
        span.end_time_unix_nano = max(s.end_ns, s.start_ns)
        span.attributes.extend(kv(k, v) for k, v in s.attributes.items())
        if s.error is None:
            span.status.code = Status.STATUS_CODE_OK
        else:
            span.status.code = Status.STATUS_CODE_ERROR
            span.status.message = s.error
    return req


class SpanWriter:
    """Writes finished spans into ``otel_traces``; a retried write of the same spans is a no-op."""

    def __init__(self, *, store: Store, metrics: GatewayMetrics) -> None:
        self._store = store
        self._metrics = metrics

    def write(self, spans: Sequence[SpanData]) -> None:
        """Insert ``spans`` (raises the store's errors; the caller decides what a failure costs)."""
        if not spans:
            return
        ids = ",".join(sorted(s.context.span_id for s in spans))
        token = hashlib.sha256(f"action-spans:{ids}".encode()).hexdigest()
        write_requests(self._store, [(Signal.TRACES, spans_request(spans))], token=token, metrics=self._metrics,
                       limits=_LIMITS, check=strict("action spans"))


def run_phase(trace: ActionTrace, name: str, call: Callable[[Deadline], Result], *, timeout_s: float,
              what: str, attributes: Mapping[str, Attr]) -> tuple[Result, float, list[SpanData]]:
    """Run one phase of an action in span ``action.<name>`` with its steps as children.

    Returns the plugin's `Result` (a failed one if it raised or overran), the seconds it took,
    and the finished spans: the steps, then the phase.
    """
    span = trace.start(f"action.{name}", {**attributes, "deadline_s": f"{timeout_s:g}"})
    steps: list[SpanData] = []
    deadline = Deadline.after(timeout_s)
    t0 = time.monotonic()
    with activate(trace, span, steps):
        result = invoke(lambda: call(deadline), deadline, what=what)
    seconds = time.monotonic() - t0
    span.end(trace.clock(), error=None if result.ok else result.detail,
             attributes={"result.ok": int(result.ok), "result.detail": result.detail})
    return result, seconds, [*list(steps), span]


def action_attributes(r: ActionRecord) -> dict[str, Attr]:
    """The span attributes that describe an action's decision."""
    return {"action.id": r.action_id, "action.plugin": r.plugin, "action.status": r.status.value,
            "action.reason": r.reason, "action.dry_run": int(r.dry_run), "plan.id": r.plan_id,
            "plan.summary": r.summary, "plan.steps": "; ".join(r.steps), "plan.drains_hosts": ",".join(r.drains_hosts),
            "plan.removes_paths": ",".join(r.removes_paths), "incident.id": r.incident_id, "entity.name": r.entity,
            "plan.path_shares": ",".join(f"{n}={s:.2f}" for n, s in sorted(r.path_shares.items()))}
