"""Hostile-input limits (issue 12): stop lists, request head size and concurrent SSE streams.

Each limit lives in one place (stop: pdserve/sampling_params.py; head: router/server.py; streams:
router/http/stream_limit.py) and its error names the field and the limit.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import pytest
from test_http_gateway import MSGS, assert_openai_error, env, live_server, post_with

from pdserve.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from pdserve.tokenizer import Tokenizer
from router.http import build_app
from router.http.header_limit import MAX_HEADER_BYTES
from router.server import Frontend, FrontendConfig

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize(
    ("field", "value", "limit"),
    [
        ("stop", [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)], MAX_STOP_STRINGS),
        ("stop", "x" * (MAX_STOP_STRING_CHARS + 1), MAX_STOP_STRING_CHARS),
        ("stop_token_ids", [5] * (MAX_STOP_TOKEN_IDS + 1), MAX_STOP_TOKEN_IDS),
    ],
)
async def test_stop_limits_are_400_naming_field_and_limit(
    tokenizer: Tokenizer, path: str, field: str, value: object, limit: int
) -> None:
    async with env(tokenizer) as e:
        r = await post_with(e, path, field, value)
        assert str(limit) in assert_openai_error(r, 400, field)["message"]
        at_limit = value[:limit] if isinstance(value, list) else value[:limit]
        r = await post_with(e, path, field, at_limit)
        assert r.status_code == 200, r.text


@contextlib.asynccontextmanager
async def frontend(tokenizer: Tokenizer) -> AsyncIterator[str]:
    """The real Frontend (uvicorn configured as `pdserve serve` does) on loopback ports."""
    async with env(tokenizer) as e:
        fe = Frontend(e.router, FrontendConfig(host="127.0.0.1", port=0, grpc_port=0))
        await fe.start()
        try:
            yield f"http://127.0.0.1:{fe.http_port}"
        finally:
            await fe.stop()
            fe.release_signals()


async def test_oversized_request_head_is_4xx_and_server_keeps_serving(
    tokenizer: Tokenizer,
) -> None:
    async with frontend(tokenizer) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            big = {"x-padding": "a" * (MAX_HEADER_BYTES + 1024)}
            r = await client.post("/v1/chat/completions", json={"messages": MSGS}, headers=big)
            assert r.status_code in (400, 431), r.text
            many = {f"x-h{i}": "b" * 100 for i in range(MAX_HEADER_BYTES // 100)}
            r = await client.get("/health", headers=many)
            assert r.status_code in (400, 431), r.text
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            ok = {"x-padding": "a" * 8192}  # a large but sane header passes
            body = {"messages": MSGS, "max_tokens": 4}
            r = await client.post("/v1/chat/completions", json=body, headers=ok)
            assert r.status_code == 200, r.text


async def test_concurrent_streams_are_capped_with_429_retry_after(tokenizer: Tokenizer) -> None:
    async with env(tokenizer, decode={"step_s": 0.05}) as e:
        app = build_app(e.router, max_concurrent_streams=2)
        body = {"prompt": [1, 2, 3], "max_tokens": 400, "ignore_eos": True, "stream": True}
        async with live_server(app) as url, httpx.AsyncClient(base_url=url, timeout=20) as client:
            async with contextlib.AsyncExitStack() as open_streams:
                for _ in range(2):
                    r = await open_streams.enter_async_context(
                        client.stream("POST", "/v1/completions", json=body)
                    )
                    assert r.status_code == 200
                assert app.state.streams.num_open == 2
                for path, prompt in (
                    ("/v1/completions", {"prompt": "hi"}),
                    ("/v1/chat/completions", {"messages": MSGS}),
                ):
                    r = await client.post(path, json={**prompt, "stream": True, "max_tokens": 2})
                    err = assert_openai_error(r, 429, "stream")
                    assert "--max-concurrent-streams 2" in err["message"]
                    assert int(r.headers["Retry-After"]) >= 1
                # non-streaming requests are not counted
                r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                assert r.status_code == 200, r.text
            # both streams were closed by the client mid-way: their slots are free again
            for _ in range(200):
                if app.state.streams.num_open == 0:
                    break
                await asyncio.sleep(0.01)
            assert app.state.streams.num_open == 0
            short = {**body, "max_tokens": 3}
            for _ in range(3):  # sequentially: every finished stream returns its slot
                r = await client.post("/v1/completions", json=short)
                assert r.status_code == 200 and r.text.rstrip().endswith("[DONE]")
            assert app.state.streams.num_open == 0
            # a streaming request refused for bad input returns its slot too
            r = await client.post("/v1/completions", json={**short, "top_k": 2**40})
            assert_openai_error(r, 400, "top_k")
            assert app.state.streams.num_open == 0


async def test_header_limit_answers_431_naming_the_limit(tokenizer: Tokenizer) -> None:
    """The exact limit (a head that arrived whole): 431 with an OpenAI body, then normal service."""
    async with env(tokenizer) as e:
        app = build_app(e.router, max_header_bytes=4096)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            r = await client.get("/v1/models", headers={"x-padding": "a" * 4096})
            err = assert_openai_error(r, 431)
            assert "4096 bytes" in err["message"]
            r = await client.post(
                "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, params={"q": "b" * 5000}
            )
            assert_openai_error(r, 431)
            r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200, r.text
