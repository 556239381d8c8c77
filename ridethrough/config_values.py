"""One config value: parsed from environment/flag text or a YAML value, then checked.

Kinds are ``str``, ``int``, ``float``, ``bool``, ``tuple`` (of strings) and ``mapping``
(``str -> str``, held in a hashable `FrozenMap`). Problems are ValueErrors;
`ridethrough.config` adds the key and where the value came from.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from ridethrough.config_yaml import yaml_type
from ridethrough.suggest import did_you_mean

EXPECTED = {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean (true/false)",
            "tuple": "a list of strings", "mapping": "a mapping of strings to strings"}
"""What a value of each kind must be, as error messages say it."""
_BOOL_WORDS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False,
               "off": False}


class FrozenMap(Mapping[str, str]):
    """An immutable, hashable ``str -> str`` mapping, so frozen configs stay hashable."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, str] | Iterable[tuple[str, str]] = ()) -> None:
        self._items = dict(items)

    def __getitem__(self, key: str) -> str:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __repr__(self) -> str:
        return f"FrozenMap({self._items!r})"


def _bad(kind: str, raw: object, *, native: bool) -> ValueError:
    shown = f"{raw!r} ({yaml_type(raw)})" if native else repr(raw)
    return ValueError(f"expected {EXPECTED[kind]}, got {shown}")


def from_text(kind: str, text: str) -> object:
    """A value of ``kind`` from environment or flag text (``a,b`` lists, ``k=v,k2=v2`` mappings)."""
    try:
        return _TEXT_PARSERS[kind](text)
    except (ValueError, KeyError):
        raise _bad(kind, text, native=False) from None


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError(f"not finite: {value}")
    return value


def _parse_mapping(text: str) -> FrozenMap:
    pairs: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = (s.strip() for s in item.partition("="))
        if not eq or not key or key in pairs:
            raise ValueError(item)
        pairs[key] = value
    return FrozenMap(pairs)


_TEXT_PARSERS: dict[str, Callable[[str], object]] = {
    "str": str,
    "int": lambda s: int(s.strip()),  # int() accepts '1_000' and rejects '1.5'
    "float": lambda s: _finite(float(s.strip())),
    "bool": lambda s: _BOOL_WORDS[s.strip().lower()],
    "tuple": lambda s: tuple(filter(None, (p.strip() for p in s.split(",")))),
    "mapping": _parse_mapping,
}


def from_yaml(kind: str, raw: object) -> object:
    """A value of ``kind`` from a native YAML value, checked strictly (``workers: yes`` is not an int)."""
    if kind in ("int", "float") and isinstance(raw, bool):
        raise _bad(kind, raw, native=True)  # bool is an int subclass; `workers: yes` is a mistake
    if kind == "float" and isinstance(raw, int | float) and math.isfinite(raw):
        return float(raw)
    if kind in ("str", "int", "bool") and isinstance(raw, {"str": str, "int": int, "bool": bool}[kind]):
        return raw
    if kind == "tuple" and isinstance(raw, list | tuple) and all(isinstance(x, str) for x in raw):
        return tuple(raw)
    if kind == "mapping" and isinstance(raw, Mapping) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in raw.items()
    ):
        return FrozenMap(raw)
    raise _bad(kind, raw, native=True)


def check(kind: str, meta: Mapping[str, Any], value: Any) -> None:
    """ValueError if ``value`` breaks a field's ``min``, ``max``, ``choices`` or ``check`` metadata."""
    if "min" in meta and value < meta["min"]:
        raise ValueError(f"must be >= {meta['min']}, got {value!r}")
    if "max" in meta and value > meta["max"]:
        raise ValueError(f"must be <= {meta['max']}, got {value!r}")
    if "choices" in meta:
        _check_choices(meta["choices"], value if kind == "tuple" else (value,))
    if "check" in meta:
        meta["check"](value)


def _check_choices(choices: Iterable[object], items: Iterable[object]) -> None:
    allowed = [str(c) for c in choices]
    for item in items:
        if str(item) not in allowed:
            hint = did_you_mean(str(item), allowed)
            raise ValueError(f"must be one of {', '.join(allowed)}; got {item!r}{hint}")
