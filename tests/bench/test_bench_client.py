"""SSE decoding, request bodies and arrival schedules."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.bench.arrivals import arrival_offsets, trace_offsets
from pdserve.bench.client import RequestSpec, SSEDecoder, build_payload

STREAM = (
    b": ping\r\n\r\n"
    b'data: {"choices": [{"text": "caf\xc3\xa9"}]}\r\n\r\n'
    b"event: message\nid: 7\ndata: line one\ndata:line two\n\n"
    b"data: [DONE]\n\n"
)
EVENTS = ['{"choices": [{"text": "café"}]}', "line one\nline two", "[DONE]"]


@pytest.mark.parametrize("step", [1, 2, 3, 7, len(STREAM)])
def test_sse_decoder_any_split(step: int) -> None:
    dec = SSEDecoder()
    got: list[str] = []
    for i in range(0, len(STREAM), step):  # splits land inside "\r\n" and inside the UTF-8 "é"
        got += dec.feed(STREAM[i : i + step])
    assert got + dec.close() == EVENTS


def test_sse_decoder_lone_cr_and_unterminated_tail() -> None:
    dec = SSEDecoder()
    assert dec.feed(b"data: a\r\rdata: b\r") == ["a"]
    assert dec.feed(b"\n") == []  # "\r\n" ends the line "data: b"; the event is still open
    assert dec.close() == ["b"]
    assert SSEDecoder().close() == []


def test_payloads() -> None:
    spec = RequestSpec("hi", 1, 5, extra_body={"temperature": 0.0})
    chat = build_payload("/v1/chat/completions", "m", spec, ignore_eos=True)
    assert chat["messages"] == [{"role": "user", "content": "hi"}]
    assert chat["stream"] and chat["stream_options"] == {"include_usage": True}
    assert chat["max_tokens"] == chat["max_completion_tokens"] == 5
    assert chat["ignore_eos"] is True and chat["temperature"] == 0.0
    comp = build_payload("/v1/completions", "m", spec)
    assert comp["prompt"] == "hi" and "messages" not in comp and "ignore_eos" not in comp
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    assert (
        build_payload("/v1/chat/completions", "m", RequestSpec("s q", 2, 1, msgs))["messages"]
        == msgs
    )
    with pytest.raises(ValueError, match="--endpoint"):
        build_payload("/v1/embeddings", "m", spec)


def test_arrivals() -> None:
    assert arrival_offsets(4, math.inf) == [0.0] * 4
    even = arrival_offsets(5, 2.0, burstiness=math.inf)
    assert even == pytest.approx([0.5, 1.0, 1.5, 2.0, 2.5])
    poisson = arrival_offsets(2000, 10.0, burstiness=1.0, seed=1)
    gaps = np.diff([0.0, *poisson])
    assert poisson[-1] == pytest.approx(200.0)  # rescaled: last send at n / rate
    assert np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(0.1, rel=1e-9)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.1)  # exponential: CV = 1
    bursty = np.diff([0.0, *arrival_offsets(2000, 10.0, burstiness=0.25, seed=1)])
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, abs=0.3)  # gamma: CV = 1/sqrt(k)
    assert arrival_offsets(3, 1.0, seed=5) == arrival_offsets(3, 1.0, seed=5)
    assert trace_offsets([3.0, None, 5.5]) == [3.0, 0.0, 5.5]
    assert trace_offsets([3.0, 5.5]) == [0.0, 2.5]
    with pytest.raises(ValueError, match="--request-rate"):
        arrival_offsets(3, 0.0)
    with pytest.raises(ValueError, match="--burstiness"):
        arrival_offsets(3, 1.0, burstiness=0)


async def test_a_server_that_wants_a_key_names_the_api_key_flag() -> None:
    """A 401 from GET /v1/models names --api-key (not --model, which fails on the next 401)."""
    import aiohttp
    from aiohttp import web

    from pdserve.bench.serve import BenchConfig, BenchmarkError, fetch_model_name

    async def models(request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != "Bearer k":
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        return web.json_response({"data": [{"id": "m"}]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as session:
            config = BenchConfig(base_url=f"http://127.0.0.1:{port}")
            with pytest.raises(BenchmarkError, match="--api-key"):
                await fetch_model_name(session, config)
            keyed = BenchConfig(base_url=f"http://127.0.0.1:{port}", api_key="k")
            assert await fetch_model_name(session, keyed) == "m"
    finally:
        await runner.cleanup()
