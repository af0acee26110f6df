"""Ray worker pool with fake worker actors: launch, registry, restart + re-register, scaling."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import fake_workers
import pytest
import ray
from fake_workers import (
    FailingStartWorkerActor,
    FakeWorkerActor,
    LoadingForeverWorkerActor,
    SlowerStartWorkerActor,
    SlowStartWorkerActor,
    SlowStopWorkerActor,
)

from pdserve.config import EngineConfig
from pdserve.sampling_params import SamplingParams
from pdserve.tokenizer import Tokenizer
from router.cluster import ClusterSpec, RayCluster, RegistryFollower
from router.pool import WorkerPool
from router.serving import Router, RouterConfig
from router.status import _worker_view

TIMEOUT_S = 180
pytestmark = pytest.mark.timeout(TIMEOUT_S)


@pytest.fixture(autouse=True)
async def report_pending_awaits() -> Any:
    """Print every asyncio task's stack 20 s before pytest-timeout fires: its own report shows
    only the event loop's select(), not which await (Ray call, start, stop) never returned.
    (One fresh-clone run hung here once for 180 s; repeated runs, loaded or not, did not.)"""

    async def watchdog() -> None:
        await asyncio.sleep(TIMEOUT_S - 20)
        print(f"--- asyncio tasks still pending after {TIMEOUT_S - 20} s ---", file=sys.stderr)
        for task in asyncio.all_tasks():
            print(f"{task.get_name()}:", file=sys.stderr)
            coro: Any = task.get_coro()
            while coro is not None:  # the await chain, outermost first
                frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
                if frame is not None:
                    code = frame.f_code
                    print(f"  {code.co_filename}:{frame.f_lineno} {code.co_name}", file=sys.stderr)
                coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)

    task = asyncio.get_running_loop().create_task(watchdog())
    yield
    task.cancel()


@pytest.fixture(scope="module")
def local_ray() -> Iterator[str]:
    ray.cloudpickle.register_pickle_by_value(fake_workers)
    ctx = ray.init(num_cpus=4, include_dashboard=False, namespace="pdserve", log_to_driver=False)
    try:
        yield ctx.address_info["address"]
    finally:
        ray.shutdown()


def spec(prefill: int = 1, decode: int = 1) -> ClusterSpec:
    return ClusterSpec(
        engine=EngineConfig(),
        num_prefill_workers=prefill,
        num_decode_workers=decode,
        cpus_per_worker=0.25,
        health_interval_s=0.3,
        drain_s=0.1,
    )


async def wait_for(pred: Callable[[], bool], timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < end, "condition not reached in time"
        await asyncio.sleep(0.1)


async def crash(handle: Any) -> None:
    """Make the actor's process exit mid-call. The call fails with RayActorError once Ray reports
    the death to this driver; that report is Ray's, not pdserve's, and once (a loaded CI run) it
    had not come 3 minutes later, so it is waited for at most 20 s: what these tests check is
    pdserve noticing the death by itself (its health pings)."""
    with contextlib.suppress(asyncio.TimeoutError):
        with pytest.raises(ray.exceptions.RayActorError):
            await asyncio.wait_for(handle.crash.remote(), 20.0)


async def test_cluster_launch_restart_scale_and_follow(
    local_ray: str, tokenizer: Tokenizer
) -> None:
    pool = WorkerPool(stats_interval_s=0.2)
    classes = {"prefill": FakeWorkerActor, "decode": FakeWorkerActor}
    cluster = RayCluster(spec(), pool, actor_classes=classes, progress=lambda _line: None)
    await cluster.start()
    pool.start()
    try:
        assert [w.worker_id for w in pool.workers("decode")] == ["decode-0"]
        assert [w.worker_id for w in pool.workers("prefill")] == ["prefill-0"]
        assert {d["worker_id"] for d in cluster.describe()} == {"decode-0", "prefill-0"}
        # /admin/workers shows a prefill worker's missing KV endpoint as /v1/cluster/status does
        rows = {d["worker_id"]: d for d in cluster.describe()}
        for wid, kv in (("prefill-0", None), ("decode-0", "kv-decode-0")):
            assert rows[wid]["kv_endpoint"] == kv, rows[wid]
            assert _worker_view(pool.get(wid), None, None)["kv_endpoint"] == kv  # type: ignore[arg-type]

        # a second router process would follow the same registry
        follower_pool = WorkerPool()
        follower = RegistryFollower(follower_pool, local_ray, poll_s=0.2)
        await follower.start(wait_for_workers_s=5)
        assert {w.worker_id for w in follower_pool} == {"decode-0", "prefill-0"}

        # Ray restarts a crashed actor; the cluster starts it again and re-registers it
        old = pool.get("decode-0").info  # type: ignore[union-attr]
        handle = ray.get_actor("decode-0", namespace="pdserve")
        await crash(handle)

        def re_registered() -> bool:
            w = pool.get("decode-0")
            return w is not None and w.healthy and w.info.pid != old.pid

        await wait_for(re_registered)
        assert pool.get("decode-0").info.grpc_address != old.grpc_address  # type: ignore[union-attr]

        def followed() -> bool:
            w = follower_pool.get("decode-0")
            return w is not None and w.info.pid != old.pid

        await wait_for(followed)

        # scale up and down at run time
        await cluster.scale("decode", 2)
        assert [w.worker_id for w in pool.workers("decode")] == ["decode-0", "decode-1"]
        await cluster.scale("prefill", 0)
        assert pool.workers("prefill") == []
        await cluster.scale("decode", 1)
        assert [w.worker_id for w in pool.workers("decode")] == ["decode-0"]
        await wait_for(lambda: {w.worker_id for w in follower_pool} == {"decode-0"})
        with pytest.raises(ValueError, match="cannot scale decode"):
            await cluster.scale("decode", 0)

        # with no prefill worker left, decode workers prefill locally
        router = Router(RouterConfig(model_name="fake", max_model_len=64), tokenizer, pool)
        stream = router.submit("r", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
        deltas = [d async for d in stream]
        assert stream.completion_tokens == 4 and deltas[-1].finish_reason == "length"
        await follower.stop()
        await follower_pool.close()
    finally:
        await cluster.stop()
        await pool.close()


async def test_scale_beyond_free_cpus_is_refused_at_once(local_ray: str) -> None:
    """QA H2: no placement wait and no 500: Ray's free CPUs are checked before launching."""
    from router.cluster import MAX_WORKERS_PER_ROLE
    from router.errors import InsufficientResources

    pool = WorkerPool(stats_interval_s=0.2)
    classes = {"prefill": FakeWorkerActor, "decode": FakeWorkerActor}
    big = ClusterSpec(
        engine=EngineConfig(), num_prefill_workers=0, num_decode_workers=1, cpus_per_worker=1.5
    )
    cluster = RayCluster(big, pool, actor_classes=classes, progress=lambda _line: None)
    await cluster.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(InsufficientResources, match="CPU"):
            await cluster.scale("prefill", 2)  # 3 CPUs more; 4 - 1.5 = 2.5 free
        assert time.monotonic() - t0 < 2.0 and cluster.workers("prefill") == []
        with pytest.raises(ValueError, match="range"):
            await cluster.scale("prefill", MAX_WORKERS_PER_ROLE + 1)
    finally:
        await cluster.stop()
        await pool.close()


async def test_worker_out_of_restarts_is_replaced_at_once(local_ray: str) -> None:
    """QA R2: once Ray will not restart an actor again, a replacement starts within seconds,
    not after replace_after_s."""
    pool = WorkerPool(stats_interval_s=0.2)
    classes = {"prefill": FakeWorkerActor, "decode": FakeWorkerActor}
    no_restarts = ClusterSpec(
        engine=EngineConfig(), num_prefill_workers=0, num_decode_workers=1,
        cpus_per_worker=0.25, health_interval_s=0.3, max_restarts=0, replace_after_s=600.0,
    )  # fmt: skip
    cluster = RayCluster(no_restarts, pool, actor_classes=classes, progress=lambda _line: None)
    await cluster.start()
    pool.start()
    try:
        handle = ray.get_actor("decode-0", namespace="pdserve")
        await crash(handle)
        t0 = time.monotonic()

        def replaced() -> bool:
            live = [w for w in pool.workers("decode") if w.healthy]
            return bool(live) and all(w.worker_id != "decode-0" for w in live)

        await wait_for(replaced, timeout_s=60.0)
        assert time.monotonic() - t0 < 60.0
        assert "decode-0" not in {d["worker_id"] for d in cluster.describe()}
    finally:
        await cluster.stop()
        await pool.close()


def test_role_resources_are_validated() -> None:
    with pytest.raises(ValueError, match="--prefill-resources: CPU"):
        ClusterSpec(engine=EngineConfig(), prefill_resources={"CPU": 1.0})
    with pytest.raises(ValueError, match="--decode-resources: pdserve_decode=0"):
        ClusterSpec(engine=EngineConfig(), decode_resources={"pdserve_decode": 0.0})
    s = ClusterSpec(engine=EngineConfig(), decode_resources={"pdserve_decode": 1.0})
    assert s.resources("decode") == {"pdserve_decode": 1.0} and s.resources("prefill") == {}


async def test_scaling_a_role_whose_resource_no_node_offers_is_refused(local_ray: str) -> None:
    """Placement by custom resource: no node advertises pdserve_prefill, so scaling prefill up
    fails at once (503) naming the resource, instead of waiting forever for placement; the
    decode role, without resources, starts and /admin/workers shows its node and state."""
    from router.errors import InsufficientResources

    pool = WorkerPool(stats_interval_s=0.2)
    classes = {"prefill": FakeWorkerActor, "decode": FakeWorkerActor}
    s = ClusterSpec(
        engine=EngineConfig(),
        num_prefill_workers=0,
        num_decode_workers=1,
        cpus_per_worker=0.25,
        health_interval_s=0.3,
        prefill_resources={"pdserve_prefill": 1.0},
    )
    cluster = RayCluster(s, pool, actor_classes=classes, progress=lambda _line: None)
    await cluster.start()
    try:
        with pytest.raises(InsufficientResources, match="free pdserve_prefill .*need 1, 0 free"):
            await cluster.scale("prefill", 1)
        assert cluster.workers("prefill") == []
        (row,) = cluster.describe()
        assert row["role"] == "decode" and row["state"] in ("ready", "unhealthy")
        assert row["resources"] == {} and "node_address" in row
    finally:
        await cluster.stop()


async def test_both_roles_start_at_once_and_a_failed_role_stops_the_start(local_ray: str) -> None:
    """The decode workers start while the prefill workers are still loading (each loads on its
    own CPUs); a role that fails to start fails the start at once, without waiting for the
    other role, whose workers the caller then stops."""
    pool = WorkerPool(stats_interval_s=0.2)
    classes = {"prefill": SlowerStartWorkerActor, "decode": SlowerStartWorkerActor}
    cluster = RayCluster(spec(), pool, actor_classes=classes, progress=lambda _line: None)
    await cluster.start()
    try:
        prefill = await ray.get_actor("prefill-0", namespace="pdserve").start_time.remote()
        decode = await ray.get_actor("decode-0", namespace="pdserve").start_time.remote()
        # one after the other they would start >= 5 s apart; at once, within process spawn skew
        assert abs(decode - prefill) < SlowerStartWorkerActor.START_S - 1.0
    finally:
        await cluster.stop()
        await pool.close()

    pool = WorkerPool(stats_interval_s=0.2)
    classes = {"prefill": LoadingForeverWorkerActor, "decode": FailingStartWorkerActor}
    cluster = RayCluster(spec(), pool, actor_classes=classes, progress=lambda _line: None)
    t0 = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="decode-0.*cannot load the model"):
            await cluster.start()
        assert time.monotonic() - t0 < 60.0  # not the prefill worker's 300 s start
        assert pool.workers("prefill") == []  # its start was cancelled: never registered
    finally:
        await cluster.stop()
        await pool.close()


async def test_scaling_up_starts_a_loading_worker_once(local_ray: str) -> None:
    """QA D2: the health monitor took a worker still loading (it answers Ray pings, serves no
    gRPC yet, has no info) for one Ray had restarted and called start() on it a second time:
    two registrations, and a real worker whose forward passes all failed."""
    pool = WorkerPool(stats_interval_s=0.2)
    lines: list[str] = []
    classes = {"prefill": SlowStartWorkerActor, "decode": FakeWorkerActor}
    cluster = RayCluster(spec(), pool, actor_classes=classes, progress=lines.append)
    await cluster.start()
    pool.start()
    try:
        await cluster.scale("prefill", 0)
        await cluster.scale("prefill", 1)  # 2 s of loading: about 6 health checks meanwhile
        await asyncio.sleep(1.0)  # and a few after it registered
        handle = ray.get_actor("prefill-1", namespace="pdserve")
        assert await handle.num_starts.remote() == 1
        assert not any("restarted by Ray" in line for line in lines), lines
        assert sum(line.startswith("prefill-1 ready") for line in lines) == 1
        (row,) = [d for d in cluster.describe() if d["worker_id"] == "prefill-1"]
        assert row["restarts"] == 0 and row["state"] == "ready"
        assert [w.worker_id for w in pool.workers("prefill")] == ["prefill-1"]
    finally:
        await cluster.stop()
        await pool.close()


async def test_a_retired_worker_stops_once_its_requests_drained(local_ray: str) -> None:
    """QA D1: scale-down drains. A retired worker leaves the pool at once but keeps running
    while this router has requests on it, and stops when they end or at drain_timeout_s."""
    pool = WorkerPool(stats_interval_s=0.2)
    classes = {"prefill": FakeWorkerActor, "decode": FakeWorkerActor}
    s = dataclasses.replace(spec(prefill=2), drain_timeout_s=4.0)
    cluster = RayCluster(s, pool, actor_classes=classes, progress=lambda _line: None)
    await cluster.start()
    pool.start()
    try:
        busy = {w: pool.get(w) for w in ("prefill-0", "prefill-1")}
        ticks = {}
        for name, worker in busy.items():
            assert worker is not None
            ticks[name] = pool.reserve(worker, tokens=100)  # a prefill in flight on each
        t0 = time.monotonic()
        await cluster.scale("prefill", 0)
        assert pool.workers("prefill") == []

        def actors() -> set[str]:
            return {d["worker_id"] for d in cluster.describe()}

        await asyncio.sleep(1.5)  # far past drain_s (0.1 s)
        assert actors() == {"decode-0", "prefill-0", "prefill-1"}
        for name in busy:
            assert await ray.get_actor(name, namespace="pdserve").ping.remote()
        assert {d["state"] for d in cluster.describe() if d["role"] == "prefill"} == {"retiring"}

        pool.release(busy["prefill-0"], ticks["prefill-0"])  # its prefill ended: it stops now
        await wait_for(lambda: "prefill-0" not in actors(), timeout_s=10.0)
        assert "prefill-1" in actors() and time.monotonic() - t0 < 4.0
        # prefill-1 never drains: stopped at drain_timeout_s, its request is re-placed
        await wait_for(lambda: "prefill-1" not in actors(), timeout_s=15.0)
        assert time.monotonic() - t0 >= 4.0 and pool.inflight("prefill-1") == 1
    finally:
        await cluster.stop()
        await pool.close()


async def test_an_orderly_stop_logs_once_and_marks_no_worker_unhealthy(
    local_ray: str, caplog: pytest.LogCaptureFixture
) -> None:
    """`pdserve serve` stopping (SIGTERM) stops its workers on purpose: while they go, the
    pool's poller must not report them as failed ('marked unhealthy' warnings); the stop is
    logged once, at info."""
    pool = WorkerPool(stats_interval_s=0.05)  # polls many times while the workers stop
    classes = {"prefill": SlowStopWorkerActor, "decode": SlowStopWorkerActor}
    cluster = RayCluster(spec(), pool, actor_classes=classes, progress=lambda _line: None)
    await cluster.start()
    pool.start()
    try:
        await wait_for(lambda: all(w.stats is not None for w in pool))
        caplog.clear()
        with caplog.at_level(logging.INFO):
            await cluster.stop()
            await asyncio.sleep(0.3)  # polls that would have found the workers gone
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert warnings == [], [r.getMessage() for r in warnings]
        stops = [r.getMessage() for r in caplog.records if "orderly shutdown" in r.getMessage()]
        assert stops == ["stopping 2 workers (orderly shutdown): decode-0, prefill-0"]
        assert list(pool) == []  # they left the pool before they stopped
    finally:
        await cluster.stop()
        await pool.close()
