"""DecodeService over a real socket (grpc.aio on 127.0.0.1) with a tiny random-weight engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from decode_kit import prompt, tiny_engine

from decode_worker.engine import DecodeEngine
from decode_worker.service import add_to_server, request_from_proto
from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)


def _req(rid: str, n: int, max_tokens: int, **kw: object) -> pb.DecodeRequest:
    return pb.DecodeRequest(
        request_id=rid,
        prompt_token_ids=list(prompt(3, n)),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        prefill_locally=True,
        **kw,  # type: ignore[arg-type]
    )


def test_the_wire_request_carries_the_first_arrival() -> None:
    """age_ms orders the decode worker's waiting and local-prefill queues, as it does the
    prefill worker's: an age, so no two hosts' clocks are compared (0 = it arrives now)."""
    m = _req("r~1", 4, 2, age_ms=2500)
    arrival = request_from_proto(m).arrival_time
    assert arrival is not None and 2.5 <= time.monotonic() - arrival < 3.5
    m.age_ms = 0
    assert request_from_proto(m).arrival_time is None


@pytest.fixture
async def served() -> AsyncIterator[tuple[DecodeEngine, str]]:
    engine = tiny_engine(num_blocks=32)
    engine.start()
    server = grpc.aio.server()
    add_to_server(engine, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield engine, f"127.0.0.1:{port}"
    finally:
        await server.stop(grace=None)
        engine.shutdown()


async def _wait_free(engine: DecodeEngine, timeout_s: float) -> float:
    t0 = time.monotonic()
    while engine.kv.num_free_blocks != engine.kv.num_blocks:
        assert time.monotonic() - t0 < timeout_s, "blocks not freed in time"
        await asyncio.sleep(0.005)
    return time.monotonic() - t0


async def test_stream_accepted_tokens_finished_and_stats(served: tuple[DecodeEngine, str]) -> None:
    engine, addr = served
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = pb_grpc.DecodeServiceStub(ch)
        events = [ev async for ev in stub.Decode(_req("a", 9, 5))]
        kinds = [ev.WhichOneof("event") for ev in events]
        assert kinds == ["accepted"] + ["tokens"] * 5 + ["finished"]
        acc = events[0].accepted
        assert acc.decode_worker_id == "decode-0" and acc.num_reserved_blocks == 3
        assert events[-1].finished == pb.Finished(reason="length", num_output_tokens=5)
        stats = await stub.GetStats(pb.StatsRequest())
        assert stats.num_finished == 1 and stats.kv_blocks_total == 32
        assert stats.kv_blocks_free == 32 and stats.generation_tokens_per_s > 0
        assert not (await stub.Abort(pb.AbortRequest(request_id="a"))).found


async def test_refusals_map_to_status_codes(served: tuple[DecodeEngine, str]) -> None:
    _, addr = served
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = pb_grpc.DecodeServiceStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Decode(_req("big", 200, 1)).read()  # 32 blocks of 4 tokens hold 128
        assert e.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        bad = _req("bad", 4, 1)
        bad.sampling.top_p = 2.0
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Decode(bad).read()
        assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "top_p" in e.value.details()
        remote = _req("remote", 4, 1)
        remote.prefill_locally = False
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Decode(remote).read()
        assert e.value.code() is grpc.StatusCode.UNAVAILABLE  # this engine has no KV receiver


async def test_abort_rpc_ends_stream_with_cancelled(served: tuple[DecodeEngine, str]) -> None:
    engine, addr = served
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = pb_grpc.DecodeServiceStub(ch)
        call = stub.Decode(_req("x", 9, 100))
        assert (await call.read()).WhichOneof("event") == "accepted"
        assert (await call.read()).WhichOneof("event") == "tokens"
        assert (await stub.Abort(pb.AbortRequest(request_id="x"))).found
        kinds = []
        while (ev := await call.read()) is not grpc.aio.EOF:
            kinds.append(ev.WhichOneof("event"))
        assert kinds[-1] == "error" and set(kinds[:-1]) <= {"tokens"}
        assert ev is grpc.aio.EOF
        await _wait_free(engine, 1.0)


@pytest.mark.parametrize("how", ["cancel", "close_channel"])
async def test_dropped_client_stream_frees_blocks_within_1s(
    served: tuple[DecodeEngine, str], how: str
) -> None:
    engine, addr = served
    ch = grpc.aio.insecure_channel(addr)
    stub = pb_grpc.DecodeServiceStub(ch)
    call = stub.Decode(_req("gone", 9, 100))
    assert (await call.read()).WhichOneof("event") == "accepted"
    assert (await call.read()).WhichOneof("event") == "tokens"
    assert engine.kv.num_free_blocks < engine.kv.num_blocks
    if how == "cancel":
        call.cancel()
        await ch.close()
    else:
        await ch.close(grace=None)
    await _wait_free(engine, 1.0)
    assert engine.num_live == 0 and engine.stats().num_finished == 0  # aborted, not finished
    engine.check_integrity()


async def test_mailbox_hands_a_round_of_events_over_with_one_wake_up() -> None:
    """Sinks of one loop only queue; the engine's flush wakes the loop once per round, and every
    queue gets its events in order."""
    from decode_worker.request import TokensEvent
    from decode_worker.service import LoopMailbox

    loop = asyncio.get_running_loop()
    box = LoopMailbox(loop)
    queues: list[asyncio.Queue[object]] = [asyncio.Queue() for _ in range(4)]
    sinks = [box.sink(q) for q in queues]  # type: ignore[arg-type]
    assert all(getattr(s, "batch", None) is box for s in sinks)
    wakes = 0
    real = loop.call_soon_threadsafe

    def counted(*args: object) -> object:
        nonlocal wakes
        wakes += 1
        return real(*args)  # type: ignore[arg-type]

    loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
    try:

        def engine_rounds() -> None:  # the engine's thread: rounds of deliveries, then a flush
            for step in range(3):
                for i, s in enumerate(sinks):
                    s(TokensEvent(((step, i),)))  # type: ignore[arg-type]
                box.flush()
                box.flush()  # a second flush with the wake-up pending adds none

        await asyncio.to_thread(engine_rounds)
        got = [[await asyncio.wait_for(q.get(), 5) for _ in range(3)] for q in queues]
    finally:
        loop.call_soon_threadsafe = real  # type: ignore[method-assign]
    assert got == [[TokensEvent(((step, i),)) for step in range(3)] for i in range(4)]
    assert 1 <= wakes <= 3
