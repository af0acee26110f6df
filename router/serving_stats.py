"""The router's own serving numbers for ``/v1/cluster/status``: counters and sliding windows.

Prometheus (``pdserve/metrics.py``) keeps process-wide cumulative series for scrapers; this object
belongs to one :class:`router.serving.Router` and answers what an operator asks without a
Prometheus: how many requests were admitted, rejected, finished, aborted; TTFT, TPOT, ITL and
end-to-end latency percentiles over the last 1 and 5 minutes (:class:`SlidingQuantiles`, DDSketch
buckets); output tokens/s and KV transfer bytes/s over the same windows (:class:`SlidingRate`).

Definitions (as vLLM's): TTFT = arrival to the first output token; TPOT = (last token time -
first token time) / (output tokens - 1) per sequence; ITL = time between consecutive tokens of a
sequence; E2E = arrival to the last token. A request is one prompt admitted by ``Router.submit``
(a completions call with k prompts counts k). Counts are since the router started.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from router.latency_window import SlidingQuantiles, SlidingRate

WINDOWS_S = {"1m": 60.0, "5m": 300.0}


class ServingStats:
    """Counters and windows fed by ``router/serving.py``. ``clock``: monotonic seconds."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.started = clock()
        self.ttft = SlidingQuantiles(clock=clock)
        self.tpot = SlidingQuantiles(clock=clock)
        self.itl = SlidingQuantiles(clock=clock)
        self.e2e = SlidingQuantiles(clock=clock)
        self.output_tokens = SlidingRate(clock=clock)
        self.kv_transfer_bytes = SlidingRate(clock=clock)
        self.running = 0  # request streams open
        self.counts: Counter[str] = Counter()
        self.finished: Counter[str] = Counter()  # sequences by finish reason

    # -- hooks (router/serving.py) -------------------------------------------------------------

    def request_admitted(self, prompt_tokens: int) -> None:
        self.counts["requests"] += 1
        self.counts["prompt_tokens"] += prompt_tokens
        self.running += 1

    def request_rejected(self) -> None:
        self.counts["rejected"] += 1

    def request_closed(self, client_left: bool) -> None:
        """A request stream closed; ``client_left``: before every sequence finished."""
        self.running -= 1
        if client_left:
            self.counts["client_disconnects"] += 1

    def token(self, since_last_s: float | None, since_arrival_s: float) -> None:
        """One output token reached the router (``since_last_s`` None for token 1: TTFT)."""
        if since_last_s is None:
            self.ttft.add(since_arrival_s)
        else:
            self.itl.add(since_last_s)
        self.output_tokens.add(1)

    def sequence_finished(
        self,
        reason: str,
        e2e_s: float,
        tpot_s: float | None,
        preemptions: int,
        migrations: int,
        cached_tokens: int,
    ) -> None:
        """A sequence ended with ``reason`` ('stop' | 'length'); times in seconds."""
        self.finished[reason] += 1
        self.e2e.add(e2e_s)
        if tpot_s is not None:
            self.tpot.add(tpot_s)
        self.counts["preemptions"] += preemptions
        self.counts["migrations"] += migrations
        self.counts["cached_prompt_tokens"] += cached_tokens

    def kv_transfer(self, num_bytes: int, path: str, outcome: str) -> None:
        """One KV transfer record (``path`` 'transferred' | 'local')."""
        self.counts[f"kv_transfers_{path or 'transferred'}"] += 1
        if (outcome or "ok") != "ok":
            self.counts["kv_transfers_failed"] += 1
        elif path != "local":
            self.counts["kv_transfer_bytes"] += num_bytes
            self.kv_transfer_bytes.add(num_bytes)

    # -- views ------------------------------------------------------------------------------------

    def latency(self) -> dict[str, Any]:
        """``{metric: {window: {count, p50, p90, p99, mean}}}`` in milliseconds."""
        out: dict[str, Any] = {}
        for name, q in (("ttft", self.ttft), ("tpot", self.tpot), ("itl", self.itl)):
            out[f"{name}_ms"] = {w: q.summary(s).to_dict(1000.0) for w, s in WINDOWS_S.items()}
        out["e2e_ms"] = {w: self.e2e.summary(s).to_dict(1000.0) for w, s in WINDOWS_S.items()}
        return out

    def throughput(self) -> dict[str, Any]:
        """Output tokens/s and KV transfer bytes/s per window."""
        return {
            "output_tokens_per_s": {
                w: round(self.output_tokens.per_second(s), 3) for w, s in WINDOWS_S.items()
            },
            "kv_transfer_bytes_per_s": {
                w: round(self.kv_transfer_bytes.per_second(s), 1) for w, s in WINDOWS_S.items()
            },
        }
