"""Workers leaving the pool under running requests (QA D1, D6): scale-down drains, a channel
closed mid-call re-places the request, and a prefill worker that failed as if down is not tried
again for the same sequence."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from fake_workers import start_fake_cluster
from lifecycle_kit import PROMPT, collect, collect_acting, expected, make, wait_until

from pdserve.sampling_params import SamplingParams
from pdserve.tokenizer import Tokenizer
from router.errors import WorkerFailure
from router.lifecycle import RequestLifecycle
from router.serving import Router, RouterConfig

pytestmark = pytest.mark.timeout(60)

# -- D1: scale-down drains ------------------------------------------------------------------------


async def test_a_removed_prefill_worker_finishes_the_prefill_it_runs() -> None:
    """QA D1: /admin/scale prefill 0 mid-prefill left the client hanging: the pool closed the
    retired worker's channel on its next poll, which cancelled the Prefill call."""
    c = await start_fake_cluster(prefills=[{"delay_s": 1.0}])
    try:
        task = asyncio.create_task(collect(make(c)))
        await wait_until(lambda: bool(c.prefills[0].running))
        assert c.pool.remove("prefill-0")
        for _ in range(5):  # the polls that used to close the channel under the call
            await c.pool.poll_once()
        assert c.pool.inflight("prefill-0") == 1  # still draining
        assert await asyncio.wait_for(task, 10.0) == expected(PROMPT, 8)
        assert len(c.prefills[0].requests) == 1 and not c.decodes[0].requests[0].prefill_locally
        assert c.pool.inflight("prefill-0") == 0
    finally:
        await c.close()


async def test_a_removed_decode_worker_finishes_the_stream_it_runs() -> None:
    c = await start_fake_cluster(decodes=[{"step_s": 0.05}, {}])
    try:
        lc = make(c, max_tokens=20)
        worker = ""

        async def remove(lc: RequestLifecycle) -> None:
            nonlocal worker
            worker = lc._attempt.worker.worker_id  # type: ignore[union-attr]
            assert c.pool.remove(worker)
            await c.pool.poll_once()
            await c.pool.poll_once()

        assert await collect_acting(lc, 3, remove) == expected(PROMPT, 20)
        assert lc.num_migrations == 0 and c.pool.inflight(worker) == 0
    finally:
        await c.close()


async def test_a_channel_closed_mid_prefill_re_places_the_request() -> None:
    """Past the drain (the worker stopped, its channel closed), the request is prefilled again,
    here locally on the decode worker as no other prefill worker is left, and never hangs."""
    c = await start_fake_cluster(prefills=[{"delay_s": 2.0}])
    try:
        lc = make(c)
        task = asyncio.create_task(collect(lc))
        await wait_until(lambda: bool(c.prefills[0].running))
        worker = c.pool.get("prefill-0")
        assert worker is not None and c.pool.remove("prefill-0")
        await worker.client.close()
        assert await asyncio.wait_for(task, 10.0) == expected(PROMPT, 8)
        assert lc.num_prefill_failures == 1
        assert [r.prefill_locally for r in c.decodes[0].requests] == [False, True]
    finally:
        await c.close()


async def test_a_channel_closed_mid_decode_migrates_the_stream() -> None:
    c = await start_fake_cluster(decodes=[{"step_s": 0.05}, {"step_s": 0.05}])
    try:
        lc = make(c, max_tokens=12)

        async def close(lc: RequestLifecycle) -> None:
            worker = lc._attempt.worker  # type: ignore[union-attr]
            c.pool.remove(worker.worker_id)
            await worker.client.close()

        assert await collect_acting(lc, 3, close) == expected(PROMPT, 12)
        assert lc.num_migrations == 1
    finally:
        await c.close()


async def test_a_stray_cancellation_reaches_the_client_as_an_error(tokenizer: Tokenizer) -> None:
    """The last resort: a CancelledError nobody asked for ends the request with an error the
    client sees (a 500 / error event), never a stream that waits forever."""
    c = await start_fake_cluster()
    try:

        async def cancelled(*_args: object) -> None:
            raise asyncio.CancelledError

        c.pool.get("prefill-0").client.prefill = cancelled  # type: ignore[union-attr,method-assign]
        router = Router(RouterConfig(model_name="smollm2", max_model_len=256), tokenizer, c.pool)
        stream = router.submit("r1", [1, 2, 3], SamplingParams(temperature=0, max_tokens=4))

        async def drain() -> None:
            async for _ in stream:
                pass

        with pytest.raises(WorkerFailure, match="cancelled"):
            await asyncio.wait_for(drain(), 10.0)
    finally:
        await c.close()


# -- D6: a prefill worker that failed as if down is not retried for the sequence ------------------


async def test_prefill_down_once_falls_back_to_local_prefill_at_once() -> None:
    """QA D6: a killed (or broken) prefill worker still looks healthy until its polls fail (or
    keeps passing them), and all 3 retries went to it within 0.5 s: 'prefill failed 3 times'."""
    c = await start_fake_cluster(prefills=[{"fail_budget": 100}])  # UNAVAILABLE every time
    try:
        lc = make(c, max_tokens=6)
        assert await collect(lc) == expected(PROMPT, 6)
        assert len(c.prefills[0].requests) == 1 and lc.num_prefill_failures == 1
        assert [r.prefill_locally for r in c.decodes[0].requests] == [False, True]
    finally:
        await c.close()


async def test_prefill_down_tries_each_other_prefill_worker_once() -> None:
    broken = {"fail_budget": 100, "fail_code": grpc.StatusCode.INTERNAL}
    c = await start_fake_cluster(prefills=[broken, dict(broken), dict(broken)])
    try:
        lc = make(c, max_tokens=4, max_prefill_attempts=4)
        assert await collect(lc) == expected(PROMPT, 4)
        assert [len(p.requests) for p in c.prefills] == [1, 1, 1]
        assert lc.num_prefill_failures == 3
        assert [r.prefill_locally for r in c.decodes[0].requests] == [False] * 3 + [True]
    finally:
        await c.close()
