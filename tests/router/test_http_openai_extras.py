"""Issue 13 in the HTTP and gRPC gateways against fake workers: tool_calls shaping (streamed == whole),
chat echo, request validation (logit_bias, structured output, tools, template controls,
max_tokens 0) and the utility endpoints."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import pytest
from fake_workers import EOS, start_fake_cluster
from test_http_gateway import assert_openai_error, sse_events

from pdserve.tokenizer import Tokenizer
from pdserve.v1 import generate_pb2 as gpb
from pdserve.v1 import generate_pb2_grpc as gpb_grpc
from pdserve.v1 import worker_pb2 as wpb
from router.grpc_gateway import GrpcGateway
from router.http import build_app
from router.serving import Router, RouterConfig

pytestmark = pytest.mark.timeout(60)

TEMPLATE = (Path(__file__).parents[1] / "fixtures" / "hermes_template.jinja").read_text()
CALL_TEXT = (
    'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@contextlib.asynccontextmanager
async def client(tokenizer: Tokenizer, answer: str = CALL_TEXT) -> AsyncIterator[httpx.AsyncClient]:
    script = tokenizer.encode(answer, add_special_tokens=False) + [EOS]
    c = await start_fake_cluster(prefills=[{"script": script}], decodes=[{"script": script}])
    router = Router(
        RouterConfig(model_name="smollm2", max_model_len=512, chat_template=TEMPLATE),
        tokenizer,
        c.pool,
    )
    transport = httpx.ASGITransport(app=build_app(router))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        try:
            yield http
        finally:
            await c.close()


async def test_auto_tool_calls_whole_and_streamed(tokenizer: Tokenizer) -> None:
    async with client(tokenizer) as http:
        body = {"messages": ASK, "tools": [WEATHER], "max_tokens": 64}
        r = await http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] == "Sure."
        (call,) = choice["message"]["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}

        s = await http.post("/v1/chat/completions", json={**body, "stream": True})
        events = [e for e in sse_events(s.text) if isinstance(e, dict)]
        content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
        calls = [tc for e in events for tc in e["choices"][0]["delta"].get("tool_calls") or []]
        assert content == "Sure."
        # the call streams as generated: id, type and name first, then argument pieces
        assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
        assert calls[0]["function"]["name"] == "get_weather"
        assert all(c["index"] == 0 and set(c) == {"index", "function"} for c in calls[1:])
        assert len(calls) > 1 and all(c["function"]["arguments"] for c in calls[1:])
        args = "".join(c["function"]["arguments"] for c in calls)
        assert json.loads(args) == {"city": "Paris"}
        assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"

        none = await http.post("/v1/chat/completions", json={**body, "tool_choice": "none"})
        assert none.json()["choices"][0]["message"]["content"] == CALL_TEXT


async def test_chat_echo_prepends_the_assistant_message(tokenizer: Tokenizer) -> None:
    async with client(tokenizer, " purr.") as http:
        msgs = [*ASK, {"role": "assistant", "content": "Cats"}]
        body = {
            "messages": msgs,
            "add_generation_prompt": False,
            "continue_final_message": True,
            "echo": True,
        }
        r = await http.post("/v1/chat/completions", json=body)
        assert r.json()["choices"][0]["message"]["content"] == "Cats purr."
        s = await http.post("/v1/chat/completions", json={**body, "stream": True})
        events = [e for e in sse_events(s.text) if isinstance(e, dict)]
        assert (
            "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == "Cats purr."
        )


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/completions", {"logit_bias": {"49152": 1}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
        ("/v1/completions", {"allowed_token_ids": [1, 10**6]}, "allowed_token_ids"),
        ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/completions", {"guided_choice": []}, "guided_choice"),
        ("/v1/completions", {"guided_regex": "[a-"}, "guided_regex"),
        ("/v1/completions", {"guided_json": {"type": "x"}}, "guided_json"),
        ("/v1/completions", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        (
            "/v1/completions",
            {"structured_outputs": {"json": {}, "regex": "a"}},
            "structured_outputs",
        ),
        ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format.type"),
        ("/v1/chat/completions", {"response_format": {}}, "response_format.type"),
        ("/v1/completions", {"structured_outputs": {}}, "structured_outputs"),
        ("/v1/completions", {"min_tokens": 1, "allowed_token_ids": [EOS]}, "allowed_token_ids"),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema"}},
            "response_format.json_schema",
        ),
        ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
        ("/v1/chat/completions", {"tools": [{"type": "function"}]}, "tools.0.function.name"),
        (
            "/v1/chat/completions",
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice.function.name",
        ),
        (
            "/v1/chat/completions",
            {"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"},
            "guided_regex",
        ),
        ("/v1/chat/completions", {"continue_final_message": True}, "continue_final_message"),
        ("/v1/chat/completions", {"chat_template_kwargs": {"tools": 1}}, "chat_template_kwargs"),
    ],
)
async def test_bad_fields_are_400_naming_them(
    tokenizer: Tokenizer, path: str, extra: dict, param: str
) -> None:
    async with client(tokenizer, "ok") as http:
        base = {"prompt": "hi"} if path == "/v1/completions" else {"messages": ASK}
        r = await http.post(path, json={**base, **extra})
        assert_openai_error(r, 400, param)
        ok = await http.post(path, json={**base, "max_tokens": 2})
        assert ok.status_code == 200  # the server keeps serving


@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": None},
        {"response_format": {"type": "text"}},
        {"response_format": {"type": "json_object"}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
        {"structured_outputs": None},
        {"structured_outputs": {"choice": ["ok", "no"], "disable_any_whitespace": True}},
        {"structured_outputs": {"json_object": True}},
        {"structured_outputs": {"json": {"type": "object"}, "json_object": False}},
        {"guided_choice": ["ok"], "guided_json": None},
        {"min_tokens": 1, "allowed_token_ids": [EOS, 28]},
        {"min_tokens": 1, "allowed_token_ids": [EOS], "ignore_eos": True},
    ],
)
async def test_valid_constraint_forms_are_accepted(tokenizer: Tokenizer, extra: dict) -> None:
    """The forms OpenAI and vLLM accept stay accepted beside the 400s above."""
    async with client(tokenizer, "ok") as http:
        r = await http.post("/v1/chat/completions", json={"messages": ASK, **extra})
        assert r.status_code == 200, r.text


async def test_auto_tools_need_a_template_that_shows_them(tokenizer: Tokenizer) -> None:
    """SmolLM2's own template ignores 'tools': 'auto' (the default with tools) is a 400 naming
    tool_choice, as vLLM refuses 'auto' without a tool parser (new-user report: the model
    answered in prose and nothing said why); 'required' and 'none' still work; gRPC alike."""
    script = tokenizer.encode('[{"name":"get_weather","arguments":{"city":"P"}}]',
                              add_special_tokens=False) + [EOS]  # fmt: skip
    c = await start_fake_cluster(prefills=[{"script": script}], decodes=[{"script": script}])
    router = Router(RouterConfig(model_name="smollm2", max_model_len=512), tokenizer, c.pool)
    assert not await router.prompts.renders_tools()
    gw = GrpcGateway(router, host="127.0.0.1", port=0)
    await gw.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}")
    transport = httpx.ASGITransport(app=build_app(router))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            body = {"messages": ASK, "tools": [WEATHER], "max_tokens": 32}
            for extra in ({}, {"tool_choice": "auto"}):
                r = await http.post("/v1/chat/completions", json={**body, **extra})
                assert_openai_error(r, 400, "tool_choice")
                assert "template ignores 'tools'" in r.json()["error"]["message"]
            for choice in ("required", "none"):
                r = await http.post("/v1/chat/completions", json={**body, "tool_choice": choice})
                assert r.status_code == 200, r.text
        stub = gpb_grpc.GenerationStub(channel)
        chat = gpb.ChatMessages(
            messages=[gpb.ChatMessage(role="user", content="Weather in Paris?")],
            tools_json=json.dumps([WEATHER]),
        )
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Generate(gpb.GenerateRequest(chat=chat)).read()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "tool_choice" in e.value.details()
    finally:
        await channel.close()
        await gw.stop(0)
        await c.close()


async def test_json_schemas_reach_the_workers_closed(tokenizer: Tokenizer) -> None:
    """response_format, structured_outputs and guided_json schemas are closed as vLLM's default
    backend (xgrammar, strict mode) closes them: a listed object admits only its properties
    unless the schema says otherwise (new-user report: a 135M model added "gender", "country"
    to a name/age schema)."""
    person = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    open_one = {**person, "additionalProperties": True}
    script = tokenizer.encode('{"name":"A"}', add_special_tokens=False) + [EOS]
    c = await start_fake_cluster(prefills=[{"script": script}], decodes=[{"script": script}])
    router = Router(RouterConfig(model_name="smollm2", max_model_len=512), tokenizer, c.pool)
    transport = httpx.ASGITransport(app=build_app(router))
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": person}}
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            for extra, want in (
                ({"response_format": rf}, {**person, "additionalProperties": False}),
                (
                    {"structured_outputs": {"json": person}},
                    {**person, "additionalProperties": False},
                ),
                ({"guided_json": json.dumps(person)}, {**person, "additionalProperties": False}),
                ({"guided_json": open_one}, open_one),
            ):
                body = {"prompt": "Answer:", "max_tokens": 8, **extra}
                r = await http.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                spec = c.decodes[0].requests[-1].sampling.structured
                assert json.loads(spec.value) == want, extra
    finally:
        await c.close()


async def test_utility_endpoints(tokenizer: Tokenizer) -> None:
    async with client(tokenizer, "ok") as http:
        r = await http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True})
        body = r.json()
        assert body["tokens"] == tokenizer.encode("Hello world") and body["max_model_len"] == 512
        assert "".join(body["token_strs"]) == "Hello world"
        chat = await http.post(
            "/tokenize", json={"messages": ASK, "tools": [WEATHER], "add_generation_prompt": True}
        )
        text = tokenizer.decode(chat.json()["tokens"], skip_special_tokens=False)
        assert "get_weather" in text and text.endswith("<|im_start|>assistant\n")
        assert_openai_error(await http.post("/tokenize", json={}), 400, "prompt")
        d = await http.post("/detokenize", json={"tokens": body["tokens"]})
        assert d.json() == {"prompt": "Hello world"}
        assert_openai_error(await http.post("/detokenize", json={"tokens": [-1]}), 400, "tokens")
        m = await http.get("/v1/models/smollm2")
        assert m.json()["id"] == "smollm2" and m.json()["max_model_len"] == 512
        assert_openai_error(await http.get("/v1/models/gpt-4"), 404, "model")


async def test_tokenize_renders_and_checks_messages_as_chat_does(tokenizer: Tokenizer) -> None:
    """/tokenize counts the prompt a chat completion would send: the assistant's tool calls and
    the tool's answer are rendered, and a malformed call or tool list is the same 400 naming the
    field."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    msgs = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21"}]  # fmt: skip
    async with client(tokenizer, "ok") as http:
        r = await http.post("/tokenize", json={"messages": msgs, "tools": [WEATHER]})
        text = tokenizer.decode(r.json()["tokens"], skip_special_tokens=False)
        assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
        assert "<tool_response>\n21\n</tool_response>" in text
        bad = [*msgs[:1], {**msgs[1], "tool_calls": [{**call, "function": {"name": 5}}]}]
        err = assert_openai_error(
            await http.post("/tokenize", json={"messages": bad}),
            400,
            "messages.1.tool_calls.0.function.name",
        )
        assert "'messages[1].tool_calls[0].function.name' must be a string" in err["message"]
        dup = {"messages": ASK, "tools": [WEATHER, WEATHER]}
        err = assert_openai_error(await http.post("/tokenize", json=dup), 400, "tools")
        assert "get_weather" in err["message"] and "twice" in err["message"]


# -- gRPC parity ------------------------------------------------------------------------------


async def test_grpc_tools_structured_and_chat_controls(tokenizer: Tokenizer) -> None:
    script = tokenizer.encode(CALL_TEXT, add_special_tokens=False) + [EOS]
    c = await start_fake_cluster(prefills=[{"script": script}], decodes=[{"script": script}])
    cfg = RouterConfig(model_name="smollm2", max_model_len=512, chat_template=TEMPLATE)
    gw = GrpcGateway(Router(cfg, tokenizer, c.pool), host="127.0.0.1", port=0)
    await gw.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}")
    try:
        stub = gpb_grpc.GenerationStub(channel)
        chat = gpb.ChatMessages(
            messages=[gpb.ChatMessage(role="user", content="Weather in Paris?")],
            tools_json=json.dumps([WEATHER]),
        )
        sampling = wpb.SamplingParams(max_tokens=64, prompt_logprobs=1)
        sampling.logit_bias[5] = -3.0
        out = [r async for r in stub.Generate(gpb.GenerateRequest(chat=chat, sampling=sampling))]
        done = out[-1].complete
        assert done.finish_reason == "tool_calls" and done.text == "Sure."
        assert [(t.name, json.loads(t.arguments)) for t in done.tool_calls] == [
            ("get_weather", {"city": "Paris"})
        ]
        sent = c.decodes[0].requests[-1].sampling
        assert dict(sent.logit_bias) == {5: -3.0} and sent.prompt_logprobs == 1

        forced = gpb.ChatMessages(
            messages=chat.messages, tools_json=chat.tools_json, tool_choice_json='"required"'
        )
        await stub.Generate(
            gpb.GenerateRequest(chat=forced, sampling=wpb.SamplingParams(max_tokens=8))
        ).read()
        spec = c.decodes[0].requests[-1].sampling.structured
        assert spec.kind == "json_schema" and spec.field == "tools"

        bad = [
            (gpb.ChatMessages(messages=chat.messages, tools_json="{"), "tools_json"),
            (
                gpb.ChatMessages(messages=chat.messages, tool_choice_json='"required"'),
                "tool_choice",
            ),
            (
                gpb.ChatMessages(
                    messages=chat.messages, add_generation_prompt=True, continue_final_message=True
                ),
                "continue_final_message",
            ),
        ]
        for msgs, word in bad:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Generate(gpb.GenerateRequest(chat=msgs)).read()
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and word in e.value.details()
        regex = wpb.SamplingParams(structured=wpb.StructuredOutput(kind="regex", value="[a-"))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Generate(gpb.GenerateRequest(text="hi", sampling=regex)).read()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "'sampling.structured'" in e.value.details()  # the field the gRPC client set
        # a JSON schema reaches the workers closed, as on the HTTP path
        person = {"type": "object", "properties": {"name": {"type": "string"}}}
        closed = wpb.SamplingParams(
            max_tokens=4,
            structured=wpb.StructuredOutput(kind="json_schema", value=json.dumps(person)),
        )
        await stub.Generate(gpb.GenerateRequest(text="hi", sampling=closed)).read()
        sent = json.loads(c.decodes[0].requests[-1].sampling.structured.value)
        assert sent == {**person, "additionalProperties": False}
    finally:
        await channel.close()
        await gw.stop(0)
        await c.close()


async def test_a_named_tool_call_streams_its_arguments(tokenizer: Tokenizer) -> None:
    """tool_choice naming a function: the call's arguments stream as they are generated (id,
    type and name in the first entry, as OpenAI and vLLM send them), and no chunk is empty.
    finish_reason is "stop", streamed or not, as OpenAI answers a forced named function (and
    vLLM since its PR 25054); "required" and "auto" calls finish with "tool_calls"."""
    args = '{"city": "Paris", "unit": "celsius"}'
    async with client(tokenizer, args) as http:
        named = {"type": "function", "function": {"name": "get_weather"}}
        body = {"messages": ASK, "tools": [WEATHER], "tool_choice": named, "max_tokens": 64}
        whole = (await http.post("/v1/chat/completions", json=body)).json()["choices"][0]
        assert whole["finish_reason"] == "stop"
        assert json.loads(whole["message"]["tool_calls"][0]["function"]["arguments"]) == (
            json.loads(args)
        )
        s = await http.post("/v1/chat/completions", json={**body, "stream": True})
        choices = [e["choices"][0] for e in sse_events(s.text) if isinstance(e, dict)]
        assert choices[0]["delta"]["role"] == "assistant"
        calls = [tc for c in choices for tc in c["delta"].get("tool_calls") or []]
        assert len(calls) > 3  # piece by piece, not one entry at the end
        head, *rest = calls
        assert head["index"] == 0 and head["type"] == "function"
        assert head["id"].startswith("call_") and head["function"]["name"] == "get_weather"
        assert all(tc == {"index": 0, "function": {"arguments": tc["function"]["arguments"]}}
                   for tc in rest)  # fmt: skip
        assert "".join(tc["function"]["arguments"] for tc in calls) == args
        assert all(c["delta"] or c["finish_reason"] for c in choices)  # no empty chunk
        assert choices[-1]["finish_reason"] == "stop"
        assert not any(c["delta"].get("content") for c in choices)
        # cut by max_tokens it is still "length"
        short = (await http.post("/v1/chat/completions", json={**body, "max_tokens": 3})).json()
        assert short["choices"][0]["finish_reason"] == "length"


async def test_grpc_finish_reason_of_a_named_and_a_required_call(tokenizer: Tokenizer) -> None:
    """The gRPC API answers as the HTTP one: "stop" for a named tool_choice, "tool_calls" for
    "required" (whose output is a JSON array of calls)."""
    args = '{"city": "Paris"}'
    for choice, answer, reason in (
        ({"type": "function", "function": {"name": "get_weather"}}, args, "stop"),
        ("required", f'[{{"name": "get_weather", "arguments": {args}}}]', "tool_calls"),
    ):
        script = tokenizer.encode(answer, add_special_tokens=False) + [EOS]
        c = await start_fake_cluster(prefills=[{"script": script}], decodes=[{"script": script}])
        cfg = RouterConfig(model_name="smollm2", max_model_len=512, chat_template=TEMPLATE)
        gw = GrpcGateway(Router(cfg, tokenizer, c.pool), host="127.0.0.1", port=0)
        await gw.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as channel:
                chat = gpb.ChatMessages(
                    messages=[gpb.ChatMessage(role="user", content="Weather in Paris?")],
                    tools_json=json.dumps([WEATHER]),
                    tool_choice_json=json.dumps(choice),
                )
                req = gpb.GenerateRequest(chat=chat, sampling=wpb.SamplingParams(max_tokens=64))
                out = [r async for r in gpb_grpc.GenerationStub(channel).Generate(req)]
            done = out[-1].complete
            assert done.finish_reason == reason, choice
            assert [(t.name, json.loads(t.arguments)) for t in done.tool_calls] == [
                ("get_weather", {"city": "Paris"})
            ]
        finally:
            await gw.stop(0)
            await c.close()


async def test_unknown_fields_are_ignored_with_a_warning_naming_them(
    tokenizer: Tokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    """New-user (session 40): a typo such as 'max_token' was ignored without a trace; as vLLM,
    the request still runs and the server's log names what it ignored."""
    async with client(tokenizer, answer="Hi there.") as http:
        with caplog.at_level("WARNING", logger="router.openai_protocol"):
            r = await http.post(
                "/v1/completions",
                json={"model": "smollm2", "prompt": "Hi", "max_tokens": 3, "max_token": 5,
                      "temperatur": 0},
            )  # fmt: skip
            assert r.status_code == 200, r.text
            r = await http.post(
                "/v1/chat/completions",
                json={"model": "smollm2", "messages": ASK, "max_tokens": 3},
            )
            assert r.status_code == 200, r.text
    warned = [rec.getMessage() for rec in caplog.records if "ignored" in rec.getMessage()]
    assert warned == [
        "request fields ignored (not known to CompletionRequest): 'max_token', 'temperatur'"
    ]
