"""Helpers of the RequestLifecycle tests (test_lifecycle.py, test_drain.py): one request of a
fixed prompt on a fake cluster, the tokens the fake workers produce for it, and waiting."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from fake_workers import FakeCluster, next_token

from pdserve.sampling_params import SamplingParams
from router.lifecycle import LifecycleConfig, RequestLifecycle

PROMPT = list(range(100, 140))  # 40 tokens: 2 full blocks of 16


def expected(prompt: list[int], n: int) -> list[int]:
    """The ``n`` greedy tokens the fake workers produce after ``prompt``."""
    seq, out = list(prompt), []
    for i in range(n):
        tok = next_token(seq, i, None)
        seq.append(tok)
        out.append(tok)
    return out


def make(
    cluster: FakeCluster,
    max_tokens: int = 8,
    timeout_s: float = 20.0,
    request_id: str = "req-1",
    prompt: list[int] | None = None,
    **cfg: object,
) -> RequestLifecycle:
    """A greedy request of ``prompt`` (default PROMPT); ``cfg`` goes to LifecycleConfig."""
    return RequestLifecycle(
        request_id,
        prompt or PROMPT,
        SamplingParams(temperature=0, max_tokens=max_tokens),
        cluster.pool,
        LifecycleConfig(**cfg),  # type: ignore[arg-type]
        deadline=time.monotonic() + timeout_s,
    )


async def collect(lc: RequestLifecycle) -> list[int]:
    return [t.token_id async for t in lc.run()]


async def collect_acting(
    lc: RequestLifecycle, at: int, act: Callable[[RequestLifecycle], Awaitable[None]]
) -> list[int]:
    """The request's tokens, calling ``act(lc)`` once ``at`` of them have arrived."""
    got: list[int] = []
    async for tok in lc.run():
        got.append(tok.token_id)
        if len(got) == at:
            await act(lc)
    return got


async def wait_until(pred: Callable[[], object], timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < end, "condition not reached in time"
        await asyncio.sleep(0.01)
