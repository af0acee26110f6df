"""Mixed traffic: short requests beside a paced stream of long prompts, from two clients at once.

:func:`run_mixed` starts both in one event loop at the same instant:

- the **short client** is an ordinary closed-loop run (:func:`pdserve.bench.serve.run_benchmark`,
  no warm-up: the server is warm from the runs before);
- the **long client** (:func:`run_paced_until`) sends long prompt ``i`` at ``t0 + i / rate``
  (evenly spaced, no concurrency cap) until the short run has finished (or, with ``max_long``,
  until it has sent that many: every server then gets the same long work), then waits up to
  ``drain_s`` for the long requests still in flight, so their TTFT and E2EL show whether they
  starve; any still unfinished then are cancelled (the server aborts them on the disconnect)
  and count as failed with an error starting :data:`UNFINISHED`, which keeps the run bounded
  when a server falls behind the long prompts' rate.

The short run itself may be capped (``max_s``): a server whose short requests starve behind the
long prompts would otherwise hold the run for as long as the starvation lasts (vLLM's CPU build
in float32 once ran 28 minutes at 2-4 tokens/s here). Past the cap both clients are cancelled
and :func:`run_mixed` raises :class:`~pdserve.bench.serve.BenchmarkError` saying so.

Long prompts come from a supplier indexed by ``i`` (a seed per index, so they are distinct and
reproducible); the ones prepared ahead are used first so that building prompt text does not hold
the event loop while requests are being timed.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import aiohttp

from pdserve.bench.client import build_payload, send_request
from pdserve.bench.datasets import SampleRequest
from pdserve.bench.metrics import RequestOutput, calculate_metrics
from pdserve.bench.serve import (
    BenchConfig,
    BenchmarkError,
    BenchmarkResult,
    auth_headers,
    fill_output_tokens,
    request_spec,
    run_benchmark,
)
from pdserve.bench.word_tokenizer import BenchTokenizer

UNFINISHED = "unfinished"  # error prefix of long requests cancelled after the drain time


class LongPrompts:
    """Long prompt ``i`` of a run: ``prepared[i]`` while it lasts, else ``make(i)`` (in a thread)."""

    def __init__(
        self, prepared: Sequence[SampleRequest], make: Callable[[int], SampleRequest]
    ) -> None:
        self.prepared = list(prepared)
        self.make = make
        self.made_late = 0  # prompts built during the run (the estimate was short)

    async def get(self, i: int) -> SampleRequest:
        """Prompt ``i``."""
        if i < len(self.prepared):
            return self.prepared[i]
        self.made_late += 1
        return await asyncio.to_thread(self.make, i)


async def run_paced_until(
    config: BenchConfig,
    prompts: LongPrompts,
    stop: asyncio.Event,
    tokenizer: BenchTokenizer | None = None,
    drain_s: float = math.inf,
    max_prompts: int = 0,
) -> BenchmarkResult:
    """Send ``prompts`` at ``config.request_rate`` per second (evenly spaced, first at once)
    until ``stop`` is set (or ``max_prompts`` have gone, when > 0: the client then waits for
    ``stop``); then wait up to ``drain_s`` seconds for the requests in flight and cancel the
    rest (failed, error ``'unfinished ...'``). ``config.model`` must be set.

    The result's duration runs from the first send to the end of the last completed request.
    Raises ValueError for an infinite rate or a missing model name.
    """
    if not math.isfinite(config.request_rate):
        raise ValueError("a paced client needs a finite request rate")
    if not config.model:
        raise ValueError("a paced client needs config.model (the served model name)")
    name = config.served_model_name or config.model
    headers = auth_headers(config)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s)
    sent: list[SampleRequest] = []
    tasks: list[asyncio.Task[RequestOutput]] = []
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(req: SampleRequest) -> RequestOutput:
            payload = build_payload(config.endpoint, name, request_spec(req, config),
                                    config.ignore_eos)  # fmt: skip
            sent_at = time.perf_counter()
            try:
                out = await send_request(session, config.url, payload, req.prompt_len, headers)
            except asyncio.CancelledError:
                waited = time.perf_counter() - sent_at
                return RequestOutput(prompt_len=req.prompt_len, start_time=sent_at,
                                     error=f"{UNFINISHED} after {waited:.0f} s: cut off "
                                     f"{drain_s:g} s after the short run ended")  # fmt: skip
            fill_output_tokens(out, tokenizer)
            return out

        started_at = time.strftime("%Y-%m-%dT%H:%M:%S")
        t0 = time.perf_counter()
        nxt = await prompts.get(0)
        while not stop.is_set():
            sent.append(nxt)
            tasks.append(asyncio.create_task(one(nxt)))
            if len(sent) == max_prompts:
                await stop.wait()
                break
            nxt = await prompts.get(len(sent))
            delay = t0 + len(sent) / config.request_rate - time.perf_counter()
            if delay > 0:
                try:
                    await asyncio.wait_for(stop.wait(), timeout=delay)
                except asyncio.TimeoutError:  # the next long prompt is due
                    pass
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=drain_s if drain_s < math.inf else None)
            for task in pending:
                task.cancel()
        outputs = list(await asyncio.gather(*tasks))
        ends = [o.start_time + o.latency for o in outputs if o.success]
        duration = max((max(ends) if ends else time.perf_counter()) - t0, 1e-9)
    metrics = calculate_metrics(outputs, duration, config.percentiles, config.slos_ms)
    return BenchmarkResult(
        config=config,
        model=config.model,
        requests=sent,
        outputs=outputs,
        metrics=metrics,
        started_at=started_at,
        self_timed=False,
    )


async def run_mixed(
    short_config: BenchConfig,
    shorts: list[SampleRequest],
    long_config: BenchConfig,
    longs: LongPrompts,
    tokenizer: BenchTokenizer | None = None,
    drain_s: float = math.inf,
    max_s: float = math.inf,
    max_long: int = 0,
) -> tuple[BenchmarkResult, BenchmarkResult]:
    """(short run, long run): both clients started together; the long client stops sending when
    the short run ends (or after ``max_long`` prompts, when > 0) and waits at most ``drain_s`` s
    for its requests in flight.
    ``long_config.request_rate`` is the long prompts' rate (req/s); ``long_config.model`` must
    be set. Raises BenchmarkError like a single run, and when the short run has not finished
    ``max_s`` seconds after it started (both clients are then cancelled)."""
    stop = asyncio.Event()
    long_task = asyncio.create_task(
        run_paced_until(long_config, longs, stop, tokenizer, drain_s, max_long)
    )
    short_run = run_benchmark(replace(short_config, num_warmups=0), shorts, tokenizer)
    try:
        short = await asyncio.wait_for(short_run, None if max_s == math.inf else max_s)
    except BaseException as e:
        long_task.cancel()
        with contextlib.suppress(BaseException):
            await long_task
        if isinstance(e, asyncio.TimeoutError):
            raise BenchmarkError(
                f"the short requests beside the long prompts had not finished after the mixed "
                f"run's cap of {max_s:.3g} s: the server fell behind the long prompts"
            ) from None
        raise
    stop.set()
    return short, await long_task
