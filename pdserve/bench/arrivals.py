"""Request arrival schedules: send offsets (seconds from the benchmark start) for each request.

- ``request_rate = inf``: every request at time 0 (``--max-concurrency`` alone then paces them).
- finite rate: inter-arrival gaps drawn from a gamma distribution with shape ``burstiness`` and
  mean ``1 / rate`` (scale ``1 / (rate * burstiness)``). ``burstiness = 1`` is a Poisson process
  (exponential gaps); below 1 arrivals are burstier, above 1 more even, and ``inf`` gives constant
  gaps. As in ``vllm bench serve``, the cumulative offsets are then rescaled so the last request
  is sent at exactly ``n / rate`` seconds, which keeps throughput comparable across seeds.
- trace replay: the requests' own timestamps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def arrival_offsets(
    num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Send offsets in seconds, non-decreasing, one per request.

    Raises ValueError naming ``--request-rate`` or ``--burstiness`` when not > 0.
    """
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if num_requests <= 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if math.isinf(burstiness):
        gaps = np.full(num_requests, 1.0 / request_rate)
    else:
        rng = np.random.default_rng(seed)
        gaps = rng.gamma(
            shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests
        )
    offsets = np.cumsum(gaps)
    if offsets[-1] > 0:
        offsets *= (num_requests / request_rate) / offsets[-1]
    return [float(x) for x in offsets]


def trace_offsets(timestamps: Sequence[float | None]) -> list[float]:
    """Offsets from trace timestamps (seconds; None = 0), shifted so the earliest is 0."""
    ts = [0.0 if t is None else float(t) for t in timestamps]
    t0 = min(ts) if ts else 0.0
    return [t - t0 for t in ts]
