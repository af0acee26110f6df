"""JSON text from requests and model output, parsed with a bound on nesting (torch-free).

Request fields that carry JSON as text (``guided_json``, a tool call's ``arguments``, the gRPC
API's ``*_json`` fields) and tool calls in model output are parsed here. Python's parser and
every walker after it (schema limits, strict tool schemas, the chat template) recurse once per
level, so a few kilobytes of ``[[[[...`` would raise RecursionError deep inside a request; a
value nested deeper than :data:`MAX_JSON_DEPTH` is refused as invalid JSON instead.
"""

from __future__ import annotations

import json
from typing import Any

MAX_JSON_DEPTH = 100  # arrays/objects inside one another; real schemas and arguments stay < 20


def json_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """Levels of arrays/objects in decoded JSON ``value`` (0 for a scalar), counted without
    recursion; stops counting past ``limit`` (returns ``limit + 1``)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            children: Any = v.values()
        elif isinstance(v, (list, tuple)):
            children = v
        else:
            continue
        d += 1
        if d > limit:
            return d
        deepest = max(deepest, d)
        stack.extend((c, d) for c in children)
    return deepest


def check_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> None:
    """Raise ValueError when decoded JSON ``value`` nests deeper than ``limit`` levels."""
    if json_depth(value, limit) > limit:
        raise ValueError(f"nested deeper than {limit} levels")


def loads(text: str, limit: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads(text)``, refusing values nested deeper than ``limit`` levels. Raises
    ValueError (json.JSONDecodeError for malformed text)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(f"nested deeper than {limit} levels") from None
    check_depth(value, limit)
    return value


def json_type(value: Any) -> str:
    """The JSON name of decoded ``value``'s type (``null``, ``boolean``, ``number``, ``string``,
    ``array``, ``object``), for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__
