"""Finding actuator plugins, checking them at load, and calling them under a deadline.

Plugins come from the entry-point group ``ridethrough.actuators`` of installed distributions
and from objects passed in explicitly. An entry point names a plugin instance, a class (built
with no arguments) or a factory function (called with none). Each is validated when it loads,
with an error that names the plugin and what is wrong, so a broken plugin stops the start
rather than the first incident it meets.

Calls into a plugin run on their own thread, joined until the deadline: a plugin that raises
or overruns yields a failed `Result`, never an exception in the runner. A thread that overruns
cannot be killed; it is left to finish (daemon) and its late answer is ignored.
"""

from __future__ import annotations

import contextvars
import importlib.metadata
import inspect
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from ridethrough.actuators.contract import Actuator, Deadline, Plan, Result
from ridethrough.detectors.incidents import Incident

GROUP = "ridethrough.actuators"
_METHODS = {"plan": ("incident", "fleet_state"), "apply": ("plan", "deadline"),
            "verify": ("plan", "deadline"), "rollback": ("plan", "deadline")}
T = TypeVar("T")


class PluginError(ValueError):
    """An actuator plugin that cannot be used; the message names the plugin and what is wrong."""


def validate(obj: object, *, plugin: str) -> Actuator:
    """``obj`` if it honours the `Actuator` contract, else `PluginError` naming ``plugin``."""
    what = f"actuator plugin {plugin}"
    if isinstance(obj, type):
        raise PluginError(f"{what}: {obj.__name__} is a class; pass an instance")
    if not hasattr(obj, "name"):
        raise PluginError(f"{what}: has no name attribute (a non-empty string)")
    name = obj.name
    if not isinstance(name, str) or not name.strip():
        raise PluginError(f"{what}: name must be a non-empty string, got {name!r}")
    for method, params in _METHODS.items():
        _check_method(obj, method, params, what=f"{what} ({name})")
    if not isinstance(obj, Actuator):  # all four methods and a name were found above
        raise PluginError(f"{what} ({name}): is not an Actuator")
    return obj


def _check_method(obj: object, method: str, params: tuple[str, ...], *, what: str) -> None:
    expected = f"{method}({', '.join(params)})"
    fn = getattr(obj, method, None)
    if fn is None:
        raise PluginError(f"{what}: missing method {expected}")
    if not callable(fn):
        raise PluginError(f"{what}: {method} is not callable ({type(fn).__name__}); expected {expected}")
    if inspect.iscoroutinefunction(fn):
        raise PluginError(f"{what}: {method} is async; the runner calls {expected} synchronously")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or C callable without a signature: the call itself will tell
    try:
        sig.bind(*params)
    except TypeError as exc:
        found = ", ".join(str(p.replace(annotation=inspect.Parameter.empty)) for p in sig.parameters.values())
        raise PluginError(f"{what}: {method}({found}) cannot be called as {expected}: {exc}") from exc


def _build(obj: object, *, plugin: str) -> object:
    """An entry point's object as a plugin instance (classes and factories are called)."""
    if isinstance(obj, type) or (callable(obj) and not hasattr(obj, "plan")):
        try:
            return obj()
        except Exception as exc:
            raise PluginError(f"actuator plugin {plugin}: building it failed: {type(exc).__name__}: {exc}") from exc
    return obj


def load_plugins(explicit: Sequence[object] = (), *, group: str = GROUP,
                 entry_points: Callable[..., Iterable[importlib.metadata.EntryPoint]] | None = None) -> list[Actuator]:
    """Every plugin of the entry-point ``group`` plus ``explicit`` ones, validated; names must be unique."""
    found: list[Actuator] = []
    for ep in (entry_points or importlib.metadata.entry_points)(group=group):
        plugin = f"{ep.name} ({ep.value})"
        try:
            obj = ep.load()
        except Exception as exc:
            raise PluginError(f"actuator plugin {plugin}: import failed: {type(exc).__name__}: {exc}") from exc
        found.append(validate(_build(obj, plugin=plugin), plugin=plugin))
    for obj in explicit:
        found.append(validate(obj, plugin=str(getattr(obj, "name", type(obj).__name__))))
    seen: set[str] = set()
    for p in found:
        if p.name in seen:
            raise PluginError(f"actuator plugin name {p.name!r} is used by more than one plugin")
        seen.add(p.name)
    return found


def call_with_deadline(fn: Callable[[], T], deadline: Deadline) -> tuple[T | None, str | None]:
    """``(value, None)``, or ``(None, why)`` if ``fn`` raised or was still running at the deadline.

    ``fn`` runs on its own thread in a copy of the caller's context (so the current span follows it).
    """
    box: dict[str, Any] = {}
    context = contextvars.copy_context()

    def target() -> None:
        try:
            box["value"] = context.run(fn)
        except BaseException as exc:  # a plugin's failure of any kind is its result, not ours
            box["error"] = f"raised {type(exc).__name__}: {exc}"

    thread = threading.Thread(target=target, name="rt-actuator-call", daemon=True)
    started = deadline.remaining_s()
    thread.start()
    thread.join(deadline.remaining_s())
    if thread.is_alive():
        return None, f"timed out after {started:.3g} s"
    if "error" in box:
        return None, str(box["error"])
    return box["value"], None


def invoke(fn: Callable[[], object], deadline: Deadline, *, what: str) -> Result:
    """Call a plugin's apply/verify/rollback: its `Result`, or a failed one saying what went wrong."""
    value, error = call_with_deadline(fn, deadline)
    if error is not None:
        return Result.failure(f"{what} {error}")
    if not isinstance(value, Result):
        return Result.failure(f"{what} returned {type(value).__name__}, not a Result")
    return value


def check_plan(value: object, plugin: Actuator, incident: Incident) -> str | None:
    """None if ``value`` is a plan by ``plugin`` about ``incident`` (or None), else what is wrong with it."""
    if value is None:
        return None
    if not isinstance(value, Plan):
        return f"returned {type(value).__name__}, not a Plan or None"
    if value.plugin != plugin.name or value.incident_id != incident.incident_id:
        return (f"returned a plan for plugin {value.plugin!r} and incident {value.incident_id!r}, "
                f"not {plugin.name!r} and {incident.incident_id!r}")
    return None
