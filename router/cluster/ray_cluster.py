"""The worker actors on Ray: launch, register, health-check, restart and scale them.

Workers are Ray actors (the classes the caller passes: ``prefill_worker.actor.PrefillActor`` and
``decode_worker.actor.DecodeActor`` for ``pdserve serve``, fakes in tests) in the namespace
``pdserve``, each serving gRPC on its own port; the router reaches them only over gRPC, through
the :class:`router.pool.WorkerPool` this module keeps up to date. Startup, health, scaling and
multi-node rules (node addresses, role placement by custom resources, node failure, joining
with Ray token authentication through :mod:`router.cluster.ray_join`): docs/cluster.md.

NOTE: a little over 450 lines on purpose: launch, health checks, restart and scale all change
the same actor table under one lock, and splitting them would spread that invariant over files.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import ray
from ray.exceptions import GetTimeoutError, RayActorError

from pdserve.config import EngineConfig, check_cpus_per_worker
from pdserve.worker_info import WorkerInfo
from router.cluster.ray_join import join, join_hint
from router.cluster.registry import NAMESPACE, live_registry
from router.errors import Conflict, InsufficientResources
from router.pool import WorkerPool
from router.worker_client import ROLES, WorkerClient

log = logging.getLogger(__name__)

MAX_WORKERS_PER_ROLE = 64  # /admin/scale bound: far beyond one node, catches typos like 2000


@dataclass(frozen=True)
class ClusterSpec:
    """What to run. ``cpus_per_worker`` None = the machine's CPUs split evenly (see
    :func:`local_resources`).

    ``gpus_per_worker`` None = 1 on CUDA (a fraction when workers outnumber GPUs), 0 on CPU.
    ``prefill_resources``/``decode_resources``: Ray custom resources each worker of that role
    requires (e.g. ``{"pdserve_prefill": 1}``), so roles land on the nodes that advertise them.
    A retired worker (scale-down) leaves the pool at once and is stopped ``drain_s`` later or,
    when this router still has requests in flight on it, once they end, at most
    ``drain_timeout_s`` after it left (what still runs then is re-placed on other workers).
    Times in seconds.
    """

    engine: EngineConfig
    num_prefill_workers: int = 1
    num_decode_workers: int = 1
    cpus_per_worker: float | None = None
    gpus_per_worker: float | None = None
    max_restarts: int = 3
    health_interval_s: float = 2.0
    ping_timeout_s: float = 10.0
    start_timeout_s: float = 900.0
    replace_after_s: float = 120.0
    drain_s: float = 5.0
    drain_timeout_s: float = 120.0
    router_flags: tuple[str, ...] = ()  # what a joining router must repeat (join_hint)
    router_ports: tuple[int, int] | None = None  # this server's (HTTP, gRPC) ports (join_hint)
    prefill_resources: dict[str, float] = field(default_factory=dict)
    decode_resources: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_decode_workers < 1:
            raise ValueError("--num-decode-workers must be >= 1")
        if self.num_prefill_workers < 0:
            raise ValueError("--num-prefill-workers must be >= 0")
        if self.cpus_per_worker is not None:
            check_cpus_per_worker(self.cpus_per_worker)
        for role, res in (("prefill", self.prefill_resources), ("decode", self.decode_resources)):
            for name, amount in res.items():
                if name in ("CPU", "GPU", "memory") or not amount > 0:
                    raise ValueError(
                        f"--{role}-resources: {name}={amount} must be a custom resource > 0 "
                        "(CPUs and GPUs have their own flags)"
                    )

    def resources(self, role: str) -> dict[str, float]:
        """The custom resources one worker of ``role`` requires."""
        return dict(self.prefill_resources if role == "prefill" else self.decode_resources)


def local_resources(spec: ClusterSpec) -> tuple[float, int]:
    """(CPUs per worker, CPUs to give a new local Ray) for ``spec``: ``cpus_per_worker``, else
    the machine's CPUs split evenly among the workers (at least 0.5 each).

    The router (HTTP and gRPC gateways, detokenization) keeps no CPU of its own: it waits on I/O
    most of the time, and a worker with two or more threads runs its prefill and decode loops
    apart (decode_worker/engine.py), which pays even where a second thread adds nothing to a
    bf16 matmul (AMX). Measured on a 2-core Intel Xeon (AMX), SmolLM2-135M bf16, unified mode, the
    serving suite's main workload, two interleaved pairs (docs/benchmarks.md, session 16): both
    CPUs 256.2 / 259.8 output tok/s (p99 ITL 81 / 80 ms), one CPU with the other left to the
    router 245.8 / 241.6 (p99 ITL 407 / 409 ms). Session 7 had measured the opposite (one thread
    15-20% faster) when a unified worker ran one loop on two synchronised threads."""
    n = spec.num_prefill_workers + spec.num_decode_workers
    total = os.cpu_count() or 1
    cpus = spec.cpus_per_worker or max(0.5, total / n)
    ray_cpus = max(total, int(cpus * n + 0.999))
    return cpus, ray_cpus


def gpus_per_worker(spec: ClusterSpec) -> float:
    """GPUs per worker: ``spec.gpus_per_worker``, else on CUDA the GPUs Ray found split among the
    workers (at most 1 each), else 0. Needs Ray initialised."""
    if spec.gpus_per_worker is not None:
        return spec.gpus_per_worker
    if not spec.engine.load.device.startswith("cuda"):
        return 0.0
    count = float(ray.cluster_resources().get("GPU", 0.0))
    n = spec.num_prefill_workers + spec.num_decode_workers
    return min(1.0, count / n) if count else 0.0


def shutdown_ray() -> None:
    """Disconnect from Ray (stopping a local Ray this process started); idempotent."""
    if ray.is_initialized():
        ray.shutdown()


@dataclass
class _Actor:
    """One worker actor as the cluster tracks it."""

    worker_id: str
    role: str
    handle: Any  # ray.actor.ActorHandle
    info: WorkerInfo | None = None
    down_since: float | None = None
    retiring: bool = False
    restarts: int = 0
    # a start() call is running (from launch until it returns): the health monitor leaves the
    # actor alone meanwhile, since a loading worker answers pings but serves no gRPC yet
    starting: bool = True


class RayCluster:
    """Owns the worker actors of one ``pdserve serve`` and keeps ``pool`` in step with them.

    ``actor_classes``: role ('prefill' | 'decode') -> actor class, a plain class (wrapped with
    ``ray.remote`` here) or a Ray actor class; the caller imports the worker modules, so the router
    never loads torch.
    ``progress``: called with one human-readable line per startup step. ``on_worker_ready``:
    called each time a worker has loaded and registered (startup progress displays).
    """

    def __init__(
        self,
        spec: ClusterSpec,
        pool: WorkerPool,
        actor_classes: dict[str, type],
        ray_address: str | None = None,
        progress: Callable[[str], None] | None = None,
        on_worker_ready: Callable[[WorkerInfo], None] | None = None,
    ) -> None:
        self.spec = spec
        self._on_worker_ready = on_worker_ready
        self.pool = pool
        self.ray_address = ray_address
        self._classes = actor_classes
        self._progress = progress or (lambda line: log.info("%s", line))
        self._actors: dict[str, _Actor] = {}
        self._next_index = {"prefill": 0, "decode": 0}
        self._registry: Any = None
        self._monitor: asyncio.Task[None] | None = None
        self._cpus, self._ray_cpus = local_resources(spec)
        self._gpus = 0.0  # set once Ray is up (init_ray)
        self._lock = asyncio.Lock()
        self._replacements: set[asyncio.Task[None]] = set()
        self._drains: set[asyncio.Task[None]] = set()  # retired actors waiting to stop

    @property
    def gcs_address(self) -> str:
        """The Ray cluster's address ('host:port'), for ``pdserve router --ray-address``."""
        return str(ray.get_runtime_context().gcs_address)

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Start (or join) Ray, launch the workers, wait until all serve, start health checks.

        Raises RuntimeError naming the worker that failed to start.
        """
        self.init_ray()
        await self._start_workers()

    def init_ray(self) -> None:
        """Start or join Ray (idempotent; blocks for the seconds Ray takes to start).

        NOTE: ``ray.init`` replaces the process's SIGTERM handler; a caller that handles
        signals itself installs its handlers again afterwards.
        """
        if not ray.is_initialized():
            t0 = time.monotonic()
            if self.ray_address:
                join(self.ray_address, NAMESPACE, log_to_driver=True)
            else:
                self._init_local_ray()
            where = "joined" if self.ray_address else f"local, {self._ray_cpus} CPUs"
            self._progress(f"Ray {where} at {self.gcs_address} in {time.monotonic() - t0:.1f} s")
            self._progress(
                join_hint(
                    self.gcs_address,
                    self.spec.engine.load.model,
                    self.spec.router_flags,
                    self.spec.router_ports,
                )
            )
        self._gpus = gpus_per_worker(self.spec)

    def _init_local_ray(self, attempts: int = 2) -> None:
        """Start a local Ray node. Ray gives its raylet a fixed 30 s to register; on a loaded
        machine that can pass, so a node that timed out during startup is retried once."""
        for attempt in range(1, attempts + 1):
            try:
                ray.init(
                    num_cpus=self._ray_cpus,
                    namespace=NAMESPACE,
                    include_dashboard=False,
                    log_to_driver=True,
                    logging_level=logging.WARNING,
                )
                return
            except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception here
                if attempt == attempts or "timed out during startup" not in str(e):
                    raise
                log.warning("Ray node timed out during startup; retrying (%s)", e)
                ray.shutdown()

    async def _start_workers(self) -> None:
        self._registry = await live_registry()
        self._progress(
            f"launching {self.spec.num_prefill_workers} prefill + {self.spec.num_decode_workers} "
            f"decode workers ({self._cpus:g} CPU, {self._gpus:g} GPU each); loading the model..."
        )
        # both roles at once: each worker loads (and warms up) its model on its own CPUs, so
        # starting the decode workers after the prefill workers only added their start times
        launches = [
            asyncio.ensure_future(self._launch(role, n))
            for role, n in (
                ("prefill", self.spec.num_prefill_workers),
                ("decode", self.spec.num_decode_workers),
            )
        ]
        try:
            done, _ = await asyncio.wait(launches, return_when=asyncio.FIRST_EXCEPTION)
        finally:  # one role failed, or startup was cancelled: stop the other launch too
            for task in launches:
                task.cancel()
            await asyncio.gather(*launches, return_exceptions=True)
        errors = [t.exception() for t in done if t.exception() is not None]
        for extra in errors[1:]:
            log.error("another worker launch failed too: %s", extra)
        if errors:
            raise errors[0]  # type: ignore[misc]
        self._monitor = asyncio.get_running_loop().create_task(self._monitor_forever())

    async def stop(self) -> None:
        """Stop health checks and every actor (best effort, never raises).

        An orderly shutdown, logged once at info: each worker leaves the pool (and the registry
        other routers follow) before it is stopped, so nothing reports the workers going away
        as failures ('marked unhealthy').
        """
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        for task in list(self._replacements) + list(self._drains):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._actors:
            ids = sorted(self._actors)
            log.info("stopping %d workers (orderly shutdown): %s", len(ids), ", ".join(ids))
        for a in self._actors.values():
            self.pool.remove(a.worker_id)
            if self._registry is not None:
                with contextlib.suppress(Exception):
                    await self._registry.remove.remote(a.worker_id)
        for a in list(self._actors.values()):
            await self._kill(a, graceful=True)
        self._actors.clear()
        if self._registry is not None:
            with contextlib.suppress(Exception):
                ray.kill(self._registry)
            self._registry = None

    # -- launching ------------------------------------------------------------------------------

    def _new_actor(self, role: str) -> _Actor:
        idx = self._next_index[role]
        self._next_index[role] += 1
        worker_id = f"{role}-{idx}"
        cls = self._classes[role]
        remote_cls = cls if isinstance(cls, ray.actor.ActorClass) else ray.remote(cls)
        kwargs: dict[str, Any] = {"num_cpus": self._cpus}
        if role == "decode":
            kwargs["allow_local_prefill"] = True  # unified mode and the no-prefill-worker fallback
        handle = remote_cls.options(
            name=worker_id,
            namespace=NAMESPACE,
            num_cpus=self._cpus,
            num_gpus=self._gpus,
            resources=self.spec.resources(role),
            max_restarts=self.spec.max_restarts,
            max_task_retries=0,
        ).remote(worker_id, self.spec.engine, **kwargs)
        actor = _Actor(worker_id, role, handle)
        self._actors[worker_id] = actor
        return actor

    async def _start_actor(self, actor: _Actor) -> WorkerInfo:
        t0 = time.monotonic()
        actor.starting = True
        try:
            info: WorkerInfo = await asyncio.wait_for(
                actor.handle.start.remote(), self.spec.start_timeout_s
            )
        except (RayActorError, asyncio.TimeoutError) as e:
            raise RuntimeError(f"worker {actor.worker_id} failed to start: {e}") from e
        finally:
            actor.starting = False
        actor.info = info
        actor.down_since = None
        if actor.retiring or actor.worker_id not in self._actors:
            return info  # scaled down while starting: never (re-)register it
        self.pool.upsert(info)
        await self._registry.put.remote(info)
        self._progress(
            f"{actor.worker_id} ready at {info.grpc_address} on node {info.node_address or '?'} "
            f"({info.num_blocks} KV blocks of {info.block_size} tokens) "
            f"in {time.monotonic() - t0:.1f} s"
        )
        if self._on_worker_ready is not None:
            self._on_worker_ready(info)
        return info

    async def _launch(self, role: str, count: int) -> None:
        actors = [self._new_actor(role) for _ in range(count)]
        results = await asyncio.gather(
            *(self._start_actor(a) for a in actors), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise RuntimeError(str(errors[0])) from errors[0]

    async def _kill(self, actor: _Actor, graceful: bool) -> None:
        if graceful:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(actor.handle.stop.remote(), 10.0)
        with contextlib.suppress(Exception):
            ray.kill(actor.handle, no_restart=True)

    # -- scaling ---------------------------------------------------------------------------------

    def workers(self, role: str) -> list[str]:
        """Ids of live (not retiring) actors of ``role``, oldest first."""
        return [a.worker_id for a in self._actors.values() if a.role == role and not a.retiring]

    async def scale(self, role: str, count: int) -> None:
        """Run exactly ``count`` workers of ``role`` (at most MAX_WORKERS_PER_ROLE).

        Raises ValueError for a bad role/count; Conflict (409) while another scale runs (the
        lock is never waited on); InsufficientResources (503) when Ray has too few free CPUs/GPUs
        for the new workers (checked before any actor is created, so nothing waits forever for
        placement); RuntimeError when a new worker fails to start.
        """
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if not (1 if role == "decode" else 0) <= count <= MAX_WORKERS_PER_ROLE:
            raise ValueError(
                f"cannot scale {role} workers to {count}: the range is "
                f"[{1 if role == 'decode' else 0}, {MAX_WORKERS_PER_ROLE}]"
            )
        if self._lock.locked():
            raise Conflict("another scale operation is in progress; retry when it has finished")
        async with self._lock:
            live = self.workers(role)
            if count > len(live):
                self._check_room(role, count - len(live))
                self._progress(f"scaling {role} workers {len(live)} -> {count}")
                await self._launch(role, count - len(live))
            for worker_id in reversed(live[count:]):
                self._progress(f"retiring {worker_id}")
                await self._retire(self._actors[worker_id])

    def _check_room(self, role: str, num_workers: int) -> None:
        """Raise InsufficientResources unless Ray has free CPUs/GPUs and ``role``'s custom
        resources for ``num_workers`` more workers (totals over the cluster, so a worker may
        still wait when the free amounts are split over nodes)."""
        free = ray.available_resources()
        need = {"CPU": self._cpus * num_workers, "GPU": self._gpus * num_workers}
        for name, amount in self.spec.resources(role).items():
            need[name] = need.get(name, 0.0) + amount * num_workers
        draining = sum(a.retiring for a in self._actors.values())
        hint = (
            f"; {draining} retired worker(s) still drain their requests and hold theirs until "
            "they stop, so retry in a few seconds"
            if draining
            else ""
        )
        for name, amount in need.items():
            have = float(free.get(name, 0.0))
            if amount > 0 and have + 1e-9 < amount:
                raise InsufficientResources(
                    f"not enough free {name} in the Ray cluster for {num_workers} more {role} "
                    f"worker(s): need {amount:g}, {have:g} free; add nodes or scale another role "
                    f"down first{hint}"
                )

    async def _retire(self, actor: _Actor) -> None:
        """Take ``actor`` out of service now and stop it once drained (:class:`ClusterSpec`)."""
        actor.retiring = True
        self.pool.remove(actor.worker_id)
        await self._registry.remove.remote(actor.worker_id)
        task = asyncio.get_running_loop().create_task(self._drain_then_kill(actor))
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)

    async def _drain_then_kill(self, actor: _Actor) -> None:
        # NOTE: at least drain_s even when idle here: routers that follow the registry
        # (`pdserve router`) learn of the removal within their poll interval, and their calls
        # in flight are not counted by this pool.
        t0 = time.monotonic()
        await asyncio.sleep(self.spec.drain_s)
        while self.pool.inflight(actor.worker_id) > 0:
            if time.monotonic() - t0 >= self.spec.drain_timeout_s:
                log.warning(
                    "%s still has %d request(s) in flight %.0f s after it was retired; stopping "
                    "it (they are re-placed on other workers)",
                    actor.worker_id, self.pool.inflight(actor.worker_id), self.spec.drain_timeout_s,
                )  # fmt: skip
                break
            await asyncio.sleep(0.1)
        await self._kill(actor, graceful=True)
        self._actors.pop(actor.worker_id, None)
        self._progress(f"{actor.worker_id} stopped after {time.monotonic() - t0:.1f} s of draining")

    async def _replace(self, role: str) -> None:
        """Launch one ``role`` worker once the cluster has room for it (a lost node's workers
        come back when a node with the role's resources joins); checks every health interval."""
        waiting = False
        while True:
            try:
                self._check_room(role, 1)
            except InsufficientResources as e:
                if not waiting:
                    self._progress(f"replacement {role} worker waits for room: {e}")
                    waiting = True
                await asyncio.sleep(self.spec.health_interval_s)
                continue
            try:
                await self._launch(role, 1)
            except RuntimeError as e:  # its actor stays tracked: the monitor handles it
                log.error("replacement %s worker failed to start: %s", role, e)
            return

    def worker_role(self, worker_id: str) -> str:
        """The role of ``worker_id`` (``/admin/faults``). Raises KeyError for an unknown one."""
        return self._actors[worker_id].role

    async def set_faults(self, worker_id: str, plan: dict[str, Any]) -> dict[str, Any]:
        """Arm a fault plan on one worker (``/admin/faults``). Raises KeyError for an unknown
        worker; the actor's error (fault injection off, bad plan) otherwise."""
        actor = self._actors[worker_id]
        armed: dict[str, Any] = await actor.handle.set_faults.remote(plan)
        return armed

    def describe(self) -> list[dict[str, Any]]:
        """One dict per actor: id, role, node address, addresses (null until it has started,
        and ``kv_endpoint`` null for a prefill worker), state, health and restart count (for
        /admin). ``state``: starting | ready | unhealthy | down | retiring."""
        out = []
        for a in self._actors.values():
            state = self.pool.get(a.worker_id)
            healthy = bool(state and state.healthy)
            if a.retiring:
                status = "retiring"
            elif a.info is None:
                status = "starting"
            elif a.down_since is not None or state is None:
                status = "down"
            else:
                status = "ready" if healthy else "unhealthy"
            info = a.info
            out.append(
                {
                    "worker_id": a.worker_id,
                    "role": a.role,
                    # an address the worker lacks (a prefill worker's KV endpoint) is null,
                    # never '', as in /v1/cluster/status
                    "node_address": (info.node_address or None) if info else None,
                    "grpc_address": info.grpc_address if info else None,
                    "kv_endpoint": (info.kv_endpoint or None) if info else None,
                    "num_blocks": a.info.num_blocks if a.info else None,
                    "pid": a.info.pid if a.info else None,
                    "resources": self.spec.resources(a.role),
                    "state": status,
                    "healthy": healthy,
                    "retiring": a.retiring,
                    "restarts": a.restarts,
                }
            )
        return out

    # -- health ----------------------------------------------------------------------------------

    async def _monitor_forever(self) -> None:
        while True:
            await asyncio.sleep(self.spec.health_interval_s)
            for actor in [a for a in self._actors.values() if not a.retiring]:
                try:
                    await self._check(actor)
                except asyncio.CancelledError:
                    raise
                except Exception:  # noqa: BLE001 - the monitor must keep running
                    log.exception("health check of %s failed", actor.worker_id)

    async def _ping(self, actor: _Actor) -> bool:
        try:
            return bool(
                await asyncio.wait_for(actor.handle.ping.remote(), self.spec.ping_timeout_s)
            )
        except (RayActorError, GetTimeoutError, asyncio.TimeoutError):
            return False

    async def _check(self, actor: _Actor) -> None:
        """One health check: re-register a restarted actor, replace a dead one."""
        if actor.starting:  # loading: it pings but serves no gRPC yet (QA D2: started twice)
            return
        now = time.monotonic()
        if not await self._ping(actor):
            if actor.retiring:
                return
            if actor.down_since is None:
                actor.down_since = now
                log.warning("worker %s does not answer Ray pings", actor.worker_id)
                self.pool.remove(actor.worker_id)
                await self._registry.remove.remote(actor.worker_id)
            elif (
                now - actor.down_since > self.spec.replace_after_s
                or actor.restarts >= self.spec.max_restarts
            ):
                # NOTE: once Ray has restarted an actor max_restarts times it never comes back,
                # so waiting replace_after_s would only keep the role short of a worker.
                log.error("worker %s is gone; launching a replacement", actor.worker_id)
                self._actors.pop(actor.worker_id, None)
                await self._kill(actor, graceful=False)
                # In the background: placement may wait for a node, and the monitor must go on
                # checking the other workers meanwhile.
                task = asyncio.get_running_loop().create_task(self._replace(actor.role))
                self._replacements.add(task)
                task.add_done_callback(self._replacements.discard)
            return
        state = self.pool.get(actor.worker_id)
        if state is not None and state.healthy:
            return
        # The process answers Ray but not (or no longer) gRPC at the registered address:
        # a restarted actor, which must be started again.
        if actor.info is not None and await _serving(actor.info, self.pool.internal_token):
            return
        if actor.retiring or actor.starting:  # retired (stopped on purpose) or being started
            return  # while we looked
        actor.restarts += 1
        self._progress(f"{actor.worker_id} restarted by Ray; starting it again")
        try:
            await self._start_actor(actor)
        except RuntimeError as e:
            log.error("%s", e)


async def _serving(info: WorkerInfo, internal_token: str | None) -> bool:
    """Whether ``info.grpc_address`` answers GetStats (a fresh channel, 3 s)."""
    client = WorkerClient(info, internal_token)
    try:
        await client.get_stats(timeout_s=3.0)
        return True
    except grpc.aio.AioRpcError:
        return False
    finally:
        await client.close()
