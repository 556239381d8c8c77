"""``ridethrough actions``: list the runner's actions, and approve or deny those awaiting a human.

    ridethrough actions list --pending
    ridethrough actions approve 3f2a9c --reason "spine1 is drained anyway"
    ridethrough actions deny 3f2a9c --by alice --reason "maintenance window at 14:00"
    ridethrough actions approve 3f2a9c --store http://127.0.0.1:8124 --gateway 127.0.0.1:4317

The controller's runner holds an action that needs approval as ``awaiting_approval`` in
``actions``; ``approve``/``deny`` check that state there and record the decision, which the
controller reads about once a second (`ridethrough.actuators.approvals`): appended to ``approvals``
in a store these commands can write (a ClickHouse server, an embedded one no other process holds),
or, with ``--gateway`` (``--lab``: the lab's), sent to the gateway as an ``action.decision`` log
record (`ridethrough.actuators.approvals_events`): the way where the server holds an embedded store
and its store endpoint only reads. An action id may be given as any unique prefix. The store is
found as every other command finds it (``--store`` > env > config file > default).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ridethrough.actuators.approvals_events import printable

if TYPE_CHECKING:  # the store client loads when a command runs: the CLI starts as quickly as before
    from ridethrough.actuators.approvals_table import Decision, Verdict
    from ridethrough.exporters.store import Store

actions_app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                          help="List actions; approve or deny those awaiting a human.")

ConfigOpt = Annotated[Path | None, typer.Option("--config", help="YAML file with one section per component.")]
StoreOpt = Annotated[str | None, typer.Option("--store", help="ClickHouse DSN: chdb://PATH or http(s)://...")]
ByOpt = Annotated[str | None, typer.Option("--by", help="Who decides (default: $USER).")]
ReasonOpt = Annotated[str, typer.Option("--reason", help="Why, in free text (stored as typed).")]
IdArg = Annotated[str, typer.Argument(help="The action's id, or a unique prefix of it.")]
GatewayOpt = Annotated[str, typer.Option("--gateway", help="Record the decision through this OTLP gateway "
                                         "(HOST:PORT), for a store only the server writes.")]
TokenOpt = Annotated[Path | None, typer.Option("--ingest-token-file", help="Bearer token for a gateway that "
                                               "requires one.")]
LabOpt = Annotated[str, typer.Option("--lab", help="A running lab: read its store endpoint, record through its "
                                     "gateway.")]

AWAITING = "awaiting_approval"
MAX_REASON_CHARS = 4096
_SHOWN_ID = 12
_SHOWN_REASON = 60

# The newest version of each action whose id starts with the prefix ('' matches all), newest first.
_ACTIONS = """
SELECT ActionId, argMax(IncidentId, Version), argMax(Plugin, Version), argMax(Entity, Version),
       argMax(Status, Version) AS status, argMax(Reason, Version),
       toUnixTimestamp64Nano(min(DecidedAt)) AS decided, argMax(PlanId, Version), argMax(Cluster, Version)
FROM actions
WHERE startsWith(ActionId, {prefix:String})
GROUP BY ActionId
HAVING NOT {pending:Bool} OR status = {awaiting:String}
ORDER BY decided DESC, ActionId
LIMIT {limit:UInt32}
"""


class ActionsError(Exception):
    """An approve/deny or list that cannot go on; the message says why."""


@dataclass(frozen=True, slots=True)
class ActionRow:
    """The current state of one action, as these commands show it."""

    action_id: str
    incident_id: str
    plugin: str
    entity: str
    status: str
    reason: str
    decided_at_ns: int
    plan_id: str
    cluster: str


def find_actions(store: Store, *, prefix: str = "", pending: bool = False, limit: int = 20) -> list[ActionRow]:
    """Actions whose id starts with ``prefix``, newest first (only those awaiting approval with ``pending``)."""
    settings = {"readonly": 2} if store.embedded else None  # reading only: the engine holds us to it
    _, rows = store.query(_ACTIONS, parameters={"prefix": prefix, "pending": pending, "awaiting": AWAITING,
                                                "limit": limit}, settings=settings)
    return [ActionRow(r[0], r[1], r[2], r[3], r[4], r[5], int(r[6]), r[7], r[8]) for r in rows]


def resolve(store: Store, prefix: str) -> ActionRow:
    """The one action whose id starts with ``prefix``; `ActionsError` if none or several do."""
    if not prefix:
        raise ActionsError("an action id (or a prefix of one) is required")
    found = find_actions(store, prefix=prefix, limit=6)
    if not found:
        raise ActionsError(f"no action with id {printable(prefix)!r} (see `ridethrough actions list`)")
    if len(found) > 1:
        shown = ", ".join(a.action_id for a in found[:5]) + (", ..." if len(found) > 5 else "")
        raise ActionsError(f"action id prefix {printable(prefix)!r} is ambiguous: it matches {shown}")
    return found[0]


def prepare(store: Store, prefix: str, verdict: Verdict, *, by: str, reason: str, now_ns: int) -> tuple[ActionRow,
                                                                                                          Decision]:
    """The decision on the action awaiting approval that ``prefix`` names, checked but not recorded (reads only);
    `ActionsError` if it names none, or one not awaiting approval, or one already decided either way."""
    from ridethrough.actuators.approvals_table import ApprovalLog, Decision

    if not by or not by.isprintable():
        raise ActionsError("--by must name who decides, in printable characters (or set $USER)")
    if len(reason) > MAX_REASON_CHARS:
        raise ActionsError(f"--reason is {len(reason)} characters long (max {MAX_REASON_CHARS})")
    action = resolve(store, prefix)
    if action.status != AWAITING:
        raise ActionsError(f"action {action.action_id} is {action.status}, not awaiting approval "
                           f"({printable(action.reason)})")
    settings = {"readonly": 2} if store.embedded else None
    earlier = ApprovalLog(store).first_decisions([action.action_id], plans={action.action_id: action.plan_id},
                                                cluster=action.cluster, settings=settings).get(action.action_id)
    if earlier is not None:
        raise ActionsError(f"action {action.action_id} was already answered: {earlier.verdict.value} by "
                           f"{printable(earlier.operator)} {_age(now_ns - earlier.decided_at_ns)} ago "
                           "(the controller applies it within seconds)")
    return action, Decision(uuid.uuid4().hex, action.action_id, action.plan_id, action.cluster, verdict, by, reason,
                            now_ns)


def decide(store: Store, prefix: str, verdict: Verdict, *, by: str, reason: str, now_ns: int) -> tuple[ActionRow,
                                                                                                         Decision]:
    """Record an operator's decision in the store's ``approvals`` table (see `prepare` for what is refused)."""
    from ridethrough.actuators.approvals_table import ApprovalLog

    action, decision = prepare(store, prefix, verdict, by=by, reason=reason, now_ns=now_ns)
    approvals = ApprovalLog(store)
    approvals.ensure_table()
    approvals.write(decision)
    return action, decision


def _age(ns: int) -> str:
    seconds = max(0, ns) // 1_000_000_000
    for unit, size in (("d", 86_400), ("h", 3_600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def render(rows: Sequence[ActionRow], *, now_ns: int) -> str:
    """The actions as an aligned table (ids cut to a prefix that ``approve``/``deny`` accept)."""
    if not rows:
        return "no actions\n"
    head = ("ID", "INCIDENT", "PLUGIN", "ENTITY", "STATUS", "AGE", "REASON")
    cells = [head] + [(r.action_id[:_SHOWN_ID], r.incident_id[:_SHOWN_ID], printable(r.plugin), printable(r.entity),
                       r.status, _age(now_ns - r.decided_at_ns), _cut(printable(r.reason))) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(head))]
    return "".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() + "\n" for row in cells)


def _cut(text: str) -> str:
    return text if len(text) <= _SHOWN_REASON else text[:_SHOWN_REASON - 1] + "…"


def _open(store: str | None, config: Path | None, lab: str = "") -> tuple[Store, str]:
    """The store to read (``--lab``'s endpoint, else as every command finds it) and the lab's gateway ('' if none)."""
    from ridethrough.config import ConfigError
    from ridethrough.exporters.store import Store
    from ridethrough.settings import load_component

    if lab:
        if store:
            raise _fail("give --lab or --store, not both (a lab's store is its server's endpoint)", 2)
        address, gateway = _lab_addresses(lab)
        return Store(address), gateway
    try:
        cfg: Any = load_component("gateway", file=config, env=os.environ, flags={"store": store}).config
    except ConfigError as exc:
        raise _fail(f"config error: {exc}", 2) from exc
    return Store(cfg.store, cluster=cfg.cluster, timeout_s=cfg.store_timeout_s), ""


def _lab_addresses(name: str) -> tuple[str, str]:
    """A running lab's store endpoint (read-only) and gateway, as its server wrote them."""
    from ridethrough.lab.control import LabError
    from ridethrough.lab.fabric import attach

    try:
        lab = attach(name)
    except (LabError, ValueError, OSError) as exc:
        raise _fail(f"--lab {name}: {exc}", 2) from exc
    address = lab.server.get("store_http", "")
    if not address:
        raise _fail(f"lab {name} has no server (brought up without agents?): it runs no controller to answer", 2)
    return address, lab.server.get("otlp", "")


def _fail(message: str, code: int = 1) -> typer.Exit:
    typer.echo(f"ridethrough: {message}", err=True)
    return typer.Exit(code)


_VIA_GATEWAY = ("send the decision through the server's gateway instead: --gateway HOST:PORT (its --otlp-listen), "
                "reading the actions through its store endpoint: --store http://HOST:PORT (its --store-http-listen)")


def _store_failure(target: Store, exc: Exception) -> typer.Exit:
    text = str(exc)
    if "UNKNOWN_TABLE" in text and "actions" in text:
        return _fail(f"the store {target.dsn} has no actions table yet (no runner has decided anything there)")
    if "READONLY" in text:
        text += (" (a read-only endpoint, such as the server's --store-http-listen, lists actions but takes no "
                 f"decision: {_VIA_GATEWAY})")
    if target.embedded and "Unable to open the chdb engine" in text:
        text += (" (an embedded store opens in one process only: while a server or controller holds it, "
                 f"{_VIA_GATEWAY})")
    return _fail(text)


@actions_app.command("list")
def list_command(
    pending: Annotated[bool, typer.Option("--pending", help="Only actions awaiting approval.")] = False,
    limit: Annotated[int, typer.Option("--limit", min=1, max=100_000, help="Show at most this many.")] = 20,
    store: StoreOpt = None,
    lab: LabOpt = "",
    config: ConfigOpt = None,
) -> None:
    """List the newest actions: id, incident, plugin, entity, status, age and reason."""
    from ridethrough.exporters.store import StoreError, StoreUnavailable

    target, _ = _open(store, config, lab)
    try:
        rows = find_actions(target, pending=pending, limit=limit)
    except (StoreUnavailable, StoreError) as exc:
        raise _store_failure(target, exc) from exc
    finally:
        target.close()
    typer.echo(render(rows, now_ns=time.time_ns()), nl=False)


@dataclass(frozen=True, slots=True)
class _Where:
    """Where a decision is read and recorded: the options every decide command takes."""

    store: str | None
    config: Path | None
    gateway: str
    token_file: Path | None
    lab: str


def _decide_command(action_id: str, verdict_name: str, by: str | None, reason: str, where: _Where) -> None:
    from ridethrough.actuators.approvals_events import DecisionNotRecorded, send_decision
    from ridethrough.actuators.approvals_table import Verdict
    from ridethrough.exporters.store import StoreError, StoreUnavailable

    verdict = Verdict(verdict_name)
    who = by if by is not None else os.environ.get("USER", "")
    headers = _headers(where.token_file)
    target, lab_gateway = _open(where.store, where.config, where.lab)
    gateway = where.gateway or lab_gateway
    if headers and not gateway:
        target.close()
        raise _fail("--ingest-token-file is for the gateway: give --gateway HOST:PORT too", 2)
    try:
        if gateway:
            action, decision = prepare(target, action_id, verdict, by=who, reason=reason, now_ns=time.time_ns())
            about = f"{action.plugin} on {action.entity}, incident {action.incident_id}"
            send_decision(gateway, decision, about=about, headers=headers)
        else:
            action, _ = decide(target, action_id, verdict, by=who, reason=reason, now_ns=time.time_ns())
    except ActionsError as exc:
        raise _fail(str(exc)) from exc
    except DecisionNotRecorded as exc:
        raise _fail(f"the decision was NOT recorded: {exc}") from exc
    except (StoreUnavailable, StoreError) as exc:
        raise _store_failure(target, exc) from exc
    finally:
        target.close()
    done = "approved" if verdict is Verdict.APPROVE else "denied"
    via = f" through the gateway {gateway}" if gateway else ""
    typer.echo(f"{done} action {action.action_id} ({printable(action.plugin)} on {printable(action.entity)}, "
               f"incident {action.incident_id}) as {printable(who)}{via}; the controller answers it within seconds")


def _headers(token_file: Path | None) -> tuple[tuple[str, str], ...]:
    from ridethrough.exporters.ingest_auth import bearer_metadata
    from ridethrough.wiring import read_token

    if token_file is None:
        return ()
    try:
        return tuple(bearer_metadata(read_token(str(token_file))))
    except ValueError as exc:
        raise _fail(f"--ingest-token-file: {exc}", 2) from exc


@actions_app.command("approve")
def approve_command(action_id: IdArg, by: ByOpt = None, reason: ReasonOpt = "", store: StoreOpt = None,
                    gateway: GatewayOpt = "", ingest_token_file: TokenOpt = None, lab: LabOpt = "",
                    config: ConfigOpt = None) -> None:
    """Let an action awaiting approval run."""
    _decide_command(action_id, "approve", by, reason, _Where(store, config, gateway, ingest_token_file, lab))


@actions_app.command("deny")
def deny_command(action_id: IdArg, by: ByOpt = None, reason: ReasonOpt = "", store: StoreOpt = None,
                 gateway: GatewayOpt = "", ingest_token_file: TokenOpt = None, lab: LabOpt = "",
                 config: ConfigOpt = None) -> None:
    """Refuse an action awaiting approval for good (its plan is never decided again)."""
    _decide_command(action_id, "deny", by, reason, _Where(store, config, gateway, ingest_token_file, lab))
