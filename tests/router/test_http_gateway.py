"""OpenAI HTTP gateway against fake workers: shapes, streaming, errors, auth, disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator

import httpx
import pytest
import uvicorn
from fake_workers import EOS, FakeCluster, start_fake_cluster

from pdserve.tokenizer import Tokenizer
from router.background import drain_background
from router.http import build_app
from router.serving import Router, RouterConfig

pytestmark = pytest.mark.timeout(60)

ANSWER = " The capital of France is Paris."
MSGS = [{"role": "user", "content": "What is the capital of France?"}]


class Env:
    def __init__(self, cluster: FakeCluster, router: Router, client: httpx.AsyncClient) -> None:
        self.cluster, self.router, self.client = cluster, router, client


@contextlib.asynccontextmanager
async def env(
    tokenizer: Tokenizer, api_key: str | None = None, decode: dict | None = None, **cfg: object
) -> AsyncIterator[Env]:
    script = tokenizer.encode(ANSWER, add_special_tokens=False) + [EOS]
    c = await start_fake_cluster(
        prefills=[{"script": script}], decodes=[{"script": script, **(decode or {})}]
    )
    router = Router(
        RouterConfig(model_name="smollm2", max_model_len=int(cfg.pop("max_model_len", 512)), **cfg),  # type: ignore[arg-type,call-overload]
        tokenizer,
        c.pool,
    )
    app = build_app(router, api_key=api_key)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        try:
            yield Env(c, router, client)
        finally:
            await c.close()


def sse_events(text: str) -> list[dict | str]:
    out: list[dict | str] = []
    for line in text.splitlines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


async def post_with(e: Env, path: str, field: str, value: object) -> httpx.Response:
    """POST a short request to ``path`` (chat messages or a completions prompt) with ``field``
    set to ``value`` and max_tokens 4."""
    prompt = {"messages": MSGS} if "chat" in path else {"prompt": "hi"}
    return await e.client.post(path, json={**prompt, field: value, "max_tokens": 4})


async def test_chat_completion_non_streaming(tokenizer: Tokenizer) -> None:
    async with env(tokenizer) as e:
        r = await e.client.post(
            "/v1/chat/completions", json={"model": "smollm2", "messages": MSGS, "max_tokens": 64}
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
        (choice,) = body["choices"]
        assert choice["message"] == {"role": "assistant", "content": ANSWER}
        assert choice["finish_reason"] == "stop" and choice["logprobs"] is None
        usage = body["usage"]
        prompt_len = len(tokenizer.apply_chat_template(MSGS))
        assert usage["prompt_tokens"] == prompt_len
        assert usage["total_tokens"] == prompt_len + usage["completion_tokens"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 0


async def test_chat_streaming_one_token_per_chunk_with_usage(tokenizer: Tokenizer) -> None:
    async with env(tokenizer) as e:
        r = await e.client.post(
            "/v1/chat/completions",
            json={
                "messages": MSGS,
                "stream": True,
                "stream_options": {"include_usage": True},
                "logprobs": True,
                "top_logprobs": 2,
            },
        )
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        chunks = [ev for ev in events[:-1] if isinstance(ev, dict)]
        usage_chunk = chunks[-1]
        assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] > 0
        body = chunks[:-1]
        assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in body)
        # the role rides in the first token's chunk: nothing goes out before the first token
        assert body[0]["choices"][0]["delta"]["role"] == "assistant"
        assert body[0]["choices"][0]["delta"]["content"] != ""
        assert all("role" not in c["choices"][0]["delta"] for c in body[1:])
        token_chunks = body
        n_tokens = usage_chunk["usage"]["completion_tokens"]
        assert len(token_chunks) == n_tokens  # one chunk per token, EOS (the finish) included
        assert all(c["choices"][0]["finish_reason"] is None for c in body[:-1])
        assert body[-1]["choices"][0]["finish_reason"] == "stop"
        assert (
            body[-1]["choices"][0]["stop_reason"] is None and body[-1]["choices"][0]["delta"] == {}
        )
        assert all(c["choices"][0]["delta"] for c in body[:-1])  # no empty token chunk
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in body)
        assert text == ANSWER
        lp = token_chunks[0]["choices"][0]["logprobs"]["content"][0]
        assert set(lp) == {"token", "logprob", "bytes", "top_logprobs"}
        assert len(lp["top_logprobs"]) == 2 and lp["bytes"] == list(lp["token"].encode())


async def test_completions_echo_logprobs_and_multiple_prompts(tokenizer: Tokenizer) -> None:
    async with env(tokenizer) as e:
        r = await e.client.post(
            "/v1/completions", json={"prompt": "Capital:", "echo": True, "max_tokens": 4}
        )
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        assert choice["text"].startswith("Capital:") and choice["finish_reason"] == "length"

        r = await e.client.post(
            "/v1/completions", json={"prompt": [[1, 2, 3]], "max_tokens": 3, "logprobs": 1}
        )
        lp = r.json()["choices"][0]["logprobs"]
        assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        assert len(lp["tokens"]) == 3 and lp["text_offset"][0] == 0
        assert all(len(t) == 1 for t in lp["top_logprobs"])

        # logprobs 0: no alternatives, but the chosen token's own entry (OpenAI, vLLM)
        r = await e.client.post(
            "/v1/completions", json={"prompt": [[1, 2, 3]], "max_tokens": 3, "logprobs": 0}
        )
        lp = r.json()["choices"][0]["logprobs"]
        assert [list(t) for t in lp["top_logprobs"]] == [[tok] for tok in lp["tokens"]]
        assert [t[tok] for t, tok in zip(lp["top_logprobs"], lp["tokens"], strict=True)] == (
            lp["token_logprobs"]
        )

        r = await e.client.post(
            "/v1/completions", json={"prompt": ["a", "b"], "n": 2, "max_tokens": 2}
        )
        body = r.json()
        assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
        assert body["usage"]["completion_tokens"] == 8


async def test_completions_streaming_echo_and_finish(tokenizer: Tokenizer) -> None:
    async with env(tokenizer) as e:
        r = await e.client.post(
            "/v1/completions",
            json={"prompt": "Q:", "echo": True, "stream": True, "max_tokens": 3},
        )
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        chunks = [ev for ev in events if isinstance(ev, dict)]
        assert chunks[0]["choices"][0]["text"] == "Q:"
        # echo, 2 tokens, then the 3rd (last) token carries finish_reason "length"
        assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 3 + ["length"]
        assert chunks[-1]["choices"][0]["text"] and chunks[-1]["choices"][0]["stop_reason"] is None
        assert "".join(c["choices"][0]["text"] for c in chunks) == "Q:" + " The capital of"


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        ({"messages": MSGS, "max_tokens": "many"}, "max_tokens"),
        ({"messages": MSGS, "max_tokens": 0}, "max_tokens"),
        ({"messages": MSGS, "max_tokens": -3}, "max_tokens"),
        ({"messages": MSGS, "n": 0}, "n"),
        ({"messages": MSGS, "temperature": -1}, "temperature"),
        ({"messages": MSGS, "top_logprobs": 3}, "top_logprobs"),
        ({"messages": []}, "messages"),
        ({"max_tokens": 5}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        ({"messages": MSGS, "stop": 5}, "stop"),
    ],
)
async def test_bad_input_gives_openai_400_naming_the_field(
    tokenizer: Tokenizer, payload: dict, param: str
) -> None:
    async with env(tokenizer) as e:
        r = await e.client.post("/v1/chat/completions", json=payload)
        err = assert_openai_error(r, 400, param)
        assert err["type"] == "invalid_request_error"


async def test_malformed_json_long_prompt_and_unknown_model_then_normal_service(
    tokenizer: Tokenizer,
) -> None:
    async with env(tokenizer, max_model_len=64) as e:
        r = await e.client.post(
            "/v1/chat/completions",
            content=b'{"messages": [',
            headers={"content-type": "application/json"},
        )
        assert "not valid JSON" in assert_openai_error(r, 400)["message"]
        long = [{"role": "user", "content": "word " * 200}]
        r = await e.client.post("/v1/chat/completions", json={"messages": long, "max_tokens": 4})
        err = assert_openai_error(r, 400)
        assert "64" in err["message"] and err["code"] == "context_length_exceeded"
        r = await e.client.post("/v1/completions", json={"prompt": "x" * 10, "max_tokens": 62})
        assert "62" in assert_openai_error(r, 400, "max_tokens")["message"]
        r = await e.client.post("/v1/chat/completions", json={"model": "gpt-9", "messages": MSGS})
        assert assert_openai_error(r, 404, "model")["code"] == "model_not_found"
        r = await e.client.get("/v1/nothing")
        assert_openai_error(r, 404)
        r = await e.client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 8})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


async def test_api_key_is_enforced(tokenizer: Tokenizer) -> None:
    async with env(tokenizer, api_key="sekret") as e:
        r = await e.client.get("/v1/models")
        assert assert_openai_error(r, 401)["code"] == "invalid_api_key"
        r = await e.client.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert_openai_error(r, 401)
        r = await e.client.get("/v1/models", headers={"Authorization": "Bearer sekret"})
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "smollm2"
        for value in ("bearer sekret", "BEARER sekret"):  # RFC 7235: any case (QA D8)
            r = await e.client.get("/v1/models", headers={"Authorization": value})
            assert r.status_code == 200, value
        for value in ("Basic sekret", "sekret", "bearer sekret2"):
            assert_openai_error(
                await e.client.get("/v1/models", headers={"Authorization": value}), 401
            )
        assert (await e.client.get("/health")).status_code == 200
        assert (await e.client.get("/metrics")).status_code == 200  # open, as vLLM's


async def test_models_health_and_metrics(tokenizer: Tokenizer) -> None:
    async with env(tokenizer) as e:
        models = (await e.client.get("/v1/models")).json()
        assert models["object"] == "list"
        assert models["data"][0]["max_model_len"] == 512
        health = await e.client.get("/health")
        assert health.status_code == 200 and health.json()["decode_workers"] == 1
        await e.client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 4})
        text = (await e.client.get("/metrics")).text
        for name in (
            "pdserve_time_to_first_token_seconds",
            "pdserve_time_per_output_token_seconds",
            "pdserve_requests_finished_total",
            "pdserve_worker_kv_cache_usage",
        ):
            assert name in text
        await e.cluster.kill("decode-0")
        await e.cluster.pool.poll_once()
        await e.cluster.pool.poll_once()
        assert (await e.client.get("/health")).status_code == 503


async def test_overload_gives_429_with_retry_after(tokenizer: Tokenizer) -> None:
    async with env(tokenizer, decode={"accept_delay_s": 0.3}, max_queued_requests=1) as e:
        body = {"messages": MSGS, "max_tokens": 2}
        first = asyncio.ensure_future(e.client.post("/v1/chat/completions", json=body))
        while e.router.admission.num_queued == 0:
            await asyncio.sleep(0.005)
        r = await e.client.post("/v1/chat/completions", json=body)
        err = assert_openai_error(r, 429)
        assert err["type"] == "rate_limit_error" and int(r.headers["Retry-After"]) >= 1
        assert (await first).status_code == 200


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def live_server(app) -> AsyncIterator[str]:  # type: ignore[no-untyped-def]
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


async def _wait_released(e: Env, timeout_s: float = 2.0) -> None:
    end = time.monotonic() + timeout_s
    while e.cluster.decodes[0].held or e.router.admission.num_queued:
        assert time.monotonic() < end, "KV still held after the client disconnected"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_aborts_on_workers(tokenizer: Tokenizer, stream: bool) -> None:
    async with env(tokenizer, decode={"step_s": 0.05}) as e:
        app = build_app(e.router)
        body = {"prompt": [1, 2, 3], "max_tokens": 200, "ignore_eos": True, "stream": stream}
        async with live_server(app) as url, httpx.AsyncClient(base_url=url) as client:
            if stream:
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    lines = 0
                    async for line in r.aiter_lines():
                        lines += line.startswith("data: ")
                        if lines == 4:
                            break
            else:
                task = asyncio.ensure_future(client.post("/v1/completions", json=body))
                while not e.cluster.decodes[0].held:
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.2)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            assert e.cluster.decodes[0].requests
            await _wait_released(e)
            await drain_background()
            assert e.cluster.decodes[0].aborted
