"""The router's load view between polls: what it placed since a poll counts on top of that
poll's report, and what a report already holds is not counted twice (router/pool.py)."""

from __future__ import annotations

import asyncio

import pytest
from fake_workers import start_fake_cluster

pytestmark = pytest.mark.timeout(60)

HOUR = 3600.0  # the background poller polls once at start, then not again in a test


async def test_a_prompt_in_flight_counts_once_in_the_prefill_backlog() -> None:
    queue = {"num_queued_tokens": 300, "num_queued_short_tokens": 100}
    queue["long_prefill_token_threshold"] = 64
    c = await start_fake_cluster(prefills=[{"queue": queue}], stats_interval_s=HOUR)
    try:
        worker = c.pool.get("prefill-0")
        assert worker is not None
        await asyncio.sleep(0.1)  # the poller's first round
        (load,) = c.pool.prefill_loads()
        assert (load.queued_tokens, load.queued_short_tokens) == (300, 100)
        short, long = c.pool.reserve(worker, tokens=40), c.pool.reserve(worker, tokens=200)
        (load,) = c.pool.prefill_loads()  # sent after the last poll: on top of its report
        assert (load.queued_tokens, load.queued_short_tokens) == (540, 140)
        queue.update(num_queued_tokens=540, num_queued_short_tokens=140)  # they reached it
        await c.pool.poll_once()
        (load,) = c.pool.prefill_loads()  # the report holds them now: not counted twice
        assert (load.queued_tokens, load.queued_short_tokens) == (540, 140)
        c.pool.release(worker, short)
        c.pool.release(worker, long)
        assert worker.inflight == 0 and worker.inflight_prompts == {}
        again = c.pool.reserve(worker, tokens=40)
        (load,) = c.pool.prefill_loads()
        assert (load.queued_tokens, load.queued_short_tokens) == (580, 180)
        c.pool.release(worker, again)  # it returned before any poll saw it
        (load,) = c.pool.prefill_loads()
        assert (load.queued_tokens, load.queued_short_tokens) == (540, 140)
    finally:
        await c.close()


async def test_a_placement_during_a_poll_counts_until_the_next_poll() -> None:
    """A poll's report cannot hold a placement made after the poll was sent: that placement
    keeps counting when the reply arrives, and only the next poll retires it."""
    c = await start_fake_cluster(prefills=[], decodes=[{"num_blocks": 100}], stats_interval_s=HOUR)
    try:
        dec, worker = c.decodes[0], c.pool.get("decode-0")
        assert worker is not None
        await asyncio.sleep(0.1)
        before = c.pool.reserve(worker, blocks=3)
        dec.stats_delay_s = 0.3
        poll = asyncio.ensure_future(c.pool.poll_once())
        await asyncio.sleep(0.1)  # the poll is on its way; this placement is not in its report
        during = c.pool.reserve(worker, blocks=5)
        await poll
        (load,) = c.pool.decode_loads()
        assert (load.free_blocks, load.running) == (100 - 5, 1)  # the fake holds neither
        dec.stats_delay_s = 0.0
        await c.pool.poll_once()
        (load,) = c.pool.decode_loads()
        assert (load.free_blocks, load.running) == (100, 0)
        c.pool.release(worker, before)
        c.pool.release(worker, during)
        assert worker.inflight == 0
    finally:
        await c.close()
