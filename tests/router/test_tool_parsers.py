"""Tool-call parsers (hermes, json), streaming equals whole-text parsing, tool-choice schemas."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.tool_parsers import (
    StreamingToolParser,
    join_deltas,
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


CUT_TEXTS = (
    HERMES,
    '[{"name": "get_time", "arguments": {}}]',
    "no calls <tool_ here",
    '<tool_call>{"arguments": {"city": "Nice"}, "name": "get_weather"}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Lyon\\"}"}</tool_call>',
    '<tool_call>{"name": "get_w\\u00e9ather", "arguments": {"q": "}</tool_call>{\\""}}',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',
    '```json\n[{"name": "get_time"}, {"name": "get_weather", "parameters": {"days": [1, 2]}}]\n```',
    '{"name": "get_time", "arguments": }xyz',
    '{"name": "get_time", "arguments": ]abc, "b": 1}',
    '<tool_call>{"name": "get_time"}</tool_call>\n<tool_call>{"name": "get_time"}</tool_call>\n',
    '\n  <tool_call>{"name": "get_time", "arguments": "a\nb"}</tool_call>',
)


def _run(parser: str, text: str, bounds: list[int], parallel: bool = True):  # type: ignore[no-untyped-def]
    s = StreamingToolParser(parser, parallel)
    content, deltas = "", []
    for a, b in zip(bounds, bounds[1:], strict=False):
        c, d = s.feed(text[a:b])
        content, deltas = content + c, deltas + d
    c, d = s.finish()
    return content + c, deltas + d


@settings(max_examples=80, deadline=None)
@given(
    cuts=st.lists(st.integers(0, 200), max_size=12),
    parser=st.sampled_from(["hermes", "json"]),
    parallel=st.booleans(),
)
def test_streaming_equals_whole(cuts: list[int], parser: str, parallel: bool) -> None:
    """However the output is cut into pieces, the stream adds up to the whole parse: the same
    content and calls, each call's first delta naming it and the rest only adding arguments."""
    for text in CUT_TEXTS:
        bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
        content, deltas = _run(parser, text, bounds, parallel)
        whole = parse(parser, text, parallel)
        assert content == (whole.content or "")  # whitespace-only content is not sent
        joined = join_deltas(deltas)
        assert [(c.name, c.arguments) for c in joined] == [
            (c.name, c.arguments) for c in whole.tool_calls
        ]
        seen: set[int] = set()
        for d in deltas:
            assert (d.name is not None) == (d.index not in seen), deltas
            seen.add(d.index)
        assert sorted(seen) == list(range(len(seen)))


def test_calls_stream_as_generated() -> None:
    """A call's id and name go out once the name is complete, its arguments piece by piece as
    written (token-sized pieces, as a model generates them)."""
    text = (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}</tool_call>'
    )
    s = StreamingToolParser("hermes")
    out = [s.feed(text[i : i + 4]) for i in range(0, len(text), 4)] + [s.finish()]
    deltas = [d for _, ds in out for d in ds]
    assert all(c == "" for c, _ in out)
    first = deltas[0]
    assert first.name == "get_weather" and first.id and first.id.startswith("call_")
    assert len(deltas) > 5  # the arguments came in many pieces, not whole at the end
    assert "".join(d.arguments for d in deltas) == '{"city": "Paris", "days": 3}'
    # the header went out before the arguments were complete
    pieces_before = [i for i, (_, ds) in enumerate(out) if ds][0]
    assert pieces_before < len(text) // 4 // 2
    wire = first.to_openai()
    assert wire["type"] == "function" and wire["function"]["name"] == "get_weather"
    assert deltas[1].to_openai() == {"index": 0, "function": {"arguments": deltas[1].arguments}}


def test_cut_and_odd_calls() -> None:
    """A call cut off by max_tokens keeps the arguments generated; arguments written as JSON
    text are decoded; a call without arguments has {}; JSON that is not a call is content; with
    parallel_tool_calls false only the first call counts."""
    out = parse("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Ro')
    assert out.content is None and [(c.name, c.arguments) for c in out.tool_calls] == [
        ("get_weather", '{"city": "Ro')
    ]
    out = parse("json", '{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}')
    assert _calls(out) == [("get_time", {"tz": "UTC"})]
    out = parse("json", '[{"name": "get_time"}, {"name": "get_weather", "arguments": {"a": [1]}}]')
    assert _calls(out) == [("get_time", {}), ("get_weather", {"a": [1]})]
    assert _calls(parse("json", '[{"name": "get_time"}, {"name": "x"}]', parallel=False)) == [
        ("get_time", {})
    ]
    person = '{"name": "Ada", "born": 1815}'
    assert _calls(parse("json", person)) == [("Ada", {})]
    assert parse("json", person, names={"get_time"}).content == person
    both = '[{"name": "Ada"}, {"name": "get_time"}]'
    assert _calls(parse("json", both, names={"get_time"})) == [("get_time", {})]
    for text in ('{"city": "Oslo", "days": {"name": "x"}}', '[{"a": 1}]', "{broken"):
        out = parse("json", text)
        assert out.tool_calls == () and out.content == text


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
    sloppy = {"type": "object", "properties": {"a": {}}, "required": ["b"]}  # b undeclared
    assert named_schema({"function": {"name": "f", "parameters": sloppy}}) == sloppy
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "trip", "arguments": {"nope": 1}}], required_schema([tool]))


def test_auto_json_calls_must_name_a_tool() -> None:
    """tool_choice auto with the json parser (no markup): a JSON answer with a "name" key is
    content unless it names an offered function; required and hermes take any name."""
    from router.chat_tools import tool_setup

    person = '{"name": "Ada", "born": 1815}'
    auto = tool_setup([WEATHER, TIME], None, None, "json")
    assert auto is not None and auto.split(person).content == person
    call = '{"name": "get_time", "arguments": {}}'
    assert _calls(auto.split(call)) == [("get_time", {})]
    stream = auto.streamer()
    assert stream is not None
    assert stream.feed(person) == ("", []) and stream.finish() == (person, [])
    hermes = tool_setup([WEATHER], "auto", None, "hermes")
    assert hermes is not None and hermes.call_names is None


def test_odd_argument_strings_and_surrogates_never_raise() -> None:
    """Fault-tester findings: a JSON-string arguments value that is not valid JSON text (a raw
    newline, a bad escape) is kept as written; a lone surrogate escape, which no UTF-8 response
    can carry, never reaches the response decoded (a name holding one is no call)."""
    for raw in ('"a\nb"', '"\\q"'):
        text = '{"name": "get_time", "arguments": ' + raw + "}"
        (call,) = parse("json", text).tool_calls
        assert call.arguments == raw
    out = parse("json", '{"name": "get_time", "arguments": "{\\"city\\": \\"\\\\ud800\\"}"}')
    (call,) = out.tool_calls
    call.arguments.encode("utf-8")
    assert json.loads(call.arguments) == {"city": "\ud800"}
    out = parse("hermes", '<tool_call>{"name": "get_\\ud800", "arguments": {}}</tool_call>')
    assert out.tool_calls == () and out.content is not None
    out.content.encode("utf-8")
    (call,) = parse("hermes", '<tool_call>{"name": "f", "arguments": {"c": "\\udc00"}}').tool_calls
    assert call.arguments == '{"c": "\\udc00"}'


def test_many_calls_cost_linear_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each feed looks only at the calls still open (was: every call of the region on every
    feed, quadratic: 2000 calls fed 4 characters at a time took 4 s of the event loop)."""
    import router.tool_parsers as tp

    seen = [0]
    real = tp._args_piece

    def counting(call, final):  # type: ignore[no-untyped-def]
        seen[0] += 1
        return real(call, final)

    monkeypatch.setattr(tp, "_args_piece", counting)
    n = 1000
    text = (
        "[" + ",".join(f'{{"name": "get_time", "arguments": {{"i": {i}}}}}' for i in range(n)) + "]"
    )
    s = StreamingToolParser("json")
    deltas = []
    for i in range(0, len(text), 4):
        deltas += s.feed(text[i : i + 4])[1]
    deltas += s.finish()[1]
    assert len(join_deltas(deltas)) == n
    assert seen[0] < 20 * n
