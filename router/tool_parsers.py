"""Tool calls in model text: parsers per template family, streaming, and tool-choice schemas.

A chat model asked to call a function writes the call as text in its template family's format;
a parser turns that text into OpenAI ``tool_calls`` and the remaining ``content``:

* ``hermes`` (Hermes 2 Pro, Qwen2.5, and templates that copy them): each call is a JSON object
  ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``; text outside
  the tags is content.
* ``json``: the whole output is one JSON call object or a JSON array of them (``arguments`` or
  ``parameters`` for the arguments) — what a model without special markup writes, and the shape
  the ``required`` tool choice is constrained to.

A call whose JSON does not parse, or lacks a string ``name``, stays in the content: nothing the
model wrote is lost. :func:`select_parser` picks ``hermes`` when the chat template mentions
``<tool_call>`` and ``json`` otherwise, unless ``--tool-call-parser`` names one.

Streaming (:class:`StreamingToolParser`): content is passed on as it arrives, holding back only
text that may be the start of a ``<tool_call>`` tag; a call is emitted whole (id, name and full
``arguments``) once its closing tag arrives, which OpenAI's streaming format allows (clients
concatenate ``arguments`` fragments, here one fragment).

Tool-choice schemas (:func:`required_schema`, :func:`named_schema`): ``required`` constrains the
output to a JSON array of calls to the offered functions, each validated against its parameters
(one item when ``parallel_tool_calls`` is false); a named function constrains the output to that
function's arguments object. Torch-free.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve import json_text

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_PARSERS = ("hermes", "json")


@dataclass(frozen=True)
class ToolCall:
    """One parsed call. ``arguments``: a JSON object as text (OpenAI's wire form)."""

    name: str
    arguments: str
    id: str = ""

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        """The OpenAI ``tool_calls`` entry (with ``index`` for a streamed delta)."""
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return out if index is None else {"index": index, **out}


@dataclass(frozen=True)
class ParsedOutput:
    """A completion split into ``content`` (None when only calls remain) and ``tool_calls``."""

    content: str | None
    tool_calls: tuple[ToolCall, ...]


def new_call_id() -> str:
    """A fresh tool-call id in OpenAI's style (``call_`` + 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def call_from_json(obj: Any) -> ToolCall | None:
    """A ToolCall from a decoded JSON call object, or None when it is not one."""
    if not isinstance(obj, Mapping) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text already
        try:
            args = json_text.loads(args)
        except ValueError:
            return None
    if not isinstance(args, Mapping):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), new_call_id())


def _strip_fence(text: str) -> str:
    t = text.strip()
    if t.startswith("```"):
        t = t.split("\n", 1)[1] if "\n" in t else ""
        if t.rstrip().endswith("```"):
            t = t.rstrip()[:-3]
    return t.strip()


def parse_json_calls(text: str) -> list[ToolCall] | None:
    """Calls from text that is wholly a JSON call object or array of them; None otherwise."""
    try:
        obj = json_text.loads(_strip_fence(text))
    except ValueError:
        return None
    items = obj if isinstance(obj, list) else [obj]
    calls = [call_from_json(o) for o in items]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


def parse(parser: str, text: str, parallel: bool = True) -> ParsedOutput:
    """Split ``text`` with the named parser (one of TOOL_PARSERS). ``parallel``: keep every
    call (False keeps the first). Raises ValueError for an unknown parser name."""
    if parser == "json":
        calls = parse_json_calls(text)
        if calls is None:
            return ParsedOutput(text, ())
        return ParsedOutput(None, tuple(calls if parallel else calls[:1]))
    if parser != "hermes":
        raise ValueError(f"unknown tool call parser {parser!r}; one of {TOOL_PARSERS}")
    stream = StreamingToolParser("hermes", parallel)
    content, calls = stream.feed(text)
    more_content, more_calls = stream.finish()
    content += more_content
    return ParsedOutput(content if content.strip() else None, tuple(calls + more_calls))


class StreamingToolParser:
    """Incremental :func:`parse` for one choice: :meth:`feed` text pieces, then :meth:`finish`.
    Each returns (content to send now, calls completed now)."""

    def __init__(self, parser: str, parallel: bool = True) -> None:
        if parser not in TOOL_PARSERS:
            raise ValueError(f"unknown tool call parser {parser!r}; one of {TOOL_PARSERS}")
        self.parser = parser
        self.parallel = parallel
        self._buf = ""  # text not yet passed on
        self._in_call = False
        self._json_mode: bool | None = None  # json parser: output starts like JSON
        self.num_calls = 0

    def _take(self, calls: list[ToolCall]) -> list[ToolCall]:
        if not self.parallel:
            calls = calls[: max(0, 1 - self.num_calls)]
        self.num_calls += len(calls)
        return calls

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Consume ``text``; return the content that is certainly not a call, and new calls."""
        self._buf += text
        if self.parser == "json":
            if self._json_mode is None and self._buf.strip():
                self._json_mode = self._buf.lstrip()[0] in "{[`"
            if self._json_mode is False:
                out, self._buf = self._buf, ""
                return out, []
            return "", []
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self._in_call:
                end = self._buf.find(TOOL_CALL_END)
                if end < 0:
                    break
                body, self._buf = self._buf[:end], self._buf[end + len(TOOL_CALL_END) :]
                self._in_call = False
                call = parse_json_calls(body)
                if call is None:  # not a call after all: keep the text
                    content.append(TOOL_CALL_START + body + TOOL_CALL_END)
                else:
                    calls.extend(call)
                continue
            start = self._buf.find(TOOL_CALL_START)
            if start < 0:
                keep = _partial_tag_len(self._buf, TOOL_CALL_START)
                content.append(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                break
            content.append(self._buf[:start])
            self._buf = self._buf[start + len(TOOL_CALL_START) :]
            self._in_call = True
        return "".join(content), self._take(calls)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """End of output: parse what is held (an unclosed call, JSON output) or release it."""
        buf, self._buf = self._buf, ""
        if self.parser == "json":
            if not self._json_mode:
                return buf, []
            calls = parse_json_calls(buf)
            return ("", self._take(calls)) if calls is not None else (buf, [])
        if self._in_call:
            self._in_call = False
            calls = parse_json_calls(buf)
            if calls is not None:
                return "", self._take(calls)
            return TOOL_CALL_START + buf, []
        return buf, []


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def select_parser(requested: str | None, chat_template: str | None) -> str:
    """The parser to use: ``requested`` when given (validated), else ``hermes`` for templates
    that mention ``<tool_call>``, else ``json``. Raises ValueError for an unknown name."""
    if requested and requested != "auto":
        if requested not in TOOL_PARSERS:
            raise ValueError(f"unknown tool call parser {requested!r}; one of {TOOL_PARSERS}")
        return requested
    return "hermes" if chat_template and TOOL_CALL_START in chat_template else "json"


def _parameters(tool: Mapping[str, Any]) -> dict[str, Any]:
    """The tool's parameters schema as the output constraint takes it: :func:`strict_objects`
    (an object schema that names its properties admits only those unless it says otherwise)."""
    params = tool["function"].get("parameters")
    if not isinstance(params, Mapping):
        return {"type": "object", "properties": {}, "additionalProperties": False}
    out = strict_objects(params)
    assert isinstance(out, dict)
    return out


# where a JSON schema holds subschemas that describe a value on their own (not allOf: its branches
# describe one object together, so a branch may not refuse another branch's properties)
_ONE_SCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def strict_objects(schema: Any) -> Any:
    """A copy of JSON schema ``schema`` in which every object schema that lists ``properties``
    and says nothing of others (no ``additionalProperties``, ``unevaluatedProperties`` or
    ``patternProperties``) gets ``additionalProperties: false``, through its nested schemas
    (except ``allOf`` branches). So a constrained tool call holds the declared arguments only:
    left open, a small model fills an argument object with invented keys (one run repeated a
    "description" key until max_tokens). xgrammar, vLLM's default structured-output backend,
    compiles schemas the same way by default (its strict mode); OpenAI's strict function calling
    requires ``additionalProperties: false`` outright."""
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
    open_keys = ("additionalProperties", "unevaluatedProperties", "patternProperties")
    if isinstance(out.get("properties"), Mapping) and not any(k in out for k in open_keys):
        out["additionalProperties"] = False
    return out


def required_schema(tools: Sequence[Mapping[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """JSON schema of ``tool_choice: "required"``: an array (>= 1 item; exactly 1 unless
    ``parallel``) of ``{"name", "arguments"}`` calls, each naming an offered function and
    matching its parameters. ``tools``: validated OpenAI tool definitions."""
    variants = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "arguments": _parameters(t),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    items = variants[0] if len(variants) == 1 else {"anyOf": variants}
    schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def named_schema(tool: Mapping[str, Any]) -> dict[str, Any]:
    """JSON schema of a named ``tool_choice``: that function's arguments object."""
    return _parameters(tool)
