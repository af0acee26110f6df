"""Sliding-window quantiles and rates: accuracy against exact percentiles, window expiry."""

from __future__ import annotations

import random

import pytest

from router.latency_window import RELATIVE_ACCURACY, SlidingQuantiles, SlidingRate

pytestmark = pytest.mark.timeout(30)


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def exact(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[int(q * (len(s) - 1))]


def test_quantiles_within_the_sketch_accuracy() -> None:
    clock = Clock()
    w = SlidingQuantiles(clock=clock)
    rng = random.Random(0)
    values = [rng.lognormvariate(-3, 1) for _ in range(5000)]
    for i, v in enumerate(values):
        clock.t = 1000.0 + i * 0.01  # 50 s of samples across several buckets
        w.add(v)
    s = w.summary(60.0)
    assert s.count == len(values)
    for got, q in ((s.p50, 0.5), (s.p90, 0.9), (s.p99, 0.99)):
        assert got is not None
        assert abs(got - exact(values, q)) <= 2 * RELATIVE_ACCURACY * exact(values, q)
    assert s.mean == pytest.approx(sum(values) / len(values))


def test_old_buckets_leave_the_window_and_memory_is_bounded() -> None:
    clock = Clock(0.0)
    w = SlidingQuantiles(bucket_s=10.0, retention_s=300.0, clock=clock)
    w.add(5.0)  # t = 0
    clock.t = 100.0
    w.add(1.0)
    assert w.summary(60.0).count == 1 and w.summary(60.0).p50 == pytest.approx(1.0, rel=0.01)
    assert w.summary(300.0).count == 2
    clock.t = 1000.0
    assert w.summary(300.0).count == 0 and w.summary(300.0).p99 is None
    for i in range(10_000):
        clock.t = 1000.0 + i
        w.add(1.0)
    assert len(w._buckets._buckets) <= 31  # retention / bucket + the current one


def test_rate_per_second_over_the_window() -> None:
    clock = Clock(0.0)
    r = SlidingRate(bucket_s=10.0, clock=clock)
    for i in range(120):
        clock.t = float(i)
        r.add(5)
    clock.t = 120.0
    assert r.total == 600
    assert r.per_second(60.0) == pytest.approx(5.0, rel=0.1)
    clock.t = 500.0
    assert r.per_second(60.0) == 0.0


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="bucket_s"):
        SlidingQuantiles(bucket_s=0)
    with pytest.raises(ValueError, match="retention_s"):
        SlidingRate(bucket_s=10, retention_s=5)
