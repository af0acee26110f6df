"""JSON schemas closed the way vLLM's default backend closes them: an object that lists its
properties admits only those unless it says otherwise.

JSON Schema leaves an object open to any other property unless ``additionalProperties`` says
no, and llguidance follows the letter: a small model given ``{"properties": {"name", "age"}}``
fills the object with invented keys (``"gender"``, ``"country"``, ...) or repeats one until
``max_tokens``. xgrammar, vLLM's default structured-output backend, compiles JSON schemas in
strict mode by default, where undeclared properties are refused; llama.cpp's schema converter
also closes an object whose ``additionalProperties`` is absent; OpenAI's strict structured
outputs require ``additionalProperties: false`` outright. :func:`strict_objects` gives the
grammar engine the closed form of a schema, for every JSON-schema constraint (``response_format``,
``structured_outputs.json``, ``guided_json``, the gRPC ``json_schema`` kind, tool parameters).
A schema that wants extra properties says so (``additionalProperties: true`` or a schema).
Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdserve import json_text
from pdserve.structured.spec import StructuredOutputSpec

# where a JSON schema holds subschemas that describe a value on their own (not allOf: its branches
# describe one object together, so a branch may not refuse another branch's properties)
_ONE_SCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


# what leaves an object schema open: it speaks of other properties, or composes with schemas
# that may bring them
_OPEN_KEYS = ("additionalProperties", "unevaluatedProperties", "patternProperties", "allOf",
              "anyOf", "oneOf", "$ref", "if", "then", "else", "dependentSchemas")  # fmt: skip


def strict_objects(schema: Any) -> Any:
    """A copy of JSON schema ``schema`` in which every object schema that lists ``properties``
    and says nothing of others gets ``additionalProperties: false``, through its nested schemas.
    Left open: an object with ``additionalProperties``, ``unevaluatedProperties`` or
    ``patternProperties``; one with a ``required`` name missing from its ``properties`` (closing
    it would leave no valid value); one that composes with other schemas (``allOf``, ``anyOf``,
    ``oneOf``, ``$ref``, ``if``/``then``/``else``, ``dependentSchemas``), whose properties may
    come from them; and ``allOf`` branches (they describe one object together). Never raises:
    what is not a schema is returned as is."""
    if not isinstance(schema, Mapping):
        return schema
    out = dict(schema)
    for key in _ONE_SCHEMA:
        if key in out:
            out[key] = strict_objects(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict_objects(s) for s in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), Mapping):
            out[key] = {k: strict_objects(s) for k, s in out[key].items()}
    if isinstance(out.get("additionalProperties"), Mapping):
        out["additionalProperties"] = strict_objects(out["additionalProperties"])
    open_keys = _OPEN_KEYS
    props = out.get("properties")
    required = out["required"] if isinstance(out.get("required"), list) else []
    if (
        isinstance(props, Mapping)
        and not any(k in out for k in open_keys)
        and all(name in props for name in required if isinstance(name, str))
    ):
        out["additionalProperties"] = False
    return out


def closed_spec(spec: StructuredOutputSpec) -> StructuredOutputSpec:
    """``spec`` with its JSON schema closed by :func:`strict_objects` (other kinds, and a schema
    that does not parse as JSON, which the compiler then refuses, as they are)."""
    if spec.kind != "json_schema":
        return spec
    try:
        schema = json_text.loads(spec.value)
    except ValueError:
        return spec
    closed = strict_objects(schema)
    return spec if closed == schema else StructuredOutputSpec.json_schema(closed, spec.field)
