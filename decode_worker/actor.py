"""DecodeActor: the decode worker as a Ray actor (DESIGN §8).

A plain class with async methods; ``router/cluster.py`` wraps it with ``ray.remote`` (so this
module does not import Ray and tests can drive it directly). Lifecycle::

    DecodeActor(worker_id, config, num_cpus, allow_local_prefill)   # cheap; sets torch threads
    await start() -> WorkerInfo    # loads the model, opens the KV receiver (its endpoint goes in
                                   # WorkerInfo.kv_endpoint), starts the step loop, serves gRPC
                                   # on a free port
    await ping() -> bool           # liveness: the step loop thread runs
    await stop()                   # stops gRPC, fails live requests, closes the KV receiver

torch threads = the actor's CPU share (``num_cpus`` rounded, at least 1), so co-located actors on
a small machine do not oversubscribe the cores. ``allow_local_prefill``: unified mode (requests
with ``prefill_locally`` are prefilled here); the cluster turns it on so a decode worker can serve
whole requests when no prefill worker is up.
"""

from __future__ import annotations

import asyncio
import logging
import os

import grpc
import torch

from decode_worker.engine import DecodeEngine
from decode_worker.service import serve
from pdserve.auth import internal_token_check
from pdserve.config import EngineConfig
from pdserve.net import engine_config_for, worker_address
from pdserve.worker_info import WorkerInfo

log = logging.getLogger(__name__)


def threads_for(num_cpus: float) -> int:
    """torch intra-op threads for a CPU share: ``round(num_cpus)``, at least 1."""
    return max(1, round(num_cpus))


class DecodeActor:
    """One decode worker. ``config.load`` names the model; ``config.transfer`` the KV transport
    (its ``host`` is where the KV receiver listens). Raises ValueError when ``num_cpus`` <= 0."""

    def __init__(
        self,
        worker_id: str,
        config: EngineConfig,
        num_cpus: float = 1.0,
        allow_local_prefill: bool = False,
    ) -> None:
        if not num_cpus > 0:
            raise ValueError(f"num_cpus must be > 0, got {num_cpus}")
        self.worker_id = worker_id
        self.config = config
        self.num_cpus = num_cpus
        self.allow_local_prefill = allow_local_prefill
        torch.set_num_threads(threads_for(num_cpus))
        self.engine: DecodeEngine | None = None
        self._server: grpc.aio.Server | None = None
        self._info: WorkerInfo | None = None

    async def start(self, host: str | None = None) -> WorkerInfo:
        """Build the engine (in a thread, so ``ping`` stays answered while weights load), then
        serve gRPC on a free port. Idempotent.

        ``host``: bind address of gRPC and the KV receiver (default ``config.worker_host``, else
        this node's IP; see pdserve/net.py); the node IP is advertised for a wildcard. Raises
        ConfigError (bad model/config), ValueError (KV receiver) or RuntimeError (the gRPC port
        cannot be bound).
        """
        if self._info is not None:
            return self._info
        where = worker_address(host or self.config.worker_host)  # multi-node: bind/advertise
        config = engine_config_for(self.config, where)
        engine = await asyncio.to_thread(
            DecodeEngine.build,
            config,
            worker_id=self.worker_id,
            allow_local_prefill=self.allow_local_prefill,
        )
        try:
            server, bound = await serve(
                engine, host=where.bind, interceptors=internal_token_check(config.internal_token)
            )
        except BaseException:
            engine.stop()
            raise
        self.engine, self._server = engine, server
        address = where.endpoint(int(bound.rpartition(":")[2]))
        self._info = WorkerInfo(
            worker_id=self.worker_id,
            role="decode",
            grpc_address=address,
            kv_endpoint=engine.kv_endpoint,
            num_blocks=engine.kv.num_blocks,
            block_size=engine.kv.block_size,
            pid=os.getpid(),
            node_address=where.advertise,
        )
        log.info(
            "decode worker %s serving on %s, KV receiver %s (%d KV blocks, %d torch threads, "
            "local prefill %s)",
            self.worker_id,
            address,
            engine.kv_endpoint,
            engine.kv.num_blocks,
            torch.get_num_threads(),
            "on" if self.allow_local_prefill else "off",
        )
        return self._info

    async def ping(self) -> bool:
        """True while the actor is alive (and, once started, its step loop thread runs)."""
        return self.engine is None or self.engine.is_running()

    async def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving: gRPC first (in-flight streams get ``grace_s`` seconds), then the engine
        (live requests fail with UNAVAILABLE, blocks are freed, the KV receiver closes)."""
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
        if self.engine is not None:
            await asyncio.to_thread(self.engine.stop)
            self.engine = None
        self._info = None
