"""An operator's approve/deny decision as an OpenTelemetry log record, sent to a gateway: how a decision
reaches the controller where the store has one writer (an embedded store held by ``ridethrough server``,
a lab's, or any fleet whose store only the gateway writes).

The gateway stores the record in ``otel_logs`` like any other: service ``ridethrough-approvals``,
``event.name`` ``action.decision``, the decision's fields as attributes (each verbatim: a reason is
never cut or escaped), a one-line summary as the body, and the decision's time as the record's::

    SELECT Timestamp, LogAttributes['decision.verdict'], LogAttributes['decision.operator'],
           LogAttributes['decision.reason'], LogAttributes['action.id']
    FROM otel_logs
    WHERE ServiceName = 'ridethrough-approvals' AND LogAttributes['event.name'] = 'action.decision'

The controller's poller reads these beside the ``approvals`` table (`EVENTS_SELECT`, used by
`ridethrough.actuators.approvals_table.ApprovalLog.first_decisions`): the first decision on an
action wins, whichever way it came.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the decision is only read here; approvals_table imports this module's query
    from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest

    from ridethrough.actuators.approvals_table import Decision

SERVICE = "ridethrough-approvals"
SCOPE = "ridethrough.approvals"
EVENT = "action.decision"
MAX_ATTRIBUTE_BYTES = 4096
"""The gateway's default ``max_attribute_value_bytes``: a record with a longer value is rejected."""

EVENTS_SELECT = """
SELECT LogAttributes['decision.id'] AS id, LogAttributes['action.id'] AS action,
       LogAttributes['action.plan_id'] AS plan, ResourceAttributes['ridethrough.cluster'] AS cluster,
       LogAttributes['decision.verdict'] AS verdict, LogAttributes['decision.operator'] AS operator,
       LogAttributes['decision.reason'] AS reason, toUnixTimestamp64Nano(Timestamp) AS at
FROM otel_logs
WHERE ServiceName = {decision_service:String} AND LogAttributes['event.name'] = {decision_event:String}
  AND action IN {action_ids:Array(String)} AND verdict IN ('approve', 'deny') AND id != ''
"""
"""The decisions recorded through a gateway on ``action_ids``, in the columns and order of a
`ridethrough.actuators.approvals_table.Decision` row (bind `EVENTS_PARAMETERS` with it). A record
anyone could have sent is checked for a verdict this code knows and a decision id; the plan id is
checked by the poller against the plan that waits. The cluster is the resource's, which a gateway
stamps from a token pinned to a cluster (the sender's own claim in the record's attributes is not
trusted), so a token pinned to one cluster cannot answer another's actions."""
EVENTS_PARAMETERS = {"decision_service": SERVICE, "decision_event": EVENT}


def printable(text: str) -> str:
    """``text`` with control characters escaped (``\\n``, ``\\x1b``): stored strings may be hostile to a terminal."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def summary(decision: Decision, *, about: str = "") -> str:
    """The decision in one line, control characters escaped (the body of its record); ``about`` says what the
    action does."""
    what = f" ({about})" if about else ""
    return (f"{decision.verdict.value} action {decision.action_id}{what} by {printable(decision.operator)}: "
            f"{printable(decision.reason)}")[:1000]


class DecisionNotRecorded(Exception):
    """The gateway did not store the decision (the message says why)."""


def attributes(decision: Decision) -> list[tuple[str, str]]:
    """The record's attributes: the event's name and the decision's fields, as typed."""
    return [("event.name", EVENT), ("decision.id", decision.decision_id), ("action.id", decision.action_id),
            ("action.plan_id", decision.plan_id), ("action.cluster", decision.cluster),
            ("decision.verdict", decision.verdict.value), ("decision.operator", decision.operator),
            ("decision.reason", decision.reason)]


def check_fits(decision: Decision, *, max_bytes: int = MAX_ATTRIBUTE_BYTES) -> None:
    """ValueError naming the field when one would be over the gateway's limit on an attribute, or is not
    text the wire can carry (a lone surrogate): better refused here than rejected there."""
    for key, value in attributes(decision):
        try:
            size = len(value.encode("utf-8"))
        except UnicodeEncodeError:
            raise ValueError(f"{key} is not valid text (it holds a lone surrogate)") from None
        if size > max_bytes:
            raise ValueError(f"{key} is {size} bytes in UTF-8; a gateway takes at most {max_bytes} per attribute")


def logs_request(decision: Decision, *, summary: str) -> ExportLogsServiceRequest:
    """One log record at the decision's time: its fields as attributes, ``summary`` (one line) as the body."""
    from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
    from opentelemetry.proto.logs.v1.logs_pb2 import SeverityNumber

    from ridethrough.exporters.rows import kv

    req = ExportLogsServiceRequest()
    rl = req.resource_logs.add()
    rl.resource.attributes.extend([kv("service.name", SERVICE), kv("ridethrough.cluster", decision.cluster)])
    sl = rl.scope_logs.add()
    sl.scope.name = SCOPE
    record = sl.log_records.add()
    record.time_unix_nano = decision.decided_at_ns
    record.observed_time_unix_nano = decision.decided_at_ns
    record.severity_number = SeverityNumber.SEVERITY_NUMBER_INFO
    record.severity_text = decision.verdict.value
    record.body.string_value = summary
    record.attributes.extend(kv(k, v) for k, v in attributes(decision))
    return req


def send_decision(endpoint: str, decision: Decision, *, about: str = "", timeout_s: float = 30.0,
                  headers: Sequence[tuple[str, str]] = (), attempts: int = 4) -> None:
    """Send the decision's record to the OTLP/gRPC gateway at ``endpoint`` (``HOST:PORT``, plaintext) and
    wait until it is stored (``about``: what the action does, for the body); retries what OTLP says is worth
    retrying. `DecisionNotRecorded` otherwise, including when the gateway answers OK but rejects the record
    (``partial_success``)."""
    try:
        check_fits(decision)
    except ValueError as exc:
        raise DecisionNotRecorded(str(exc)) from None
    from ridethrough.audit_events import RecordError, export_logs

    request = logs_request(decision, summary=summary(decision, about=about))
    try:
        rejected, message = export_logs(endpoint, request.SerializeToString(), what="the decision",
                                        timeout_s=timeout_s, headers=headers, attempts=attempts)
    except RecordError as exc:
        raise DecisionNotRecorded(str(exc)) from None
    if rejected:
        raise DecisionNotRecorded(f"the gateway at {endpoint} rejected the decision record ({message or 'no reason'})")
