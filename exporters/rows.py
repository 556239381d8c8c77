"""Column-wise row batches, and the OTLP value conventions shared by every signal.

A `Rows` holds, per table, one list per insert column; converters append to it and the
gateway inserts it in one columnar call per table.
"""

from __future__ import annotations

import base64
import json
import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from ridethrough.exporters.schema import TABLES_BY_NAME, Table


@dataclass(frozen=True, slots=True)
class Limits:
    """What a single point, span or log record may carry before it is rejected."""

    max_attributes: int = 128
    max_attribute_value_bytes: int = 4096


# Resource and scope attributes describe the sender, not one item: a long one is no reason
# to drop a sender's whole request, so they get generous fixed limits.
RESOURCE_LIMITS = Limits(max_attributes=1024, max_attribute_value_bytes=65536)


class Rows:
    """Rows for several tables, column by column."""

    __slots__ = ("columns", "counts")

    def __init__(self) -> None:
        self.columns: dict[str, dict[str, list[Any]]] = {}
        self.counts: Counter[str] = Counter()

    def table(self, table: Table) -> dict[str, list[Any]]:
        """The column lists of one table, created on first use."""
        cols = self.columns.get(table.name)
        if cols is None:
            cols = {name: [] for name in table.insert_columns}
            self.columns[table.name] = cols
        return cols

    def append_row(self, table: Table, values: Iterable[Any]) -> None:
        """Append one row, its values in the table's insert-column order."""
        cols = self.table(table)
        for name, value in zip(table.insert_columns, values, strict=True):
            cols[name].append(value)
        self.counts[table.name] += 1

    @property
    def total(self) -> int:
        """Rows across all tables."""
        return sum(self.counts.values())

    def extend(self, other: Rows) -> None:
        """Append every row of ``other``."""
        for name, cols in other.columns.items():
            mine = self.table(TABLES_BY_NAME[name])
            for col, values in cols.items():
                mine[col].extend(values)
        self.counts.update(other.counts)

    def ordered(self, table: Table) -> list[list[Any]]:
        """The table's columns in insert order."""
        cols = self.columns[table.name]
        return [cols[name] for name in table.insert_columns]


@dataclass(slots=True)
class Rejections:
    """What a request carried that could not be stored, and why (for OTLP partial_success)."""

    count: int = 0
    reasons: Counter[str] = field(default_factory=Counter)

    def add(self, reason: str, n: int = 1) -> None:
        """Count ``n`` items rejected for ``reason``."""
        self.count += n
        self.reasons[reason] += n

    def message(self, *, limit: int = 5) -> str:
        """A short human-readable summary, most frequent reasons first."""
        parts = [f"{n} {reason}" for reason, n in self.reasons.most_common(limit)]
        return "rejected: " + "; ".join(parts) if parts else ""


def strict(what: str) -> Callable[[Rejections], None]:
    """A ``check`` for requests the project builds itself: any rejection is a bug, raised as ValueError."""
    def check(rej: Rejections) -> None:
        if rej.count:
            raise ValueError(f"{what} rejected by the converter: {rej.message()}")
    return check


class InvalidItem(Exception):
    """One point, span or record is invalid; the message is the reason."""


MAX_TIME_NS = 2**63 - 1
"""The last nanosecond a DateTime64(9) column holds (2262-04-11); OTLP's uint64 times go further."""


def check_time(ns: int, what: str) -> int:
    """``ns`` if a DateTime64(9) column can hold it, else `InvalidItem`: one far-future item must be
    refused alone, not make the store refuse the whole batch it rides in."""
    if ns > MAX_TIME_NS:
        raise InvalidItem(f"{what} {ns} is past 2262-04-11 (beyond DateTime64(9))")
    return ns


def any_value_str(value: AnyValue) -> str:
    """An AnyValue as the upstream Collector stores it in a String column."""
    which = value.WhichOneof("value")
    if which == "string_value":
        return value.string_value
    if which is None:
        return ""
    if which == "bool_value":
        return "true" if value.bool_value else "false"
    if which in ("int_value", "double_value"):
        return str(getattr(value, which))
    if which == "bytes_value":
        return base64.b64encode(value.bytes_value).decode("ascii")
    return _json_text(_any_value_py(value))


def _any_value_py(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which == "array_value":
        return [_any_value_py(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _any_value_py(kv.value) for kv in value.kvlist_value.values}
    if which == "bytes_value":
        return base64.b64encode(value.bytes_value).decode("ascii")
    if which == "double_value" and not math.isfinite(value.double_value):
        return str(value.double_value)
    return getattr(value, which) if which else None


def _json_text(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def kv(key: str, value: str | int) -> KeyValue:
    """One OTLP attribute (string or int) for requests the project builds itself."""
    out = KeyValue(key=key)
    if isinstance(value, int):
        out.value.int_value = value
    else:
        out.value.string_value = value
    return out


def attributes(kvs: Iterable[KeyValue], count: int, limits: Limits) -> dict[str, str]:
    """KeyValues → a String map, or `InvalidItem` if there are too many or one is too long."""
    if count > limits.max_attributes:
        raise InvalidItem(f"more than {limits.max_attributes} attributes")
    # Fast path: nearly every attribute is a string. An empty result may be a non-string
    # value (whose string_value reads as ''), so only then is each value's type asked.
    out = {kv.key: kv.value.string_value for kv in kvs}
    if "" in out.values():
        out = {kv.key: any_value_str(kv.value) for kv in kvs}
    cap = limits.max_attribute_value_bytes
    # len() counts characters (up to 4 bytes each): encode only when it could be over.
    if out and max(map(len, out.values())) * 4 > cap:
        for s in out.values():
            if len(s.encode("utf-8", "surrogatepass")) > cap:
                raise InvalidItem(f"attribute value over {cap} bytes")
    return out


def hex_id(raw: bytes, size: int, what: str, *, required: bool) -> str:
    """A trace or span id as lower-case hex ('' when absent and allowed)."""
    if not raw:
        if required:
            raise InvalidItem(f"missing {what}")
        return ""
    if len(raw) != size:
        raise InvalidItem(f"{what} is {len(raw)} bytes, not {size}")
    return raw.hex()


def finite(x: float, what: str) -> float:
    """``x`` if it is a finite number, else `InvalidItem`."""
    if not math.isfinite(x):
        raise InvalidItem(f"non-finite {what}")
    return x
