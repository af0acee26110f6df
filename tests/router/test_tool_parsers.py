"""Tool-call parsers (hermes, json), streaming equals whole-text parsing, tool-choice schemas."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.tool_parsers import (
    StreamingToolParser,
    named_schema,
    parse,
    required_schema,
    select_parser,
)

pytestmark = pytest.mark.timeout(60)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}

HERMES = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)


def _calls(out) -> list[tuple[str, dict]]:  # type: ignore[no-untyped-def]
    return [(c.name, json.loads(c.arguments)) for c in out.tool_calls]


def test_hermes_calls_and_content() -> None:
    out = parse("hermes", HERMES)
    assert out.content == "Let me check.\n\n"
    assert _calls(out) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(c.id.startswith("call_") for c in out.tool_calls)
    assert len({c.id for c in out.tool_calls}) == 2
    assert _calls(parse("hermes", HERMES, parallel=False)) == [("get_weather", {"city": "Paris"})]


def test_hermes_keeps_what_is_not_a_call() -> None:
    assert parse("hermes", "plain answer") == parse("json", "plain answer")
    assert parse("hermes", "plain answer").content == "plain answer"
    bad = "x <tool_call>{not json}</tool_call> y"
    out = parse("hermes", bad)
    assert out.tool_calls == () and out.content == bad
    # an unclosed call at the end (EOS before the closing tag) still parses
    out = parse("hermes", '<tool_call>{"name": "get_time", "arguments": {}}')
    assert _calls(out) == [("get_time", {})] and out.content is None
    out = parse("hermes", '<tool_call>{"name": ')
    assert out.tool_calls == () and out.content == '<tool_call>{"name": '


def test_json_parser() -> None:
    assert _calls(parse("json", '{"name": "get_time", "parameters": {}}')) == [("get_time", {})]
    arr = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time"}]'
    assert _calls(parse("json", arr)) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    fenced = '```json\n{"name": "get_time", "arguments": "{}"}\n```'
    assert _calls(parse("json", fenced)) == [("get_time", {})]
    for text in ('{"city": "Oslo"}', "[1, 2]", "hello", '{"name": 3}'):
        out = parse("json", text)
        assert out.tool_calls == () and out.content == text


@settings(max_examples=60, deadline=None)
@given(
    cuts=st.lists(st.integers(0, len(HERMES)), max_size=12),
    parser=st.sampled_from(["hermes", "json"]),
)
def test_streaming_equals_whole(cuts: list[int], parser: str) -> None:
    for text in (HERMES, '[{"name": "get_time", "arguments": {}}]', "no calls <tool_ here"):
        bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
        s = StreamingToolParser(parser)
        content, names = "", []
        for a, b in zip(bounds, bounds[1:], strict=False):
            c, calls = s.feed(text[a:b])
            content += c
            names += [(x.name, x.arguments) for x in calls]
        c, calls = s.finish()
        content += c
        names += [(x.name, x.arguments) for x in calls]
        whole = parse(parser, text)
        assert (content if content.strip() else None) == whole.content
        assert names == [(x.name, x.arguments) for x in whole.tool_calls]


def test_streaming_holds_back_only_a_possible_tag() -> None:
    s = StreamingToolParser("hermes")
    assert s.feed("Hello <tool") == ("Hello ", [])
    assert s.feed("box> done") == ("<toolbox> done", [])


def test_select_parser() -> None:
    assert select_parser(None, "... <tool_call> ...") == "hermes"
    assert select_parser("auto", "{{ messages }}") == "json"
    assert select_parser("json", "<tool_call>") == "json"
    with pytest.raises(ValueError, match="mistral"):
        select_parser("mistral", None)


def test_tool_choice_schemas_validate_calls() -> None:
    schema = required_schema([WEATHER, TIME])
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [
        {"name": "get_weather", "arguments": {"city": "Rome"}},
        {"name": "get_time", "arguments": {}},
    ]
    jsonschema.validate(good, schema)
    for bad in (
        [],
        [{"name": "nope", "arguments": {}}],
        [{"name": "get_weather", "arguments": {}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = required_schema([WEATHER], parallel=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good[:1] * 2, one)
    jsonschema.validate({"city": "Rome", "days": 2}, named_schema(WEATHER))
    assert named_schema(TIME) == {"type": "object", "properties": {}, "additionalProperties": False}


def test_tool_arguments_hold_only_the_declared_properties() -> None:
    """A parameters schema that lists properties and says nothing of others admits only those
    (xgrammar's default, vLLM's usual backend), through nested objects, arrays, $defs and
    anyOf; a schema that opens itself (additionalProperties, patternProperties) stays open, and
    allOf branches are left alone (they describe one object together)."""
    params = {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
            "stops": {"type": "array", "items": {"$ref": "#/$defs/stop"}},
            "any": {"anyOf": [{"type": "object", "properties": {"a": {}}}, {"type": "null"}]},
            "tags": {
                "type": "object",
                "properties": {},
                "additionalProperties": {"type": "string"},
            },
            "both": {"allOf": [{"properties": {"x": {}}}, {"properties": {"y": {}}}]},
        },
        "$defs": {"stop": {"type": "object", "properties": {"name": {"type": "string"}}}},
    }
    tool = {"type": "function", "function": {"name": "trip", "parameters": params}}
    schema = named_schema(tool)
    good = {"city": "Rome", "where": {"lat": 1.5}, "stops": [{"name": "a"}], "any": {"a": 1},
            "tags": {"k": "v"}, "both": {"x": 1, "y": 2}}  # fmt: skip
    jsonschema.validate(good, schema)
    for bad in (
        {"city": "Rome", "description": "sunny"},
        {"where": {"lat": 1, "lon": 2}},
        {"stops": [{"name": "a", "extra": 1}]},
        {"any": {"a": 1, "b": 2}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert params["properties"]["where"] == {  # type: ignore[index]
        "type": "object",
        "properties": {"lat": {"type": "number"}},
    }  # the request's own schema is not changed
    (variant,) = [required_schema([tool])["items"]]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "trip", "arguments": {"nope": 1}}, variant)
