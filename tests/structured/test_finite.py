"""JSON schemas that admit no finite value are found up front (pdserve/structured/finite.py)."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.structured.finite import has_finite_instance
from pdserve.structured.limits import check_spec_limits
from pdserve.structured.spec import StructuredOutputError, StructuredOutputSpec

pytestmark = pytest.mark.timeout(60)

NODE = {"type": "object", "properties": {"next": {"$ref": "#"}}}

NO_FINITE_VALUE: list[Any] = [
    {**NODE, "required": ["next"]},
    {
        "$id": "urn:root",
        **NODE,
        "required": ["next"],
        "properties": {"id": {}, "next": {"$ref": "#"}},
    },
    {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    {
        "$defs": {
            "n": {"type": "object", "properties": {"n": {"$ref": "#/$defs/n"}}, "required": ["n"]}
        },
        "type": "object",
        "properties": {"x": {"$ref": "#/$defs/n"}},
        "required": ["x"],
    },  # fmt: skip
    {  # mutual recursion through anyOf branches that all recurse
        "definitions": {
            "a": {
                "type": "object",
                "properties": {"b": {"$ref": "#/definitions/b"}},
                "required": ["b"],
            },
            "b": {
                "anyOf": [
                    {"$ref": "#/definitions/a"},
                    {"type": "array", "minItems": 2, "items": {"$ref": "#/definitions/a"}},
                ]
            },
        },
        "$ref": "#/definitions/a",
    },  # fmt: skip
    {"type": "object", "properties": {}, "required": ["x"], "additionalProperties": False},
    {"allOf": [{"type": "string"}, False]},
    {"type": "array", "prefixItems": [{"type": "integer"}, {"$ref": "#"}], "minItems": 2},
    False,
]

FINITE: list[Any] = [
    NODE,  # "next" is optional: {} ends it
    {
        **NODE,
        "required": ["next"],
        "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
    },
    {"type": ["object", "null"], "properties": {"next": {"$ref": "#"}}, "required": ["next"]},
    {"type": "array", "items": {"$ref": "#"}},  # [] ends it
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "required": ["a"]},
    {"$ref": "https://example.com/schema.json"},
    {"type": "object", "required": ["x"]},  # any value for x
    {"type": "object", "required": [["not", "a", "name"]]},  # malformed: the compiler's to say
    {"type": "object", "patternProperties": {"^x": {"$ref": "#"}}, "required": ["x"]},
    {"anyOf": []},
    {"type": "banana"},  # the compiler's to refuse
    {  # an anchor, not the root (fault-tester finding: "#leaf" was read as "#")
        "type": "object",
        "properties": {"x": {"$ref": "#leaf"}},
        "required": ["x"],
        "$defs": {"leaf": {"$anchor": "leaf", "type": "string"}},
    },  # fmt: skip
    {  # "#/$defs/leaf" below an $id means that subschema's $defs, not the root's
        "type": "object",
        "required": ["p"],
        "properties": {
            "p": {
                "$id": "urn:a",
                "type": "object",
                "required": ["q"],
                "properties": {"q": {"$ref": "#/$defs/leaf"}},
                "$defs": {"leaf": {"type": "string"}},
            }
        },
        "$defs": {"leaf": {"$ref": "#"}},
    },  # fmt: skip
    {  # a property named like a keyword is a name, not a keyword
        "$id": "urn:root",
        "type": "object",
        "required": ["id"],
        "properties": {"id": {"type": "string"}, "next": {"$ref": "#"}},
    },  # fmt: skip
    True,
    {},
    "not a schema",
]


@pytest.mark.parametrize("schema", NO_FINITE_VALUE)
def test_schemas_with_no_finite_value(schema: Any) -> None:
    assert not has_finite_instance(schema)


@pytest.mark.parametrize("schema", FINITE)
def test_schemas_with_a_finite_value(schema: Any) -> None:
    assert has_finite_instance(schema)


def test_a_long_chain_settles() -> None:
    """A chain of 500 definitions, each requiring the next, the last a string: finite; closing
    the chain into a loop makes it infinite."""
    defs = {f"d{i}": {"type": "object", "properties": {"v": {"$ref": f"#/$defs/d{i + 1}"}},
                      "required": ["v"]} for i in range(500)}  # fmt: skip
    defs["d500"] = {"type": "string"}
    chain = {"$defs": defs, "$ref": "#/$defs/d0"}
    assert has_finite_instance(chain)
    defs["d500"] = {"$ref": "#/$defs/d0"}
    assert not has_finite_instance(chain)


def test_spec_check_names_the_field() -> None:
    spec = StructuredOutputSpec.json_schema(NO_FINITE_VALUE[0], "response_format")
    with pytest.raises(StructuredOutputError, match="no finite JSON value") as e:
        check_spec_limits(spec)
    assert e.value.field == "response_format"
    check_spec_limits(StructuredOutputSpec.json_schema(FINITE[0]))
