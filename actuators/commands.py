"""The commands an agent runs for the controller: a registry of typed handlers, and the built-in ones.

A command is registered with its parameters (type, required or default, an optional check);
`CommandRegistry.bind` turns a command's raw arguments into checked ones or says exactly what is
wrong, so a handler only ever sees arguments of the types it declared. Handlers return an
`Outcome` value; one that raises is the control plane's to report, never the agent's to die of.

Built in: ``ping`` (is the agent there, what time does it think it is) and, where the agent has
a `RouteOps`, ``route.set``, ``route.restore`` and ``route.get``. ``route.set`` remembers the
route it replaced (once per destination, so repeated sets still restore the original) and
returns it in its data, so a caller that outlives the agent can pass it back to
``route.restore`` explicitly. ``route.get`` reads a destination's route back, and which
interfaces the kernel would send its traffic out of (what a caller verifies against), and the
host's own route beneath ridethrough's (what a caller plans from).

A route has one nexthop (``dev``, ``via``) and optionally ``more`` ECMP nexthops, written as
``DEV@VIA,DEV@VIA`` (``DEV`` alone for an on-link one): arguments are scalars.
"""

from __future__ import annotations

import ipaddress
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ridethrough.actuators.command_auth import Scalar

_NAME = re.compile(r"[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*){0,3}")
_IFNAME = re.compile(r"[A-Za-z0-9_.:@-]{1,15}")
MAIN_TABLE = 254
Args = Mapping[str, Scalar]


class BadArgs(ValueError):
    """Arguments that do not fit the command's parameters; the message names each problem."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a handler did: ``ok``, a line for a human, and small typed data for the caller."""

    ok: bool
    detail: str = ""
    data: Mapping[str, Scalar] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Param:
    """One parameter: its type, whether it is required (else its default), and an optional check."""

    kind: type[str] | type[int] | type[float] | type[bool]
    default: Scalar | None = None
    """None: required."""
    check: Callable[[Any], None] | None = None
    """Raises ValueError for a value of the right type that is still wrong."""

    def coerce(self, name: str, value: Scalar) -> Scalar:
        """``value`` as this parameter's type (an int is a valid float), or BadArgs."""
        ok = type(value) is self.kind or (self.kind is float and type(value) is int)
        if not ok:
            raise BadArgs(f"{name} must be {self.kind.__name__}, got {type(value).__name__} {value!r}")
        if self.check is not None:
            try:
                self.check(value)
            except ValueError as exc:
                raise BadArgs(f"{name}: {exc}") from None
        return float(value) if self.kind is float else value


Handler = Callable[[Args], Outcome]


@dataclass(frozen=True, slots=True)
class CommandSpec:
    """A registered command."""

    name: str
    handler: Handler
    params: Mapping[str, Param]
    check: Callable[[Args], None] | None = None
    """Cross-parameter check on the bound arguments; raises ValueError."""
    help: str = ""


class CommandRegistry:
    """Command name → handler with typed parameters."""

    def __init__(self) -> None:
        self._specs: dict[str, CommandSpec] = {}

    def register(self, name: str, handler: Handler, *, params: Mapping[str, Param],
                 check: Callable[[Args], None] | None = None, help: str = "") -> None:
        """Add a command; a bad or taken name is a ValueError (at start, not at the first call)."""
        if not _NAME.fullmatch(name):
            raise ValueError(f"command name {name!r} must be dotted lower_snake_case, e.g. 'route.set'")
        if name in self._specs:
            raise ValueError(f"command {name!r} is already registered")
        for pname, param in params.items():
            if param.default is not None:
                param.coerce(pname, param.default)  # a default that fails its own check is a bug, found now
        self._specs[name] = CommandSpec(name, handler, dict(params), check, help)

    def names(self) -> tuple[str, ...]:
        """The registered commands, sorted."""
        return tuple(sorted(self._specs))

    def get(self, name: str) -> CommandSpec | None:
        """The command called ``name``, if registered."""
        return self._specs.get(name)

    def bind(self, name: str, args: Args) -> tuple[CommandSpec, dict[str, Scalar]]:
        """The command and its checked arguments (defaults filled in); KeyError or BadArgs otherwise."""
        spec = self._specs.get(name)
        if spec is None:
            raise KeyError(f"unknown command {name!r}; this agent runs {list(self.names())}")
        problems = [f"unexpected argument {k!r}" for k in sorted(set(args) - set(spec.params))]
        bound: dict[str, Scalar] = {}
        for pname, param in spec.params.items():
            if pname not in args:
                if param.default is None:
                    problems.append(f"missing argument {pname!r}")
                else:
                    bound[pname] = param.default
                continue
            try:
                bound[pname] = param.coerce(pname, args[pname])
            except BadArgs as exc:
                problems.append(str(exc))
        if not problems and spec.check is not None:
            try:
                spec.check(bound)
            except ValueError as exc:
                problems.append(str(exc))
        if problems:
            raise BadArgs(f"{name}: " + "; ".join(problems))
        return spec, bound


@dataclass(frozen=True, slots=True)
class Route:
    """One route: ``destination`` (a CIDR prefix or ``default``) out of ``dev``, via ``via`` if not on-link."""

    destination: str
    dev: str
    via: str = ""
    table: int = MAIN_TABLE
    metric: int = 0
    more: tuple[tuple[str, str], ...] = ()
    """Further ECMP nexthops after (``dev``, ``via``): (dev, via) each."""

    @property
    def devs(self) -> tuple[str, ...]:
        """Every interface the route leaves through, in order."""
        return (self.dev, *(dev for dev, _ in self.more))

    def data(self, prefix: str) -> dict[str, Scalar]:
        """The route as flat reply data."""
        return {f"{prefix}dev": self.dev, f"{prefix}via": self.via, f"{prefix}metric": self.metric,
                f"{prefix}more": format_hops(self.more)}


def format_hops(hops: tuple[tuple[str, str], ...]) -> str:
    """``(dev, via)`` pairs as ``DEV@VIA,DEV`` (the ``more`` argument)."""
    return ",".join(f"{dev}@{via}" if via else dev for dev, via in hops)


def parse_hops(text: str) -> tuple[tuple[str, str], ...]:
    """``DEV@VIA,DEV`` as checked ``(dev, via)`` pairs; ValueError naming the bad entry."""
    out: list[tuple[str, str]] = []
    for entry in filter(None, text.split(",")):
        dev, _, via = entry.partition("@")
        check_dev(dev)
        try:
            check_via(via)
        except ValueError:
            raise ValueError(f"nexthop {entry!r}: {via!r} is not an IP address") from None
        out.append((dev, via))
    return tuple(out)


class RouteOps(Protocol):
    """The node's routing table, one route per (destination, table) (real: netlink, `actuators.routes`)."""

    def get(self, destination: str, *, table: int) -> Route | None:
        """The route for exactly ``destination`` in ``table``, or None if there is none."""
        ...

    def replace(self, route: Route) -> None:
        """Install ``route`` in place of any route for its destination and table."""
        ...

    def delete(self, destination: str, *, table: int) -> None:
        """Remove the route for ``destination`` in ``table`` (no error if there is none)."""
        ...

    def lookup(self, destination: str, *, own: bool) -> tuple[tuple[str, str], ...]:
        """The nexthops, (dev, via) each, of the route that carries ``destination``'s first address now.

        ``own``: counting the routes ridethrough wrote (what the kernel uses); else the host's own
        route beneath them (what a reroute starts from).
        """
        ...


def check_destination(text: str) -> None:
    """A CIDR prefix with no host bits set, or ``default``."""
    if text != "default":
        try:
            ipaddress.ip_network(text, strict=True)
        except ValueError as exc:
            raise ValueError(f"destination {text!r} is not a CIDR prefix or 'default': {exc}") from None


def check_via(text: str) -> None:
    """Empty (on-link) or an IP address."""
    if text:
        ipaddress.ip_address(text)


def check_dev(text: str) -> None:
    """A Linux interface name."""
    if not _IFNAME.fullmatch(text):
        raise ValueError(f"{text!r} is not an interface name (1-15 of A-Z a-z 0-9 _ . : @ -)")


def _check_optional_dev(text: str) -> None:
    if text:
        check_dev(text)


def _check_table(n: int) -> None:
    if not 1 <= n < 2**32:
        raise ValueError(f"routing table {n} is outside 1..{2**32 - 1}")


def _check_metric(n: int) -> None:
    if not 0 <= n < 2**32:
        raise ValueError(f"metric {n} is outside 0..{2**32 - 1}")


def _check_hops(text: str) -> None:
    parse_hops(text)


def _route(args: Args, prefix: str = "") -> Route:
    dest, via = str(args["destination"]), str(args[f"{prefix}via"])
    more = parse_hops(str(args[f"{prefix}more"]))
    for gateway in (via, *(v for _, v in more)):
        if gateway and dest != "default" and \
                ipaddress.ip_address(gateway).version != ipaddress.ip_network(dest).version:
            raise ValueError(f"{prefix}via {gateway} and destination {dest} are of different IP versions")
    return Route(dest, str(args[f"{prefix}dev"]), via, int(args["table"]), int(args[f"{prefix}metric"]), more)


class RouteJournal:
    """The route each ``route.set`` replaced, per (destination, table), oldest forgotten beyond ``capacity``."""

    def __init__(self, *, capacity: int = 4096) -> None:
        self._saved: OrderedDict[tuple[str, int], Route | None] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def remember(self, destination: str, table: int, previous: Route | None) -> Route | None:
        """Keep ``previous`` unless a route is already kept (the original wins); returns the kept one."""
        with self._lock:
            where = (destination, table)
            if where not in self._saved:
                self._saved[where] = previous
                while len(self._saved) > self._capacity:
                    self._saved.popitem(last=False)
            return self._saved[where]

    def take(self, destination: str, table: int) -> tuple[bool, Route | None]:
        """(found, route) kept for the destination, forgetting it."""
        with self._lock:
            if (destination, table) not in self._saved:
                return False, None
            return True, self._saved.pop((destination, table))


_ROUTE = {"destination": Param(str, check=check_destination), "dev": Param(str, check=check_dev),
          "via": Param(str, "", check_via), "table": Param(int, MAIN_TABLE, _check_table),
          "metric": Param(int, 0, _check_metric), "more": Param(str, "", _check_hops)}
_RESTORE = {"destination": Param(str, check=check_destination), "table": Param(int, MAIN_TABLE, _check_table),
            "previous_dev": Param(str, "", _check_optional_dev), "previous_via": Param(str, "", check_via),
            "previous_metric": Param(int, 0, _check_metric), "previous_more": Param(str, "", _check_hops),
            "previous_absent": Param(bool, False)}
_GET = {"destination": Param(str, check=check_destination), "table": Param(int, MAIN_TABLE, _check_table)}


class RouteCommands:
    """``route.set`` and ``route.restore`` over a `RouteOps`."""

    def __init__(self, ops: RouteOps, journal: RouteJournal | None = None) -> None:
        self._ops = ops
        self._journal = journal if journal is not None else RouteJournal()

    def set(self, args: Args) -> Outcome:
        """Route ``destination`` out of ``dev`` (via ``via``); data: the route it replaced."""
        new = _route(args)
        current = self._ops.get(new.destination, table=new.table)
        original = self._journal.remember(new.destination, new.table, current)
        data: dict[str, Scalar] = {"previous_absent": original is None}
        data.update(original.data("previous_") if original is not None else {})
        if current == new:
            return Outcome(True, f"{new.destination} already routed via {new.dev}", data)
        self._ops.replace(new)
        return Outcome(True, f"{new.destination} now via {new.via or 'link'} on {new.dev}", data)

    @staticmethod
    def check_set(args: Args) -> None:
        """The route to set is consistent (ValueError otherwise)."""
        _route(args)

    @staticmethod
    def check_restore(args: Args) -> None:
        """An explicit previous route is one route or none, and consistent (ValueError otherwise)."""
        if args["previous_dev"] and args["previous_absent"]:
            raise ValueError("give previous_dev or previous_absent=true, not both")
        if args["previous_dev"]:
            _route(args, "previous_")
        elif args["previous_via"] or args["previous_more"]:
            raise ValueError("previous_via and previous_more need previous_dev")

    def restore(self, args: Args) -> Outcome:
        """Put back the route ``route.set`` replaced (or the one given as ``previous_*``)."""
        dest, table = str(args["destination"]), int(args["table"])
        found, saved = self._journal.take(dest, table)
        if args["previous_dev"]:
            saved, found = _route(args, "previous_"), True
        elif args["previous_absent"]:
            saved, found = None, True
        if not found:
            return Outcome(False, f"no route saved for {dest} in table {table} (the agent may have restarted); "
                                  "pass previous_dev/previous_via, or previous_absent=true")
        if saved is None:
            self._ops.delete(dest, table=table)
            return Outcome(True, f"{dest} removed (there was no route before)")
        self._ops.replace(saved)
        return Outcome(True, f"{dest} restored via {saved.via or 'link'} on {saved.dev}", saved.data("restored_"))

    def get(self, args: Args) -> Outcome:
        """Read ``destination``'s route back (data ``present``, ``dev``...), the devices the kernel sends its
        traffic out of (``lookup``), and the host's own route beneath (``base``, as ``more`` is written)."""
        dest, table = str(args["destination"]), int(args["table"])
        route = self._ops.get(dest, table=table)
        data: dict[str, Scalar] = {"present": route is not None,
                                   "lookup": ",".join(dev for dev, _ in self._ops.lookup(dest, own=True)),
                                   "base": format_hops(self._ops.lookup(dest, own=False))}
        data.update(route.data("") if route is not None else {})
        shown = f"via {','.join(route.devs)}" if route is not None else "no route of ours"
        return Outcome(True, f"{dest}: {shown}; traffic leaves through {data['lookup'] or 'nothing'}", data)


def builtin_registry(*, node_id: str, clock: Callable[[], int], route_ops: RouteOps | None = None) -> CommandRegistry:
    """``ping``, and the route commands (``route.set``, ``route.restore``, ``route.get``) with ``route_ops``."""
    registry = CommandRegistry()

    def ping(args: Args) -> Outcome:
        return Outcome(True, f"{node_id} is here", {"node": node_id, "time_unix_nano": clock()})

    registry.register("ping", ping, params={}, help="Answer with the node id and its clock.")
    if route_ops is not None:
        routes = RouteCommands(route_ops)
        registry.register("route.set", routes.set, params=_ROUTE, check=routes.check_set,
                          help=RouteCommands.set.__doc__ or "")
        registry.register("route.restore", routes.restore, params=_RESTORE, check=routes.check_restore,
                          help=RouteCommands.restore.__doc__ or "")
        registry.register("route.get", routes.get, params=_GET, help=RouteCommands.get.__doc__ or "")
    return registry
