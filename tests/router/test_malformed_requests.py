"""A table of malformed and edge-case requests on /v1/chat/completions, /v1/completions and the
gRPC Generate API (issue 12).

Each row gets its exact HTTP status (or gRPC code) and an error naming the field at fault; none is
a 5xx; afterwards every worker is alive, nothing is queued or held, and a normal request on every
API is served.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import pytest
from fake_workers import EOS, VOCAB
from test_http_gateway import MSGS, env

from pdserve.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from pdserve.tokenizer import Tokenizer
from pdserve.v1 import common_pb2 as cpb
from pdserve.v1 import generate_pb2 as gpb
from pdserve.v1 import generate_pb2_grpc as gpb_grpc
from router.background import drain_background
from router.grpc_gateway import GrpcGateway
from router.http import build_app
from router.request_id import MAX_REQUEST_ID_CHARS

pytestmark = pytest.mark.timeout(120)

CHAT, CMPL = "/v1/chat/completions", "/v1/completions"
MAX_BODY = 64 * 1024  # the test app's body limit, bytes
MANY_STOPS = [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]
DEEP = "[" * 1500 + "]" * 1500  # JSON text nested past Python's recursion limit
BAD_SCHEMA_TOOL = {"type": "function",
                   "function": {"name": "f", "parameters": {"type": "banana"}}}  # fmt: skip
DEEP_TOOL = {"type": "function", "function": {"name": "f", "parameters": {}}}
_node = DEEP_TOOL["function"]["parameters"]  # type: ignore[index]
for _ in range(150):  # parameters nested past the JSON depth bound (well inside the body's)
    _node["properties"] = {"x": {}}
    _node = _node["properties"]["x"]
LONG_STOP = "x" * (MAX_STOP_STRING_CHARS + 1)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
TOOL_F = {"type": "function", "function": {"name": "f"}}


def call(**fields: Any) -> dict[str, Any]:
    """A well-formed assistant tool call with ``fields`` of it (or of its ``function``) replaced
    (None: removed)."""
    out: dict[str, Any] = {"id": "call_1", "type": "function"}
    fn: dict[str, Any] = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    for key, value in fields.items():
        target = fn if key in fn else out
        target[key] = value
        if value is None:
            del target[key]
    out["function"] = fn
    return out


def with_calls(calls: Any) -> dict[str, Any]:
    """A chat request whose third message (index 2) is the assistant's with ``calls``."""
    msgs = [*MSGS, {"role": "user", "content": "Paris?"},
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": "call_1", "content": "21"}]  # fmt: skip
    return {"messages": msgs, "max_tokens": 4}


@dataclass(frozen=True)
class Http:
    """One HTTP row: ``body`` is JSON (or raw bytes when ``raw``); ``param`` the expected field
    (None: the error has no field, e.g. a body that is not JSON); ``says`` must be in the message."""

    name: str
    path: str
    body: Any
    status: int
    param: str | None
    says: str = ""
    raw: bool = False
    method: str = "POST"


def chat(**kw: Any) -> dict[str, Any]:
    return {"messages": MSGS, "max_tokens": 4, **kw}


def cmpl(**kw: Any) -> dict[str, Any]:
    return {"prompt": "hello", "max_tokens": 4, **kw}


HTTP_ROWS = [
    Http("chat no messages", CHAT, {"max_tokens": 4}, 400, "messages", "required"),
    Http("chat empty messages", CHAT, {"messages": []}, 400, "messages"),
    Http("chat messages a string", CHAT, {"messages": "hi"}, 400, "messages"),
    Http("chat bad role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400,
         "messages.0.role"),
    Http("chat content a number", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400,
         "messages.0.content"),
    Http("chat image part", CHAT,
         {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
         "messages.0.content.0.type", "only 'text'"),
    Http("chat text part without text", CHAT,
         {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400,
         "messages.0.content.0.text", "without 'text'"),
    Http("chat lone surrogate", CHAT, b'{"messages": [{"role": "user", "content": "a\\udc80"}]}',
         400, "messages", "surrogate", raw=True),
    Http("chat n 0", CHAT, chat(n=0), 400, "n", ">= 1"),
    Http("chat n over max_n", CHAT, chat(n=17), 400, "n", "16"),
    Http("chat n a string", CHAT, chat(n="2"), 400, "n"),
    Http("chat max_tokens 0", CHAT, chat(max_tokens=0), 400, "max_tokens", ">= 1"),
    Http("chat max_tokens over context", CHAT, chat(max_tokens=10**6), 400, "max_tokens", "512"),
    Http("chat max_completion_tokens -1", CHAT, chat(max_completion_tokens=-1), 400,
         "max_completion_tokens"),
    Http("chat temperature -1", CHAT, chat(temperature=-1), 400, "temperature", "[0, 2]"),
    Http("chat top_p 0", CHAT, chat(top_p=0), 400, "top_p", "(0, 1]"),
    Http("chat presence_penalty 3", CHAT, chat(presence_penalty=3), 400, "presence_penalty"),
    Http("chat top_logprobs 21", CHAT, chat(logprobs=True, top_logprobs=21), 400,
         "top_logprobs", "20"),
    Http("chat top_logprobs without logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    Http("chat logprobs a string", CHAT, chat(logprobs="yes"), 400, "logprobs"),
    Http("chat too many stops", CHAT, chat(stop=MANY_STOPS), 400, "stop", str(MAX_STOP_STRINGS)),
    Http("chat empty stop", CHAT, chat(stop=[""]), 400, "stop", "non-empty"),
    Http("chat stop too long", CHAT, chat(stop=LONG_STOP), 400, "stop", "1024"),
    Http("chat negative stop id", CHAT, chat(stop_token_ids=[-1]), 400, "stop_token_ids"),
    Http("chat seed -1", CHAT, chat(seed=-1), 400, "seed"),
    Http("chat unknown model", CHAT, chat(model="gpt-4"), 404, "model", "gpt-4"),
    Http("chat model a lone surrogate", CHAT,
         b'{"model": "\\udfff", "messages": [{"role": "user", "content": "a"}]}', 404, "model",
         "\\udfff", raw=True),
    Http("chat model 60 KB long", CHAT, chat(model="m" * 60_000), 404, "model", "characters cut"),
    Http("chat guided_json nested too deeply", CHAT, chat(guided_json=DEEP), 400, "guided_json",
         "nested deeper than 100 levels"),
    Http("chat structured_outputs json nested too deeply", CHAT,
         chat(structured_outputs={"json": DEEP}), 400, "structured_outputs.json",
         "'structured_outputs.json' schema is not valid JSON: nested deeper"),
    Http("chat tool parameters nested too deeply", CHAT, chat(tools=[DEEP_TOOL]), 400,
         "tools.0.function.parameters", "'tools[0].function.parameters' is nested deeper"),
    Http("chat tools naming one function twice", CHAT, chat(tools=[WEATHER, TOOL_F, WEATHER]),
         400, "tools", "'tools' defines function \"get_weather\" twice (tools[0] and tools[2])"),
    Http("chat tool_choice.function.name a number", CHAT,
         chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": 5}}), 400,
         "tool_choice.function.name", "'tool_choice.function.name' must be a string"),
    Http("chat tool_choice.type not function", CHAT,
         chat(tools=[WEATHER], tool_choice={"type": "tool", "function": {"name": "get_weather"}}),
         400, "tool_choice.type", "'tool_choice.type' must be 'function'"),
    # an assistant message's tool_calls as OpenAI defines them: {id, type, function: {name,
    # arguments}}, all strings, type "function"
    Http("chat tool_calls not a list", CHAT, with_calls("get_weather"), 400,
         "messages.2.tool_calls", "'messages.2.tool_calls'"),
    Http("chat tool_call not an object", CHAT, with_calls([5]), 400, "messages.2.tool_calls.0"),
    Http("chat tool_call without function", CHAT, with_calls([{"id": "c", "type": "function"}]),
         400, "messages.2.tool_calls.0.function",
         "'messages[2].tool_calls[0].function' must be an object"),
    Http("chat tool_call name a number", CHAT, with_calls([call(name=5)]), 400,
         "messages.2.tool_calls.0.function.name",
         "'messages[2].tool_calls[0].function.name' must be a string (got number)"),
    Http("chat tool_call name empty", CHAT, with_calls([call(name="")]), 400,
         "messages.2.tool_calls.0.function.name", "must not be empty"),
    Http("chat tool_call without arguments", CHAT, with_calls([call(arguments=None)]), 400,
         "messages.2.tool_calls.0.function.arguments",
         "'messages[2].tool_calls[0].function.arguments' must be a string (it is missing)"),
    Http("chat tool_call arguments an object", CHAT, with_calls([call(arguments={"c": 1})]), 400,
         "messages.2.tool_calls.0.function.arguments", "must be a string (got object)"),
    Http("chat second tool_call of type tool", CHAT, with_calls([call(), call(type="tool")]), 400,
         "messages.2.tool_calls.1.type",
         "'messages[2].tool_calls[1].type' must be 'function' (got \"tool\")"),
    Http("chat tool_call without type", CHAT, with_calls([call(type=None)]), 400,
         "messages.2.tool_calls.0.type", "'messages[2].tool_calls[0].type' must be 'function'"),
    Http("chat tool_call id a number", CHAT, with_calls([call(id=7)]), 400,
         "messages.2.tool_calls.0.id", "'messages[2].tool_calls[0].id' must be a string"),
    Http("chat required tool with a bad schema", CHAT,
         chat(tools=[BAD_SCHEMA_TOOL], tool_choice="required"), 400, "tools", "cannot be compiled"),
    Http("chat response_format schema with no finite value", CHAT,
         chat(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {
             "type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}}}),
         400, "response_format.json_schema.schema", "no finite JSON value matches the schema"),
    Http("cmpl guided_json array that must hold itself", CMPL,
         cmpl(guided_json={"type": "array", "items": {"$ref": "#"}, "minItems": 1}), 400,
         "guided_json", "no finite JSON value"),
    Http("cmpl regex that does not parse", CMPL, cmpl(guided_regex="(abc"), 400, "guided_regex",
         "regex parse error: unclosed group"),
    Http("cmpl regex matching nothing", CMPL, cmpl(guided_regex="a[^\\s\\S]"), 400,
         "guided_regex", "matches no output"),
    Http("cmpl logit_bias key of 5000 digits", CMPL, cmpl(logit_bias={"9" * 5000: 1}), 400,
         "logit_bias", "outside the vocabulary"),
    Http("chat stream_options without stream", CHAT,
         chat(stream_options={"include_usage": True}), 400, "stream_options"),
    Http("chat logit_bias over 100", CHAT, chat(logit_bias={"5": 101.0}), 400, "logit_bias"),
    Http("chat logit_bias id out of vocab", CHAT, chat(logit_bias={"99999999": 1.0}), 400, "logit_bias"),
    Http("chat logit_bias key not an id", CHAT, chat(logit_bias={"abc": 1.0}), 400, "logit_bias"),
    Http("chat logit_bias key with a space", CHAT, chat(logit_bias={" 5": 1.0}), 400,
         "logit_bias", "digits only"),
    Http("chat logit_bias key with a plus", CHAT, chat(logit_bias={"+5": 1.0}), 400,
         "logit_bias", "digits only"),
    Http("chat logit_bias key with an underscore", CHAT, chat(logit_bias={"1_0": 1.0}), 400,
         "logit_bias", "digits only"),
    Http("chat logit_bias key in Arabic-Indic digits", CHAT, chat(logit_bias={"\u0665": 1.0}),
         400, "logit_bias", "digits only"),
    Http("chat stop lone surrogate", CHAT,
         b'{"messages": [{"role": "user", "content": "a"}], "stop": ["x\\udc80"]}', 400, "stop",
         "surrogate", raw=True),
    Http("chat allowed_token_ids outside guided_choice", CHAT,
         chat(guided_choice=["yes", "no"], allowed_token_ids=[0]), 400, "allowed_token_ids",
         "'guided_choice' allows"),
    Http("cmpl allowed_token_ids outside guided_regex", CMPL,
         cmpl(guided_regex="[0-9]+", allowed_token_ids=[0, 1]), 400, "allowed_token_ids",
         "'guided_regex' allows"),
    Http("chat json_schema without schema", CHAT,
         chat(response_format={"type": "json_schema"}), 400, "response_format.json_schema"),
    Http("chat response_format type unknown", CHAT,
         chat(response_format={"type": "yaml"}), 400, "response_format.type",
         "'response_format.type' \"yaml\" is not supported; it must be one of 'text', "
         "'json_object', 'json_schema'"),
    Http("chat response_format without type", CHAT, chat(response_format={}), 400,
         "response_format.type",
         "'response_format.type' is required; it must be one of 'text', 'json_object', "
         "'json_schema'"),
    Http("cmpl response_format type null", CMPL, cmpl(response_format={"type": None}), 400,
         "response_format.type", "is required"),
    Http("chat response_format structural_tag", CHAT,
         chat(response_format={"type": "structural_tag"}), 400, "response_format.type",
         "\"structural_tag\" is not supported"),
    Http("chat empty structured_outputs", CHAT, chat(structured_outputs={}), 400,
         "structured_outputs",
         "'structured_outputs' sets no constraint; it must set exactly one of 'json', 'regex', "
         "'choice', 'grammar', 'json_object'"),
    Http("chat structured_outputs with a misspelt key", CHAT,
         chat(structured_outputs={"jsn": {"type": "object"}}), 400, "structured_outputs",
         "'structured_outputs' has unknown key(s) 'jsn'"),
    Http("chat response_format json_schema without a name", CHAT,
         chat(response_format={"type": "json_schema", "json_schema": {"schema": {}}}), 400,
         "response_format.json_schema.name", "is required"),
    Http("chat response_format json_schema schema a string", CHAT,
         chat(response_format={"type": "json_schema", "json_schema": {"name": "n",
                                                                      "schema": "string"}}),
         400, "response_format.json_schema.schema", "must be a JSON schema (an object), got str"),
    Http("cmpl structured_outputs with options only", CMPL,
         cmpl(structured_outputs={"disable_any_whitespace": True, "json": None}), 400,
         "structured_outputs", "sets no constraint"),
    Http("cmpl structured_outputs with two constraints", CMPL,
         cmpl(structured_outputs={"regex": "a+", "choice": ["a"]}), 400, "structured_outputs",
         "sets 2 constraints (regex, choice)"),
    Http("chat structured_outputs structural_tag", CHAT,
         chat(structured_outputs={"structural_tag": "{}"}), 400,
         "structured_outputs.structural_tag", "'structured_outputs.structural_tag' is not supported"),
    # a sub-field of a nested object with the wrong type: the error names its whole path
    Http("chat structured_outputs.regex an integer", CHAT, chat(structured_outputs={"regex": 5}),
         400, "structured_outputs.regex", "'structured_outputs.regex' must be a string"),
    Http("cmpl structured_outputs.regex that does not parse", CMPL,
         cmpl(structured_outputs={"regex": "(abc"}), 400, "structured_outputs.regex",
         "'structured_outputs.regex' cannot be compiled"),
    Http("chat structured_outputs.choice a string", CHAT,
         chat(structured_outputs={"choice": "yes"}), 400, "structured_outputs.choice",
         "'structured_outputs.choice' must be a list of strings"),
    Http("chat structured_outputs.choice of numbers", CHAT,
         chat(structured_outputs={"choice": [1, 2]}), 400, "structured_outputs.choice",
         "'structured_outputs.choice' must be a non-empty list"),
    Http("chat structured_outputs.grammar a list", CHAT,
         chat(structured_outputs={"grammar": ["root"]}), 400, "structured_outputs.grammar",
         "'structured_outputs.grammar' must be a string"),
    Http("chat structured_outputs.json a number", CHAT, chat(structured_outputs={"json": 5}),
         400, "structured_outputs.json", "'structured_outputs.json' schema must be a JSON object"),
    Http("chat structured_outputs.json_object a string", CHAT,
         chat(structured_outputs={"json_object": "yes"}), 400, "structured_outputs.json_object",
         "'structured_outputs.json_object' must be a boolean, got str"),
    Http("chat structured_outputs option a string", CHAT,
         chat(structured_outputs={"regex": "a+", "disable_any_whitespace": "no"}), 400,
         "structured_outputs.disable_any_whitespace",
         "'structured_outputs.disable_any_whitespace' must be a boolean"),
    Http("chat structured_outputs.whitespace_pattern a number", CHAT,
         chat(structured_outputs={"json_object": True, "whitespace_pattern": 1}), 400,
         "structured_outputs.whitespace_pattern",
         "'structured_outputs.whitespace_pattern' must be a string"),
    Http("chat response_format json_schema a number", CHAT,
         chat(response_format={"type": "json_schema", "json_schema": 5}), 400,
         "response_format.json_schema", "'response_format.json_schema' is required"),
    Http("chat response_format json_schema.strict a string", CHAT,
         chat(response_format={"type": "json_schema",
                               "json_schema": {"name": "n", "schema": {}, "strict": "yes"}}),
         400, "response_format.json_schema.strict",
         "'response_format.json_schema.strict' must be a boolean, got str"),
    Http("chat allowed_token_ids only EOS with min_tokens", CHAT,
         chat(allowed_token_ids=[EOS], min_tokens=2), 400, "allowed_token_ids",
         f"'allowed_token_ids' [{EOS}] holds only EOS or stop token ids, which 'min_tokens' (2) "
         "forbids"),
    Http("cmpl allowed_token_ids only stop ids with min_tokens", CMPL,
         cmpl(allowed_token_ids=[7, EOS], stop_token_ids=[7], min_tokens=1, stream=True), 400,
         "allowed_token_ids", "'min_tokens' (1)"),
    Http("chat tools not a list", CHAT, chat(tools="search"), 400, "tools"),
    Http("chat tool_choice required without tools", CHAT, chat(tool_choice="required"), 400,
         "tool_choice"),
    Http("chat streaming bad temperature", CHAT, chat(stream=True, temperature=9), 400,
         "temperature"),
    Http("chat body not JSON", CHAT, b"{not json", 400, None, "not valid JSON", raw=True),
    Http("cmpl body not UTF-8", CMPL, b'{"prompt": "hi \xff\xfe"}', 400, None, "utf-8",
         raw=True),
    Http("cmpl integer of 5000 digits", CMPL, b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}",
         400, None, "4300", raw=True),
    Http("chat body a JSON array", CHAT, b"[1, 2]", 400, None, "JSON object", raw=True),
    Http("chat body over the limit", CHAT, chat(pad="x" * MAX_BODY), 413, None, str(MAX_BODY)),
    Http("chat GET", CHAT, None, 405, None, method="GET"),
    Http("cmpl no prompt", CMPL, {"max_tokens": 4}, 400, "prompt", "required"),
    Http("cmpl empty prompt list", CMPL, cmpl(prompt=[]), 400, "prompt", "empty"),
    Http("cmpl empty token list", CMPL, cmpl(prompt=[[]]), 400, "prompt"),
    Http("cmpl empty string", CMPL, cmpl(prompt=""), 400, "prompt", "empty"),
    Http("cmpl token id past vocab", CMPL, cmpl(prompt=[1, VOCAB]), 400, "prompt", str(VOCAB)),
    Http("cmpl negative token id", CMPL, cmpl(prompt=[-5]), 400, "prompt"),
    Http("cmpl prompt a dict", CMPL, cmpl(prompt={"a": 1}), 400, "prompt"),
    Http("cmpl prompt over context", CMPL, cmpl(prompt=[5] * 600), 400, "prompt", "512"),
    Http("cmpl logprobs 21", CMPL, cmpl(logprobs=21), 400, "logprobs", "20"),
    Http("cmpl suffix", CMPL, cmpl(suffix="x"), 400, "suffix"),
    Http("cmpl best_of other than n", CMPL, cmpl(best_of=3), 400, "best_of"),
    Http("cmpl too many sequences", CMPL, cmpl(prompt=["a"] * 65), 400, "prompt", "64"),
    Http("cmpl max_tokens a string", CMPL, cmpl(max_tokens="10"), 400, "max_tokens"),
    Http("cmpl min_tokens over max_tokens", CMPL, cmpl(min_tokens=9), 400, "min_tokens"),
    Http("cmpl top_k past int32", CMPL, cmpl(top_k=2**40), 400, "top_k", str(2**31 - 1)),
    Http("cmpl too many stops", CMPL, cmpl(stop=MANY_STOPS), 400, "stop", str(MAX_STOP_STRINGS)),
    Http("cmpl too many stop ids", CMPL, cmpl(stop_token_ids=[5] * 1025), 400, "stop_token_ids",
         "1024"),
    Http("cmpl stop id past vocab", CMPL, cmpl(stop_token_ids=[VOCAB]), 400, "stop_token_ids"),
    Http("cmpl negative logit_bias key", CMPL, cmpl(logit_bias={"-1": 1}), 400, "logit_bias",
         "token ids are >= 0"),
    Http("cmpl stop a number", CMPL, cmpl(stop=123), 400, "stop",
         "'stop' must be a string or an array of strings (got 123)"),
    Http("cmpl stop element a number", CMPL, cmpl(stop=["a", 5]), 400, "stop", "'stop.1'"),
    Http("cmpl prompt a float", CMPL, cmpl(prompt=5.5), 400, "prompt",
         "an array of arrays of integers"),
    Http("cmpl prompt token a string", CMPL, cmpl(prompt=[[1, "a"]]), 400, "prompt",
         "'prompt.0.1'"),
    Http("cmpl streaming bad n", CMPL, cmpl(stream=True, n=0), 400, "n"),
    # fields of OpenAI's or vLLM's API that pdserve does not implement: refused, not ignored
    Http("cmpl bad_words", CMPL, cmpl(bad_words=[" 5"]), 400, "bad_words", "not supported"),
    Http("cmpl truncate_prompt_tokens", CMPL, cmpl(truncate_prompt_tokens=2), 400,
         "truncate_prompt_tokens"),
    Http("cmpl use_beam_search", CMPL, cmpl(use_beam_search=True), 400, "use_beam_search"),
    Http("cmpl priority", CMPL, cmpl(priority=1), 400, "priority"),
    Http("cmpl continuous usage", CMPL,
         cmpl(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}),
         400, "stream_options.continuous_usage_stats"),
    Http("cmpl include_stop a string", CMPL, cmpl(include_stop_str_in_output="x"), 400,
         "include_stop_str_in_output"),
    Http("chat own template", CHAT, chat(chat_template="{% for %}"), 400, "chat_template"),
    Http("chat audio out", CHAT, chat(modalities=["text", "audio"]), 400, "modalities"),
    Http("chat legacy functions", CHAT, chat(functions=[{"name": "f"}]), 400, "functions"),
    Http("chat prediction", CHAT, chat(prediction={"type": "content", "content": "x"}), 400,
         "prediction"),
]  # fmt: skip


def sampling(**kw: Any) -> cpb.SamplingParams:
    return cpb.SamplingParams(**{"max_tokens": 4, **kw})


@dataclass(frozen=True)
class Grpc:
    """One gRPC row: the status ``code`` and text naming the field (``says``)."""

    name: str
    request: gpb.GenerateRequest
    code: grpc.StatusCode
    says: str


BAD = grpc.StatusCode.INVALID_ARGUMENT
GRPC_ROWS = [
    Grpc("no input", gpb.GenerateRequest(sampling=sampling()), BAD, "'text', 'chat' or"),
    Grpc("unknown model", gpb.GenerateRequest(model="gpt-4", text="hi"),
         grpc.StatusCode.NOT_FOUND, "gpt-4"),
    Grpc("token id past vocab", gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=[1, VOCAB])), BAD,
         "'token_ids' holds token id"),
    Grpc("empty token ids", gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=[])), BAD, "empty"),
    Grpc("empty text", gpb.GenerateRequest(text=""), BAD, "empty"),
    Grpc("empty stop", gpb.GenerateRequest(text="hi", stop=[""]), BAD, "'stop'"),
    Grpc("too many stops", gpb.GenerateRequest(text="hi", stop=MANY_STOPS), BAD, "'stop'"),
    Grpc("stop too long", gpb.GenerateRequest(text="hi", stop=[LONG_STOP]), BAD, "'stop'"),
    Grpc("temperature 3", gpb.GenerateRequest(text="hi", sampling=sampling(temperature=3)), BAD,
         "'temperature'"),
    Grpc("top_logprobs 21",
         gpb.GenerateRequest(text="hi", sampling=sampling(logprobs=True, top_logprobs=21)), BAD,
         "'top_logprobs'"),
    Grpc("max_tokens over context",
         gpb.GenerateRequest(text="hi", sampling=sampling(max_tokens=10**6)), BAD, "max_tokens"),
    Grpc("negative max_tokens",
         gpb.GenerateRequest(text="hi", sampling=sampling(max_tokens=-3)), BAD, "'max_tokens'"),
    Grpc("bad chat role",
         gpb.GenerateRequest(chat=gpb.ChatMessages(messages=[gpb.ChatMessage(role="wizard")])),
         BAD, "chat.messages[0].role"),
    Grpc("tools_json nested too deeply",
         gpb.GenerateRequest(chat=gpb.ChatMessages(messages=[gpb.ChatMessage(role="user",
                             content="hi")], tools_json=DEEP)), BAD, "nested deeper"),
    Grpc("structured schema nested too deeply",
         gpb.GenerateRequest(text="hi", sampling=sampling(structured=cpb.StructuredOutput(
             kind="json_schema", value=DEEP, field="structured"))), BAD, "nested deeper"),
    Grpc("tool_calls_json call without a name",
         gpb.GenerateRequest(chat=gpb.ChatMessages(messages=[
             gpb.ChatMessage(role="user", content="hi"),
             gpb.ChatMessage(role="assistant", tool_calls_json=json.dumps([call(name=None)]))])),
         BAD, "'chat.messages[1].tool_calls_json[0].function.name' must be a string"),
    Grpc("tools_json naming one function twice",
         gpb.GenerateRequest(chat=gpb.ChatMessages(
             messages=[gpb.ChatMessage(role="user", content="hi")],
             tools_json=json.dumps([TOOL_F, TOOL_F]))),
         BAD, "'chat.tools_json' defines function \"f\" twice"),
    # the tool fields are named as the gRPC request spells them (adversarial pass, session 40)
    Grpc("tools_json entry not a function tool",
         gpb.GenerateRequest(chat=gpb.ChatMessages(
             messages=[gpb.ChatMessage(role="user", content="hi")],
             tools_json=json.dumps([{"type": "retrieval"}]))),
         BAD, "'chat.tools_json[0]' must be {'type': 'function'"),
    Grpc("tool_choice_json naming no tool",
         gpb.GenerateRequest(chat=gpb.ChatMessages(
             messages=[gpb.ChatMessage(role="user", content="hi")],
             tool_choice_json=json.dumps("required"))),
         BAD, "'chat.tool_choice_json' needs 'chat.tools_json'"),
    Grpc("request_id over the limit",
         gpb.GenerateRequest(text="hi", request_id="r" * (MAX_REQUEST_ID_CHARS + 1)), BAD,
         f"'request_id' is {MAX_REQUEST_ID_CHARS + 1} characters long; at most "
         f"{MAX_REQUEST_ID_CHARS} are allowed"),
    Grpc("request_id with a newline", gpb.GenerateRequest(text="hi", request_id="a\nb"), BAD,
         "'request_id' may hold only the characters A-Z a-z 0-9 . _ : -"),
    Grpc("request_id with the request log's suffix mark",
         gpb.GenerateRequest(text="hi", request_id="r~2"), BAD, "'request_id' may hold only"),
    Grpc("chat without messages", gpb.GenerateRequest(chat=gpb.ChatMessages()), BAD,
         "'chat.messages' must hold at least one message"),
    Grpc("allowed_token_ids only EOS with min_tokens",
         gpb.GenerateRequest(text="hi", sampling=sampling(allowed_token_ids=[EOS], min_tokens=1)),
         BAD, "'allowed_token_ids' [2] holds only EOS or stop token ids, which 'min_tokens'"),
    Grpc("stop id past vocab",
         gpb.GenerateRequest(text="hi", sampling=sampling(stop_token_ids=[VOCAB])), BAD,
         "'stop_token_ids'"),
]  # fmt: skip


async def test_malformed_request_table(tokenizer: Tokenizer) -> None:
    assert len(HTTP_ROWS) + len(GRPC_ROWS) >= 30
    async with env(tokenizer) as e:
        app = build_app(e.router, max_body_bytes=MAX_BODY)
        transport = httpx.ASGITransport(app=app)
        gw = GrpcGateway(e.router, host="127.0.0.1", port=0)
        await gw.start()
        failures: list[str] = []
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                for row in HTTP_ROWS:
                    if row.method == "GET":
                        r = await client.get(row.path)
                    elif row.raw:
                        r = await client.post(
                            row.path, content=row.body, headers={"content-type": "application/json"}
                        )
                    else:
                        r = await client.post(row.path, json=row.body)
                    failures += _check_http(row, r)
                async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as ch:
                    stub = gpb_grpc.GenerationStub(ch)
                    for g in GRPC_ROWS:
                        failures += await _check_grpc(stub, g)
                    assert not failures, "\n".join(failures)
                    # nothing leaked, every worker alive, and normal service on every API
                    await drain_background()
                    assert e.router.admission.num_queued == 0
                    assert all(not d.held for d in e.cluster.decodes)
                    assert all(w.healthy for w in e.router.pool)
                    r = await client.post(CHAT, json=chat())
                    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
                    r = await client.post(CMPL, json=cmpl())
                    assert r.status_code == 200 and r.json()["choices"][0]["text"]
                    out = [m async for m in stub.Generate(gpb.GenerateRequest(text="hi"))]
                    assert out[-1].complete.finish_reason in ("stop", "length")
        finally:
            await gw.stop(0.1)


def _check_http(row: Http, r: httpx.Response) -> list[str]:
    if r.status_code >= 500:
        return [f"{row.name}: 5xx {r.status_code} {r.text[:200]}"]
    if r.status_code != row.status:
        return [f"{row.name}: status {r.status_code} != {row.status}: {r.text[:200]}"]
    if len(r.content) > 2048:
        return [f"{row.name}: a {len(r.content)}-byte error body echoes the input"]
    if row.status == 405:
        return []
    try:
        err = r.json()["error"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return [f"{row.name}: not an OpenAI error body: {r.text[:200]}"]
    problems = []
    if set(err) != {"message", "type", "param", "code"}:
        problems.append(f"{row.name}: error keys {sorted(err)}")
    if err["param"] != row.param:
        problems.append(f"{row.name}: param {err['param']!r} != {row.param!r}")
    if row.param and row.param.split(".")[0] not in err["message"]:
        problems.append(f"{row.name}: message does not name {row.param}: {err['message']}")
    if row.says not in err["message"]:
        problems.append(f"{row.name}: message lacks {row.says!r}: {err['message']}")
    return problems


async def _check_grpc(stub: gpb_grpc.GenerationStub, row: Grpc) -> list[str]:
    try:
        out = [m async for m in stub.Generate(row.request)]
    except grpc.aio.AioRpcError as err:
        if err.code() != row.code:
            return [f"gRPC {row.name}: {err.code().name} != {row.code.name}: {err.details()}"]
        if row.says not in (err.details() or ""):
            return [f"gRPC {row.name}: details lack {row.says!r}: {err.details()}"]
        return []
    return [f"gRPC {row.name}: no error, got {out[-1] if out else 'nothing'}"]
