"""Worker health in the router's pool: a worker that answers GetStats late stays in placement
until it has been silent for ``unresponsive_after_s``; a worker that is gone (connection refused)
is marked unhealthy after ``unhealthy_after`` polls, at once."""

from __future__ import annotations

import asyncio
import time

import pytest
from fake_workers import start_fake_cluster

from router.pool import WorkerPool

pytestmark = pytest.mark.timeout(60)


async def test_slow_stats_keep_a_worker_healthy_until_it_is_unresponsive() -> None:
    # the pool polls every 0.05 s with a 1 s timeout in the background
    c = await start_fake_cluster(prefills=[], decodes=[{}], stats_interval_s=0.05)
    try:
        c.pool.unresponsive_after_s = 8.0
        dec = c.decodes[0]
        state = c.pool.get(dec.worker_id)
        assert state is not None and state.healthy
        dec.stats_delay_s = 1.5  # every poll times out from now on
        t0 = time.monotonic()
        await asyncio.sleep(3.0)  # two or three timed-out polls, well inside the 8 s window
        assert state.healthy and state.failures == 0
        while state.healthy:  # silent past 8 s: the timeouts count now
            assert time.monotonic() - t0 < 20.0, "never marked unhealthy"
            await asyncio.sleep(0.1)
        assert time.monotonic() - t0 > 6.0  # not before the window (less the polls before t0)
        dec.stats_delay_s = 0.0
        while not state.healthy:
            assert time.monotonic() - t0 < 30.0, "never healthy again"
            await asyncio.sleep(0.1)
        assert state.failures == 0
    finally:
        await c.close()


async def test_a_gone_worker_is_unhealthy_after_two_failed_polls() -> None:
    c = await start_fake_cluster(prefills=[], decodes=[{}], stats_interval_s=0.05)
    try:
        c.pool.unresponsive_after_s = 60.0  # timeouts would take a minute; refusals do not wait
        dec = c.decodes[0]
        state = c.pool.get(dec.worker_id)
        assert state is not None and state.healthy
        t0 = time.monotonic()
        await c.kill(dec.worker_id)
        while state.healthy:
            assert time.monotonic() - t0 < 5.0, "a refused worker stayed healthy"
            await asyncio.sleep(0.05)
    finally:
        await c.close()


def test_unresponsive_after_must_be_positive() -> None:
    with pytest.raises(ValueError, match="unresponsive_after_s"):
        WorkerPool(unresponsive_after_s=0)
