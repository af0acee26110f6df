"""Tiny prefill and decode engines behind their real gRPC services, in this process, KV over the
loopback transport, registered in a router WorkerPool; sequences are driven by the router's own
RequestLifecycle. For fault-injection tests (issue 12): every worker has a FaultInjector whose
kill stops that worker's gRPC server (in-flight RPCs fail, as with a dead process) and ends its
step loop without cleanup (:class:`~pdserve.engine.faults.WorkerKilled`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import grpc
from decode_kit import TINY, tiny_config

from decode_worker import service as decode_service
from decode_worker.engine import DecodeEngine
from pdserve.config import EngineConfig, TransferConfig
from pdserve.engine.faults import FaultInjector, FaultPhase, FaultPlan, WorkerKilled
from pdserve.engine.worker_engine import WorkerEngine
from pdserve.sampling_params import SamplingParams
from pdserve.worker_info import WorkerInfo
from prefill_worker import service as prefill_service
from prefill_worker.engine import PrefillEngine
from router.lifecycle import LifecycleConfig, RequestLifecycle
from router.pool import WorkerPool

BLOCK_SIZE = 4


@dataclass
class Worker:
    """One in-process worker: its engine, gRPC server and fault injector."""

    worker_id: str
    engine: WorkerEngine
    server: grpc.aio.Server | None = None
    faults: FaultInjector = field(default_factory=FaultInjector)
    killed: threading.Event = field(default_factory=threading.Event)

    def idle(self) -> bool:
        """Nothing live and every KV block free (evictable prefix-cache blocks count as free)."""
        s = self.engine.stats()
        if isinstance(self.engine, DecodeEngine):
            return (
                s.num_running == 0  # type: ignore[union-attr]
                and s.num_waiting == 0
                and s.num_waiting_for_kv == 0  # type: ignore[union-attr]
                and s.kv_blocks_free == s.kv_blocks_total  # type: ignore[union-attr]
            )
        return (
            s.num_running == 0 and s.num_waiting == 0 and s.kv_blocks_used == 0  # type: ignore[union-attr]
        )


@dataclass
class EngineCluster:
    pool: WorkerPool
    prefills: list[Worker]
    decodes: list[Worker]
    loop: asyncio.AbstractEventLoop

    @property
    def workers(self) -> list[Worker]:
        return self.prefills + self.decodes

    async def kill(self, w: Worker) -> None:
        """Kill ``w`` from the test (its server stops; the pool is not told)."""
        w.killed.set()
        assert w.server is not None
        await w.server.stop(grace=None)

    async def wait_idle(self, timeout_s: float, workers: Sequence[Worker] = ()) -> float:
        """Seconds until every live (or given) worker is idle; AssertionError after
        ``timeout_s``. Then checks each one's integrity."""
        chosen = list(workers) or [w for w in self.workers if not w.killed.is_set()]
        t0 = time.monotonic()
        while not all(w.idle() for w in chosen):
            busy = {w.worker_id: w.engine.stats() for w in chosen if not w.idle()}
            assert time.monotonic() - t0 < timeout_s, f"busy after {timeout_s} s: {busy}"
            await asyncio.sleep(0.05)
        for w in chosen:
            w.engine.check_integrity()
        return time.monotonic() - t0

    async def close(self) -> None:
        await self.pool.close()
        for w in self.workers:
            if w.server is not None:
                with contextlib.suppress(Exception):
                    await w.server.stop(grace=None)
            await asyncio.to_thread(w.engine.shutdown, 5.0)


def _on_kill(w: Worker, loop: asyncio.AbstractEventLoop):  # type: ignore[no-untyped-def]
    def kill(phase: FaultPhase) -> None:
        w.killed.set()
        assert w.server is not None
        server = w.server
        loop.call_soon_threadsafe(lambda: loop.create_task(server.stop(grace=None)))
        raise WorkerKilled(phase.value)

    return kill


async def _start_worker(
    role: str, index: int, plans: Sequence[FaultPlan], cfg: EngineConfig, pool: WorkerPool
) -> Worker:
    """Build one engine with its injector (plan ``plans[index]``, else none), serve, register."""
    loop = asyncio.get_running_loop()
    w = Worker(f"{role}-{index}", engine=None)  # type: ignore[arg-type]
    w.faults = FaultInjector(
        plans[index] if index < len(plans) else FaultPlan(), on_kill=_on_kill(w, loop)
    )
    if role == "decode":
        dengine = await asyncio.to_thread(
            DecodeEngine.build, cfg, TINY, worker_id=w.worker_id, faults=w.faults
        )
        w.engine, (w.server, addr) = dengine, await decode_service.serve(dengine)
        kv, blocks = dengine.kv_endpoint, dengine.kv.num_blocks
    else:
        pengine = await asyncio.to_thread(
            PrefillEngine.build, cfg, TINY, name=w.worker_id, faults=w.faults
        )
        w.engine, (w.server, addr) = pengine, await prefill_service.serve(pengine, w.worker_id)
        kv, blocks = "", pengine.kv.num_blocks
    pool.upsert(WorkerInfo(w.worker_id, role, addr, kv, blocks, BLOCK_SIZE))
    return w


async def start_engine_cluster(
    num_prefill: int = 1,
    num_decode: int = 1,
    prefill_faults: Sequence[FaultPlan] = (),
    decode_faults: Sequence[FaultPlan] = (),
    num_blocks: int = 64,
) -> EngineCluster:
    """Start the workers (plans by index; missing ones break nothing) and a polled pool."""
    base = tiny_config(num_blocks=num_blocks, block_size=BLOCK_SIZE, prefix_caching=True)
    cfg = replace(base, transfer=TransferConfig(backend="loopback", timeout_s=20.0))
    pool = WorkerPool(stats_interval_s=0.1)
    decodes = [
        await _start_worker("decode", i, decode_faults, cfg, pool) for i in range(num_decode)
    ]
    prefills = [
        await _start_worker("prefill", i, prefill_faults, cfg, pool) for i in range(num_prefill)
    ]
    await pool.poll_once()
    pool.start()
    return EngineCluster(pool, prefills, decodes, asyncio.get_running_loop())


def lifecycle_config(**kw: object) -> LifecycleConfig:
    """Short timeouts so a lost message shows within seconds."""
    base: dict[str, object] = {
        "block_size": BLOCK_SIZE,
        "accept_timeout_s": 5.0,
        "prefill_timeout_s": 10.0,
        "kv_timeout_s": 2.0,
        "abort_timeout_s": 1.0,
    }
    return LifecycleConfig(**{**base, **kw})  # type: ignore[arg-type]


async def generate(
    pool: WorkerPool,
    rid: str,
    prompt: Sequence[int],
    max_tokens: int,
    config: LifecycleConfig | None = None,
    timeout_s: float = 20.0,
) -> tuple[list[int], RequestLifecycle]:
    """Run one greedy sequence through the router's lifecycle; (token ids, the lifecycle).
    Router errors propagate."""
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    lc = RequestLifecycle(
        rid,
        prompt,
        sampling,
        pool,
        config or lifecycle_config(),
        deadline=time.monotonic() + timeout_s,
    )
    out = [t.token_id async for t in lc.run()]
    return out, lc
