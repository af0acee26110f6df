"""Soak on real engines (issue 12): requests through the router to tiny in-process prefill and
decode engines (tests/decode_worker/engine_cluster.py), a quarter of them dropped by the client
at random points (queued, in prefill or transfer, in decode). Afterwards every worker is idle with
all blocks free and ``check_integrity()`` passing, the router's counters add up (finished +
aborted = admitted) and the next request is served. The 200-request HTTP variant with fake
workers is tests/router/test_soak.py.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from engine_cluster import BLOCK_SIZE, lifecycle_config, start_engine_cluster

from pdserve.sampling_params import SamplingParams
from pdserve.tokenizer import load_tokenizer
from router.background import drain_background
from router.serving import RequestStream, Router, RouterConfig

pytestmark = pytest.mark.timeout(240)

NUM_REQUESTS = 40
NUM_DROPPED = 10
CONCURRENCY = 8


async def _consume(stream: RequestStream, drop_after_tokens: int) -> int:
    """Read ``stream``; with ``drop_after_tokens`` > 0 close it after that many tokens."""
    tokens = 0
    try:
        async for d in stream:
            tokens += len(d.tokens)
            if drop_after_tokens and tokens >= drop_after_tokens:
                break
    finally:
        await stream.aclose()
    return tokens


async def test_soak_on_real_engines_with_client_disconnects() -> None:
    rng = random.Random(7)
    dropped = set(rng.sample(range(NUM_REQUESTS), NUM_DROPPED))
    cluster = await start_engine_cluster(num_prefill=1, num_decode=2, num_blocks=96)
    router = Router(
        RouterConfig(
            model_name="tiny",
            max_model_len=256,
            lifecycle=lifecycle_config(block_size=BLOCK_SIZE),
        ),
        load_tokenizer("smollm2"),  # ids below the tiny model's vocabulary (128) decode fine
        cluster.pool,
    )
    try:
        gate = asyncio.Semaphore(CONCURRENCY)

        async def one(i: int) -> str:
            async with gate:
                prompt = [(i * 7 + k) % 120 + 3 for k in range(5 + i % 11)]
                sampling = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
                stream = router.submit(f"soak-{i}", prompt, sampling)
                if i not in dropped:
                    assert await _consume(stream, 0) == 16
                    return "done"
                if i % 2:  # by time: mostly while queued, in prefill or in transfer
                    task = asyncio.ensure_future(_consume(stream, 0))
                    await asyncio.sleep(rng.uniform(0.0, 0.05))
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    return "dropped-early"
                await _consume(stream, rng.randint(1, 15))  # in decode
                return "dropped-in-decode"

        outcomes = await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS)))
        assert outcomes.count("done") == NUM_REQUESTS - NUM_DROPPED
        await drain_background()
        await cluster.wait_idle(20.0)  # every worker: nothing running, all blocks free, integrity
        c = router.stats.counts
        assert sum(router.stats.finished.values()) + c["aborted"] == c["requests"] == NUM_REQUESTS
        assert c["aborted"] >= 1 and router.admission.num_queued == 0
        sampling = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        assert await _consume(router.submit("after", [5, 6, 7, 8], sampling), 0) == 8
        await cluster.wait_idle(10.0)
    finally:
        router.prompts.close()
        await cluster.close()
