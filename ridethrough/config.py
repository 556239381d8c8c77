"""Typed, layered configuration: default < YAML file < environment < command-line flag.

A component's config is a frozen, keyword-only dataclass. Each field carries its help text
and constraints in ``metadata``, so the same model drives loading, ``config show`` and the
JSON Schema that Helm values are generated from. Field metadata keys:

``help``     one line shown in ``--help``, the schema and Helm values (required by convention)
``min``      inclusive lower bound (int and float fields)
``max``      inclusive upper bound (int and float fields)
``choices``  allowed values (for ``tuple[str, ...]`` fields: allowed items)
``check``    a callable taking the value and raising ValueError when it is malformed
``secret``   never print the value
``dsn``      a URL whose password must never be printed

Constraints are enforced by :func:`load`, where the origin of a bad value is known; a
model's ``__post_init__`` may add cross-field checks by raising ValueError.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, get_args, get_origin, get_type_hints

from ridethrough.config_values import EXPECTED, FrozenMap, check, from_text, from_yaml
from ridethrough.config_yaml import ConfigFileError, located, read_yaml, yaml_type
from ridethrough.suggest import did_you_mean

__all__ = ["ConfigError", "FrozenMap", "Loaded", "env_var", "json_schema", "load", "mask_dsn", "render"]

T = TypeVar("T")

_KINDS: dict[object, str] = {str: "str", int: "int", float: "float", bool: "bool"}


class ConfigError(Exception):
    """A configuration problem, described in one line that names the key and where it came from."""


@dataclass(frozen=True)
class Loaded(Generic[T]):
    """A loaded config and, for each field, where its value came from.

    Origins are ``"default"``, ``"file:<path>"``, ``"env:<VAR>"`` or ``"flag"``.
    """

    config: T
    origins: Mapping[str, str]


@dataclass(frozen=True)
class _Field:
    name: str
    kind: str
    default: object
    meta: Mapping[str, Any]


@dataclass(frozen=True)
class _Layer:
    """One source of values: ``where(key)`` phrases its location for error messages."""

    values: Mapping[str, object]
    origin: Callable[[str], str]
    where: Callable[[str], str]
    parse_strings: bool  # env and flags carry text; YAML carries native types and is checked strictly


def env_var(component: str, field: str) -> str:
    """The environment variable for a field, e.g. ``RIDETHROUGH_GATEWAY_OTLP_LISTEN``."""
    return f"{_env_prefix(component)}{field.upper()}"


def load(
    model: type[T],
    *,
    component: str,
    file: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, object] | None = None,
    known_sections: Iterable[str] = (),
) -> Loaded[T]:
    """Build ``model`` from defaults, then the file's ``component`` section, then env, then flags.

    ``env`` defaults to ``os.environ``; ``flags`` entries that are None were not given. A non-empty
    ``known_sections`` makes any other top-level section of the file an error. Raises ConfigError
    for bad input, ValueError for a flag name the model does not have (a programming error).
    """
    fields = _fields(model)
    layers = [] if file is None else [_file_layer(os.fspath(file), fields, component, set(known_sections))]
    layers.append(_env_layer(os.environ if env is None else env, fields, component))
    layers.append(_flag_layer(flags or {}, fields, component))
    values = {name: f.default for name, f in fields.items()}
    origins = dict.fromkeys(fields, "default")
    for layer in layers:
        for key, raw in layer.values.items():
            values[key] = _coerce(fields[key], raw, layer, component)
            origins[key] = layer.origin(key)
    return Loaded(config=_construct(model, values, component), origins=FrozenMap(origins))


def render(loaded: Loaded[Any], *, component: str) -> str:
    """A plain-text table of field, effective value and origin; secrets and DSN passwords masked."""
    fields = _fields(type(loaded.config))
    rows = [("field", "value", "origin")]
    for name, f in fields.items():
        rows.append((name, _display(f, getattr(loaded.config, name)), loaded.origins.get(name, "?")))
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    lines = [f"{a.ljust(widths[0])}  {b.ljust(widths[1])}  {c}" for a, b, c in rows]
    return "\n".join([f"# {component}", *lines]) + "\n"


def json_schema(model: type) -> dict[str, Any]:
    """A JSON Schema (draft 2020-12) for ``model``: one property per field, nothing else allowed."""
    doc = (model.__doc__ or model.__name__).strip().splitlines()[0]
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": model.__name__,
        "description": doc,
        "type": "object",
        "properties": {name: _property(f) for name, f in _fields(model).items()},
        "additionalProperties": False,
    }


def mask_dsn(url: str) -> str:
    """``url`` with any password (userinfo or ``password=`` query parameter) replaced by ``***``."""
    url = re.sub(r"(?i)([?&]password=)[^&#]*", r"\1***", url)
    scheme, sep, rest = url.partition("://")
    # rpartition: a stray '@' in the path over-masks, which is safer than leaking a password
    userinfo, at, hostpath = rest.rpartition("@")
    if not sep or not at or ":" not in userinfo:
        return url
    return f"{scheme}://{userinfo.partition(':')[0]}:***@{hostpath}"


# -- model introspection ------------------------------------------------------------------


def _fields(model: type) -> dict[str, _Field]:
    if not dataclasses.is_dataclass(model):
        raise TypeError(f"{model!r} is not a dataclass")
    hints = get_type_hints(model)
    return {f.name: _Field(f.name, _kind(hints[f.name], f.name), _default(f), f.metadata)
            for f in dataclasses.fields(model)}


def _kind(tp: object, name: str) -> str:
    if tp in _KINDS:
        return _KINDS[tp]
    origin, args = get_origin(tp), get_args(tp)
    if origin is tuple and args == (str, ...):
        return "tuple"
    if origin in (dict, Mapping) and args == (str, str):
        return "mapping"
    raise TypeError(f"config field {name!r} has unsupported type {tp!r}")


def _default(f: dataclasses.Field[Any]) -> object:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"config field {f.name!r} needs a default")


def _construct(model: type[T], values: Mapping[str, object], component: str) -> T:
    factory: Callable[..., T] = model
    try:
        return factory(**values)
    except ValueError as e:  # a model's cross-field check in __post_init__
        raise ConfigError(f"{component}: {e}") from e


# -- sources ------------------------------------------------------------------------------


def _env_prefix(component: str) -> str:
    return f"RIDETHROUGH_{component.upper().replace('-', '_')}_"


def _env_layer(env: Mapping[str, str], fields: Mapping[str, _Field], component: str) -> _Layer:
    prefix = _env_prefix(component)
    values: dict[str, object] = {}
    for var in sorted(v for v in env if v.startswith(prefix)):
        name = var[len(prefix):].lower()
        if name not in fields:
            hint = did_you_mean(var, [env_var(component, f) for f in fields], quote=False)
            raise ConfigError(f"{component}: unknown environment variable {var}{hint}")
        values[name] = env[var]

    def var_of(key: str) -> str:
        return env_var(component, key)

    return _Layer(values, lambda k: f"env:{var_of(k)}", lambda k: f"from env {var_of(k)}", True)


def _flag_layer(flags: Mapping[str, object], fields: Mapping[str, _Field], component: str) -> _Layer:
    unknown = sorted(set(flags) - set(fields))
    if unknown:
        raise ValueError(f"{component}: no config field for flag(s) {unknown}; fields are {sorted(fields)}")
    values = {k: v for k, v in flags.items() if v is not None}
    return _Layer(values, lambda k: "flag", lambda k: "from flag", True)


def _file_layer(path: str, fields: Mapping[str, _Field], component: str, known: set[str]) -> _Layer:
    try:
        data, lines = read_yaml(path)
    except ConfigFileError as e:
        raise ConfigError(str(e)) from None

    def where(at: tuple[str, ...]) -> str:
        return located(path, lines.get(at))

    section = _section(data, where, component, known)
    for key in section:
        if key not in fields:
            raise ConfigError(f"{component}: unknown key {key!r} in {where((component, key))}"
                              f"{did_you_mean(str(key), fields)}")
    return _Layer(section, lambda k: f"file:{path}", lambda k: f"in {where((component, k))}", False)


def _section(data: Mapping[Any, Any], where: Callable[[tuple[str, ...]], str], component: str,
             known: set[str]) -> dict[Any, Any]:
    """The file's ``component`` section (empty if absent); checks the other section names against ``known``."""
    for name in data if known else ():
        if name not in known:
            raise ConfigError(f"unknown section {name!r} in {where((name,))}{did_you_mean(str(name), known)}")
    section = {} if data.get(component) is None else data[component]
    if not isinstance(section, dict):
        got = yaml_type(section)
        raise ConfigError(f"{component}: expected a mapping of settings in {where((component,))}, got {got}")
    return section


# -- values -------------------------------------------------------------------------------


def _coerce(f: _Field, raw: object, layer: _Layer, component: str) -> object:
    """Parse and check one value; a problem becomes a ConfigError naming the key and its origin."""
    try:
        if layer.parse_strings and isinstance(raw, str):
            value = from_text(f.kind, raw)
        else:
            value = from_yaml(f.kind, raw)
        check(f.kind, f.meta, value)
    except ValueError as e:
        problem = _redact(f, str(e), raw)
        raise ConfigError(f"{component}.{f.name}: {problem} ({layer.where(f.name)})") from None
    return value


def _redact(f: _Field, message: str, raw: object) -> str:
    """The problem without the secret: a secret is never shown, a DSN only with its password masked."""
    if f.meta.get("secret"):
        return "invalid value (not shown: secret field)"
    if not f.meta.get("dsn"):
        return message
    if not isinstance(raw, str):  # a list or mapping could hold the DSN anywhere inside
        return f"expected {EXPECTED[f.kind]}, got a {yaml_type(raw)}"
    return message.replace(repr(raw), repr(mask_dsn(raw))) if raw else message


# -- presentation -------------------------------------------------------------------------


def _jsonable(value: object) -> object:
    if isinstance(value, tuple):
        return list(value)
    return dict(value) if isinstance(value, Mapping) else value


def _display(f: _Field, value: object) -> str:
    if f.meta.get("secret"):
        return "***"
    if f.meta.get("dsn") and isinstance(value, str):
        value = mask_dsn(value)
    return json.dumps(_jsonable(value))


_SCHEMA_TYPES = {"str": "string", "int": "integer", "float": "number", "bool": "boolean",
                 "tuple": "array", "mapping": "object"}


def _property(f: _Field) -> dict[str, Any]:
    prop: dict[str, Any] = {"type": _SCHEMA_TYPES[f.kind], "description": f.meta.get("help", "")}
    prop["default"] = _jsonable(f.default)
    if f.kind == "tuple":
        prop["items"] = {"type": "string"}
    if f.kind == "mapping":
        prop["additionalProperties"] = {"type": "string"}
    for key, schema_key in (("min", "minimum"), ("max", "maximum")):
        if key in f.meta:
            prop[schema_key] = f.meta[key]
    if "choices" in f.meta:
        (prop["items"] if f.kind == "tuple" else prop)["enum"] = list(f.meta["choices"])
    if f.meta.get("secret"):
        prop["writeOnly"] = True
    return prop
