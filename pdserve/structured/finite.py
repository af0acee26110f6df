"""Whether a JSON schema admits any finite value: refuse a schema that only infinite JSON meets.

A schema can require a value to contain itself: ``{"type": "object", "properties": {"next":
{"$ref": "#"}}, "required": ["next"]}`` admits no finite object, only
``{"next": {"next": ...}}`` without end. The grammar engine compiles such a schema, but the
first token it allows starts a value that can never close (llguidance then fails on its forced
tokens, "Too many items", or the model runs to ``max_tokens``). :func:`has_finite_instance`
finds these up front so the router answers 400 instead.

The test is the classic productivity analysis of a context-free grammar (a nonterminal is
productive when some rule derives a finite string from productive symbols; Hopcroft & Ullman,
*Introduction to Automata Theory*, the "useless symbols" construction), read over the schema's
structure: a schema node is productive when it can be met by a finite value given which nodes
are productive so far, iterated from "none" to a fixed point. Only keywords that make a value
contain other values count (``$ref``, ``allOf``, ``anyOf``/``oneOf``, required properties,
``minItems`` with ``items``/``prefixItems``, ``type``); every other keyword is taken as
satisfiable, so the answer errs towards "yes": a schema said to have no finite value has none,
while a schema that is empty for other reasons (contradictory bounds, ``not``) is left to the
grammar engine. Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Fixed-point passes before giving up and answering "yes" (each pass settles at least one more
# node; children are visited before parents, so acyclic parts settle in the first pass).
MAX_PASSES = 64


def has_finite_instance(schema: Any) -> bool:
    """True when some finite JSON value may meet ``schema`` (a decoded JSON Schema document;
    ``$ref`` resolved against it: ``#``, ``#/$defs/...``, ``#/definitions/...`` and other JSON
    pointers into it; a reference it cannot resolve counts as met). False only when no finite
    value can meet it: every value it admits would have to contain itself without end, or a
    value it requires is refused outright (a ``false`` schema, a required property that
    ``additionalProperties: false`` shuts out). Never raises on a malformed schema (the grammar
    compiler reports those)."""
    if _has_scoped_refs(schema):
        return True  # refs resolve against $id bases or anchors: not followed here
    nodes = _reachable(schema)
    productive: set[int] = set()
    for _ in range(MAX_PASSES):
        before = len(productive)
        for node in nodes:
            if id(node) not in productive and _met(node, schema, productive):
                productive.add(id(node))
        if len(productive) == before:
            return id(schema) in productive or not _counts(schema)
    return True  # not settled within the pass budget: leave it to the grammar engine


_SCOPING = ("$id", "$anchor", "$dynamicAnchor", "$dynamicRef", "$recursiveRef")


def _has_scoped_refs(schema: Any) -> bool:
    """Whether ``schema`` uses what makes a ``$ref`` mean something other than a JSON pointer
    from its root: ``$id`` below the root (a new base), anchors, dynamic refs, or a ``$ref``
    that is not ``#`` or ``#/...``."""
    stack: list[tuple[Any, bool]] = [(schema, True)]
    while stack:
        node, root = stack.pop()
        if isinstance(node, Mapping):
            if any(k in node and not (root and k == "$id") for k in _SCOPING):
                return True
            ref = node.get("$ref")
            if isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):
                return True
            stack.extend((v, False) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, False) for v in node)
    return False


def _counts(node: Any) -> bool:
    """Whether ``node`` is a schema the analysis tracks (objects and booleans)."""
    return isinstance(node, Mapping) or isinstance(node, bool)


def _children(node: Any, root: Any) -> list[Any]:
    """The subschemas :func:`_met` reads for ``node``."""
    if not isinstance(node, Mapping):
        return []
    out: list[Any] = []
    target = _resolve(node.get("$ref"), root)
    if target is not None:
        out.append(target)
    for key in ("allOf", "anyOf", "oneOf", "prefixItems"):
        if isinstance(node.get(key), list):
            out.extend(node[key])
    for key in ("items", "additionalProperties"):
        if key in node:
            out.append(node[key])
    if isinstance(node.get("properties"), Mapping):
        out.extend(node["properties"].values())
    return [c for c in out if _counts(c)]


def _reachable(root: Any) -> list[Any]:
    """Every tracked schema node reachable from ``root``, children before their parents."""
    order: list[Any] = []
    seen: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if id(node) in seen or not _counts(node):
            continue
        seen.add(id(node))
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node, root) if id(c) not in seen)
    return order


def _resolve(ref: Any, root: Any) -> Any:
    """The node a local ``$ref`` (``#`` or ``#/a/b`` JSON pointer, RFC 6901) names; None."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if _counts(node) else None


def _met(node: Any, root: Any, productive: set[int]) -> bool:
    """Whether ``node`` is met by a finite value, given the nodes known ``productive``."""
    if isinstance(node, bool):
        return node
    if not isinstance(node, Mapping):
        return True

    def ok(sub: Any) -> bool:
        if isinstance(sub, bool):
            return sub
        return not isinstance(sub, Mapping) or id(sub) in productive

    target = _resolve(node.get("$ref"), root)
    if target is not None and not ok(target):
        return False
    if isinstance(node.get("allOf"), list) and not all(ok(s) for s in node["allOf"]):
        return False
    for key in ("anyOf", "oneOf"):
        branches = node.get(key)
        if isinstance(branches, list) and branches and not any(ok(s) for s in branches):
            return False
    types = node.get("type")
    if types is None:
        return True  # any type: a scalar meets the rest as far as this analysis sees
    if isinstance(types, str):
        types = [types]
    if not isinstance(types, list):
        return True
    return any(_type_met(t, node, ok) for t in types)


def _type_met(kind: Any, node: Mapping[str, Any], ok: Any) -> bool:
    if kind == "object":
        props = _get(node, "properties", Mapping, {})
        required = _get(node, "required", list, [])
        for name in required:
            if not isinstance(name, str):
                continue
            if name in props:
                sub = props[name]
            elif "patternProperties" in node:
                continue  # a pattern may cover it: not followed
            else:
                sub = node.get("additionalProperties", True)
            if not ok(sub):
                return False
        return True
    if kind == "array":
        least = node.get("minItems", 0)
        prefix = _get(node, "prefixItems", list, [])
        if not isinstance(least, int) or isinstance(least, bool) or least <= 0:
            return True
        for i in range(min(least, len(prefix) + 1)):
            sub = prefix[i] if i < len(prefix) else node.get("items", True)
            if not ok(sub):
                return False
        return True
    return True  # a scalar type, or a name the grammar compiler will refuse


def _get(node: Mapping[str, Any], key: str, kind: type, default: Any) -> Any:
    """``node[key]`` when it is a ``kind``, else ``default``."""
    value = node.get(key)
    return value if isinstance(value, kind) else default
