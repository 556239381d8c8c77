"""Rewrite the resources of an OTLP Export request in its bytes: drop some attributes, append others.

The gateway stamps each accepted request with its sender's tenant (`ingest_auth`). A full parse
and re-serialisation of a 1,000-point request costs about 0.8 ms; this walks the protobuf wire
format only down to each resource, re-encodes that small ``Resource`` message and copies every
other byte (about 50 us). Requests holding protobuf groups (legal, never sent by OTLP clients)
take the full parse. The three Export requests share the layout this relies on: field 1 is the
repeated ``resource_metrics``/``resource_spans``/``resource_logs``, and in each of those, field 1
is the ``resource``.
"""

from __future__ import annotations

from collections.abc import Iterator

from google.protobuf.message import DecodeError, Message
from opentelemetry.proto.common.v1.common_pb2 import KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource


class _Irregular(Exception):
    """Wire content the fast path does not handle (groups): use the full parse."""


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise DecodeError("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift >= 70:
            raise DecodeError("varint longer than 10 bytes")


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _wire_fields(buf: bytes) -> Iterator[tuple[int, int, int, int, int]]:
    """(field number, wire type, field start, payload start, end) of each top-level field of ``buf``."""
    pos = 0
    while pos < len(buf):
        start = pos
        tag, pos = _read_varint(buf, pos)
        number, wire = tag >> 3, tag & 7
        if number == 0:
            raise DecodeError("field number 0")
        if wire == 0:
            _, end = _read_varint(buf, pos)
        elif wire == 1:
            end = pos + 8
        elif wire == 5:
            end = pos + 4
        elif wire == 2:
            length, pos = _read_varint(buf, pos)
            end = pos + length
        elif wire in (3, 4):
            raise _Irregular
        else:
            raise DecodeError(f"wire type {wire}")
        if end > len(buf):
            raise DecodeError("truncated field")
        yield number, wire, start, pos, end
        pos = end


_LEN1 = _varint(1 << 3 | 2)  # field 1, length-delimited: resource_* in a request, resource in each of them


def _stamp_resource(resource: Resource, strip: frozenset[str], add: tuple[KeyValue, ...]) -> None:
    kept = [kv for kv in resource.attributes if kv.key not in strip]
    if len(kept) != len(resource.attributes):
        del resource.attributes[:]
        resource.attributes.extend(kept)
    resource.attributes.extend(add)


def _stamp_element(element: bytes, strip: frozenset[str], add: tuple[KeyValue, ...]) -> bytes:
    parts, rest = [], []
    for number, wire, start, payload, end in _wire_fields(element):
        if number == 1 and wire == 2:
            parts.append(element[payload:end])  # repeated occurrences merge, as the parser would
        else:
            rest.append(element[start:end])
    resource = Resource.FromString(b"".join(parts))
    _stamp_resource(resource, strip, add)
    encoded = resource.SerializeToString()
    return b"".join([_LEN1, _varint(len(encoded)), encoded, *rest])


def stamp_request(raw: bytes, *, strip: frozenset[str], add: tuple[KeyValue, ...],
                  request_type: type[Message] | None = None) -> bytes:
    """Drop ``strip`` keys from every resource of an OTLP Export request and append ``add``.

    Works on metrics, traces and logs requests alike (their field 1 is the repeated resource_*,
    whose field 1 is the resource). ``request_type`` is only needed for requests with groups.
    """
    if not strip and not add:
        return raw
    try:
        out = []
        for number, wire, start, payload, end in _wire_fields(raw):
            if number == 1 and wire == 2:
                element = _stamp_element(raw[payload:end], strip, add)
                out += [_LEN1, _varint(len(element)), element]
            else:
                out.append(raw[start:end])
        return b"".join(out)
    except _Irregular:
        return _stamp_parsed(raw, strip, add, request_type)


def _stamp_parsed(raw: bytes, strip: frozenset[str], add: tuple[KeyValue, ...],
                  request_type: type[Message] | None) -> bytes:
    if request_type is None:
        raise DecodeError("request holds protobuf groups and its type is unknown")
    request = request_type.FromString(raw)
    resources = getattr(request, request.DESCRIPTOR.fields_by_number[1].name)
    for element in resources:
        _stamp_resource(element.resource, strip, add)
    return bytes(request.SerializeToString())
