"""PrefillService over real loopback sockets: gRPC to the worker, gloo KV to a receiver process.

The receiver is a separate (spawned) process running a torch_dist TorchDistReceiver, as a decode
worker would. Results must equal the in-process engine's (loopback transport): same token 1,
bit-identical KV.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import torch
from prefill_tiny import TINY, ask, prompt, spawn_receiver, tiny_config

from kv_transfer import make_receiver
from kv_transfer.base import KVLayout
from pdserve import rpc
from pdserve.kv_cache.pool import KVPool
from pdserve.sampling_params import SamplingParams
from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc as pb_grpc
from prefill_worker.engine import PrefillEngine
from prefill_worker.request import KVTarget, PrefillRequest
from prefill_worker.service import request_from_proto, serve

pytestmark = pytest.mark.timeout(180)
SAMPLING = SamplingParams(temperature=0, logprobs=True, top_logprobs=2, max_tokens=8)


def in_process(prompts: list[tuple[int, ...]]) -> list[tuple[int, float, torch.Tensor]]:
    """(token 1, logprob, KV) of each prompt from an in-process engine over loopback."""
    eng = PrefillEngine.build(tiny_config(backend="loopback"), model_config=TINY)
    src = eng.runner.kv_pool
    pool = KVPool(src.num_layers, 256, 16, src.num_kv_heads, src.head_dim, src.dtype)
    rx = make_receiver(eng.config.transfer, pool, KVLayout.from_pool(src, TINY.model_id))
    out = []
    start = 0
    for i, p in enumerate(prompts):
        blocks = list(range(start, start + -(-len(p) // 16)))
        start += len(blocks)
        recv = rx.expect(i + 1, blocks, time.time() + 60)
        f = eng.add_request(
            PrefillRequest(f"r{i}", p, SAMPLING, target=KVTarget(i + 1, rx.endpoint))
        )
        eng.run_until_idle()
        recv.result(10)
        res = f.result(0)
        out.append((res.token.token_id, res.token.logprob, pool.gather(blocks, len(p))))
    eng.shutdown()
    rx.close()
    return out


async def test_grpc_service_with_gloo_receiver_matches_in_process_engine() -> None:
    system = prompt(64, seed=300)
    prompts = [prompt(5, seed=1), prompt(600, seed=2), system + prompt(50, seed=3)]
    prompts.append(system + prompt(70, seed=4))  # prefix-cache hit on the worker
    expected = in_process(prompts)

    proc, conn, kv_endpoint = spawn_receiver()
    engine = PrefillEngine.build(tiny_config(backend="torch_dist"), model_config=TINY)
    server, address = await serve(engine, "prefill-0")
    channel = grpc.aio.insecure_channel(address)
    stub = pb_grpc.PrefillServiceStub(channel)
    try:
        start = 10
        for i, (p, (tok, logprob, kv)) in enumerate(zip(prompts, expected, strict=True)):
            blocks = list(range(start + 16 * i, start + 16 * i + -(-len(p) // 16)))[::-1]
            start += len(blocks)
            tid = 1000 + i
            assert ask(conn, ("expect", tid, blocks)) == "ok"
            resp = await stub.Prefill(
                pb.PrefillRequest(
                    request_id=f"g{i}",
                    prompt_token_ids=list(p),
                    sampling=rpc.sampling_to_proto(SAMPLING),
                    target=pb.KVTarget(
                        transfer_id=tid, kv_endpoint=kv_endpoint, decode_worker_id="d0"
                    ),
                ),
                timeout=60,
            )
            first_token, first_logprob, got_kv = await asyncio.to_thread(
                ask, conn, ("wait", tid, blocks)
            )
            assert resp.request_id == f"g{i}"
            assert resp.token.token_id == tok == first_token
            assert resp.token.logprob == pytest.approx(logprob, abs=1e-6)
            assert first_logprob == pytest.approx(logprob, abs=1e-6)
            assert len(resp.token.top_token_ids) == 2 and resp.token.top_token_ids[0] == tok
            torch.testing.assert_close(got_kv, kv, atol=0, rtol=0)
            assert resp.transfer.outcome == "ok" and resp.transfer.transfer_id == tid
            assert resp.transfer.path == "transferred"
            assert resp.transfer.bytes == len(p) * engine.runner.kv_pool.bytes_per_token()
            assert resp.cached_tokens == (64 if i == 3 else 0)
            assert resp.queue_ms >= 0 and resp.compute_ms > 0 and resp.transfer_ms > 0

        stats = await stub.GetStats(pb.StatsRequest(), timeout=10)
        assert stats.worker_id == "prefill-0" and stats.num_prefills == 4
        assert stats.transfer_failures == 0 and stats.num_running == 0
        total = sum(len(p) for p in prompts)
        assert stats.transfer_bytes == total * engine.runner.kv_pool.bytes_per_token()
        assert stats.prefix_cache_hit_rate == pytest.approx(64 / total)
        assert stats.kv_blocks_total == engine.kv.num_blocks and stats.kv_blocks_cached > 0
        assert stats.prompt_tokens_per_s > 0
    finally:
        await channel.close()
        await server.stop(1)
        engine.shutdown()
        conn.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()


async def test_bad_requests_get_invalid_argument_and_the_worker_keeps_serving() -> None:
    engine = PrefillEngine.build(tiny_config(backend="loopback"), model_config=TINY)
    src = engine.runner.kv_pool
    pool = KVPool(src.num_layers, 64, 16, src.num_kv_heads, src.head_dim, src.dtype)
    rx = make_receiver(engine.config.transfer, pool, KVLayout.from_pool(src, TINY.model_id))
    server, address = await serve(engine, "prefill-1")
    channel = grpc.aio.insecure_channel(address)
    stub = pb_grpc.PrefillServiceStub(channel)
    target = pb.KVTarget(transfer_id=7, kv_endpoint=rx.endpoint)
    good = rpc.sampling_to_proto(SamplingParams(temperature=0, max_tokens=4))

    async def status(req: pb.PrefillRequest) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Prefill(req, timeout=30)
        return e.value.code(), e.value.details() or ""

    try:
        code, msg = await status(
            pb.PrefillRequest(request_id="e", prompt_token_ids=[], sampling=good, target=target)
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "empty" in msg
        code, msg = await status(
            pb.PrefillRequest(
                request_id="l", prompt_token_ids=[1] * 2048, sampling=good, target=target
            )
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "2048" in msg
        bad = pb.SamplingParams(temperature=-1, max_tokens=4)
        code, msg = await status(
            pb.PrefillRequest(request_id="s", prompt_token_ids=[1], sampling=bad, target=target)
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in msg
        code, msg = await status(
            pb.PrefillRequest(request_id="t", prompt_token_ids=[1], sampling=good)
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "target" in msg

        assert not (await stub.Abort(pb.AbortRequest(request_id="nope"), timeout=5)).found

        # Still serving: a valid request goes through.
        recv = rx.expect(7, [0, 1], time.time() + 30)
        resp = await stub.Prefill(
            pb.PrefillRequest(
                request_id="ok", prompt_token_ids=list(prompt(20, 5)), sampling=good, target=target
            ),
            timeout=30,
        )
        assert resp.token.token_id == recv.result(10).first_token
    finally:
        await channel.close()
        await server.stop(1)
        engine.shutdown()
        rx.close()


async def test_cancelled_rpc_aborts_the_request_and_frees_its_blocks() -> None:
    engine = PrefillEngine.build(
        tiny_config(backend="loopback", max_num_batched_tokens=16), model_config=TINY
    )
    server, address = await serve(engine, "prefill-2")
    channel = grpc.aio.insecure_channel(address)
    stub = pb_grpc.PrefillServiceStub(channel)
    try:
        call = stub.Prefill(
            pb.PrefillRequest(
                request_id="c",
                prompt_token_ids=list(prompt(1900, 8)),
                sampling=rpc.sampling_to_proto(SamplingParams(temperature=0, max_tokens=4)),
                target=pb.KVTarget(transfer_id=1, kv_endpoint="loopback:1"),
            ),
            timeout=60,
        )
        for _ in range(200):  # wait until it is being prefilled in chunks
            if (await stub.GetStats(pb.StatsRequest(), timeout=5)).num_running:
                break
            await asyncio.sleep(0.01)
        call.cancel()
        for _ in range(200):
            st = await stub.GetStats(pb.StatsRequest(), timeout=5)
            if st.num_running == 0 and st.kv_blocks_used == 0:
                break
            await asyncio.sleep(0.01)
        assert st.num_running == 0 and st.kv_blocks_used == 0 and st.num_waiting == 0
        # It was aborted mid-prefill: it neither finished nor reached its (unreachable) target.
        assert st.num_prefills == 0 and st.transfer_failures == 0
        assert call.cancelled()
        engine.check_integrity()
    finally:
        await channel.close()
        await server.stop(1)
        engine.shutdown()


def test_the_wire_request_carries_the_first_arrival() -> None:
    """age_ms orders the prefill worker's queue: the sequence's first arrival at its router, as an
    age so that no two hosts' clocks are compared (0 = it arrives now)."""
    m = pb.PrefillRequest(
        request_id="r~1",
        prompt_token_ids=[1, 2, 3],
        sampling=rpc.sampling_to_proto(SAMPLING),
        target=pb.KVTarget(transfer_id=1, kv_endpoint="127.0.0.1:1"),
        age_ms=2500,
    )
    arrival = request_from_proto(m).arrival_time
    assert arrival is not None and 2.5 <= time.monotonic() - arrival < 3.5
    m.age_ms = 0
    assert request_from_proto(m).arrival_time is None
