"""A chat request's tools: validation, the tool choice's output constraint, and how its output
is split into content and ``tool_calls`` (whole or streamed).

``tool_choice`` (OpenAI): ``none`` (the template still sees the tools; the output is not
parsed), ``auto`` (default when tools are given: the model decides; its text is parsed by the
template family's parser), ``required`` (the output is constrained to a JSON array of calls,
:func:`router.tool_parsers.required_schema`) or ``{"type": "function", "function": {"name"}}``
(constrained to that function's arguments). ``parallel_tool_calls`` false keeps one call.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve import json_text
from pdserve.structured.spec import StructuredOutputSpec
from router.errors import BadRequest
from router.tool_parsers import (
    CallDelta,
    ParsedOutput,
    StreamingToolParser,
    ToolCall,
    named_schema,
    new_call_id,
    parse,
    required_schema,
)


def check_tools(tools: Sequence[Any]) -> list[dict[str, Any]]:
    """OpenAI tool definitions, validated. Raises BadRequest naming the field at fault
    (``tools[i].function.name`` ...), or ``tools`` when two define the same function name (a
    call names its function, so a name must pick one)."""
    out = []
    first: dict[str, int] = {}  # function name -> index of the tool that defines it
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, Mapping) else None
        if not isinstance(t, Mapping) or t.get("type", "function") != "function":
            raise BadRequest(
                f"'tools[{i}]' must be {{'type': 'function', ...}}", param=f"tools.{i}"
            )
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRequest(
                f"'tools[{i}].function.name' must be a non-empty string",
                param=f"tools.{i}.function.name",
            )
        params = fn.get("parameters")
        where = f"tools[{i}].function.parameters"
        if params is not None and not isinstance(params, Mapping):
            raise BadRequest(f"'{where}' must be an object", param=f"tools.{i}.function.parameters")
        try:
            json_text.check_depth(params)
        except ValueError as e:
            raise BadRequest(f"'{where}' is {e}", param=f"tools.{i}.function.parameters") from None
        name = fn["name"]
        if name in first:
            raise BadRequest(
                f"'tools' defines function {_shown(name)} twice (tools[{first[name]}] and "
                f"tools[{i}]); function names must be unique",
                param="tools",
            )
        first[name] = i
        out.append({"type": "function", "function": dict(fn)})
    return out


def check_tool_calls(calls: Sequence[Any], where: str, param: str) -> None:
    """An assistant message's ``tool_calls``, as OpenAI's API reference defines them: a list of
    ``{"id": str, "type": "function", "function": {"name": str, "arguments": str}}``
    (``arguments`` is the call's JSON text, as a response carries it). ``where`` and ``param``
    name the list as a message and as the error's ``param`` spell it (``messages[2].tool_calls``,
    ``messages.2.tool_calls``). Raises BadRequest naming the first field at fault, e.g.
    ``messages[2].tool_calls[0].function.name``."""
    if not isinstance(calls, Sequence) or isinstance(calls, (str, bytes)):
        raise BadRequest(f"'{where}' must be a list of tool calls", param=param)
    for j, call in enumerate(calls):
        at, at_param = f"{where}[{j}]", f"{param}.{j}"
        if not isinstance(call, Mapping):
            raise BadRequest(
                f"'{at}' must be an object {{'id', 'type': 'function', 'function'}}", param=at_param
            )
        if call.get("type") != "function":
            got = "it is missing" if "type" not in call else f"got {_shown(call['type'])}"
            raise BadRequest(f"'{at}.type' must be 'function' ({got})", param=f"{at_param}.type")
        if not isinstance(call.get("id"), str):
            got = "it is missing" if "id" not in call else f"got {json_text.json_type(call['id'])}"
            raise BadRequest(f"'{at}.id' must be a string ({got})", param=f"{at_param}.id")
        fn = call.get("function")
        if not isinstance(fn, Mapping):
            raise BadRequest(
                f"'{at}.function' must be an object {{'name', 'arguments'}}",
                param=f"{at_param}.function",
            )
        for key in ("name", "arguments"):
            if not isinstance(fn.get(key), str):
                got = "it is missing" if key not in fn else f"got {json_text.json_type(fn[key])}"
                raise BadRequest(
                    f"'{at}.function.{key}' must be a string ({got})",
                    param=f"{at_param}.function.{key}",
                )
        if not fn["name"]:
            raise BadRequest(
                f"'{at}.function.name' must not be empty", param=f"{at_param}.function.name"
            )


def _shown(value: Any) -> str:
    """A client's value for an error message, cut to 40 characters."""
    text = json.dumps(value) if isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else f"{text[:36]}..."


@dataclass(frozen=True)
class ToolSetup:
    """How one request uses tools. ``mode``: 'none' | 'auto' | 'required' | 'named'."""

    tools: tuple[dict[str, Any], ...]
    mode: str
    name: str | None
    parallel: bool
    parser: str

    def spec(self) -> StructuredOutputSpec | None:
        """The output constraint ``required`` and named choices need (None otherwise). Its field
        (what an error that it cannot be compiled names) is ``tools``: the tools' parameter
        schemas make it up."""
        if self.mode == "required":
            schema = required_schema(self.tools, self.parallel)
            return StructuredOutputSpec.json_schema(schema, "tools")
        if self.mode == "named":
            tool = next(t for t in self.tools if t["function"]["name"] == self.name)
            return StructuredOutputSpec.json_schema(named_schema(tool), "tools")
        return None

    def finish_reason(self, reason: str, made_calls: bool) -> str:
        """A choice's OpenAI ``finish_reason``: ``tool_calls`` in place of ``stop`` when it made
        calls, except under a named ``tool_choice``, which stays ``stop``. OpenAI's reference
        only says "tool_calls if the model called a tool", but its API answers a forced named
        function with ``stop`` (``auto`` and ``required`` with ``tool_calls``), streamed or
        not, and vLLM matches it (vllm-project/vllm PR 25054). ``length`` and the others pass
        through: a call cut short is not a finished call."""
        if reason == "stop" and made_calls and self.mode != "named":
            return "tool_calls"
        return reason

    def check_visible(self, template_renders_tools: bool) -> None:
        """Refuse ``auto`` when the chat template does not show the model its tools: the model
        would answer as if it had none, and nothing would tell the client. vLLM likewise refuses
        ``auto`` unless it was started with a tool parser for the model's template. ``required``
        and a named function still work (the output is constrained to the tools' schemas).
        Raises BadRequest naming ``tool_choice``."""
        if self.mode == "auto" and not template_renders_tools:
            raise BadRequest(
                "'tool_choice' 'auto' (the default with 'tools') needs a chat template that shows "
                "the model its tools, and this model's template ignores 'tools'; use 'required' "
                "or a named function (the output is then constrained to the tools' schemas), "
                "'none', or serve with --chat-template FILE whose template renders 'tools'",
                param="tool_choice",
            )

    def split(self, text: str) -> ParsedOutput:
        """The complete output split into content and calls."""
        if self.mode == "none":
            return ParsedOutput(text, ())
        if self.mode == "named":
            return ParsedOutput(None, (_named_call(self.name or "", text),))
        parser = "json" if self.mode == "required" else self.parser
        return parse(parser, text, self.parallel, self.call_names)

    @property
    def call_names(self) -> frozenset[str] | None:
        """The names an ``auto`` json-parser call must have (the offered functions): without
        markup, a JSON answer with a ``name`` key is a call only when it names a tool. None
        (any name) for hermes, whose tags mark calls, and ``required``, constrained to them."""
        if self.mode != "auto" or self.parser != "json":
            return None
        return frozenset(t["function"]["name"] for t in self.tools)

    def streamer(self) -> ToolStream | None:
        """A per-choice streaming splitter (None for ``none``: content passes through)."""
        return None if self.mode == "none" else ToolStream(self)


class ToolStream:
    """Streaming :meth:`ToolSetup.split` for one choice: ``feed``/``finish`` return (content
    now, ``tool_calls`` delta entries now, in OpenAI's streamed form with their ``index``).

    Calls stream as they are generated, as OpenAI and vLLM do: a call's first entry carries its
    id, type and name (with the first piece of its arguments, if any), later ones
    ``{"index": i, "function": {"arguments": piece}}``. The pieces join to the generated JSON
    text as is, the same bytes the whole response carries. A named choice's output
    is its one call's arguments; ``auto`` and ``required`` go through the template family's
    parser (:class:`router.tool_parsers.StreamingToolParser`).
    """

    def __init__(self, setup: ToolSetup) -> None:
        self.setup = setup
        self._named_id: str | None = None
        self._parser = (
            None
            if setup.mode == "named"
            else StreamingToolParser(
                "json" if setup.mode == "required" else setup.parser,
                setup.parallel,
                setup.call_names,
            )
        )

    @property
    def num_calls(self) -> int:
        """Calls begun so far (their first entry sent)."""
        if self._parser is None:
            return 0 if self._named_id is None else 1
        return self._parser.num_calls

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if self._parser is None:
            return "", self._named_piece(text) if text else []
        content, deltas = self._parser.feed(text)
        return content, [d.to_openai() for d in deltas]

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        if self._parser is None:
            return "", self._named_piece("") if self._named_id is None else []
        content, deltas = self._parser.finish()
        return content, [d.to_openai() for d in deltas]

    def _named_piece(self, text: str) -> list[dict[str, Any]]:
        if self._named_id is not None:
            return [CallDelta(0, text).to_openai()]
        self._named_id = new_call_id()
        return [CallDelta(0, text, self.setup.name or "", self._named_id).to_openai()]


def _named_call(name: str, text: str) -> ToolCall:
    """A named choice's one call: its arguments the text as generated (the bytes a stream of
    the same output sends; cut by max_tokens, what was generated)."""
    return ToolCall(name, text, new_call_id())


def tool_setup(
    tools: Sequence[Any] | None,
    tool_choice: str | Mapping[str, Any] | None,
    parallel_tool_calls: bool | None,
    parser: str,
) -> ToolSetup | None:
    """Validate a request's tool fields. None when no tools are given (and ``tool_choice`` is
    absent or 'none'). Raises BadRequest naming ``tools`` / ``tool_choice``."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise BadRequest("'tool_choice' needs 'tools'", param="tool_choice")
        return None
    checked = tuple(check_tools(tools))
    names = [t["function"]["name"] for t in checked]
    parallel = parallel_tool_calls is not False
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        mode = "auto" if tool_choice is None else str(tool_choice)
        return ToolSetup(checked, mode, None, parallel, parser)
    if isinstance(tool_choice, Mapping):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        shape = "'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"
        if tool_choice.get("type") != "function":
            raise BadRequest(
                f"'tool_choice.type' must be 'function' (tool_choice is {shape})",
                param="tool_choice.type",
            )
        if not isinstance(fn, Mapping):
            raise BadRequest(
                f"'tool_choice.function' must be an object {{'name': ...}} (tool_choice is "
                f"{shape})",
                param="tool_choice.function",
            )
        if not isinstance(name, str):
            raise BadRequest(
                "'tool_choice.function.name' must be a string (the name of one of 'tools')",
                param="tool_choice.function.name",
            )
        if name not in names:
            raise BadRequest(
                f"'tool_choice.function.name' names function {_shown(name)}, which is not in "
                f"'tools' ({names})",
                param="tool_choice.function.name",
            )
        return ToolSetup(checked, "named", name, parallel, parser)
    raise BadRequest(f"'tool_choice' {tool_choice!r} is not supported", param="tool_choice")
