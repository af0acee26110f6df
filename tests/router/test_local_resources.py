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


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_sixteen_bit_leaves_a_cpu_to_the_router(
    dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # unified on 2 cores: the decode worker gets one, the router the other
    assert split(2, dtype, 0, 1, monkeypatch) == (1.0, 2)
    # 1 prefill + 1 decode on 2 cores: reserving one would leave a worker half a CPU
    assert split(2, dtype, 1, 1, monkeypatch) == (1.0, 2)
    # 16 cores, 2 workers: 7.5 CPUs each, 7 torch threads each, 2 cores for the router
    cpus, ray_cpus = split(16, dtype, 1, 1, monkeypatch)
    assert (cpus, ray_cpus, threads_for(cpus)) == (7.5, 16, 7)


def test_float32_keeps_every_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert split(2, "float32", 0, 1, monkeypatch) == (2.0, 2)
    assert split(16, "float32", 1, 1, monkeypatch) == (8.0, 16)


def test_more_workers_than_cpus_and_explicit_share(monkeypatch: pytest.MonkeyPatch) -> None:
    assert split(2, "bfloat16", 2, 2, monkeypatch) == (0.5, 2)
    assert split(1, "bfloat16", 0, 1, monkeypatch) == (1.0, 1)
    assert split(2, "bfloat16", 0, 1, monkeypatch, cpus_per_worker=2.0) == (2.0, 2)
    assert split(2, "bfloat16", 1, 2, monkeypatch, cpus_per_worker=1.0) == (1.0, 3)
