"""Regressions from QA of the HTTP gateway: validation edges, leaks and stream shapes.

Each test names the QA finding it pins (C1, L1, ... in the router QA issue).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from fake_workers import VOCAB
from test_http_gateway import MSGS, assert_openai_error, env, sse_events

from pdserve import metrics
from pdserve.tokenizer import Tokenizer
from router.background import drain_background

pytestmark = pytest.mark.timeout(60)


def _gauges() -> tuple[float, float]:
    return metrics.REQUESTS_RUNNING._value.get(), metrics.REQUESTS_WAITING._value.get()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_k", 2**40),
        ("min_tokens", 2**40),
        ("max_tokens", 2**40),
        ("stop_token_ids", [2147483648]),
        ("stop_token_ids", [VOCAB]),  # W1: in int32 but outside the vocabulary
        ("seed", 2**63),
        ("seed", -1),
    ],
)
async def test_out_of_range_integers_are_400(
    tokenizer: Tokenizer, field: str, value: object, stream: bool
) -> None:
    """C1/W1: integers beyond int32 / the vocabulary are a 400 naming the field, not a 500."""
    async with env(tokenizer) as e:
        before = _gauges()
        body = {"messages": MSGS, field: value, "stream": stream}
        r = await e.client.post("/v1/chat/completions", json=body)
        err = assert_openai_error(r, 400, field)
        assert (
            str(2**31 - 1) in err["message"]
            or "2^63" in err["message"]
            or str(VOCAB) in (err["message"])
        )
        assert e.router.admission.num_queued == 0 and _gauges() == before
        r = await e.client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 4})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("field", "literal"),
    [
        ("temperature", "NaN"),
        ("temperature", "Infinity"),
        ("top_p", "NaN"),
        ("presence_penalty", "-Infinity"),
        ("frequency_penalty", "NaN"),
        ("repetition_penalty", "Infinity"),
        ("min_p", "NaN"),
    ],
)
async def test_non_finite_floats_are_400(tokenizer: Tokenizer, field: str, literal: str) -> None:
    """W4: bare NaN/Infinity literals parse as JSON; they must be refused naming the field."""
    async with env(tokenizer) as e:
        raw = f'{{"messages": [{{"role": "user", "content": "hi"}}], "{field}": {literal}}}'
        r = await e.client.post(
            "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
        )
        err = assert_openai_error(r, 400, field)
        assert "finite" in err["message"]


async def test_temperature_and_min_tokens_ranges(tokenizer: Tokenizer) -> None:
    """W4: temperature follows OpenAI's [0, 2]; min_tokens may not exceed max_tokens."""
    async with env(tokenizer) as e:
        r = await e.client.post("/v1/chat/completions", json={"messages": MSGS, "temperature": 2.5})
        assert "[0, 2]" in assert_openai_error(r, 400, "temperature")["message"]
        r = await e.client.post(
            "/v1/chat/completions", json={"messages": MSGS, "temperature": 2, "max_tokens": 2}
        )
        assert r.status_code == 200, r.text
        r = await e.client.post(
            "/v1/completions", json={"prompt": "hi", "min_tokens": 5, "max_tokens": 4}
        )
        assert "max_tokens (4)" in assert_openai_error(r, 400, "min_tokens")["message"]
        # max_tokens null = the rest of the context (512 here): min_tokens beyond it is a 400 too
        r = await e.client.post(
            "/v1/completions", json={"prompt": "hi", "min_tokens": 600, "max_tokens": None}
        )
        assert_openai_error(r, 400, "min_tokens")
        # absent, completions' max_tokens is 16 (OpenAI's default), so min_tokens 20 exceeds it
        r = await e.client.post("/v1/completions", json={"prompt": "hi", "min_tokens": 20})
        assert "max_tokens (16)" in assert_openai_error(r, 400, "min_tokens")["message"]


@pytest.mark.parametrize("stream", [False, True])
async def test_failure_to_start_releases_ticket_and_gauges(
    tokenizer: Tokenizer, stream: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L1: a request that fails while starting its sequences gives its queue place back."""
    async with env(tokenizer, max_queued_requests=1) as e:
        before = _gauges()

        def broken(*_args: object) -> None:
            raise RuntimeError("injected: lifecycle cannot start")

        with monkeypatch.context() as m:
            m.setattr(e.router, "_lifecycle", broken)
            for _ in range(3):
                r = await e.client.post(
                    "/v1/chat/completions", json={"messages": MSGS, "stream": stream}
                )
                if stream:
                    assert any("error" in ev for ev in sse_events(r.text) if isinstance(ev, dict))
                else:
                    assert_openai_error(r, 500)
        await drain_background()
        assert e.router.admission.num_queued == 0 and e.router.admission.queued_tokens == 0
        assert _gauges() == before
        r = await e.client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 4})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("raw", [False, True])
async def test_lone_surrogates_are_400(tokenizer: Tokenizer, raw: bool) -> None:
    """C2: a lone surrogate ("\\udc80" escape, or raw bytes ED A0 80) is a 400, not a 500."""
    async with env(tokenizer) as e:
        bad = b"\xed\xa0\x80" if raw else b"\\udc80"
        for path, param, body in (
            ("/v1/completions", "prompt", b'{"prompt": "a' + bad + b'b"}'),
            (
                "/v1/chat/completions",
                "messages",
                b'{"messages": [{"role": "user", "content": "a' + bad + b'b"}]}',
            ),
        ):
            r = await e.client.post(
                path, content=body, headers={"content-type": "application/json"}
            )
            assert "surrogate" in assert_openai_error(r, 400, param)["message"]


@pytest.mark.parametrize("ids", [[-5], [2**40], [5, VOCAB]])
async def test_echo_with_bad_token_ids_is_400(tokenizer: Tokenizer, ids: list[int]) -> None:
    """C3: token ids are validated before they are decoded for ``echo``."""
    async with env(tokenizer) as e:
        r = await e.client.post("/v1/completions", json={"prompt": ids, "echo": True})
        assert "vocabulary" in assert_openai_error(r, 400, "prompt")["message"]


async def test_over_long_prompt_names_the_right_field(tokenizer: Tokenizer) -> None:
    """W2: /v1/completions names 'prompt'; chat names 'messages'."""
    async with env(tokenizer, max_model_len=32) as e:
        r = await e.client.post("/v1/completions", json={"prompt": list(range(5, 45))})
        assert "max-model-len" in assert_openai_error(r, 400, "prompt")["message"]
        msgs = [{"role": "user", "content": "word " * 40}]
        r = await e.client.post("/v1/chat/completions", json={"messages": msgs})
        assert_openai_error(r, 400, "messages")


async def test_prompt_beyond_the_queue_token_limit_is_400(tokenizer: Tokenizer) -> None:
    """W3: a request that alone exceeds --max-queued-tokens is a 400, never a retryable 429."""
    async with env(tokenizer, max_queued_tokens=50) as e:
        r = await e.client.post("/v1/completions", json={"prompt": list(range(5, 35)), "n": 2})
        err = assert_openai_error(r, 400, "prompt")
        assert "--max-queued-tokens 50" in err["message"] and "60 prompt tokens" in err["message"]
        assert "retry-after" not in r.headers
        r = await e.client.post("/v1/completions", json={"prompt": list(range(5, 35))})
        assert r.status_code == 200, r.text


async def test_prompts_times_n_is_capped(tokenizer: Tokenizer) -> None:
    """W3: prompts x n per request are bounded by RouterConfig.max_sequences."""
    async with env(tokenizer, max_sequences=16, max_n=16) as e:
        r = await e.client.post("/v1/completions", json={"prompt": [[5, 6]] * 5, "n": 4})
        assert "at most 16" in assert_openai_error(r, 400, "prompt")["message"]
        r = await e.client.post(
            "/v1/completions", json={"prompt": [[5, 6]] * 4, "n": 4, "max_tokens": 2}
        )
        assert r.status_code == 200 and len(r.json()["choices"]) == 16


@pytest.mark.parametrize(
    ("content", "headers"),
    [
        (b'[{"messages": []}]', {"content-type": "application/json"}),
        (b"messages=hello" + b"x" * 5000, {"content-type": "application/x-www-form-urlencoded"}),
        (b'"just a string"', {}),
    ],
)
async def test_body_must_be_a_json_object(
    tokenizer: Tokenizer, content: bytes, headers: dict[str, str]
) -> None:
    """W5: a non-object body is a clean 400 that does not echo the body back."""
    async with env(tokenizer) as e:
        r = await e.client.post("/v1/chat/completions", content=content, headers=headers)
        err = assert_openai_error(r, 400)
        assert err["param"] is None and "JSON object" in err["message"]
        assert "xxxx" not in r.text and "just a string" not in r.text


async def test_body_size_limit_is_413(tokenizer: Tokenizer) -> None:
    """H1: bodies over the limit are refused before parsing, with an OpenAI error body."""
    from router.http import build_app

    async with env(tokenizer) as e:
        app = build_app(e.router, max_body_bytes=1000)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            big = {"prompt": "x" * 2000}
            r = await client.post("/v1/completions", json=big)
            assert "1000 bytes" in assert_openai_error(r, 413)["message"]

            async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: counted as read
                yield b'{"prompt": "'
                for _ in range(10):
                    yield b"x" * 200
                yield b'"}'

            r = await client.post("/v1/completions", content=chunked())
            assert_openai_error(r, 413)
            r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200, r.text


async def test_tokenization_does_not_block_the_event_loop(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """H1: a slow (huge) prompt is tokenized off the event loop: /health answers meanwhile."""
    async with env(tokenizer) as e:
        real = tokenizer.encode

        def slow_encode(text: str, *args: object, **kwargs: object) -> list[int]:
            time.sleep(1.0)
            return real(text, *args, **kwargs)

        monkeypatch.setattr(e.router.tokenizer, "encode", slow_encode)
        task = asyncio.ensure_future(
            e.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        )
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        r = await e.client.get("/health")
        assert r.status_code == 200 and time.monotonic() - t0 < 0.5
        assert not task.done()
        assert (await task).status_code == 200


async def test_streaming_n2_disconnect_aborts_every_sequence(tokenizer: Tokenizer) -> None:
    """L2: a client that leaves an n=2 stream early aborts both sequences (5 at a time)."""
    from test_http_gateway import live_server

    from router.http import build_app

    async with env(tokenizer, decode={"step_s": 0.02}) as e:
        app = build_app(e.router)
        body = {
            "prompt": [1, 2, 3], "max_tokens": 300, "ignore_eos": True, "stream": True, "n": 2,
        }  # fmt: skip
        async with live_server(app) as url, httpx.AsyncClient(base_url=url) as client:

            async def leave_early() -> None:
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    lines = 0
                    async for line in r.aiter_lines():
                        lines += line.startswith("data: ")
                        if lines == 6:
                            break

            for _ in range(2):
                await asyncio.gather(*(leave_early() for _ in range(5)))
            dec = e.cluster.decodes[0]
            end = time.monotonic() + 3.0
            while dec.held or e.router.admission.num_queued:
                assert time.monotonic() < end, f"still decoding after disconnect: {list(dec.held)}"
                await asyncio.sleep(0.02)
            assert dec.num_finished == 0  # nothing ran on to max_tokens
            assert _gauges()[0] == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_reason_and_finish_chunk(tokenizer: Tokenizer, stream: bool) -> None:
    """vLLM's ``stop_reason``: the stop string or stop token id; None for EOS and length. The
    token that ends a stream rides in the finish chunk (no empty chunk before it)."""
    from test_http_gateway import ANSWER

    stop_id = tokenizer.encode(ANSWER, add_special_tokens=False)[3]
    cases = [
        ({}, "stop", None),
        ({"stop": ["Paris"]}, "stop", "Paris"),
        ({"stop_token_ids": [stop_id]}, "stop", stop_id),
        ({"max_tokens": 3}, "length", None),
    ]
    async with env(tokenizer) as e:
        for extra, finish, stop_reason in cases:
            body = {"messages": MSGS, "stream": stream, "logprobs": True, **extra}
            r = await e.client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            if not stream:
                (choice,) = r.json()["choices"]
                assert (choice["finish_reason"], choice["stop_reason"]) == (finish, stop_reason)
                continue
            chunks = [ev for ev in sse_events(r.text) if isinstance(ev, dict)][1:]
            last = chunks[-1]["choices"][0]
            assert (last["finish_reason"], last["stop_reason"]) == (finish, stop_reason), extra
            assert last["logprobs"]["content"], "the last token's logprobs ride in the finish"
            assert all(c["choices"][0]["delta"] for c in chunks[:-1]), "an empty token chunk"


@pytest.mark.parametrize("stream", [False, True])
async def test_include_stop_str_in_output(tokenizer: Tokenizer, stream: bool) -> None:
    """vLLM's ``include_stop_str_in_output``: the text ends with the stop string that ended it
    (without it, just before), streamed or not; the finish still names the stop."""

    def text(r: httpx.Response) -> str:
        assert r.status_code == 200, r.text
        if not stream:
            return str(r.json()["choices"][0]["message"]["content"])
        chunks = [ev for ev in sse_events(r.text) if isinstance(ev, dict)]
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)

    async with env(tokenizer) as e:
        body = {"messages": MSGS, "stream": stream, "stop": ["Paris"]}
        cut = text(await e.client.post("/v1/chat/completions", json=body))
        body["include_stop_str_in_output"] = True
        kept = text(await e.client.post("/v1/chat/completions", json=body))
    assert "Paris" not in cut and kept == cut + "Paris"


class _SlowControl:
    """A ClusterControl whose scale takes a while and refuses overlapping calls, like RayCluster."""

    def __init__(self) -> None:
        self.busy = False

    def describe(self) -> list[dict[str, object]]:
        return []

    async def scale(self, role: str, count: int) -> None:
        from router.cluster import MAX_WORKERS_PER_ROLE
        from router.errors import Conflict

        if count > MAX_WORKERS_PER_ROLE:
            raise ValueError(f"cannot scale {role} workers to {count}")
        if self.busy:
            raise Conflict("another scale operation is in progress")
        if count == 7:
            raise RuntimeError("worker prefill-3 failed to start: no placement")
        self.busy = True
        try:
            await asyncio.sleep(0.3)
        finally:
            self.busy = False


async def test_admin_scale_never_500_never_waits_on_a_busy_lock(tokenizer: Tokenizer) -> None:
    """H2: bad counts are 400, an overlapping scale 409, a worker that cannot start 503."""
    from router.http import build_app

    async with env(tokenizer) as e:
        app = build_app(e.router, control=_SlowControl())
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            r = await client.post("/admin/scale", json={"role": "prefill", "count": 2000})
            assert_openai_error(r, 400, "count")
            first = asyncio.ensure_future(
                client.post("/admin/scale", json={"role": "prefill", "count": 2})
            )
            await asyncio.sleep(0.05)
            t0 = time.monotonic()
            r = await client.post("/admin/scale", json={"role": "prefill", "count": 3})
            assert_openai_error(r, 409)
            assert time.monotonic() - t0 < 0.2
            assert (await first).status_code == 200
            r = await client.post("/admin/scale", json={"role": "prefill", "count": 7})
            assert "failed to start" in assert_openai_error(r, 503)["message"]


async def test_admin_routes_on_a_router_without_the_workers_say_where_they_are(
    tokenizer: Tokenizer,
) -> None:
    """New-user (session 40): /admin/scale on a `pdserve router` answered a bare 404."""
    from router.http import build_app

    async with env(tokenizer) as e:
        transport = httpx.ASGITransport(app=build_app(e.router))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            for r in (
                await client.post("/admin/scale", json={"role": "prefill", "count": 2}),
                await client.get("/admin/workers"),
            ):
                err = assert_openai_error(r, 404)
                assert err["code"] == "not_the_head_router" and "pdserve serve" in err["message"]
