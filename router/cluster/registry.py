"""The worker registry: a small named Ray actor listing every registered worker's WorkerInfo.

``pdserve serve`` (:class:`router.cluster.RayCluster`) writes it as workers start, restart and
retire; each extra ``pdserve router`` process mirrors it into its own worker pool with
:class:`RegistryFollower`, so routers scale horizontally without talking to each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import ray
from ray.exceptions import RayActorError

from pdserve.worker_info import WorkerInfo
from router.pool import WorkerPool

log = logging.getLogger(__name__)

NAMESPACE = "pdserve"  # Ray namespace of the registry and the worker actors
REGISTRY_NAME = "pdserve-registry"


@ray.remote(num_cpus=0)
class WorkerRegistry:
    """Ray actor holding the current WorkerInfo of every registered worker (for extra routers)."""

    def __init__(self) -> None:
        self._workers: dict[str, WorkerInfo] = {}

    def put(self, info: WorkerInfo) -> None:
        self._workers[info.worker_id] = info

    def remove(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    def list(self) -> list[WorkerInfo]:
        return list(self._workers.values())


async def live_registry(attempts: int = 20) -> Any:
    """The named registry actor, created if absent. A registry left by an earlier router
    in the same Ray cluster may still be shutting down (its last handle just went away), and
    ``get_if_exists`` then hands back the dying actor: probe it and ask again until a live
    one answers."""
    for _ in range(attempts):
        # detached: its lifetime is the cluster's, not that of whichever router object
        # happened to create it (stop() kills it with the workers it lists)
        registry = WorkerRegistry.options(  # type: ignore[attr-defined]
            name=REGISTRY_NAME, namespace=NAMESPACE, get_if_exists=True, lifetime="detached"
        ).remote()
        try:
            await registry.list.remote()
            return registry
        except RayActorError:
            await asyncio.sleep(0.25)
    raise RuntimeError(f"Ray actor {REGISTRY_NAME!r} could not be created")


class RegistryFollower:
    """For ``pdserve router``: mirror the registry of an existing cluster into ``pool``.

    ``poll_s``: seconds between registry reads.
    """

    def __init__(self, pool: WorkerPool, ray_address: str, poll_s: float = 1.0) -> None:
        self.pool = pool
        self.ray_address = ray_address
        self.poll_s = poll_s
        self._registry: Any = None
        self._task: asyncio.Task[None] | None = None

    async def start(self, wait_for_workers_s: float = 60.0) -> None:
        """Join Ray, find the registry, load the workers. Raises RuntimeError if none appear."""
        if not ray.is_initialized():
            ray.init(address=self.ray_address, namespace=NAMESPACE, log_to_driver=False)
        try:
            self._registry = ray.get_actor(REGISTRY_NAME, namespace=NAMESPACE)
        except ValueError:
            raise RuntimeError(
                f"no pdserve cluster at {self.ray_address}: actor {REGISTRY_NAME!r} not found "
                f"in namespace {NAMESPACE!r} (start one with `pdserve serve`)"
            ) from None
        end = time.monotonic() + wait_for_workers_s
        while True:
            await self.sync()
            if self.pool.workers("decode"):
                break
            if time.monotonic() > end:
                raise RuntimeError(f"the cluster at {self.ray_address} has no decode worker")
            await asyncio.sleep(self.poll_s)
        self._task = asyncio.get_running_loop().create_task(self._follow())

    async def sync(self) -> None:
        """Read the registry once and apply additions, address changes and removals."""
        infos: list[WorkerInfo] = await self._registry.list.remote()
        ids = {i.worker_id for i in infos}
        for info in infos:
            self.pool.upsert(info)
        for w in list(self.pool):
            if w.worker_id not in ids:
                self.pool.remove(w.worker_id)

    async def _follow(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                await self.sync()
            except RayActorError:
                log.error("the cluster's registry is gone; keeping the last known workers")
            except Exception:  # noqa: BLE001
                log.exception("registry sync failed")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
