"""Issue 13 on a real server (bundled SmolLM2, float32): prompt logprobs (echo + logprobs,
max_tokens 0, vLLM's prompt_logprobs) against transformers, logit_bias, structured output
(JSON schema, json_object, guided_choice, guided_regex), tools, chat-template controls, the
utility endpoints, and disaggregated == unified for prompt logprobs and grammar output.

One disaggregated server (1 prefill + 1 decode worker) with a Hermes-style ``--chat-template``
serves the module; the unified comparison starts a second server at the end.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import torch
from serve_process import ServeProcess
from transformers import AutoModelForCausalLM

from pdserve.model.resolve import resolve_model
from pdserve.tokenizer import Tokenizer, load_tokenizer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

TEMPLATE = Path(__file__).resolve().parents[1] / "fixtures" / "hermes_template.jinja"
ARGS = ["--dtype", "float32", "--chat-template", str(TEMPLATE)]
PROMPT = "The capital of France is"
# nested objects, arrays, enums, integers and numbers (bounded lengths: small outputs)
SCHEMA: dict[str, Any] = json.loads((TEMPLATE.parent / "person_schema.json").read_text())
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    srv = ServeProcess(ARGS)
    try:
        srv.wait_ready()
        yield srv
    finally:
        assert srv.stop() == 0, srv.last_output


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer("smollm2")


def _post(server: ServeProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=600)


def _echo(server: ServeProcess) -> dict[str, Any]:
    body = {"prompt": PROMPT, "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


# -- prompt logprobs ----------------------------------------------------------------------------


def _running_sums(tokens: list[str]) -> list[int]:
    out, at = [], 0
    for t in tokens:
        out.append(at)
        at += len(t)
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_echo_text_offsets_only_go_up(server: ServeProcess, tok: Tokenizer, stream: bool) -> None:
    """A prompt holding a special token (skipped in the text) and a character split over byte
    tokens: text_offset stays the running sum of the tokens' lengths (as vLLM), never going back
    at the prompt / completion boundary."""
    prompt = [1, *tok.encode("日本語 ok")]  # 1: <|im_start|>
    body = {"prompt": prompt, "max_tokens": 3, "echo": True, "logprobs": 1, "temperature": 0}
    if not stream:
        r = _post(server, "/v1/completions", body)
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        tokens, offsets = lp["tokens"], lp["text_offset"]
    else:
        tokens, offsets = [], []
        with httpx.stream(
            "POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=120
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        if c.get("logprobs"):
                            tokens += c["logprobs"]["tokens"]
                            offsets += c["logprobs"]["text_offset"]
    assert len(tokens) == len(prompt) + 3
    assert offsets == _running_sums(tokens)


def test_echo_logprobs_equal_transformers(server: ServeProcess, tok: Tokenizer) -> None:
    ids = tok.encode(PROMPT)
    out = _echo(server)
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1  # every prompt token, then the completion's
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) for x in lp["token_logprobs"][1:])
    assert out["choices"][0]["text"].startswith(PROMPT)
    assert "".join(lp["tokens"]) == out["choices"][0]["text"]

    path = resolve_model("smollm2").path
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)
    ref_sum = sum(ref[j, ids[j + 1]].item() for j in range(len(ids) - 1))
    ours = sum(lp["token_logprobs"][1 : len(ids)])
    assert abs(ours - ref_sum) < 1e-3, (ours, ref_sum)

    # max_tokens 0 with echo scores the prompt without generating
    r = _post(
        server,
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 0},
    )
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["text"] == PROMPT and len(c["logprobs"]["tokens"]) == len(ids)
    assert c["logprobs"]["token_logprobs"][1:] == lp["token_logprobs"][1 : len(ids)]
    assert r.json()["usage"]["completion_tokens"] == 0

    # vLLM's prompt_logprobs on chat: one entry per prompt token, null first
    msgs = [{"role": "user", "content": "Hi"}]
    r = _post(
        server,
        "/v1/chat/completions",
        {"messages": msgs, "max_tokens": 2, "prompt_logprobs": 2, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    plp = r.json()["prompt_logprobs"]
    assert plp[0] is None and len(plp) == r.json()["usage"]["prompt_tokens"]
    assert all(1 <= len(e) <= 3 for e in plp[1:])
    # every entry has its vocabulary rank, the prompt token's too when outside the top 2
    assert all(isinstance(v["rank"], int) and v["rank"] >= 1 for e in plp[1:] for v in e.values())
    assert any(v["rank"] > 2 for e in plp[1:] for v in e.values())  # "Hi" is no likely token


# -- logit_bias ---------------------------------------------------------------------------------


def test_logit_bias_forces_and_bans(
    server: ServeProcess, client: openai.OpenAI, tok: Tokenizer
) -> None:
    r = client.chat.completions.create(
        model="smollm2", messages=ASK_WEATHER, max_tokens=1, temperature=0, logit_bias={"1": 100}
    )  # the request: token 1 is <|im_start|>, a special token (hidden from the text)
    assert r.choices[0].finish_reason == "length"
    lp = client.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0,
        logit_bias={"1": 100},
    )  # fmt: skip
    assert lp.choices[0].logprobs.tokens == [tok.decode([1], skip_special_tokens=False)]

    base = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=1, temperature=0)
    greedy = tok.encode(base.choices[0].text, add_special_tokens=False)[0]
    forced = tok.encode(" banana", add_special_tokens=False)[0]
    up = client.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=1, temperature=0,
        logit_bias={str(forced): 100},
    )  # fmt: skip
    assert tok.encode(up.choices[0].text, add_special_tokens=False)[0] == forced
    down = client.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=1, temperature=0,
        logit_bias={str(greedy): -100},
    )  # fmt: skip
    assert down.choices[0].text != base.choices[0].text

    for key in ("49152", "-3", "x"):
        bad = _post(server, "/v1/completions", {"prompt": PROMPT, "logit_bias": {key: 5}})
        assert bad.status_code == 400, bad.text
        err = bad.json()["error"]
        assert err["param"] == "logit_bias" and key in err["message"]
    again = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=1, temperature=0)
    assert again.choices[0].text == base.choices[0].text  # still serving


# -- structured output ----------------------------------------------------------------------------


def test_json_schema_outputs_validate(client: openai.OpenAI) -> None:
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
    }

    async def one(aclient: openai.AsyncOpenAI, i: int) -> str:
        r = await aclient.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": f"Describe person number {i} as JSON."}],
            response_format=fmt,  # type: ignore[arg-type]
            max_tokens=200,
            temperature=0.8,
            seed=i,
        )
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        return r.choices[0].message.content or ""

    async def run() -> list[str]:
        aclient = openai.AsyncOpenAI(
            base_url=client.base_url, api_key="none", max_retries=0, timeout=600
        )
        return await asyncio.gather(*(one(aclient, i) for i in range(20)))

    texts = asyncio.run(run())
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 1  # seeded sampling, not one forced string

    # streamed == non-streamed for a fixed seed
    kw: dict[str, Any] = dict(
        model="smollm2", messages=ASK_WEATHER, response_format=fmt, max_tokens=200,
        temperature=0.8, seed=7,
    )  # fmt: skip
    whole = client.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(stream=True, **kw)
        if c.choices
    )
    assert streamed == whole

    obj = client.chat.completions.create(
        model="smollm2", messages=ASK_WEATHER, response_format={"type": "json_object"},
        max_tokens=120, temperature=0,
    )  # fmt: skip
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)


def test_guided_choice_regex_and_first_token(client: openai.OpenAI) -> None:
    choices = ["positive", "negative", "neutral"]
    for seed in range(4):
        r = client.completions.create(
            model="smollm2", prompt="Sentiment of 'I love it':", max_tokens=10,
            temperature=1.0, seed=seed, extra_body={"guided_choice": choices},
        )  # fmt: skip
        assert r.choices[0].text in choices
    # token 1 is sampled on the prefill worker: it obeys the grammar too
    first = client.completions.create(
        model="smollm2", prompt="Sentiment:", max_tokens=1, temperature=1.0, seed=3,
        extra_body={"guided_choice": ["zebra crossing", "xylophone"]},
    )  # fmt: skip
    assert any(c.startswith(first.choices[0].text) for c in ["zebra crossing", "xylophone"])
    assert first.choices[0].text
    date = client.completions.create(
        model="smollm2", prompt="Today's date is", max_tokens=20, temperature=0.7, seed=1,
        extra_body={"guided_regex": r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"},
    )  # fmt: skip
    assert re.fullmatch(r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])", date.choices[0].text)


def test_uncompilable_schema_is_a_400(server: ServeProcess) -> None:
    body = {
        "messages": ASK_WEATHER,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "nope"}},
        },
    }
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "response_format.json_schema.schema", r.text


# -- tools --------------------------------------------------------------------------------------


def test_tool_choice_required_streamed_and_not(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(
        model="smollm2", messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required",
        max_tokens=100, temperature=0,
    )  # fmt: skip
    r = client.chat.completions.create(**kw)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls
    assert calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")
    args = json.loads(calls[0].function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])

    names, arguments, finish = [], {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                if tc.function and tc.function.name:
                    names.append(tc.function.name)
                arguments[tc.index] = arguments.get(tc.index, "") + (tc.function.arguments or "")
            finish = c.finish_reason or finish
    assert names == ["get_weather"] and finish == "tool_calls"
    assert json.loads(arguments[0]) == args

    named = client.chat.completions.create(
        **{**kw, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    )
    assert named.choices[0].finish_reason == "stop"  # as OpenAI answers a forced named function
    jsonschema.validate(
        json.loads(named.choices[0].message.tool_calls[0].function.arguments),  # type: ignore[index]
        WEATHER["function"]["parameters"],
    )


def test_conversation_with_a_tool_message(client: openai.OpenAI) -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}  # fmt: skip
    r = client.chat.completions.create(
        model="smollm2",
        messages=[
            *ASK_WEATHER,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {
                "role": "tool",
                "tool_call_id": "call_1",
                "content": '{"temperature": 21, "sky": "sunny"}',
            },
        ],  # type: ignore[list-item]
        tools=[WEATHER],  # type: ignore[list-item]
        max_tokens=30,
        temperature=0,
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage is not None and r.usage.prompt_tokens > 60  # tools and the result rendered


# -- chat-template controls and utility endpoints -------------------------------------------------


def test_continue_final_message(server: ServeProcess, client: openai.OpenAI) -> None:
    msgs = [
        {"role": "user", "content": "Write one sentence about cats."},
        {"role": "assistant", "content": "Cats are"},
    ]
    closed = client.chat.completions.create(
        model="smollm2", messages=msgs, max_tokens=8, temperature=0,  # type: ignore[arg-type]
        extra_body={"add_generation_prompt": False},
    )  # fmt: skip
    cont = client.chat.completions.create(
        model="smollm2", messages=msgs, max_tokens=8, temperature=0,  # type: ignore[arg-type]
        extra_body={"add_generation_prompt": False, "continue_final_message": True, "echo": True},
    )  # fmt: skip
    assert cont.usage is not None and closed.usage is not None
    assert cont.usage.prompt_tokens < closed.usage.prompt_tokens
    text = cont.choices[0].message.content or ""
    assert text.startswith("Cats are") and len(text) > len("Cats are")
    both = _post(
        server,
        "/v1/chat/completions",
        {"messages": msgs, "add_generation_prompt": True, "continue_final_message": True},
    )
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_utility_endpoints(server: ServeProcess, tok: Tokenizer) -> None:
    r = _post(server, "/tokenize", {"prompt": PROMPT})
    assert r.status_code == 200 and r.json()["tokens"] == tok.encode(PROMPT)
    assert r.json()["count"] == len(tok.encode(PROMPT)) and r.json()["max_model_len"] == 2048
    d = _post(server, "/detokenize", {"tokens": r.json()["tokens"]})
    assert d.json()["prompt"] == PROMPT
    assert _post(server, "/detokenize", {"tokens": [10**6]}).json()["error"]["param"] == "tokens"
    chat = _post(server, "/tokenize", {"messages": ASK_WEATHER})
    assert chat.status_code == 200 and chat.json()["count"] > 5
    m = httpx.get(f"{server.url}/v1/models/smollm2", timeout=30)
    assert m.status_code == 200 and m.json()["max_model_len"] == 2048
    assert httpx.get(f"{server.url}/v1/models/other", timeout=30).status_code == 404
    listed = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]
    assert listed["max_model_len"] == 2048


# -- disaggregated == unified -----------------------------------------------------------------------


def test_unified_matches_disaggregated(server: ServeProcess, client: openai.OpenAI) -> None:
    disagg = _echo(server)
    guided = client.completions.create(
        model="smollm2", prompt="A person as JSON:", max_tokens=120, temperature=0.8, seed=5,
        extra_body={"guided_json": SCHEMA},
    ).choices[0].text  # fmt: skip
    unified = ServeProcess([*ARGS, "--mode", "unified"])
    try:
        unified.wait_ready()
        uni = _echo(unified)
        a = disagg["choices"][0]["logprobs"]["token_logprobs"]
        b = uni["choices"][0]["logprobs"]["token_logprobs"]
        assert a[0] is None and b[0] is None
        assert max(abs(x - y) for x, y in zip(a[1:], b[1:], strict=True)) < 1e-4
        uclient = openai.OpenAI(
            base_url=f"{unified.url}/v1", api_key="none", max_retries=0, timeout=600
        )
        same = uclient.completions.create(
            model="smollm2", prompt="A person as JSON:", max_tokens=120, temperature=0.8, seed=5,
            extra_body={"guided_json": SCHEMA},
        ).choices[0].text  # fmt: skip
        assert same == guided
    finally:
        assert unified.stop() == 0, unified.last_output
