"""Tool calls in model text: parsers per template family, streaming, and tool-choice schemas.

A chat model asked to call a function writes the call as text in its template family's format;
a parser turns that text into OpenAI ``tool_calls`` and the remaining ``content``:

* ``hermes`` (Hermes 2 Pro, Qwen2.5, and templates that copy them): each call is a JSON object
  ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``; text outside
  the tags is content.
* ``json``: the whole output is one JSON call object or a JSON array of them (``arguments`` or
  ``parameters`` for the arguments) — what a model without special markup writes, and the shape
  the ``required`` tool choice is constrained to. Without tags to mark a call, ``auto`` takes
  an object for a call only when it names an offered function.

An object at the call level (the body's own object, or an array's items) with a string
``name`` is a call; its ``arguments`` (or ``parameters``) is the call's arguments, and a call
without them has ``{}``. A region in which no call is found (text that is not JSON, JSON with
no ``name``) stays in the content: nothing the model wrote is lost. :func:`select_parser` picks
``hermes`` when the chat template mentions ``<tool_call>`` and ``json`` otherwise, unless
``--tool-call-parser`` names one.

Streaming (:class:`StreamingToolParser`): content is passed on as it arrives, holding back only
text that may be the start of a ``<tool_call>`` tag; a call is passed on as it is generated, as
vLLM's tool parsers and OpenAI's streaming format do: its id and name once the name is complete,
then its arguments text piece by piece (clients concatenate the ``arguments`` fragments). The
whole-text :func:`parse` runs the same parser, so both add up to the same calls.

Tool-choice schemas (:func:`required_schema`, :func:`named_schema`): ``required`` constrains the
output to a JSON array of calls to the offered functions, each validated against its parameters
(one item when ``parallel_tool_calls`` is false); a named function constrains the output to that
function's arguments object. Torch-free.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pdserve import json_text
from pdserve.structured.strict import strict_objects

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


def parse(
    parser: str, text: str, parallel: bool = True, names: Collection[str] | None = None
) -> ParsedOutput:
    """Split ``text`` with the named parser (one of TOOL_PARSERS): :class:`StreamingToolParser`
    fed the whole text, so a streamed response adds up to the same calls. ``parallel``: keep
    every call (False keeps the first); ``names``: when given, only an object naming one of
    these functions is a call. Raises ValueError for an unknown parser name."""
    stream = StreamingToolParser(parser, parallel, names)
    content, deltas = stream.feed(text)
    more, late = stream.finish()
    content += more
    return ParsedOutput(content if content.strip() else None, tuple(join_deltas(deltas + late)))


@dataclass(frozen=True)
class CallDelta:
    """A piece of one streamed call: ``arguments`` text to append to call ``index``; the call's
    first delta also carries its ``id`` and ``name``."""

    index: int
    arguments: str
    name: str | None = None
    id: str | None = None

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI streamed ``tool_calls`` entry: id, type and name on a call's first."""
        fn: dict[str, Any] = {"arguments": self.arguments}
        if self.name is None:
            return {"index": self.index, "function": fn}
        fn = {"name": self.name, **fn}
        return {"index": self.index, "id": self.id, "type": "function", "function": fn}


def join_deltas(deltas: Sequence[CallDelta]) -> list[ToolCall]:
    """The whole calls a delta stream adds up to, in index order, each call's arguments the
    concatenation of its pieces: the text as generated, so a streamed call and the whole
    response's carry the same bytes."""
    calls: dict[int, list[Any]] = {}
    for d in deltas:
        if d.name is not None:
            calls[d.index] = [d.name, d.id or "", []]
        calls[d.index][2].append(d.arguments)
    return [ToolCall(name, "".join(pieces), call_id) for name, call_id, pieces in
            (calls[i] for i in sorted(calls))]  # fmt: skip


@dataclass
class _Call:
    """One call object being read: its name and arguments value as written (JSON text)."""

    name_raw: list[str] = field(default_factory=list)
    name: str | None = None
    args_raw: list[str] = field(default_factory=list)
    args_kind: str = ""  # "" (none yet), "box" (object/array), "str" or "scalar"
    args_closed: bool = False
    closed: bool = False
    done: bool = False  # its arguments passed on in full
    index: int | None = None  # the stream's call index once it is passed on
    sent: int = 0  # characters of args_raw passed on


class _CallScanner:
    """Call objects in JSON text that grows piece by piece (one hermes ``<tool_call>`` body, or
    the json parser's whole output): a call object, an array of them, or several in a row,
    optionally in a ``` fence. An object at that level with a string ``name`` is a call; its
    ``arguments`` (or ``parameters``, whichever comes first) value is kept as written, so it can
    be passed on while it grows. A character-level JSON lexer (strings, escapes, nesting):
    O(1) per character, so a long call costs no re-parse per token."""

    def __init__(self) -> None:
        self.objects: list[_Call] = []  # call-level objects, named or not (yet)
        self.is_json: bool | None = None  # None until the first non-space character
        self._fence = False  # skipping a fence's opening line
        self._stack: list[str] = []
        self._in_str = False
        self._esc = False
        self._call: _Call | None = None  # the call-level object open now
        self._depth = 0  # len(_stack) inside it
        self._expect = ""  # at the call level: "key", "colon", "value", "in" (a value), "comma"
        self._key: list[str] | None = None  # the key being read, as written
        self._last_key = ""
        self._sink: list[str] | None = None  # where the captured value's characters go
        self._sink_kind = ""

    def feed(self, text: str) -> None:
        for ch in text:
            self._char(ch)

    def _level(self) -> bool:
        return self._call is not None and len(self._stack) == self._depth

    def _put(self, ch: str) -> None:
        if self._sink is not None:
            self._sink.append(ch)
        if self._key is not None:
            self._key.append(ch)

    def _char(self, ch: str) -> None:
        if self.is_json is False:
            return
        if self._fence:
            self._fence = ch != "\n"
            return
        if self.is_json is None:
            if ch.isspace():
                return
            if ch == "`":
                self._fence = True
                return
            self.is_json = ch in "{["
            if not self.is_json:
                return
        if self._in_str:
            self._put(ch)
            if self._esc:
                self._esc = False
            elif ch == "\\":
                self._esc = True
            elif ch == '"':
                self._in_str = False
                if self._level():
                    self._string_end()
            return
        if self._sink_kind == "scalar" and (ch.isspace() or ch in ",}]"):
            self._value_end()
        if ch.isspace():
            self._put(ch)
            return
        if self._level() and self._expect == "value":
            self._value_start(ch)
        self._put(ch)
        if ch == '"':
            self._in_str = True
            if self._level() and self._expect == "key":
                self._key = ['"']
        elif ch in "{[":
            self._stack.append(ch)
            top = self._stack[0] == "[" and len(self._stack) == 2
            if ch == "{" and self._call is None and (len(self._stack) == 1 or top):
                self._call = _Call()
                self.objects.append(self._call)
                self._depth = len(self._stack)
                self._expect = "key"
        elif ch in "}]":
            if self._stack:
                self._stack.pop()
            if self._sink_kind == "box" and self._level():
                self._value_end()
            elif self._call is not None and len(self._stack) < self._depth:
                self._call.closed = True
                self._call = None
        elif self._level() and ch == ":" and self._expect == "colon":
            self._expect = "value"
        elif self._level() and ch == ",":
            self._expect = "key"

    def _string_end(self) -> None:
        assert self._call is not None
        if self._key is not None:
            raw, self._key = "".join(self._key), None
            self._last_key = _decode(raw) or ""
            self._expect = "colon"
        elif self._sink_kind == "str":
            if self._sink is self._call.name_raw:
                name = _decode("".join(self._call.name_raw))
                ok = isinstance(name, str) and name and _is_utf8(name)
                self._call.name = name if ok else None
            self._value_end()

    def _value_start(self, ch: str) -> None:
        assert self._call is not None
        if ch in ",}]":
            return  # a key without a value (malformed): nothing to capture
        self._expect = "in"
        key, call = self._last_key, self._call
        if key == "name" and ch == '"' and call.name is None and not call.name_raw:
            self._sink, self._sink_kind = call.name_raw, "str"
        elif key in ("arguments", "parameters") and not call.args_kind:
            kind = "str" if ch == '"' else "box" if ch in "{[" else "scalar"
            self._sink, self._sink_kind, call.args_kind = call.args_raw, kind, kind

    def _value_end(self) -> None:
        if self._call is not None and self._sink is self._call.args_raw:
            self._call.args_closed = True
        self._sink, self._sink_kind, self._expect = None, "", "comma"


def _decode(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None


class StreamingToolParser:
    """Incremental :func:`parse` for one choice: :meth:`feed` text pieces, then :meth:`finish`.
    Each returns (content to send now, :class:`CallDelta` s now).

    A call is passed on as it is generated: its first delta (id and name) once its ``name``
    string is complete, then its ``arguments`` text piece by piece as written (an arguments
    value written as a JSON string is decoded and passed on whole when it closes; one that is
    not valid JSON text, or holds a lone surrogate escape, is passed on as written). A hermes
    call ends at the first ``</tool_call>``, even one inside a JSON string. So the calls
    a stream adds up to (:func:`join_deltas`) are the whole parse's, whatever the cuts: a call
    cut off by max_tokens keeps the arguments generated, and an array's items or trailing text
    that are not calls are dropped once a region holds a call. A region in which no call was
    found is content, as written (the tags included). ``names``: when given, an object whose
    name is not one of them is not a call (the json parser's guard against JSON content that
    happens to have a ``name`` key, such as a person record)."""

    def __init__(
        self, parser: str, parallel: bool = True, names: Collection[str] | None = None
    ) -> None:
        if parser not in TOOL_PARSERS:
            raise ValueError(f"unknown tool call parser {parser!r}; one of {TOOL_PARSERS}")
        self.parser = parser
        self.parallel = parallel
        self.names = names
        self._buf = ""  # hermes: text not yet passed on or scanned
        self._region: list[str] = []  # the open call region's text (its fallback content)
        self._scanner: _CallScanner | None = None  # the open call region, if any
        self._settled = 0  # the region's objects before this one are passed on in full
        self._held = ""  # whitespace content held until content with text arrives
        self._spoken = False  # content with text was passed on
        self.num_calls = 0
        if parser == "json":
            self._scanner = _CallScanner()

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        """Consume ``text``; return the content that is certainly not a call, and call deltas.
        Content that is only whitespace is held until content with text follows (the whole
        parse has no content at all when it is only whitespace)."""
        content, deltas = self._feed(text)
        return self._say(content, final=False), deltas

    def finish(self) -> tuple[str, list[CallDelta]]:
        """End of output: close what is open (an unclosed call, JSON output) or release it."""
        content, deltas = self._finish()
        return self._say(content, final=True), deltas

    def _say(self, content: str, final: bool) -> str:
        if self._spoken:
            return content
        self._held += content
        if not self._held.strip():
            if final:
                self._held = ""
            return ""
        out, self._held, self._spoken = self._held, "", True
        return out

    def _feed(self, text: str) -> tuple[str, list[CallDelta]]:
        if self.parser == "json":
            return self._feed_json(text)
        self._buf += text
        content: list[str] = []
        deltas: list[CallDelta] = []
        while True:
            if self._scanner is not None:
                end = self._buf.find(TOOL_CALL_END)
                cut = (
                    end if end >= 0 else len(self._buf) - _partial_tag_len(self._buf, TOOL_CALL_END)
                )
                self._scan(self._buf[:cut], deltas)
                self._buf = self._buf[cut:]
                if end < 0:
                    break
                self._buf = self._buf[len(TOOL_CALL_END) :]
                content.append(self._close_region(deltas, TOOL_CALL_END))
                continue
            start = self._buf.find(TOOL_CALL_START)
            if start < 0:
                keep = _partial_tag_len(self._buf, TOOL_CALL_START)
                content.append(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                break
            content.append(self._buf[:start])
            self._buf = self._buf[start + len(TOOL_CALL_START) :]
            self._scanner, self._region, self._settled = _CallScanner(), [TOOL_CALL_START], 0
        return "".join(content), _merge(deltas)

    def _finish(self) -> tuple[str, list[CallDelta]]:
        deltas: list[CallDelta] = []
        if self.parser == "json":
            content = self._close_region(deltas, "") if self._scanner is not None else ""
            return content, _merge(deltas)
        buf, self._buf = self._buf, ""
        if self._scanner is None:
            return buf, []
        self._scan(buf, deltas)
        return self._close_region(deltas, ""), _merge(deltas)

    def _feed_json(self, text: str) -> tuple[str, list[CallDelta]]:
        scanner = self._scanner
        if scanner is None:  # output that did not start like JSON: content
            return text, []
        deltas: list[CallDelta] = []
        self._scan(text, deltas)
        if scanner.is_json is False:
            self._scanner = None
            return "".join(self._region), []
        return "", _merge(deltas)

    def _scan(self, text: str, deltas: list[CallDelta]) -> None:
        assert self._scanner is not None
        self._region.append(text)
        self._scanner.feed(text)
        self._pass_on(deltas, final=False)

    def _pass_on(self, deltas: list[CallDelta], final: bool) -> None:
        """Deltas for what the open region's calls gained; ``final``: the region ended."""
        assert self._scanner is not None
        objects = self._scanner.objects
        for call in objects[self._settled :]:
            if call.name is not None and self.names is not None and call.name not in self.names:
                call.name = None  # names no offered function: not a call
            if call.name is None:
                if call.closed or final:
                    continue  # not a call
                break  # its name may come yet: later calls wait for it
            if call.index is None:
                if not self.parallel and self.num_calls:
                    continue
                call.index = self.num_calls
                self.num_calls += 1
                deltas.append(CallDelta(call.index, "", call.name, new_call_id()))
            piece = _args_piece(call, final)
            if piece:
                deltas.append(CallDelta(call.index, piece))
        while self._settled < len(objects) and objects[self._settled].closed:
            self._settled += 1  # a closed object has nothing more to pass on

    def _close_region(self, deltas: list[CallDelta], tag: str) -> str:
        """End the open region: its calls' last deltas, or its text as content when it held
        no call (``tag``: the closing tag that ended it, if any)."""
        assert self._scanner is not None
        self._pass_on(deltas, final=True)
        held_call = any(o.name is not None for o in self._scanner.objects)
        region, self._region, self._scanner = "".join(self._region) + tag, [], None
        return "" if held_call else region


def _args_piece(call: _Call, final: bool) -> str:
    """What ``call``'s arguments gained since last passed on ("" when nothing yet): an object
    streams as written; a JSON-string value is decoded (and re-serialised when it holds a JSON
    object) once it closes; no arguments at all is ``{}`` once the call ends."""
    if call.done:
        return ""
    if call.args_kind == "box":
        piece = "".join(call.args_raw[call.sent :])
        call.sent, call.done = len(call.args_raw), call.args_closed
        return piece
    if not (call.args_closed or call.closed or final):
        return ""
    call.done = True
    raw = "".join(call.args_raw)
    if call.args_kind == "str" and call.args_closed:
        text = _decode(raw)
        if not isinstance(text, str) or not _is_utf8(text):
            return raw  # not a valid JSON string (a raw newline), or a lone surrogate escape
        try:
            obj = json_text.loads(text)
        except ValueError:
            return text
        out = json.dumps(obj, ensure_ascii=False) if isinstance(obj, Mapping) else text
        return out if _is_utf8(out) else json.dumps(obj)  # escapes what UTF-8 cannot carry
    return raw if call.args_kind else "{}"


def _is_utf8(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (holds no lone surrogate, which a JSON ``\\ud800``
    escape decodes to and no response could carry)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _merge(deltas: list[CallDelta]) -> list[CallDelta]:
    """Consecutive deltas of one call as one (a call's header and first pieces in one entry)."""
    out: list[CallDelta] = []
    for d in deltas:
        if out and out[-1].index == d.index and d.name is None:
            out[-1] = replace(out[-1], arguments=out[-1].arguments + d.arguments)
        else:
            out.append(d)
    return out


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


def required_schema(tools: Sequence[Mapping[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """JSON schema of ``tool_choice: "required"``: an array (>= 1 item; exactly 1 unless
    ``parallel``) of ``{"name", "arguments"}`` calls, each naming an offered function and
    matching its parameters. ``tools``: validated OpenAI tool definitions. A parameters schema
    that refers into itself (``$defs``, ``#`` recursion, as pydantic writes nested models) moves
    to the array schema's ``$defs`` with its references rebased, so they still mean its own.
    (Anchors and ``$id`` bases inside a tool are not rebased.)"""
    defs: dict[str, Any] = {}
    variants = []
    for i, t in enumerate(tools):
        params = _parameters(t)
        if _has_local_ref(params):  # its "#..." refs mean its own root: hoist it, rebased
            key = f"pdserve_tool_{i}"
            defs[key] = _rebase_refs(params, f"#/$defs/{key}")
            params = {"$ref": f"#/$defs/{key}"}
        variants.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t["function"]["name"]]},
                    "arguments": params,
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    items = variants[0] if len(variants) == 1 else {"anyOf": variants}
    schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if defs:
        schema["$defs"] = defs
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _has_local_ref(node: Any) -> bool:
    """Whether JSON schema ``node`` holds a ``$ref`` into its own document ("#...")."""
    if isinstance(node, Mapping):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            return True
        return any(_has_local_ref(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_local_ref(v) for v in node)
    return False


def _rebase_refs(node: Any, base: str) -> Any:
    """A copy of ``node`` whose JSON-pointer ``$ref`` s ("#", "#/...") point into ``base`` (a
    pointer to where ``node`` now sits in a larger document)."""
    if isinstance(node, list):
        return [_rebase_refs(v, base) for v in node]
    if not isinstance(node, Mapping):
        return node
    out = {k: _rebase_refs(v, base) for k, v in node.items()}
    ref = out.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = base + ref[1:]
    return out


def named_schema(tool: Mapping[str, Any]) -> dict[str, Any]:
    """JSON schema of a named ``tool_choice``: that function's arguments object."""
    return _parameters(tool)
