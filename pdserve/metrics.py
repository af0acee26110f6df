"""Every Prometheus metric name in one place (DESIGN §9), prefixed ``pdserve_``.

Metrics live in the process-wide default registry of ``prometheus_client``; the router's
``/metrics`` endpoint renders it with :func:`render`. Times are in seconds, sizes in bytes, as the
Prometheus naming conventions ask. Label sets are small and bounded (finish reason, status code,
worker id, role).

Histogram buckets: latency buckets span 5 ms .. 5 min, which covers TTFT on a loaded 2-core CPU
as well as on a GPU; token-interval buckets span 1 ms .. 10 s.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 300.0,
)  # fmt: skip
_TOKEN_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
    5.0, 10.0,
)  # fmt: skip
_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST

# -- per-request latency (router) ----------------------------------------------------------------
TTFT = Histogram(
    "pdserve_time_to_first_token_seconds",
    "Time from request arrival to its first output token (TTFT).",
    buckets=_LATENCY_BUCKETS,
)
TPOT = Histogram(
    "pdserve_time_per_output_token_seconds",
    "Mean time per output token after the first, per sequence (TPOT).",
    buckets=_TOKEN_BUCKETS,
)
ITL = Histogram(
    "pdserve_inter_token_latency_seconds",
    "Time between consecutive output tokens of a sequence (ITL).",
    buckets=_TOKEN_BUCKETS,
)
E2E_LATENCY = Histogram(
    "pdserve_e2e_request_latency_seconds",
    "Time from request arrival to its last output token.",
    buckets=_LATENCY_BUCKETS,
)
QUEUE_TIME = Histogram(
    "pdserve_request_queue_time_seconds",
    "Time a sequence waited in the router before a decode worker accepted it.",
    buckets=_LATENCY_BUCKETS,
)

# -- token and request counts (router) ------------------------------------------------------------
PROMPT_TOKENS = Counter("pdserve_prompt_tokens", "Prompt tokens of finished requests.")
GENERATION_TOKENS = Counter("pdserve_generation_tokens", "Output tokens streamed to clients.")
CACHED_PROMPT_TOKENS = Counter(
    "pdserve_prefix_cache_hit_tokens",
    "Prompt tokens served from a prefix cache (a prefill worker's, or in unified mode the decode "
    "worker's).",
)
REQUESTS_FINISHED = Counter(
    "pdserve_requests_finished", "Sequences that ended, by finish reason.", ["finish_reason"]
)
REQUESTS_RUNNING = Gauge("pdserve_requests_running", "Requests being served by the router.")
REQUESTS_WAITING = Gauge(
    "pdserve_requests_waiting", "Admitted requests still waiting for their first token."
)
REQUESTS_REJECTED = Counter(
    "pdserve_requests_rejected", "Requests refused by admission control (HTTP 429)."
)
REQUESTS_ABORTED = Counter(
    "pdserve_requests_aborted", "Sequences aborted (stop string, disconnect, deadline)."
)
REQUESTS_MIGRATED = Counter(
    "pdserve_requests_migrated", "Re-placements after a broken decode stream or failed transfer."
)
REQUESTS_PREEMPTED = Counter(
    "pdserve_requests_preempted", "Preemptions reported by decode workers (re-prefilled)."
)
PREFILL_RETRIES = Counter("pdserve_prefill_retries", "Failed prefill attempts that were retried.")
CLIENT_DISCONNECTS = Counter(
    "pdserve_client_disconnects", "Clients that went away before their request finished."
)
REQUEST_ERRORS = Counter(
    "pdserve_request_errors", "Requests answered with an error, by HTTP status code.", ["code"]
)

# -- prefill phases (reported by prefill workers in PrefillResponse) ------------------------------
PREFILL_QUEUE_TIME = Histogram(
    "pdserve_prefill_queue_seconds",
    "Time a prompt waited on its prefill worker before its first chunk ran.",
    buckets=_LATENCY_BUCKETS,
)
PREFILL_COMPUTE_TIME = Histogram(
    "pdserve_prefill_compute_seconds",
    "Time from a prompt's first prefill chunk to token 1 on the prefill worker.",
    buckets=_LATENCY_BUCKETS,
)
PREFILL_TRANSFER_TIME = Histogram(
    "pdserve_prefill_transfer_seconds",
    "Time the prefill worker spent sending a prompt's KV (as it reports it).",
    buckets=_LATENCY_BUCKETS,
)

# -- KV transfer (reported by prefill workers in PrefillResponse) ---------------------------------
KV_TRANSFER_BYTES = Counter(
    "pdserve_kv_transfer_bytes", "KV cache bytes moved from prefill to decode workers."
)
KV_TRANSFER_SECONDS = Histogram(
    "pdserve_kv_transfer_seconds", "Wall time of one KV transfer.", buckets=_TRANSFER_BUCKETS
)
KV_TRANSFERS = Counter(
    "pdserve_kv_transfers", "KV transfers by outcome and path.", ["outcome", "path"]
)
for _path in ("transferred", "local"):  # exported at 0 from the start, so rate() sees them
    KV_TRANSFERS.labels(outcome="ok", path=_path)

# -- per-worker load (polled GetStats) ------------------------------------------------------------
_WORKER_LABELS = ["worker_id", "role"]
WORKER_UP = Gauge("pdserve_worker_up", "1 if the worker answers GetStats.", _WORKER_LABELS)
WORKER_KV_USAGE = Gauge(
    "pdserve_worker_kv_cache_usage",
    "Fraction of the worker's KV blocks in use (0..1).",
    _WORKER_LABELS,
)
WORKER_RUNNING = Gauge(
    "pdserve_worker_num_running", "Requests running on the worker.", _WORKER_LABELS
)
WORKER_WAITING = Gauge(
    "pdserve_worker_num_waiting", "Requests waiting on the worker.", _WORKER_LABELS
)
WORKER_PREFIX_HIT_RATE = Gauge(
    "pdserve_worker_prefix_cache_hit_rate",
    "Prefix-cache hit rate of a prefill worker since start (0..1).",
    _WORKER_LABELS,
)
WORKER_STEP_TIME = Gauge(
    "pdserve_worker_step_time_seconds",
    "Mean forward step time of the worker over its recent window (GetStats).",
    _WORKER_LABELS,
)
WORKER_BATCH_SIZE = Gauge(
    "pdserve_worker_batch_size",
    "Mean sequences (decode) or prompt chunks (prefill) per step over the recent window.",
    _WORKER_LABELS,
)
WORKER_TOKENS_PER_SECOND = Gauge(
    "pdserve_worker_tokens_per_second",
    "Tokens computed per second over the recent window: generated (decode), prompt (prefill).",
    _WORKER_LABELS,
)


def observe_transfer(num_bytes: int, ms: float, outcome: str, path: str) -> None:
    """Record one KV transfer (``num_bytes`` bytes, ``ms`` milliseconds)."""
    KV_TRANSFERS.labels(outcome=outcome or "ok", path=path or "transferred").inc()
    if path != "local":
        KV_TRANSFER_BYTES.inc(num_bytes)
        KV_TRANSFER_SECONDS.observe(ms / 1000.0)


def observe_prefill(queue_ms: float, compute_ms: float, transfer_ms: float) -> None:
    """Record one prefill's phases as its worker reported them (milliseconds)."""
    PREFILL_QUEUE_TIME.observe(queue_ms / 1000.0)
    PREFILL_COMPUTE_TIME.observe(compute_ms / 1000.0)
    PREFILL_TRANSFER_TIME.observe(transfer_ms / 1000.0)


def set_worker_load(
    worker_id: str,
    role: str,
    up: bool,
    kv_usage: float = 0.0,
    running: int = 0,
    waiting: int = 0,
    prefix_hit_rate: float | None = None,
) -> None:
    """Publish a worker's polled load. ``kv_usage`` and ``prefix_hit_rate`` are fractions."""
    labels = {"worker_id": worker_id, "role": role}
    WORKER_UP.labels(**labels).set(1 if up else 0)
    if not up:
        return
    WORKER_KV_USAGE.labels(**labels).set(kv_usage)
    WORKER_RUNNING.labels(**labels).set(running)
    WORKER_WAITING.labels(**labels).set(waiting)
    if prefix_hit_rate is not None:
        WORKER_PREFIX_HIT_RATE.labels(**labels).set(prefix_hit_rate)


def set_worker_steps(
    worker_id: str, role: str, step_time_s: float, batch_size: float, tokens_per_s: float
) -> None:
    """Publish a worker's polled step shape (seconds, sequences or chunks, tokens/s)."""
    labels = {"worker_id": worker_id, "role": role}
    WORKER_STEP_TIME.labels(**labels).set(step_time_s)
    WORKER_BATCH_SIZE.labels(**labels).set(batch_size)
    WORKER_TOKENS_PER_SECOND.labels(**labels).set(tokens_per_s)


def forget_worker(worker_id: str, role: str) -> None:
    """Drop a removed worker's series so dashboards do not show it forever."""
    for gauge in (
        WORKER_UP,
        WORKER_KV_USAGE,
        WORKER_RUNNING,
        WORKER_WAITING,
        WORKER_PREFIX_HIT_RATE,
        WORKER_STEP_TIME,
        WORKER_BATCH_SIZE,
        WORKER_TOKENS_PER_SECOND,
    ):
        try:
            gauge.remove(worker_id, role)
        except KeyError:
            pass


def render() -> bytes:
    """The default registry in the Prometheus text format (content type ``CONTENT_TYPE``)."""
    return generate_latest(REGISTRY)
