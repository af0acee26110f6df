"""Sliding-window quantiles and rates for the operators' view (``/v1/cluster/status``).

Time is cut into fixed buckets of ``bucket_s`` seconds (10 s by default). Each bucket holds one
DDSketch (a mergeable streaming-quantile sketch with a relative-error guarantee: Masson, Rim and
Lee, "DDSketch: A Fast and Fully-Mergeable Quantile Sketch with Relative-Error Guarantees",
VLDB 2019; the ``ddsketch`` package's implementation) or one running sum. A quantile over the
last W seconds merges the sketches of the buckets that overlap the window; buckets older than
``retention_s`` are dropped as time moves on. Memory is therefore bounded by the number of
buckets (``retention_s / bucket_s``) times a sketch's size, never by the number of requests.

Windows are bucket-aligned: "the last 60 s" covers the current, partly filled bucket and the
buckets that started within the last 60 s, i.e. between 50 and 60 s of data with 10 s buckets.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from ddsketch import DDSketch

RELATIVE_ACCURACY = 0.01  # a reported quantile is within 1 % of a value of that rank
DEFAULT_BUCKET_S = 10.0
DEFAULT_RETENTION_S = 300.0  # the longest window the status API reports (5 minutes)

_T = TypeVar("_T")


class _Buckets(Generic[_T]):
    """``(bucket start s, payload)`` pairs, newest last, each ``bucket_s`` seconds wide."""

    def __init__(
        self,
        make: Callable[[], _T],
        bucket_s: float,
        retention_s: float,
        clock: Callable[[], float],
    ) -> None:
        if bucket_s <= 0:
            raise ValueError(f"bucket_s must be > 0, got {bucket_s}")
        if retention_s < bucket_s:
            raise ValueError(f"retention_s ({retention_s}) must be >= bucket_s ({bucket_s})")
        self.bucket_s = bucket_s
        self.retention_s = retention_s
        self.clock = clock
        self._make = make
        self._buckets: deque[tuple[float, _T]] = deque()

    def _start_of(self, t: float) -> float:
        return math.floor(t / self.bucket_s) * self.bucket_s

    def _expire(self, now: float) -> None:
        while self._buckets and self._buckets[0][0] + self.bucket_s <= now - self.retention_s:
            self._buckets.popleft()

    def current(self) -> _T:
        """The payload of the bucket holding now (created on first use)."""
        now = self.clock()
        self._expire(now)
        start = self._start_of(now)
        if not self._buckets or self._buckets[-1][0] < start:
            self._buckets.append((start, self._make()))
        return self._buckets[-1][1]

    def since(self, window_s: float, now: float | None = None) -> list[tuple[float, _T]]:
        """Buckets overlapping the last ``window_s`` seconds (bucket-aligned), oldest first."""
        now = self.clock() if now is None else now
        self._expire(now)
        first = self._start_of(now - window_s) + self.bucket_s
        return [(s, p) for s, p in self._buckets if s >= first or s + self.bucket_s > now]


@dataclass(frozen=True)
class WindowSummary:
    """Quantiles of one window. Values in the unit the samples were added in; None when empty."""

    count: int
    p50: float | None
    p90: float | None
    p99: float | None
    mean: float | None

    def to_dict(self, scale: float = 1.0, digits: int = 3) -> dict[str, float | int | None]:
        """JSON form with every value multiplied by ``scale`` (e.g. 1000 for s -> ms)."""

        def v(x: float | None) -> float | None:
            return None if x is None else round(x * scale, digits)

        return {
            "count": self.count,
            "p50": v(self.p50),
            "p90": v(self.p90),
            "p99": v(self.p99),
            "mean": v(self.mean),
        }


class _Windowed(Generic[_T]):
    """Common state of the sliding statistics: buckets of ``_new_bucket()`` payloads.

    ``bucket_s``/``retention_s``: seconds (ValueError when <= 0 or retention < bucket).
    ``clock``: seconds, monotonic (``time.monotonic`` by default; tests pass a fake).
    """

    def __init__(
        self,
        bucket_s: float = DEFAULT_BUCKET_S,
        retention_s: float = DEFAULT_RETENTION_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._started = clock()
        self._buckets: _Buckets[_T] = _Buckets(self._new_bucket, bucket_s, retention_s, clock)

    def _new_bucket(self) -> _T:
        raise NotImplementedError


class SlidingQuantiles(_Windowed[DDSketch]):
    """Quantiles of a stream of non-negative values over recent windows.

    ``add(x)`` costs one sketch insert; ``summary(window_s)`` merges ``window_s / bucket_s``
    sketches.
    """

    def _new_bucket(self) -> DDSketch:
        return DDSketch(RELATIVE_ACCURACY)

    def add(self, value: float) -> None:
        """Record one sample (negative values are clamped to 0: they are clock noise)."""
        self._buckets.current().add(max(0.0, float(value)))

    def summary(self, window_s: float) -> WindowSummary:
        """Count, p50/p90/p99 and mean of the samples of the last ``window_s`` seconds."""
        return _summarise(p for _, p in self._buckets.since(window_s))


def _summarise(sketches: Iterable[DDSketch]) -> WindowSummary:
    merged = DDSketch(RELATIVE_ACCURACY)
    for s in sketches:
        if s.count:
            merged.merge(s)
    n = int(merged.count)
    if n == 0:
        return WindowSummary(0, None, None, None, None)
    q = merged.get_quantile_value
    return WindowSummary(n, q(0.5), q(0.9), q(0.99), merged.sum / n)


class SlidingRate(_Windowed[list[float]]):
    """A running sum over recent windows (tokens, bytes), reported per second.

    A window longer than the object's life is divided by the time actually observed.
    ``total``: everything added since creation.
    """

    total = 0.0

    def _new_bucket(self) -> list[float]:
        return [0.0]

    def add(self, amount: float) -> None:
        """Count ``amount`` (>= 0) now."""
        self._buckets.current()[0] += amount
        self.total += amount

    def per_second(self, window_s: float) -> float:
        """Sum over the last ``window_s`` seconds divided by the seconds covered."""
        now = self._clock()
        buckets = self._buckets.since(window_s, now)
        if not buckets:
            return 0.0
        span = now - max(buckets[0][0], self._started)
        return sum(p[0] for _, p in buckets) / max(span, 1e-3)
