"""Serving benchmark metric math: pure functions over per-request timings (no I/O).

Definitions follow ``vllm bench serve`` so numbers from either tool compare side by side:

- **TTFT**: seconds from sending the request to the first streamed chunk whose ``choices`` list is
  non-empty (its text may be empty, e.g. a chat role delta).
- **ITL**: the gaps between consecutive chunks with non-empty ``choices`` (one value per gap, so a
  server that packs several tokens into one chunk shows fewer, longer gaps).
- **E2EL**: seconds from sending the request to the last chunk with non-empty ``choices``.
- **TPOT**: ``(E2EL - TTFT) / (output_tokens - 1)``, only for requests with more than one output
  token; ``output_tokens`` comes from the server's ``usage.completion_tokens``.
- **Throughput**: completed requests, output tokens and input + output tokens per second of
  benchmark wall time (start of the first request to the end of the last).
- **Goodput** (DistServe, Zhong et al., OSDI 2024): completed requests per second that meet every
  given SLO (``ttft``, ``tpot``, ``e2el`` in ms, each "<="); a request with one output token has
  TPOT 0 for this test.

Failed requests count only in ``failed``; they add nothing to latency statistics or throughput.
Statistics of an empty set are reported as 0.0 (vLLM does the same), never NaN, so result JSON
stays valid.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

SLO_NAMES = ("ttft", "tpot", "e2el")
METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestOutput:
    """What the load generator observed for one request. Times in seconds (perf_counter clock).

    ``start_time`` is when the request was sent. ``output_tokens`` is the server's
    ``usage.completion_tokens`` (or a local count when the server sent no usage); ``prompt_len`` is
    ``usage.prompt_tokens`` when reported, else the dataset's token count.
    """

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0  # E2EL
    start_time: float = 0.0
    queue_time: float = 0.0  # waiting for a --max-concurrency slot, before start_time
    generated_text: str = ""
    error: str = ""
    usage_reported: bool = False
    num_chunks: int = 0  # chunks with non-empty choices

    @property
    def tpot(self) -> float:
        """Time per output token after the first, seconds; 0.0 when fewer than 2 tokens."""
        if self.output_tokens > 1:
            return (self.latency - self.ttft) / (self.output_tokens - 1)
        return 0.0


@dataclass(frozen=True)
class Stats:
    """Summary of one latency metric in milliseconds; ``percentiles`` maps p (0-100) -> ms."""

    mean: float
    median: float
    std: float
    percentiles: dict[float, float]
    count: int


@dataclass(frozen=True)
class BenchmarkMetrics:
    """Aggregate metrics of one benchmark run (see module docstring for definitions).

    ``good_completed`` is the number of requests meeting every SLO (equal to ``completed`` when no
    SLO was given); ``request_goodput`` is None when no SLO was given.
    """

    duration_s: float
    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    good_completed: int
    request_goodput: float | None
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    stats: dict[str, Stats]  # 'ttft' | 'tpot' | 'itl' | 'e2el'


def summarize(values_s: Sequence[float], percentiles: Sequence[float]) -> Stats:
    """Mean, median, std and percentiles (linear interpolation, numpy's default) in ms.

    ``values_s`` are seconds. Empty input gives zeros.
    """
    arr = np.asarray(values_s, dtype=np.float64) * 1000.0
    if arr.size == 0:
        return Stats(0.0, 0.0, 0.0, {float(p): 0.0 for p in percentiles}, 0)
    return Stats(
        mean=float(arr.mean()),
        median=float(np.median(arr)),
        std=float(arr.std()),
        percentiles={float(p): float(np.percentile(arr, p)) for p in percentiles},
        count=int(arr.size),
    )


def meets_slos(out: RequestOutput, slos_ms: dict[str, float]) -> bool:
    """True if a successful request meets every SLO in ``slos_ms`` (name -> ms, "<=")."""
    if not out.success:
        return False
    observed = {"ttft": out.ttft, "tpot": out.tpot, "e2el": out.latency}
    return all(observed[name] * 1000.0 <= limit for name, limit in slos_ms.items())


def peak_output_rate(outputs: Sequence[RequestOutput]) -> tuple[float, int]:
    """(max output chunks in any 1-second bucket, peak number of requests in flight at once).

    Token times are reconstructed from ``start_time + ttft + cumsum(itl)`` and bucketed by whole
    seconds from the first request's start; in-flight intervals are ``[start, start + E2EL)``.
    """
    ok = [o for o in outputs if o.success]
    if not ok:
        return 0.0, 0
    t0 = min(o.start_time for o in ok)
    t_end = max(o.start_time + o.latency for o in ok)
    buckets = np.zeros(int(math.ceil(t_end - t0)) + 1)
    for o in ok:
        times = o.start_time + o.ttft + np.concatenate(([0.0], np.cumsum(o.itl)))
        idx = np.clip((times - t0).astype(np.int64), 0, buckets.size - 1)
        np.add.at(buckets, idx, 1)
    # Sweep line over half-open intervals: at equal times an end (-1) sorts before a start (+1).
    events = sorted([(o.start_time, 1) for o in ok] + [(o.start_time + o.latency, -1) for o in ok])
    peak = cur = 0
    for _, delta in events:
        cur += delta
        peak = max(peak, cur)
    return float(buckets.max()), peak


def calculate_metrics(
    outputs: Sequence[RequestOutput],
    duration_s: float,
    percentiles: Sequence[float] = (99.0,),
    slos_ms: dict[str, float] | None = None,
) -> BenchmarkMetrics:
    """Aggregate per-request outputs of one run.

    ``duration_s``: benchmark wall time in seconds (> 0). ``percentiles``: values in [0, 100].
    ``slos_ms``: goodput SLOs, names in ``SLO_NAMES``, values in ms (>= 0).
    Raises ValueError naming the bad argument.
    """
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    for p in percentiles:
        if not 0 <= p <= 100:
            raise ValueError(f"percentile {p} is outside [0, 100]")
    slos = dict(slos_ms or {})
    for name, value in slos.items():
        if name not in SLO_NAMES:
            raise ValueError(f"goodput SLO {name!r} is not one of {', '.join(SLO_NAMES)}")
        if value < 0:
            raise ValueError(f"goodput SLO {name} must be >= 0 ms, got {value}")

    ok = [o for o in outputs if o.success]
    ttfts = [o.ttft for o in ok]
    e2els = [o.latency for o in ok]
    tpots = [o.tpot for o in ok if o.output_tokens > 1]
    itls = [gap for o in ok for gap in o.itl]
    total_input = sum(o.prompt_len for o in ok)
    total_output = sum(o.output_tokens for o in ok)
    good = sum(1 for o in ok if meets_slos(o, slos)) if slos else len(ok)
    peak_rate, peak_conc = peak_output_rate(outputs)
    return BenchmarkMetrics(
        duration_s=duration_s,
        completed=len(ok),
        failed=len(outputs) - len(ok),
        total_input=total_input,
        total_output=total_output,
        request_throughput=len(ok) / duration_s,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        good_completed=good,
        request_goodput=good / duration_s if slos else None,
        max_output_tokens_per_s=peak_rate,
        max_concurrent_requests=peak_conc,
        stats={
            "ttft": summarize(ttfts, percentiles),
            "tpot": summarize(tpots, percentiles),
            "itl": summarize(itls, percentiles),
            "e2el": summarize(e2els, percentiles),
        },
    )


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """``['ttft:500', 'tpot:50']`` -> ``{'ttft': 500.0, 'tpot': 50.0}`` (ms).

    Raises ValueError naming the bad item (format ``NAME:MS``, NAME in ttft|tpot|e2el, MS >= 0).
    """
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in SLO_NAMES:
            raise ValueError(
                f"--goodput {item!r}: expected NAME:MS with NAME one of {', '.join(SLO_NAMES)}"
            )
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of ms") from None
        if not ms >= 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be >= 0 ms")
        slos[name] = ms
    return slos


def parse_percentiles(text: str) -> list[float]:
    """``'50,90,99'`` -> ``[50.0, 90.0, 99.0]``. Raises ValueError naming a bad value."""
    out: list[float] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            p = float(part)
        except ValueError:
            raise ValueError(f"--percentiles: {part!r} is not a number") from None
        if not 0 < p <= 100:
            raise ValueError(f"--percentiles: {p} is outside (0, 100]")
        out.append(p)
    if not out:
        raise ValueError("--percentiles: give at least one value, e.g. 50,90,99")
    return out


def percentile_key(p: float) -> str:
    """JSON key fragment of a percentile: 99 -> 'p99', 99.9 -> 'p99.9'."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"
