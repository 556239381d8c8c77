"""``ridethrough actions``: list the runner's actions, and approve or deny those awaiting a human.

    ridethrough actions list --pending
    ridethrough actions approve 3f2a9c --reason "spine1 is drained anyway"
    ridethrough actions deny 3f2a9c --by alice --reason "maintenance window at 14:00"

The controller's runner holds an action that needs approval as ``awaiting_approval`` in
``actions``; ``approve``/``deny`` check that state there and append the decision to ``approvals``,
which the controller reads about once a second (`ridethrough.actuators.approvals`). Operator and
controller share only the store, so these commands need a store they can write: a ClickHouse
server, or an embedded one no other process holds. An action id may be given as any unique prefix.
The store is found as every other command finds it (``--store`` > env > config file > default).
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


def printable(text: str) -> str:
    """``text`` with control characters escaped (``\\n``, ``\\x1b``): stored strings may be hostile to a terminal."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


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


def decide(store: Store, prefix: str, verdict: Verdict, *, by: str, reason: str, now_ns: int) -> tuple[ActionRow,
                                                                                                         Decision]:
    """Record an operator's decision on the action awaiting approval that ``prefix`` names; `ActionsError`
    if it names none, or one not awaiting approval, or one already decided."""
    from ridethrough.actuators.approvals_table import ApprovalLog, Decision

    if not by or not by.isprintable():
        raise ActionsError("--by must name who decides, in printable characters (or set $USER)")
    if len(reason) > MAX_REASON_CHARS:
        raise ActionsError(f"--reason is {len(reason)} characters long (max {MAX_REASON_CHARS})")
    action = resolve(store, prefix)
    if action.status != AWAITING:
        raise ActionsError(f"action {action.action_id} is {action.status}, not awaiting approval "
                           f"({printable(action.reason)})")
    approvals = ApprovalLog(store)
    approvals.ensure_table()
    earlier = approvals.first_decisions([action.action_id]).get(action.action_id)
    if earlier is not None:
        raise ActionsError(f"action {action.action_id} was already answered: {earlier.verdict.value} by "
                           f"{printable(earlier.operator)} {_age(now_ns - earlier.decided_at_ns)} ago "
                           "(the controller applies it within seconds)")
    decision = Decision(uuid.uuid4().hex, action.action_id, action.plan_id, action.cluster, verdict, by, reason,
                        now_ns)
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


def _open(store: str | None, config: Path | None) -> Store:
    from ridethrough.config import ConfigError
    from ridethrough.exporters.store import Store
    from ridethrough.settings import load_component

    try:
        cfg: Any = load_component("gateway", file=config, env=os.environ, flags={"store": store}).config
    except ConfigError as exc:
        raise _fail(f"config error: {exc}", 2) from exc
    return Store(cfg.store, cluster=cfg.cluster, timeout_s=cfg.store_timeout_s)


def _fail(message: str, code: int = 1) -> typer.Exit:
    typer.echo(f"ridethrough: {message}", err=True)
    return typer.Exit(code)


def _store_failure(target: Store, exc: Exception) -> typer.Exit:
    text = str(exc)
    if "UNKNOWN_TABLE" in text and "actions" in text:
        return _fail(f"the store {target.dsn} has no actions table yet (no runner has decided anything there)")
    if "READONLY" in text:
        text += " (a read-only endpoint, such as the server's --store-http-listen, lists actions but takes no decision)"
    if target.embedded and "Unable to open the chdb engine" in text:
        text += (" (an embedded store opens in one process only: while a server or controller holds it, "
                 "approvals need a ClickHouse server store both can reach)")
    return _fail(text)


@actions_app.command("list")
def list_command(
    pending: Annotated[bool, typer.Option("--pending", help="Only actions awaiting approval.")] = False,
    limit: Annotated[int, typer.Option("--limit", min=1, max=100_000, help="Show at most this many.")] = 20,
    store: StoreOpt = None,
    config: ConfigOpt = None,
) -> None:
    """List the newest actions: id, incident, plugin, entity, status, age and reason."""
    from ridethrough.exporters.store import StoreError, StoreUnavailable

    target = _open(store, config)
    try:
        rows = find_actions(target, pending=pending, limit=limit)
    except (StoreUnavailable, StoreError) as exc:
        raise _store_failure(target, exc) from exc
    finally:
        target.close()
    typer.echo(render(rows, now_ns=time.time_ns()), nl=False)


def _decide_command(action_id: str, verdict_name: str, by: str | None, reason: str, store: str | None,
                    config: Path | None) -> None:
    from ridethrough.actuators.approvals_table import Verdict
    from ridethrough.exporters.store import StoreError, StoreUnavailable

    verdict = Verdict(verdict_name)
    who = by if by is not None else os.environ.get("USER", "")
    target = _open(store, config)
    try:
        action, _ = decide(target, action_id, verdict, by=who, reason=reason, now_ns=time.time_ns())
    except ActionsError as exc:
        raise _fail(str(exc)) from exc
    except (StoreUnavailable, StoreError) as exc:
        raise _store_failure(target, exc) from exc
    finally:
        target.close()
    done = "approved" if verdict is Verdict.APPROVE else "denied"
    typer.echo(f"{done} action {action.action_id} ({printable(action.plugin)} on {printable(action.entity)}, "
               f"incident {action.incident_id}) as {printable(who)}; the controller answers it within seconds")


@actions_app.command("approve")
def approve_command(action_id: IdArg, by: ByOpt = None, reason: ReasonOpt = "", store: StoreOpt = None,
                    config: ConfigOpt = None) -> None:
    """Let an action awaiting approval run."""
    _decide_command(action_id, "approve", by, reason, store, config)


@actions_app.command("deny")
def deny_command(action_id: IdArg, by: ByOpt = None, reason: ReasonOpt = "", store: StoreOpt = None,
                 config: ConfigOpt = None) -> None:
    """Refuse an action awaiting approval for good (its plan is never decided again)."""
    _decide_command(action_id, "deny", by, reason, store, config)
