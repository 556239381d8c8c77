"""The controller's side of human approval: answer the runner's waiting actions from the store.

An operator's ``ridethrough actions approve|deny`` appends a decision to ``approvals``
(`ridethrough.actuators.approvals_table`), or sends it through the gateway into ``otel_logs`` where
the store has one writer (`ridethrough.actuators.approvals_events`); the operator and the controller
share only the store. While the runner holds actions awaiting approval, `ApprovalPoller` reads the
earliest decision on each of them, from both places in one query, every ``interval_s`` and passes it
on (`Runner.approve` / `Runner.deny`, with who decided and why, which the runner writes into the
action's reason). With nothing waiting it reads nothing; the query names only the actions waiting
here, as bound parameters.

A decision on an action this runner does not hold (another controller's, or one whose wait
already timed out) is not this poller's business and is skipped; a store that is away is logged
and retried at the next tick, and the wait's own timeout still refuses the action in the end.

    poller = ApprovalPoller(runner=runner, log=ApprovalLog(store))
    poller.start()
    ...
    poller.stop()
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

from ridethrough.actuators.approvals_table import ApprovalLog, Decision, Verdict
from ridethrough.actuators.policy import UnknownPlan
from ridethrough.exporters.store import StoreError, StoreUnavailable

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 1.0


class Approvable(Protocol):
    """What the poller needs of the runner (`ridethrough.actuators.runner.Runner`)."""

    def awaiting_approval(self) -> dict[str, str]:
        """Action id → plan id of the actions waiting for a human."""
        ...

    def approve(self, plan_id: str, *, by: str = "", reason: str = "") -> None:
        """Let the plan run."""
        ...

    def deny(self, plan_id: str, *, by: str = "", reason: str = "") -> None:
        """Refuse the plan for good."""
        ...


class ApprovalPoller:
    """Passes operators' decisions from ``approvals`` and ``otel_logs`` to the runner (see the module docstring)."""

    def __init__(self, *, runner: Approvable, log: ApprovalLog, interval_s: float = DEFAULT_INTERVAL_S,
                 cluster: str = "") -> None:
        """``cluster``: the controller's; only decisions for it count (empty: any)."""
        if not interval_s > 0:
            raise ValueError(f"ApprovalPoller interval_s must be > 0, got {interval_s!r}")
        self._runner = runner
        self._log = log
        self._interval_s = interval_s
        self._cluster = cluster
        self._table_ready = False
        self._answered: set[str] = set()  # action ids passed on; pruned to those still waiting
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll_once(self) -> list[Decision]:
        """Read the decisions on the actions waiting now and pass them on; returns those passed on.
        Raises the store's errors."""
        waiting = self._runner.awaiting_approval()
        self._answered &= set(waiting)
        asked = sorted(set(waiting) - self._answered)
        if not asked:
            return []
        if not self._table_ready:
            self._log.ensure_table()  # an operator may not have decided anything yet: no table
            self._table_ready = True
        passed = []
        decided = self._log.first_decisions(asked, plans=waiting, cluster=self._cluster)
        for action_id, decision in sorted(decided.items()):
            if decision.plan_id != waiting[action_id]:
                log.warning("approval %s names action %s with plan %s, but it waits with plan %s; ignored",
                            decision.decision_id, action_id, decision.plan_id, waiting[action_id])
                continue
            if self._pass_on(decision):
                passed.append(decision)
            self._answered.add(action_id)
        return passed

    def _pass_on(self, d: Decision) -> bool:
        answer = self._runner.approve if d.verdict is Verdict.APPROVE else self._runner.deny
        try:
            answer(d.plan_id, by=d.operator, reason=d.reason)
        except UnknownPlan:  # its wait ended meanwhile (a timeout, a shutdown): nothing left to answer
            log.debug("approval %s: action %s no longer waits here", d.decision_id, d.action_id)
            return False
        log.info("action %s %s by %r", d.action_id, "approved" if d.verdict is Verdict.APPROVE else "denied",
                 d.operator)
        return True

    def start(self) -> None:
        """Poll on a daemon thread until `stop`."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="rt-approvals", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.poll_once()
            except (StoreUnavailable, StoreError) as exc:  # the wait's timeout still ends the action
                log.warning("cannot read approvals: %s", exc)
            except Exception:  # a bug here must not end polling: a human's answer would never arrive
                log.exception("approval poller failed; polling on")

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop polling; waits up to ``timeout_s`` for the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
