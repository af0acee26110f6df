"""Stopping the gateways (router/server.py: what SIGTERM / Ctrl-C of `pdserve serve|router` runs):
prompt, and every request in flight ends cleanly on both APIs (a complete response saying the
server is shutting down, never a cut connection) and is aborted on its workers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import pytest
from test_http_gateway import env

from pdserve.sampling_params import SamplingParams
from pdserve.tokenizer import Tokenizer
from pdserve.v1 import common_pb2 as cpb
from pdserve.v1 import generate_pb2 as gpb
from pdserve.v1 import generate_pb2_grpc as gpb_grpc
from router.background import drain_background
from router.errors import ShuttingDown
from router.server import Frontend, FrontendConfig
from router.serving import Router

pytestmark = pytest.mark.timeout(60)

LONG = {"prompt": [1, 2, 3], "max_tokens": 400, "ignore_eos": True}  # 20 s at 50 ms a step


@contextlib.asynccontextmanager
async def frontend(router: Router, drain_timeout_s: float = 0.0) -> AsyncIterator[Frontend]:
    """Both gateways over ``router`` on free loopback ports, stopped (again) on exit."""
    cfg = FrontendConfig(host="127.0.0.1", port=0, grpc_port=0, drain_timeout_s=drain_timeout_s)
    fe = Frontend(router, cfg)
    await fe.start()
    try:
        yield fe
    finally:
        await fe.stop()
        fe.release_signals()


async def test_stop_ends_requests_in_flight_cleanly_and_promptly(tokenizer: Tokenizer) -> None:
    async with env(tokenizer, decode={"step_s": 0.05}) as e, frontend(e.router) as fe:
        url = f"http://127.0.0.1:{fe.http_port}"
        sse: list[str] = []

        async def streamed(client: httpx.AsyncClient) -> None:
            async with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():  # raises if the body is cut short
                    if line.startswith("data: "):
                        sse.append(line[len("data: ") :])

        async def grpc_stream() -> list[gpb.GenerateResponse]:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{fe.grpc.port}") as ch:
                req = gpb.GenerateRequest(
                    token_ids=gpb.TokenIds(ids=[1, 2, 3]),
                    sampling=cpb.SamplingParams(max_tokens=400, ignore_eos=True),
                )
                return [m async for m in gpb_grpc.GenerationStub(ch).Generate(req)]

        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            tasks: list[asyncio.Task[Any]] = [
                asyncio.create_task(streamed(client)),
                asyncio.create_task(client.post("/v1/completions", json=LONG)),
                asyncio.create_task(grpc_stream()),
            ]
            t0 = time.monotonic()
            while len(e.cluster.decodes[0].requests) < 3 or len(sse) < 2:
                assert time.monotonic() - t0 < 10, "the requests did not start"
                await asyncio.sleep(0.02)
            t0 = time.monotonic()
            await fe.stop()
            stopped_s = time.monotonic() - t0
            done, whole, over_grpc = await asyncio.wait_for(asyncio.gather(*tasks), 5)
        assert stopped_s < 1.0, f"the gateways took {stopped_s:.2f} s to stop"
        # SSE: the tokens so far, then one error event, then [DONE]: a complete body
        assert done is None and sse[-1] == "[DONE]"
        err = json.loads(sse[-2])["error"]
        assert err["code"] == "server_shutting_down" and "shutting down" in err["message"]
        assert all("choices" in json.loads(x) for x in sse[:-2])
        # the whole response: a 503 saying so
        assert whole.status_code == 503, whole.text
        assert whole.json()["error"]["code"] == "server_shutting_down"
        # gRPC: the chunks so far, then a GenerateError
        assert over_grpc[-1].WhichOneof("response") == "error"
        assert over_grpc[-1].error.code == 503 and "shutting down" in over_grpc[-1].error.message
        # every sequence was aborted on its worker; nothing is queued or held
        await drain_background()
        assert e.router.admission.num_queued == 0
        assert not e.cluster.decodes[0].held
        # a request that arrives now is refused with the same error
        with pytest.raises(ShuttingDown):
            e.router.submit("late", [1, 2, 3], SamplingParams(max_tokens=4))


async def test_drain_lets_requests_finish_and_refuses_new_ones(tokenizer: Tokenizer) -> None:
    """--drain-timeout: the request in flight finishes normally; meanwhile /health is 503
    'shutting_down' and a new request a 503; the stop returns once nothing is left."""
    async with (
        env(tokenizer, decode={"step_s": 0.05}) as e,
        frontend(e.router, drain_timeout_s=10.0) as fe,
    ):
        url = f"http://127.0.0.1:{fe.http_port}"
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            short = {"prompt": [1, 2, 3], "max_tokens": 12, "ignore_eos": True}
            inflight = asyncio.create_task(client.post("/v1/completions", json=short))
            while not e.cluster.decodes[0].requests:
                await asyncio.sleep(0.01)
            t0 = time.monotonic()
            stop = asyncio.create_task(fe.stop())
            await asyncio.sleep(0.1)
            health = await client.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "shutting_down"
            late = await client.post("/v1/completions", json=short)
            assert late.status_code == 503, late.text
            assert late.json()["error"]["code"] == "server_shutting_down"
            r = await inflight
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
            await asyncio.wait_for(stop, 5)
            assert time.monotonic() - t0 < 3.0  # ~0.6 s of decoding, not the 10 s bound


async def test_a_second_signal_ends_the_drain(tokenizer: Tokenizer) -> None:
    async with (
        env(tokenizer, decode={"step_s": 0.05}) as e,
        frontend(e.router, drain_timeout_s=30.0) as fe,
    ):
        url = f"http://127.0.0.1:{fe.http_port}"
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            inflight = asyncio.create_task(client.post("/v1/completions", json=LONG))
            while not e.cluster.decodes[0].requests:
                await asyncio.sleep(0.01)
            stop = asyncio.create_task(fe.stop())
            await asyncio.sleep(0.3)
            assert not stop.done()  # draining
            t0 = time.monotonic()
            fe.stop_now.set()  # what a second SIGTERM / Ctrl-C does
            await asyncio.wait_for(stop, 5)
            assert time.monotonic() - t0 < 1.0
            r = await inflight
            assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"


async def test_a_body_still_arriving_gets_a_503_when_the_stop_begins(tokenizer: Tokenizer) -> None:
    """Adversarial (session 40): a POST whose body was still arriving at SIGTERM got a bare 500
    after uvicorn's 3 s graceful timeout (and held the stop that long)."""
    async with env(tokenizer) as e, frontend(e.router) as fe:
        reader, writer = await asyncio.open_connection("127.0.0.1", fe.http_port)
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"prompt": [1, 2'
        )
        await writer.drain()
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        stop = asyncio.create_task(fe.stop())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 503"), head
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        body = json.loads(await reader.readexactly(length))
        assert body["error"]["code"] == "server_shutting_down"
        await asyncio.wait_for(stop, 5)
        assert time.monotonic() - t0 < 2.0  # not uvicorn's 3 s timeout
        writer.close()
