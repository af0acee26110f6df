"""The default CPU split of `pdserve serve`'s workers (no Ray: a pure function of the spec)."""

from __future__ import annotations

import pytest

from pdserve.config import EngineConfig, LoadConfig
from pdserve.engine.actor import threads_for
from router.cluster import ClusterSpec, local_resources, ray_cluster

pytestmark = pytest.mark.timeout(30)


def split(cpus: int, dtype: str, prefill: int, decode: int, monkeypatch: pytest.MonkeyPatch,
          cpus_per_worker: float | None = None) -> tuple[float, int]:  # fmt: skip
    monkeypatch.setattr(ray_cluster.os, "cpu_count", lambda: cpus)
    engine = EngineConfig(load=LoadConfig(dtype=dtype))
    spec = ClusterSpec(engine, prefill, decode, cpus_per_worker=cpus_per_worker)
    return local_resources(spec)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_every_cpu_is_split_among_the_workers(dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # measured: a unified worker on both cores (its prefill and decode loops apart) beats one
    # core with the other left to the router, on AMX too (ray_cluster's note)
    assert split(2, dtype, 0, 1, monkeypatch) == (2.0, 2)
    assert split(2, dtype, 1, 1, monkeypatch) == (1.0, 2)
    assert split(3, dtype, 1, 1, monkeypatch) == (1.5, 3)
    assert split(16, dtype, 1, 1, monkeypatch) == (8.0, 16)
    cpus, ray_cpus = split(17, dtype, 2, 2, monkeypatch)
    assert (cpus, ray_cpus, threads_for(cpus)) == (4.25, 17, 4)


def test_float32_keeps_every_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert split(2, "float32", 0, 1, monkeypatch) == (2.0, 2)
    assert split(3, "float32", 1, 1, monkeypatch) == (1.5, 3)
    assert threads_for(1.5) == 2


def test_more_workers_than_cpus_and_explicit_share(monkeypatch: pytest.MonkeyPatch) -> None:
    assert split(2, "bfloat16", 2, 2, monkeypatch) == (0.5, 2)
    assert split(1, "bfloat16", 0, 1, monkeypatch) == (1.0, 1)
    assert split(2, "bfloat16", 0, 1, monkeypatch, cpus_per_worker=2.0) == (2.0, 2)
    assert split(2, "bfloat16", 1, 2, monkeypatch, cpus_per_worker=1.0) == (1.0, 3)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), 0.00001])
def test_bad_cpus_per_worker_is_named(bad: float) -> None:
    with pytest.raises(ValueError, match="--cpus-per-worker must be a number >= 0.0001"):
        ClusterSpec(EngineConfig(), 1, 1, cpus_per_worker=bad)
