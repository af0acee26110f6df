"""Startup readiness (issue 12): until a decode worker is up, /v1/models, the OpenAI endpoints and
the gRPC API answer 503 / UNAVAILABLE with Retry-After, and /health stays 503."""

from __future__ import annotations

import grpc
import httpx
import pytest
from fake_workers import start_fake_cluster

from pdserve.tokenizer import Tokenizer
from pdserve.v1 import common_pb2 as cpb
from pdserve.v1 import generate_pb2 as gpb
from pdserve.v1 import generate_pb2_grpc as gpb_grpc
from router.grpc_gateway import GrpcGateway
from router.http import build_app
from router.readiness import STARTING_RETRY_AFTER_S
from router.serving import Router, RouterConfig

pytestmark = pytest.mark.timeout(60)

GEN = gpb.GenerateRequest(text="hi", sampling=cpb.SamplingParams(max_tokens=2))
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def test_not_ready_until_a_decode_worker_registers(tokenizer: Tokenizer) -> None:
    c = await start_fake_cluster(prefills=[{}], decodes=[{}])
    decode = c.pool.workers("decode")[0].info
    c.pool.remove(decode.worker_id)  # a prefill worker alone serves nothing
    router = Router(RouterConfig(model_name="smollm2", max_model_len=512), tokenizer, c.pool)
    gateway = GrpcGateway(router, host="127.0.0.1", port=0)
    await gateway.start()
    app = build_app(router)
    transport = httpx.ASGITransport(app=app)
    try:
        async with (
            httpx.AsyncClient(transport=transport, base_url="http://t") as client,
            grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel,
        ):
            stub = gpb_grpc.GenerationStub(channel)
            calls = [
                client.get("/v1/models"),
                client.post("/v1/chat/completions", json=CHAT),
                client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}),
            ]
            for call in calls:
                r = await call
                assert r.status_code == 503, r.text
                assert r.headers["retry-after"] == str(STARTING_RETRY_AFTER_S)
                assert "not ready" in r.json()["error"]["message"]
            health = await client.get("/health")
            assert health.status_code == 503  # with Retry-After, as README says (new-user #5)
            assert health.headers["retry-after"] == str(STARTING_RETRY_AFTER_S)
            for rpc in (
                stub.ListModels(gpb.ListModelsRequest(), timeout=5),
                stub.Generate(GEN, timeout=5).read(),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await rpc
                assert err.value.code() is grpc.StatusCode.UNAVAILABLE

            c.pool.upsert(decode)  # the worker has loaded and registered: ready
            assert (await client.get("/health")).status_code == 200
            models = await client.get("/v1/models")
            assert models.status_code == 200 and models.json()["data"][0]["id"] == "smollm2"
            r = await client.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200, r.text
            listed = await stub.ListModels(gpb.ListModelsRequest(), timeout=5)
            assert listed.models[0].id == "smollm2"
    finally:
        await gateway.stop(0)
        await c.close()
