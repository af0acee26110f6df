"""The gRPC API's chat input (``pdserve.v1.ChatMessages``) -> what the chat template and the
tool handling need, at parity with the HTTP gateway's chat fields. JSON-valued wire fields
(``tools_json``, ``tool_choice_json``, ``chat_template_kwargs_json``, ``documents_json``,
``tool_calls_json``) are decoded here; a bad one is a BadRequest naming it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve import json_text
from pdserve.v1 import generate_pb2 as gpb
from router.chat_tools import ToolSetup, check_tool_calls, tool_setup
from router.errors import BadRequest, RouterError
from router.openai_protocol import CHAT_ROLES


@dataclass
class ChatInputs:
    """``messages`` for the template, ``tools`` (None without tools) and the template
    controls (keyword arguments of ``Tokenizer.render_chat``)."""

    messages: list[dict[str, Any]]
    tools: ToolSetup | None
    controls: dict[str, Any]


_KIND_NAMES: dict[type, str] = {list: "array", dict: "object", str: "string"}


def _json(text: str, param: str, kinds: tuple[type, ...], items: type | None = None) -> Any:
    """``text`` decoded as JSON of one of ``kinds`` (each element of type ``items`` when given).
    Raises BadRequest naming ``param``."""
    if not text:
        return None
    try:
        value = json_text.loads(text)
    except ValueError as e:
        raise BadRequest(f"'{param}' is not valid JSON: {e}", param=param) from None
    if not isinstance(value, kinds) or isinstance(value, bool):
        want = " or ".join(_KIND_NAMES[k] for k in kinds)
        raise BadRequest(
            f"'{param}' must be a JSON {want} (got {json_text.json_type(value)})", param=param
        )
    if items is not None and isinstance(value, list):
        for i, item in enumerate(value):
            if not isinstance(item, items):
                raise BadRequest(
                    f"'{param}'[{i}] must be a JSON {_KIND_NAMES[items]} (got {json_text.json_type(item)})",
                    param=f"{param}.{i}",
                )
    return value


# The HTTP API's names of the tool fields (in the errors router/chat_tools.py and the structured
# output checks raise) and the gRPC request's, which carries them as JSON text
_GRPC_TOOL_FIELDS = (("tool_choice", "chat.tool_choice_json"), ("tools", "chat.tools_json"))


def grpc_field_names(e: RouterError) -> RouterError:
    """``e`` with the tool fields named as the gRPC request spells them (``tools[0]`` ->
    ``chat.tools_json[0]``, ``tool_choice`` -> ``chat.tool_choice_json``); other errors as
    they are."""
    param = e.param or ""
    if not isinstance(e, BadRequest) or not any(
        param == http or param.startswith(http + ".") for http, _ in _GRPC_TOOL_FIELDS
    ):
        return e
    message = e.message
    for http, name in _GRPC_TOOL_FIELDS:
        if param == http or param.startswith(http + "."):
            param = name + param[len(http) :]
        message = message.replace(f"'{http}", f"'{name}")
    return BadRequest(message, param=param)


def chat_inputs(chat: gpb.ChatMessages, tool_parser: str) -> ChatInputs:
    """Decode and validate ``chat``. Raises BadRequest naming the field as the gRPC request
    spells it (``chat.messages`` when there is none: OpenAI's chat API needs at least one)."""
    if not chat.messages:
        raise BadRequest("'chat.messages' must hold at least one message", param="chat.messages")
    messages: list[dict[str, Any]] = []
    for i, m in enumerate(chat.messages):
        if m.role not in CHAT_ROLES:
            raise BadRequest(
                f"chat.messages[{i}].role is {m.role!r}; it must be one of {', '.join(CHAT_ROLES)}",
                param=f"chat.messages.{i}.role",
            )
        msg: dict[str, Any] = {"role": m.role, "content": m.content}
        calls = _json(m.tool_calls_json, f"chat.messages.{i}.tool_calls_json", (list,), dict)
        if calls:
            check_tool_calls(
                calls, f"chat.messages[{i}].tool_calls_json", f"chat.messages.{i}.tool_calls_json"
            )
            msg["tool_calls"] = calls
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        if m.name:
            msg["name"] = m.name
        messages.append(msg)
    choice = _json(chat.tool_choice_json, "chat.tool_choice_json", (str, dict))
    tools = tool_setup(
        _json(chat.tools_json, "chat.tools_json", (list,)),
        choice,
        chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else None,
        tool_parser,
    )
    controls = {
        "add_generation_prompt": (
            chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
        ),
        "continue_final_message": chat.continue_final_message,
        "chat_template_kwargs": _json(
            chat.chat_template_kwargs_json, "chat.chat_template_kwargs_json", (dict,)
        ),
        "documents": _json(chat.documents_json, "chat.documents_json", (list,), dict),
        "tools": list(tools.tools) if tools else None,
    }
    return ChatInputs(messages, tools, controls)
