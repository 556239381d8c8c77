"""A config file's YAML: its top-level mapping and the line of each section and key.

`ridethrough.config` layers these values over defaults; the lines let its errors say
``file:line``. Every problem here is one `ConfigFileError` whose message is ready to show.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import yaml

_YAML_TYPE_NAMES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "list",
                    dict: "mapping", type(None): "null"}

KeyLines = dict[tuple[str, ...], int]
"""The line of each section ``(section,)`` and key ``(section, key)``."""


class ConfigFileError(Exception):
    """A config file that cannot be read, is not YAML, or is not a mapping of sections."""


def yaml_type(value: object) -> str:
    """The YAML name of a value's type: ``string``, ``integer``, ``mapping``, ..."""
    return _YAML_TYPE_NAMES.get(type(value), type(value).__name__)


def located(path: str, line: int | None) -> str:
    """``path:line``, or ``path`` when the line is unknown."""
    return path if line is None else f"{path}:{line}"


def read_yaml(path: str) -> tuple[dict[Any, Any], KeyLines]:
    """The file's top-level mapping and the line of each section and ``(section, key)``."""
    loader = yaml.SafeLoader(_read_text(path))
    try:
        node = loader.get_single_node()
        data = {} if node is None else loader.construct_document(node)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = path if mark is None else f"{path}:{mark.line + 1}:{mark.column + 1}"
        raise ConfigFileError(f"config file {where}: invalid YAML: {e.problem}") from None
    except yaml.YAMLError as e:
        raise ConfigFileError(f"config file {path}: invalid YAML: {e}") from None
    finally:
        loader.dispose()
    if not isinstance(data, dict):
        raise ConfigFileError(f"config file {path}: expected a mapping of sections, got {yaml_type(data)}")
    return data, _key_lines(node, path)


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except FileNotFoundError:
        raise ConfigFileError(f"config file {path}: not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigFileError(f"config file {path}: cannot read: {e}") from None


def _key_lines(node: yaml.Node | None, path: str) -> KeyLines:
    """Lines of sections and their keys; a key given twice is an error (YAML keeps the last silently)."""
    lines: KeyLines = {}
    for key, where in _keys(node, ()):
        if where in lines:
            raise ConfigFileError(f"config file {path}:{key.start_mark.line + 1}: duplicate key {'.'.join(where)!r}")
        lines[where] = key.start_mark.line + 1
    return lines


def _keys(node: yaml.Node | None, prefix: tuple[str, ...]) -> Iterator[tuple[yaml.Node, tuple[str, ...]]]:
    """Scalar keys, with their paths, of the top-level mapping and of each section mapping."""
    if not isinstance(node, yaml.MappingNode):
        return
    for key, value in node.value:
        if isinstance(key, yaml.ScalarNode):
            yield key, (*prefix, key.value)
            if not prefix:
                yield from _keys(value, (key.value,))
