"""gRPC chat input decoding (router/grpc_chat.py): bad JSON-valued fields are BadRequests
naming the field, and the gateway turns them into INVALID_ARGUMENT (QA D3, D7.3)."""

from __future__ import annotations

import grpc
import pytest
from test_grpc_gateway import gateway

from pdserve.tokenizer import Tokenizer
from pdserve.v1 import common_pb2 as cpb
from pdserve.v1 import generate_pb2 as gpb
from pdserve.v1 import generate_pb2_grpc as gpb_grpc
from router.errors import BadRequest
from router.grpc_chat import chat_inputs

pytestmark = pytest.mark.timeout(60)

TOOLS = '[{"type":"function","function":{"name":"f"}}]'
USER = [gpb.ChatMessage(role="user", content="hi")]


@pytest.mark.parametrize("value", ["5", "null", "[]", "true", "1.5"])
def test_tool_choice_json_of_the_wrong_json_type_names_the_field(value: str) -> None:
    chat = gpb.ChatMessages(messages=USER, tools_json=TOOLS, tool_choice_json=value)
    with pytest.raises(BadRequest) as e:
        chat_inputs(chat, "hermes")
    assert e.value.param == "chat.tool_choice_json"
    assert "must be a JSON string or object" in e.value.message


def test_tool_choice_json_string_and_object_still_work() -> None:
    for value in ('"auto"', '{"type":"function","function":{"name":"f"}}'):
        chat = gpb.ChatMessages(messages=USER, tools_json=TOOLS, tool_choice_json=value)
        assert chat_inputs(chat, "hermes").tools is not None


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("documents_json", "[1]", "chat.documents_json.0"),
        ("documents_json", "{}", "chat.documents_json"),
        ("chat_template_kwargs_json", "[]", "chat.chat_template_kwargs_json"),
        ("tools_json", '"f"', "chat.tools_json"),
    ],
)
def test_other_json_fields_name_the_field(field: str, value: str, param: str) -> None:
    chat = gpb.ChatMessages(messages=USER, **{field: value})
    with pytest.raises(BadRequest) as e:
        chat_inputs(chat, "hermes")
    assert e.value.param == param and field in e.value.message


def test_message_tool_calls_must_be_objects() -> None:
    msgs = [*USER, gpb.ChatMessage(role="assistant", tool_calls_json="[3]")]
    with pytest.raises(BadRequest) as e:
        chat_inputs(gpb.ChatMessages(messages=msgs), "hermes")
    assert e.value.param == "chat.messages.1.tool_calls_json.0"


def test_chat_without_messages_names_chat_messages() -> None:
    with pytest.raises(BadRequest) as e:
        chat_inputs(gpb.ChatMessages(tools_json=TOOLS), "hermes")
    assert e.value.param == "chat.messages"
    assert e.value.message == "'chat.messages' must hold at least one message"


async def test_gateway_answers_invalid_argument_not_unknown(tokenizer: Tokenizer) -> None:
    async with gateway(tokenizer) as (_c, _router, channel):
        stub = gpb_grpc.GenerationStub(channel)
        for field, value in (("tool_choice_json", "5"), ("documents_json", "[1]")):
            extra = {"tools_json": TOOLS} if field == "tool_choice_json" else {}
            chat = gpb.ChatMessages(messages=USER, **{field: value}, **extra)
            req = gpb.GenerateRequest(chat=chat, sampling=cpb.SamplingParams(max_tokens=4))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                _ = [r async for r in stub.Generate(req)]
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"chat.{field}" in (e.value.details() or "")
        req = gpb.GenerateRequest(
            chat=gpb.ChatMessages(), sampling=cpb.SamplingParams(max_tokens=4)
        )
        with pytest.raises(grpc.aio.AioRpcError) as e:
            _ = [r async for r in stub.Generate(req)]
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (e.value.details() or "").startswith("'chat.messages'")
