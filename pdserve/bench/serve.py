"""Load generator of `pdserve bench serve`: sends a workload to an OpenAI-compatible server.

Lifecycle of one run:

1. warm-up: ``num_warmups`` copies of the first request, concurrency-limited, not measured; if
   every warm-up fails the run stops with the server's error (a wrong URL or model name shows
   up here, not as N failed requests);
2. the main run: requests are released on the arrival schedule (:mod:`pdserve.bench.arrivals`),
   each waits for a ``max_concurrency`` slot (its wait is ``queue_time``), then is sent and timed
   (:mod:`pdserve.bench.client`);
3. the benchmark duration runs from the start of step 2 until the last request finishes; metrics
   are computed by :mod:`pdserve.bench.metrics`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from tqdm import tqdm

from pdserve.bench.arrivals import arrival_offsets, trace_offsets
from pdserve.bench.client import ENDPOINTS, RequestSpec, build_payload, send_request
from pdserve.bench.datasets import SampleRequest
from pdserve.bench.metrics import BenchmarkMetrics, RequestOutput, calculate_metrics
from pdserve.bench.word_tokenizer import BenchTokenizer
from pdserve.gc_heap import freeze_heap


class BenchmarkError(RuntimeError):
    """The benchmark could not run (server unreachable, warm-up failed, bad settings)."""


@dataclass(frozen=True)
class BenchConfig:
    """Settings of one run (the `pdserve bench serve` flags of the same names).

    ``request_rate`` requests/s (``inf`` = all at once); ``max_concurrency`` None = unlimited;
    ``slos_ms`` goodput SLOs in ms; ``extra_body`` is merged into every request body (sampling
    parameters such as temperature). ``request_timeout_s`` bounds one request.
    """

    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
    model: str | None = None
    served_model_name: str | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_warmups: int = 1
    ignore_eos: bool = False
    seed: int = 0
    percentiles: tuple[float, ...] = (99.0,)
    percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el")
    slos_ms: dict[str, float] = field(default_factory=dict)
    extra_body: dict[str, Any] = field(default_factory=dict)
    api_key: str | None = None
    request_timeout_s: float = 6 * 3600.0
    ready_timeout_s: float = 0.0
    disable_tqdm: bool = False
    label: str = "pdserve"

    def __post_init__(self) -> None:
        if not self.endpoint.startswith("/") or not self.endpoint.endswith(
            ("/chat/completions", "/completions")
        ):
            raise ValueError(
                f"--endpoint must be one of {' | '.join(ENDPOINTS)}, got {self.endpoint!r}"
            )
        if self.max_concurrency is not None and self.max_concurrency <= 0:
            raise ValueError(f"--max-concurrency must be > 0, got {self.max_concurrency}")
        if self.num_warmups < 0:
            raise ValueError(f"--num-warmups must be >= 0, got {self.num_warmups}")
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 (or inf), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"--burstiness must be > 0, got {self.burstiness}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"--request-timeout must be > 0 s, got {self.request_timeout_s}")

    @property
    def url(self) -> str:
        """Full URL of the endpoint."""
        return self.base_url.rstrip("/") + self.endpoint


@dataclass
class BenchmarkResult:
    """A finished run: settings, inputs, per-request outputs (same order) and metrics."""

    config: BenchConfig
    model: str
    requests: list[SampleRequest]
    outputs: list[RequestOutput]
    metrics: BenchmarkMetrics
    started_at: str  # ISO-8601 local time of the main run's start
    self_timed: bool  # arrivals from trace timestamps


def auth_headers(config: BenchConfig) -> dict[str, str]:
    """The ``Authorization`` header of ``config.api_key`` (empty when none)."""
    return {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}


async def fetch_model_name(session: aiohttp.ClientSession, config: BenchConfig) -> str:
    """First model id from the server's ``GET /v1/models``. Raises BenchmarkError."""
    url = config.base_url.rstrip("/") + "/v1/models"
    try:
        async with session.get(url, headers=auth_headers(config)) as resp:
            if resp.status in (401, 403):
                raise BenchmarkError(
                    f"GET {url} returned HTTP {resp.status}: the server wants an API key; "
                    "pass --api-key (or set OPENAI_API_KEY)"
                )
            if resp.status != 200:
                raise BenchmarkError(f"GET {url} returned HTTP {resp.status}; pass --model")
            data = await resp.json()
    except aiohttp.ClientError as e:
        raise BenchmarkError(f"cannot reach {url}: {e}") from None
    models = data.get("data") if isinstance(data, dict) else None
    if not models:
        raise BenchmarkError(f"GET {url} lists no models; pass --model")
    return str(models[0]["id"])


def fill_output_tokens(out: RequestOutput, tokenizer: BenchTokenizer | None) -> None:
    """Output tokens when the server sent no usage: re-tokenize the text, else count chunks."""
    if out.success and not out.usage_reported:
        if tokenizer is not None:
            out.output_tokens = len(tokenizer.encode(out.generated_text, add_special_tokens=False))
        else:
            out.output_tokens = out.num_chunks


def request_spec(req: SampleRequest, config: BenchConfig) -> RequestSpec:
    """What :func:`pdserve.bench.client.build_payload` needs to send ``req`` under ``config``."""
    return RequestSpec(
        prompt=req.prompt,
        prompt_len=req.prompt_len,
        output_len=req.output_len,
        messages=req.chat_messages() if req.messages else None,
        extra_body=config.extra_body,
    )


async def _wait_ready(
    session: aiohttp.ClientSession, config: BenchConfig, model: str, first: SampleRequest
) -> None:
    """Retry one request until it succeeds or ``ready_timeout_s`` passes (server start-up)."""
    deadline = time.monotonic() + config.ready_timeout_s
    payload = build_payload(config.endpoint, model, request_spec(first, config), config.ignore_eos)
    last = ""
    while time.monotonic() < deadline:
        out = await send_request(
            session, config.url, payload, first.prompt_len, auth_headers(config)
        )
        if out.success:
            return
        last = out.error
        await asyncio.sleep(1.0)
    raise BenchmarkError(
        f"server at {config.url} not ready after {config.ready_timeout_s:.0f} s: {last}"
    )


async def run_benchmark(
    config: BenchConfig,
    requests: list[SampleRequest],
    tokenizer: BenchTokenizer | None = None,
) -> BenchmarkResult:
    """Warm up, send ``requests`` on schedule, and measure. Raises BenchmarkError.

    Requests with ``timestamp`` set (trace replay) are sent at their timestamps; otherwise the
    schedule comes from ``request_rate`` / ``burstiness`` / ``seed``.
    """
    if not requests:
        raise BenchmarkError("the workload holds no requests")
    limit = config.max_concurrency or 0
    connector = aiohttp.TCPConnector(limit=limit, limit_per_host=limit, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s)
    headers = auth_headers(config)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        model = config.model or await fetch_model_name(session, config)
        name = config.served_model_name or model
        if config.ready_timeout_s > 0:
            await _wait_ready(session, config, name, requests[0])
        freeze_heap()  # no GC pause over the client's startup heap while it times the run
        sem: Any = (
            asyncio.Semaphore(config.max_concurrency)
            if config.max_concurrency
            else contextlib.nullcontext()
        )

        async def one(req: SampleRequest, pbar: tqdm | None) -> RequestOutput:
            payload = build_payload(
                config.endpoint, name, request_spec(req, config), config.ignore_eos
            )
            arrived = time.perf_counter()
            async with sem:
                out = await send_request(session, config.url, payload, req.prompt_len, headers)
            out.queue_time = out.start_time - arrived
            fill_output_tokens(out, tokenizer)
            if pbar is not None:
                pbar.update(1)
            return out

        if config.num_warmups:
            warm = await asyncio.gather(
                *(one(requests[0], None) for _ in range(config.num_warmups))
            )
            if not any(o.success for o in warm):
                raise BenchmarkError(f"all {len(warm)} warm-up requests failed: {warm[0].error}")

        self_timed = any(r.timestamp is not None for r in requests)
        offsets = (
            trace_offsets([r.timestamp for r in requests])
            if self_timed
            else arrival_offsets(len(requests), config.request_rate, config.burstiness, config.seed)
        )
        pbar = None if config.disable_tqdm else tqdm(total=len(requests), desc="requests")
        started_at = time.strftime("%Y-%m-%dT%H:%M:%S")
        t0 = time.perf_counter()
        tasks = []
        for req, offset in zip(requests, offsets, strict=True):
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req, pbar)))
        outputs = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
        if pbar is not None:
            pbar.close()
    metrics = calculate_metrics(outputs, duration, config.percentiles, config.slos_ms)
    return BenchmarkResult(
        config=config,
        model=model,
        requests=requests,
        outputs=outputs,
        metrics=metrics,
        started_at=started_at,
        self_timed=self_timed,
    )
