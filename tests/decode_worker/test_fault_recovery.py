"""Fault injection across the prefill/decode boundary (issue 12 acceptance, in-process).

Tiny engines behind their real gRPC services, KV over the loopback transport, sequences driven
by the router's RequestLifecycle (tests/decode_worker/engine_cluster.py). Every test checks the
outcome a user sees (the same greedy tokens as a fault-free run, or a clear error) and that every
surviving worker ends with nothing running and every KV block free (``check_integrity`` too).
"""

from __future__ import annotations

import asyncio
import time

import pytest
from decode_kit import prompt
from engine_cluster import generate, start_engine_cluster

from decode_worker import service as decode_service
from pdserve.engine.faults import FaultPhase, FaultPlan
from pdserve.engine.request import DEFAULT_LEASE_S, wire_deadline
from pdserve.v1 import common_pb2 as cpb
from pdserve.v1 import worker_pb2 as wpb
from prefill_worker import service as prefill_service
from prefill_worker.request import PrefillState
from router.errors import NoWorkers

pytestmark = pytest.mark.timeout(120)

PROMPTS = [prompt(i, 6 + 3 * i) for i in range(4)]
MAX_TOKENS = 12
LEASE_S = 2.0  # the decode reservation lease (kv_timeout_s) of lifecycle_config()


async def reference() -> list[list[int]]:
    """The fault-free greedy outputs of PROMPTS."""
    c = await start_engine_cluster(1, 1)
    try:
        return [
            (await generate(c.pool, f"ref{i}", p, MAX_TOKENS))[0] for i, p in enumerate(PROMPTS)
        ]
    finally:
        await c.close()


@pytest.mark.parametrize("phase", [FaultPhase.PREFILL_QUEUED, FaultPhase.KV_SEND])
async def test_prefill_killed_requests_complete_elsewhere(phase: FaultPhase) -> None:
    """prefill-0 dies holding queued requests / while about to send KV; the decode worker drops
    every Abort, so only the reservation lease frees what the dead prefill's attempts held."""
    want = await reference()
    c = await start_engine_cluster(
        2, 1, prefill_faults=[FaultPlan(kill_at=phase)], decode_faults=[FaultPlan(drop_aborts=99)]
    )
    try:
        t0 = time.monotonic()
        results = await asyncio.gather(
            *(generate(c.pool, f"r{i}", p, MAX_TOKENS) for i, p in enumerate(PROMPTS))
        )
        assert c.prefills[0].killed.is_set()
        assert [out for out, _ in results] == want
        assert sum(lc.num_prefill_failures for _, lc in results) >= 1
        assert all(lc.finish_reason == "length" for _, lc in results)
        assert time.monotonic() - t0 < 15  # nothing waited for a long timeout
        # the reservations of the failed attempts go when their lease passes
        waited = await c.wait_idle(LEASE_S + 2.0)
        assert waited <= LEASE_S + 2.0
    finally:
        await c.close()


async def test_decode_unreachable_on_arrival_placed_elsewhere() -> None:
    want = await reference()
    c = await start_engine_cluster(1, 2)
    try:
        await c.kill(c.decodes[0])  # the pool still lists it as healthy
        t0 = time.monotonic()
        out, _ = await generate(c.pool, "r0", PROMPTS[0], MAX_TOKENS)
        assert out == want[0]
        assert time.monotonic() - t0 < 5
        await c.wait_idle(2.0)  # the prefill worker and decode-1 hold nothing
    finally:
        await c.close()


async def test_only_decode_unreachable_fails_503_within_seconds() -> None:
    c = await start_engine_cluster(1, 1)
    try:
        prefilled = c.prefills[0].engine.stats().num_prefills  # type: ignore[attr-defined]
        await c.kill(c.decodes[0])
        t0 = time.monotonic()
        with pytest.raises(NoWorkers) as err:
            await generate(c.pool, "r0", PROMPTS[0], MAX_TOKENS)
        assert time.monotonic() - t0 < 10
        assert err.value.status == 503 and err.value.retry_after_s
        assert c.prefills[0].engine.stats().num_prefills == prefilled  # type: ignore[attr-defined]
        await c.wait_idle(1.0, c.prefills)  # the prefill worker never held anything for it
    finally:
        await c.close()


async def test_stalled_transfer_and_dropped_aborts_free_within_lease() -> None:
    """The KV transfer stalls 3 s and the client leaves meanwhile; both workers drop the Abort.
    The decode reservation goes at its lease; the prefill side frees when the stalled send comes
    back refused (its reservation is gone)."""
    stall = 3.0
    c = await start_engine_cluster(
        1,
        1,
        prefill_faults=[FaultPlan(stall_transfer_s=stall, drop_aborts=99)],
        decode_faults=[FaultPlan(drop_aborts=99)],
    )
    try:
        task = asyncio.create_task(generate(c.pool, "r0", PROMPTS[1], MAX_TOKENS))
        t0 = time.monotonic()
        while c.decodes[0].idle() or c.prefills[0].idle():  # reserved on D, sending on P
            assert time.monotonic() - t0 < 10
            await asyncio.sleep(0.02)
        task.cancel()  # the client disconnects; its Aborts are lost
        with pytest.raises(asyncio.CancelledError):
            await task
        waited = await c.wait_idle(stall + 2.0)
        assert waited <= stall + 2.0
        assert c.decodes[0].engine.receiver.stats().reservations_expired == 1  # type: ignore[attr-defined]
        out, _ = await generate(c.pool, "r1", PROMPTS[0], MAX_TOKENS)  # still serving
        assert len(out) == MAX_TOKENS
    finally:
        await c.close()


async def test_corrupted_payload_detected_and_recomputed() -> None:
    want = await reference()
    c = await start_engine_cluster(1, 1, prefill_faults=[FaultPlan(corrupt_payload=True)])
    try:
        out, lc = await generate(c.pool, "r0", PROMPTS[2], MAX_TOKENS)
        assert out == want[2]  # never answered from the corrupted KV
        assert lc.num_prefill_failures == 1
        stats = c.decodes[0].engine.receiver.stats()  # type: ignore[attr-defined]
        assert "CRC-32" in stats.last_error and stats.failures >= 1
        await c.wait_idle(LEASE_S + 1.0)
    finally:
        await c.close()


async def test_abort_reaches_a_prefill_mid_send_and_is_idempotent() -> None:
    """The transfer stalls; the router's Abort reaches the prefill worker while its request is
    SENDING: its blocks are free at once, and a second Abort is a no-op."""
    c = await start_engine_cluster(1, 1, prefill_faults=[FaultPlan(stall_transfer_s=2.0)])
    try:
        task = asyncio.create_task(generate(c.pool, "r0", PROMPTS[3], MAX_TOKENS))
        prefill = c.prefills[0].engine
        t0 = time.monotonic()
        while prefill.request_state("r0") is not PrefillState.SENDING:  # type: ignore[attr-defined]
            assert time.monotonic() - t0 < 10
            await asyncio.sleep(0.01)
        client = c.pool.workers("prefill")[0].client
        assert await client.abort("r0", 2.0) is True
        assert c.prefills[0].idle()  # freed at once, though the send is still stalled
        assert await client.abort("r0", 2.0) is False  # idempotent
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await c.wait_idle(LEASE_S + 1.0)
    finally:
        await c.close()


SAMPLING = cpb.SamplingParams(max_tokens=1, top_p=1.0, repetition_penalty=1.0)


def test_a_wire_request_without_deadline_gets_the_default_lease() -> None:
    now = time.time()
    assert wire_deadline(0, now) == now + DEFAULT_LEASE_S
    assert wire_deadline(1_500, now) == 1.5
    req = prefill_service.request_from_proto(
        wpb.PrefillRequest(
            request_id="x",
            prompt_token_ids=[1],
            sampling=SAMPLING,
            target=wpb.KVTarget(kv_endpoint="loopback:1"),
        )
    )
    assert req.deadline is not None and req.deadline <= time.time() + DEFAULT_LEASE_S
    dreq = decode_service.request_from_proto(
        wpb.DecodeRequest(request_id="y", prompt_token_ids=[1], sampling=SAMPLING)
    )
    assert dreq.deadline is not None and dreq.deadline > now
