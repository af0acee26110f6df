"""JSON schemas closed as vLLM's default backend closes them (pdserve/structured/strict.py)."""

from __future__ import annotations

import json

import pytest

from pdserve.structured.spec import StructuredOutputSpec
from pdserve.structured.strict import closed_spec, strict_objects

pytestmark = pytest.mark.timeout(60)

PERSON = {"type": "object", "properties": {"name": {"type": "string"}}}


def test_listed_objects_are_closed_through_nested_schemas() -> None:
    schema = {
        **PERSON,
        "properties": {"name": {"type": "string"}, "pets": {"type": "array", "items": PERSON}},
    }
    out = strict_objects(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["pets"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the caller's schema is not changed


@pytest.mark.parametrize(
    "schema",
    [
        {**PERSON, "additionalProperties": True},
        {**PERSON, "additionalProperties": {"type": "integer"}},
        {**PERSON, "patternProperties": {"^x_": {}}},
        {**PERSON, "unevaluatedProperties": False},
        {**PERSON, "required": ["name", "age"]},  # age only through additional properties
        {**PERSON, "allOf": [{"properties": {"age": {}}}]},  # properties composed from elsewhere
        {**PERSON, "anyOf": [{"properties": {"age": {}}}, {"properties": {"id": {}}}]},
        {**PERSON, "$ref": "#/$defs/base", "$defs": {"base": {"type": "object"}}},
        {**PERSON, "if": {"properties": {"name": {"const": "x"}}}, "then": {"required": ["a"]}},
        {"type": "object"},  # lists no properties: any object
    ],
)
def test_objects_that_say_otherwise_stay_open(schema: dict) -> None:
    assert strict_objects(schema).get("additionalProperties") == schema.get("additionalProperties")


def test_closed_spec() -> None:
    spec = closed_spec(StructuredOutputSpec.json_schema(PERSON, "response_format"))
    assert json.loads(spec.value) == {**PERSON, "additionalProperties": False}
    assert spec.field == "response_format"
    same = StructuredOutputSpec.json_schema({"type": "object"})
    assert closed_spec(same) is same
    regex = StructuredOutputSpec("regex", "a+", "guided_regex")
    assert closed_spec(regex) is regex
