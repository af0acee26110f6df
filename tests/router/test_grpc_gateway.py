"""Public gRPC API against fake workers: Generate, ListModels, health, reflection, errors."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest
from fake_workers import EOS, FakeCluster, start_fake_cluster
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.tokenizer import Tokenizer
from pdserve.v1 import common_pb2 as cpb
from pdserve.v1 import generate_pb2 as gpb
from pdserve.v1 import generate_pb2_grpc as gpb_grpc
from router.grpc_gateway import SERVICE_NAME, GrpcGateway
from router.serving import Router, RouterConfig

pytestmark = pytest.mark.timeout(60)

ANSWER = " Paris."


@contextlib.asynccontextmanager
async def gateway(
    tokenizer: Tokenizer, decode: dict | None = None, **cfg: object
) -> AsyncIterator[tuple[FakeCluster, Router, grpc.aio.Channel]]:
    script = tokenizer.encode(ANSWER, add_special_tokens=False) + [EOS]
    c = await start_fake_cluster(
        prefills=[{"script": script}], decodes=[{"script": script, **(decode or {})}]
    )
    router = Router(RouterConfig(model_name="smollm2", max_model_len=128, **cfg), tokenizer, c.pool)  # type: ignore[arg-type]
    gw = GrpcGateway(router, host="127.0.0.1", port=0)
    await gw.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}")
    try:
        yield c, router, channel
    finally:
        await channel.close()
        await gw.stop(0)
        await c.close()


async def test_generate_streams_chunks_then_complete(tokenizer: Tokenizer) -> None:
    async with gateway(tokenizer) as (_c, _router, channel):
        stub = gpb_grpc.GenerationStub(channel)
        req = gpb.GenerateRequest(
            chat=gpb.ChatMessages(messages=[gpb.ChatMessage(role="user", content="Capital?")]),
            sampling=cpb.SamplingParams(max_tokens=0, logprobs=True),
            request_id="my-id",
        )
        out = [r async for r in stub.Generate(req)]
        assert all(r.request_id == "my-id" for r in out)
        chunks = [r.chunk for r in out if r.WhichOneof("response") == "chunk"]
        complete = out[-1].complete
        assert complete.finish_reason == "stop"
        assert "".join(c.text for c in chunks) == complete.text
        # skip_special_tokens defaults to false on the wire, but the EOS text is never shown
        assert complete.text == ANSWER
        n_tokens = len(tokenizer.encode(ANSWER, add_special_tokens=False)) + 1
        assert complete.usage.completion_tokens == n_tokens == sum(len(c.tokens) for c in chunks)
        assert chunks[0].tokens[0].logprob != 0


async def test_list_models_health_and_reflection(tokenizer: Tokenizer) -> None:
    async with gateway(tokenizer) as (c, _router, channel):
        models = await gpb_grpc.GenerationStub(channel).ListModels(gpb.ListModelsRequest())
        assert [(m.id, m.max_model_len) for m in models.models] == [("smollm2", 128)]
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", SERVICE_NAME):
            resp = await health.Check(health_pb2.HealthCheckRequest(service=name))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        call = refl.ServerReflectionInfo()
        await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        resp = await call.read()
        await call.done_writing()
        names = {s.name for s in resp.list_services_response.service}
        assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names
        c.pool.remove("decode-0")
        await c.pool.wait_changed(0.1)
        for _ in range(50):
            resp = await health.Check(health_pb2.HealthCheckRequest(service=""))
            if resp.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            await c.pool.wait_changed(0.05)
        assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_errors_map_to_status_codes(tokenizer: Tokenizer) -> None:
    async with gateway(tokenizer, max_queued_requests=1) as (_c, _router, channel):
        stub = gpb_grpc.GenerationStub(channel)
        cases = [
            (gpb.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT),
            (gpb.GenerateRequest(text="hi", model="other"), grpc.StatusCode.NOT_FOUND),
            (
                gpb.GenerateRequest(text="hi", sampling=cpb.SamplingParams(temperature=-1)),
                grpc.StatusCode.INVALID_ARGUMENT,
            ),
            (
                gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=list(range(1, 200)))),
                grpc.StatusCode.INVALID_ARGUMENT,
            ),
        ]
        for req, code in cases:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                [r async for r in stub.Generate(req)]
            assert e.value.code() == code, (req, e.value.details())
        ok = [r async for r in stub.Generate(gpb.GenerateRequest(text="hi"))]
        assert ok[-1].WhichOneof("response") == "complete"


async def test_full_queue_is_resource_exhausted(tokenizer: Tokenizer) -> None:
    async with gateway(tokenizer, {"accept_delay_s": 0.3}, max_queued_requests=1) as (
        _c,
        router,
        channel,
    ):
        stub = gpb_grpc.GenerationStub(channel)
        first = stub.Generate(gpb.GenerateRequest(text="hi"))
        while router.admission.num_queued == 0:
            await asyncio.sleep(0.005)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            [r async for r in stub.Generate(gpb.GenerateRequest(text="hi"))]
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (await first.read()).WhichOneof("response") == "chunk"
        first.cancel()


async def test_unknown_chat_role_is_invalid_argument(tokenizer: Tokenizer) -> None:
    """QA W4: the gRPC gateway refuses roles the HTTP API refuses."""
    async with gateway(tokenizer) as (_c, _router, channel):
        stub = gpb_grpc.GenerationStub(channel)
        req = gpb.GenerateRequest(
            chat=gpb.ChatMessages(messages=[gpb.ChatMessage(role="wizard", content="hi")]),
            sampling=cpb.SamplingParams(max_tokens=2),
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            _ = [r async for r in stub.Generate(req)]
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "wizard" in (info.value.details() or "")


async def test_grpc_errors_are_counted(tokenizer: Tokenizer) -> None:
    """QA metrics: gRPC errors count in pdserve_request_errors_total like HTTP ones."""
    from pdserve import metrics

    errors = metrics.REQUEST_ERRORS.labels(code="400")
    async with gateway(tokenizer) as (_c, _router, channel):
        stub = gpb_grpc.GenerationStub(channel)
        before = errors._value.get()
        req = gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=[-1]), sampling=cpb.SamplingParams())
        with pytest.raises(grpc.aio.AioRpcError):
            _ = [r async for r in stub.Generate(req)]
        assert errors._value.get() == before + 1


async def test_api_key_is_required_on_generation_but_not_on_health(tokenizer: Tokenizer) -> None:
    script = tokenizer.encode(ANSWER, add_special_tokens=False) + [EOS]
    c = await start_fake_cluster(prefills=[{"script": script}], decodes=[{"script": script}])
    router = Router(RouterConfig(model_name="smollm2", max_model_len=128), tokenizer, c.pool)
    gw = GrpcGateway(router, host="127.0.0.1", port=0, api_key="k-123")
    await gw.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as channel:
            stub = gpb_grpc.GenerationStub(channel)
            req = gpb.GenerateRequest(text="Capital?", sampling=cpb.SamplingParams(max_tokens=4))
            for metadata in ((), (("authorization", "Bearer wrong"),)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    _ = [r async for r in stub.Generate(req, metadata=metadata)]
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "authorization: Bearer <key>" in (err.value.details() or "")
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.ListModels(gpb.ListModelsRequest(), metadata=metadata)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert not c.decodes[0].requests  # refused before anything was placed
            good = (("authorization", "Bearer k-123"),)
            out = [r async for r in stub.Generate(req, metadata=good)]
            assert out[-1].WhichOneof("response") == "complete"
            health = health_pb2_grpc.HealthStub(channel)
            resp = await health.Check(health_pb2.HealthCheckRequest(service=""))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await gw.stop(0)
        await c.close()


async def test_prompts_are_tokenized_off_the_event_loop(tokenizer: Tokenizer) -> None:
    from test_prompts import RecordingTokenizer

    from router.prompts import PromptPreparer

    async with gateway(tokenizer) as (_c, router, channel):
        rec = RecordingTokenizer(tokenizer)
        router.prompts = PromptPreparer(rec)  # type: ignore[arg-type]
        stub = gpb_grpc.GenerationStub(channel)
        chat = gpb.ChatMessages(messages=[gpb.ChatMessage(role="user", content="Capital?")])
        for req in (gpb.GenerateRequest(text="Capital?"), gpb.GenerateRequest(chat=chat)):
            out = [r async for r in stub.Generate(req)]
            assert out[-1].WhichOneof("response") == "complete"
        assert len(rec.threads) == 2 and all(t.startswith("tokenize") for t in rec.threads)


async def test_undecodable_request_is_invalid_argument(tokenizer: Tokenizer) -> None:
    """Bytes that are not a valid request message (corrupt wire format, a string field that is
    not UTF-8) get INVALID_ARGUMENT naming the decoding error, not UNKNOWN; the gateway serves the
    next call."""
    raw = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}
    not_utf8 = b"\x12\x04hi\xff\xfe"  # field 2 (text), 4 bytes that are not UTF-8
    async with gateway(tokenizer) as (_c, _router, channel):
        generate = channel.unary_stream(f"/{SERVICE_NAME}/Generate", **raw)
        for body in (b"\xff\xff\xff\xff", not_utf8):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [r async for r in generate(body)]
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "not a valid message" in (err.value.details() or "")
        list_models = channel.unary_unary(f"/{SERVICE_NAME}/ListModels", **raw)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await list_models(b"\xff\xff\xff\xff")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        stub = gpb_grpc.GenerationStub(channel)
        models = await stub.ListModels(gpb.ListModelsRequest())
        assert [m.id for m in models.models] == ["smollm2"]
        req = gpb.GenerateRequest(text="Capital?", sampling=cpb.SamplingParams(max_tokens=4))
        out = [r async for r in stub.Generate(req)]
        assert out[-1].WhichOneof("response") == "complete"


async def test_a_reused_request_id_neither_collides_on_workers_nor_merges_records(
    tokenizer: Tokenizer,
) -> None:
    """Adversarial (session 40): the client's request_id was the workers' sequence id, so
    concurrent calls sharing one were refused by the decode worker as already live and retried
    one after another, and their records merged into one."""
    async with gateway(tokenizer, decode={"step_s": 0.02}) as (c, router, channel):
        stub = gpb_grpc.GenerationStub(channel)
        req = gpb.GenerateRequest(
            text="Capital?", sampling=cpb.SamplingParams(max_tokens=4), request_id="dup"
        )
        outs = await asyncio.gather(*[_collect(stub.Generate(req)) for _ in range(4)])
        for out in outs:
            assert all(r.request_id == "dup" for r in out)
            assert out[-1].WhichOneof("response") == "complete"
        seq_ids = {r.request_id for r in c.decodes[0].requests}
        assert len(seq_ids) == 4 and "dup" not in seq_ids  # the gateway's own ids
        records = [router.requests.get(k) for k in ("dup", "dup~2", "dup~3", "dup~4")]
        assert all(r is not None and len(r.sequences) == 1 for r in records)
        assert all(r.summary()["status"] == "finished" for r in records if r is not None)


async def _collect(call: AsyncIterator[gpb.GenerateResponse]) -> list[gpb.GenerateResponse]:
    return [r async for r in call]
