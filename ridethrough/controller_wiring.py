"""The controller's composition: detectors, incidents, and what hears of their transitions.

Every transition goes, in order, to the incident events (OTel log records and trace root
spans in the store), the actuator runner (when enabled) and PagerDuty (when enabled). Each
listener is isolated: one that raises is logged and counted, the others still hear it. With
both the runner and PagerDuty, every action that touched the fleet becomes a PagerDuty change
event when it ends (`ridethrough.exporters.pagerduty_actions`); the runner knows only a listener.
With the runner, an approval poller passes operators' approve/deny decisions from the store to it
(`ridethrough.actuators.approvals`).

    parts = build_controller(cfg, store=store, metrics=ControllerMetrics.create(), event_metrics=...,
                             actuators=ActuatorConfig(enabled=True), pager=pager_cfg)
    parts.start()   # PagerDuty sender, reconcile pages, take over actions left in flight, detector loop
    parts.stop()
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ridethrough.actuators.approvals import ApprovalPoller
from ridethrough.actuators.approvals_table import ApprovalLog
from ridethrough.actuators.contract import FleetState
from ridethrough.actuators.plugins import load_plugins
from ridethrough.actuators.policy import RunnerPolicy
from ridethrough.actuators.runner import Runner, RunnerMetrics
from ridethrough.detectors.controller import Controller, ControllerMetrics, default_detectors
from ridethrough.detectors.fabric_map import RouteFile, RouteMap
from ridethrough.detectors.incident_events import IncidentEmitter
from ridethrough.detectors.incidents import IncidentTracker, Transition
from ridethrough.exporters.gateway_metrics import GatewayMetrics
from ridethrough.exporters.pagerduty import PagerDutyExporter
from ridethrough.exporters.pagerduty_actions import ActionChanges
from ridethrough.exporters.pagerduty_config import PagerDutyConfig
from ridethrough.exporters.pagerduty_delivery import PagerDutyMetrics
from ridethrough.exporters.store import Store, StoreError, StoreUnavailable
from ridethrough.settings import ActuatorConfig, ControllerConfig

log = logging.getLogger(__name__)

Listener = Callable[[Sequence[Transition]], object]


def fan_out(listeners: Sequence[tuple[str, Listener]]) -> Callable[[Sequence[Transition]], None]:
    """One ``emit`` that calls every listener; a failure of one does not skip the next (raised after all ran,
    so the controller counts it)."""
    def emit(transitions: Sequence[Transition]) -> None:
        failed: list[str] = []
        for name, listener in listeners:
            try:
                listener(transitions)
            except Exception:  # each listener is independent: a page must go out even if a span could not
                log.exception("incident listener %s failed on %d transition(s)", name, len(transitions))
                failed.append(name)
        if failed:
            raise RuntimeError(f"incident listener(s) failed: {', '.join(failed)}")
    return emit


def fleet_from_map(fabric: Callable[[], RouteMap] | None, tracker: IncidentTracker,
                   clock: Callable[[], int] = time.time_ns) -> Callable[[], FleetState]:
    """The runner's fleet snapshot: open incidents, and (with a fabric map) hosts and the routes (`route_id`) through
    each node."""
    def snapshot() -> FleetState:
        open_now = tuple(tracker.open())
        if fabric is None:
            return FleetState(taken_at_ns=clock(), open_incidents=open_now)
        fmap = fabric()
        paths: dict[str, set[str]] = {}
        for pid in fmap.path_ids():  # counted by route: a leaf draining one uplink removes only the routes over it
            for rid, route in zip(fmap.route_ids(pid), fmap.routes(pid), strict=True):
                for link in route:
                    for node in link.split("-"):
                        paths.setdefault(node, set()).add(rid)
        hosts = frozenset(p.split("/", 1)[0] for p in fmap.path_ids())
        return FleetState(taken_at_ns=clock(), open_incidents=open_now, hosts=hosts,
                          paths={n: frozenset(ids) for n, ids in paths.items()})
    return snapshot


@dataclass
class ControllerParts:
    """A built controller and what listens to it; `start` and `stop` them together."""

    controller: Controller
    tracker: IncidentTracker
    runner: Runner | None = None
    pager: PagerDutyExporter | None = None
    approvals: ApprovalPoller | None = None

    def start(self) -> None:
        """Start paging (after making PagerDuty match the open incidents), finish the actions a previous
        controller left in flight, then detect."""
        if self.pager is not None:
            self.pager.start()
            try:
                self.tracker.load()
                queued = self.pager.reconcile(self.tracker.open())
                if queued:
                    log.info("PagerDuty: %d event(s) queued to match the open incidents", queued)
            except (StoreUnavailable, StoreError) as exc:  # the outbox still holds what was queued before
                log.warning("store away at start; PagerDuty not reconciled: %s", exc)
        if self.runner is not None:
            try:
                # Now, not at the first incident: an action left half applied must not wait for one.
                taken = self.runner.load()
                if taken:
                    log.warning("took over %d action(s) a previous controller left in flight", taken)
            except (StoreUnavailable, StoreError) as exc:  # the runner loads before it next acts
                log.warning("store away at start; actions left in flight are taken over later: %s", exc)
        if self.approvals is not None:
            self.approvals.start()
        self.controller.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop detecting, then the runner (actions in flight finish or time out), then paging."""
        self.controller.stop(timeout_s)
        if self.approvals is not None:
            self.approvals.stop(timeout_s)
        if self.runner is not None:
            self.runner.shutdown(timeout_s)
        if self.pager is not None:
            self.pager.shutdown(timeout_s)


def build_controller(cfg: ControllerConfig, *, store: Store, metrics: ControllerMetrics,
                     event_metrics: GatewayMetrics, actuators: ActuatorConfig | None = None,
                     pager: PagerDutyConfig | None = None) -> ControllerParts:
    """A controller over ``store`` with the installed detector plugins (a bad plugin raises `PluginError`),
    its incident events, and the runner and PagerDuty when their configs enable them."""
    tracker = IncidentTracker(store, quiet_s=cfg.quiet_s, reopen_hysteresis_s=cfg.reopen_hysteresis_s,
                              cluster=cfg.cluster or None)
    listeners: list[tuple[str, Listener]] = [("incident events", IncidentEmitter(store=store, metrics=event_metrics))]
    acting = actuators is not None and actuators.enabled
    plugins = load_plugins() if acting else []  # a bad plugin stops the start before the outbox is opened
    for plugin in plugins:  # one that verifies from telemetry (reroute: the probes) reads the controller's store
        use_store = getattr(plugin, "use_store", None)
        if callable(use_store):
            use_store(store)
    exporter = None
    if pager is not None and pager.enabled:
        exporter = PagerDutyExporter.from_config(pager, metrics=PagerDutyMetrics.create(metrics.registry))
    runner = None
    if actuators is not None and acting:
        policy = RunnerPolicy(**{f.name: getattr(actuators, f.name) for f in dataclasses.fields(RunnerPolicy)})
        fabric = RouteFile(cfg.fabric_map_file) if cfg.fabric_map_file else None
        on_end = [] if exporter is None else [
            ActionChanges(exporter, incident_of=lambda r: tracker.get(r.incident_key, cluster=r.cluster))]
        runner = Runner(store=store, plugins=plugins, policy=policy, fleet=fleet_from_map(fabric, tracker),
                        metrics=RunnerMetrics.create(metrics.registry), span_metrics=event_metrics,
                        cluster=cfg.cluster or None, on_end=on_end)
        listeners.append(("actuator runner", runner.on_transitions))
    if exporter is not None:
        listeners.append(("pagerduty", exporter.emit))
    controller = Controller(store=store, detectors=default_detectors(cfg), tracker=tracker, metrics=metrics,
                            emit=fan_out(listeners), cluster=cfg.cluster, interval_floor_s=cfg.interval_floor_s)
    approvals = None if runner is None else ApprovalPoller(runner=runner, log=ApprovalLog(store), cluster=cfg.cluster)
    return ControllerParts(controller=controller, tracker=tracker, runner=runner, pager=exporter, approvals=approvals)
