"""The actor shell both workers share (DESIGN §8): build the engine, serve gRPC, answer pings.

A plain class with async methods; ``router/cluster.py`` wraps a subclass with ``ray.remote`` (so
this module does not import Ray and tests drive actors directly). Lifecycle::

    Actor(worker_id, config, num_cpus)   # cheap: no model yet; sets torch threads
    await start() -> WorkerInfo          # loads the model in a thread (pings stay answered),
                                         # opens the KV transport, serves gRPC on a free port
    await ping() -> bool                 # liveness: the step loop thread runs
    await stop()                         # stops gRPC, fails live requests, closes the transport

torch threads = the actor's CPU share (``num_cpus`` rounded, at least 1), so co-located actors on
a small machine do not oversubscribe the cores. Ray starts worker processes at niceness 15 (its
``worker_niceness`` default), below the router, the client and everything else on the machine;
an actor is the serving hot path, so it asks for the normal priority back (best effort: lowering
niceness needs CAP_SYS_NICE or an RLIMIT_NICE that allows it). A prefill worker may ask for a
niceness above 0 instead (``EngineConfig.prefill_niceness``, on by default on CPUs): where it
shares cores with a decode worker, the decode steps, whose latency every running sequence feels,
then win the contended time (docs/benchmarks.md, session 32). Threads are not pinned to cores:
measured on a shared 2-core machine (a prefill process and a decode process, 1 torch thread
each, 4 pinned/unpinned pairs), pinning each to its own core left decode step times within the
noise and made their p99 twice as slow in some runs, since a pinned actor cannot move off a core
another process is using. Subclasses say only how to build and serve their engine.
"""

from __future__ import annotations

import asyncio
import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

import grpc
import torch

from pdserve.auth import internal_token_check
from pdserve.config import EngineConfig
from pdserve.engine.faults import FaultInjector, FaultPlan
from pdserve.engine.worker_engine import WorkerEngine
from pdserve.gc_heap import freeze_heap
from pdserve.net import engine_config_for, worker_address
from pdserve.worker_info import WorkerInfo

log = logging.getLogger(__name__)

E = TypeVar("E", bound=WorkerEngine)


def threads_for(num_cpus: float) -> int:
    """torch intra-op threads for a CPU share: ``round(num_cpus)``, at least 1."""
    return max(1, round(num_cpus))


# the name of decode_layers.c's helper thread, whose scheduling the kernel library sets itself
HELPER_THREAD_NAME = "pdserve-helper"


def _thread_name(tid: int) -> str:
    """Thread ``tid`` of this process's name ('' when it cannot be read)."""
    try:
        return Path(f"/proc/self/task/{tid}/comm").read_text().strip()
    except OSError:
        return ""


def restore_priority(niceness: int = 0) -> int:
    """Set every thread of this process to ``niceness`` (0-19): lowered where it is above (a
    Ray worker starts at 15); raised where it is below, when ``niceness`` is above 0 (a thread
    an operator started below 0 keeps that for the default 0); see the module docstring. On Linux
    niceness belongs to each thread (new threads inherit their creator's), so all live threads
    are set, via ``/proc/self/task``, except the kernels' helper thread
    (:data:`HELPER_THREAD_NAME`), which sets its own. Returns the calling thread's niceness
    afterwards; a refusal to lower it is logged, not raised."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # not Linux: the process as a whole
        tids = [0]
    for tid in tids:
        try:
            if tid and _thread_name(tid) == HELPER_THREAD_NAME:
                continue  # its niceness is its own (see share_prefill_linears)
            now = os.getpriority(os.PRIO_PROCESS, tid)
            if now > niceness or 0 < niceness != now:
                os.setpriority(os.PRIO_PROCESS, tid, niceness)
        except ProcessLookupError:
            continue  # the thread ended meanwhile
        except OSError as e:
            log.info("worker stays at its niceness (cannot lower it: %s)", e)
            break
    return os.getpriority(os.PRIO_PROCESS, 0)


class WorkerActor(ABC, Generic[E]):
    """One worker of ``role``. ``config.load`` names the model; ``config.transfer`` the KV
    transport. Raises ValueError when ``num_cpus`` is not positive."""

    role: str = ""

    def __init__(self, worker_id: str, config: EngineConfig, num_cpus: float = 1.0) -> None:
        if not num_cpus > 0:
            raise ValueError(f"num_cpus must be > 0, got {num_cpus}")
        self.worker_id = worker_id
        self.config = config
        self.num_cpus = num_cpus
        torch.set_num_threads(threads_for(num_cpus))
        self.niceness = restore_priority(self.niceness_for(config))
        # armed through set_faults (/admin/faults) when --enable-fault-injection is given
        self.faults = FaultInjector() if config.enable_fault_injection else None
        self.engine: E | None = None
        self._server: grpc.aio.Server | None = None
        self._info: WorkerInfo | None = None

    def niceness_for(self, config: EngineConfig) -> int:
        """The niceness this actor's threads run at: 0 (a prefill worker may ask for more,
        :attr:`~pdserve.config.EngineConfig.prefill_niceness`)."""
        return 0

    @abstractmethod
    def build_engine(self, config: EngineConfig) -> E:
        """Load the model and open the KV transport for ``config`` (this actor's config with its
        node's KV addresses filled in); runs in a worker thread."""

    @abstractmethod
    async def serve(
        self, engine: E, host: str, interceptors: Sequence[grpc.aio.ServerInterceptor] = ()
    ) -> tuple[grpc.aio.Server, str]:
        """Start the engine's loop and its gRPC service on a free port of ``host`` behind
        ``interceptors``; returns (server, 'host:port')."""

    def kv_endpoint(self, engine: E) -> str:
        """'host:port' other workers send KV to ('' when this role receives none)."""
        return ""

    async def start(self, host: str | None = None) -> WorkerInfo:
        """Build the engine (in a thread, so ``ping`` stays answered while weights load), then
        serve gRPC on a free port. Idempotent.

        ``host``: bind address of gRPC and the KV receiver (default ``config.worker_host``, else
        this node's IP, see pdserve/net.py); a wildcard binds every interface and advertises the
        node IP. Worker RPCs must carry ``config.internal_token`` when it is set. Raises
        ConfigError (bad model/config), ValueError (KV transport) or RuntimeError (the gRPC port
        cannot be bound).
        """
        if self._info is not None:
            return self._info
        where = worker_address(host or self.config.worker_host)
        config = engine_config_for(self.config, where)
        engine = await asyncio.to_thread(self.build_engine, config)
        try:
            server, bound = await self.serve(
                engine, where.bind, internal_token_check(config.internal_token)
            )
        except BaseException:
            await asyncio.to_thread(engine.shutdown)
            raise
        self.engine, self._server = engine, server
        # again: the step loop and transport threads now exist
        self.niceness = restore_priority(self.niceness_for(config))
        freeze_heap()  # the weights, modules and libraries are here to stay: no GC pauses over them
        address = where.endpoint(int(bound.rpartition(":")[2]))
        self._info = WorkerInfo(
            worker_id=self.worker_id,
            role=self.role,
            grpc_address=address,
            kv_endpoint=self.kv_endpoint(engine),
            num_blocks=engine.kv.num_blocks,
            block_size=engine.kv.block_size,
            pid=os.getpid(),
            node_address=where.advertise,
            device=config.load.device,
        )
        log.info(
            "%s worker %s serving on %s (KV endpoint %r, %d KV blocks, %d torch threads, "
            "niceness %d)",
            self.role,
            self.worker_id,
            address,
            self._info.kv_endpoint,
            engine.kv.num_blocks,
            torch.get_num_threads(),
            self.niceness,
        )
        return self._info

    async def set_faults(self, plan: dict[str, Any]) -> dict[str, Any]:
        """Arm this worker's fault injector with ``plan`` (a :class:`FaultPlan` as a dict);
        returns the plan now in force. Raises RuntimeError when fault injection is off,
        ValueError for a bad plan or one with a fault this worker's role never fires."""
        if self.faults is None:
            raise RuntimeError(f"worker {self.worker_id} runs without --enable-fault-injection")
        armed = FaultPlan.from_dict(plan)
        armed.check_role(self.role)
        self.faults.set(armed)
        log.warning("worker %s: fault plan armed: %s", self.worker_id, armed.to_dict())
        return armed.to_dict()

    async def ping(self) -> bool:
        """True while the actor is alive (and, once started, its step loop thread runs)."""
        return self.engine is None or self.engine.is_running()

    async def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving: gRPC first (in-flight RPCs get ``grace_s`` seconds), then the engine
        (live requests fail with UNAVAILABLE, blocks are freed, the KV transport closes)."""
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
        if self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown)
            self.engine = None
        self._info = None


async def serve_grpc(
    engine: WorkerEngine,
    add_servicer: Callable[[grpc.aio.Server], object],
    host: str = "127.0.0.1",
    port: int = 0,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> tuple[grpc.aio.Server, str]:
    """Start a grpc.aio server on ``host:port`` (0 = a free port) with the servicer that
    ``add_servicer`` registers behind ``interceptors`` (e.g. the internal-token check of
    pdserve/auth.py), and the engine's step loop. Returns (server, 'host:port').
    Raises RuntimeError when the port cannot be bound."""
    server = grpc.aio.server(interceptors=list(interceptors))
    add_servicer(server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"cannot bind the {engine.name} gRPC server to {host}:{port}")
    engine.start()
    await server.start()
    return server, f"{host}:{bound}"
