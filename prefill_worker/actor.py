"""PrefillActor: the prefill worker as a Ray actor (DESIGN §8).

A plain class with async methods; ``router/cluster.py`` wraps it with ``ray.remote`` (so this
module does not import Ray and tests can drive it directly). Lifecycle::

    PrefillActor(worker_id, config, num_cpus)   # cheap: no model yet; sets torch threads
    await start() -> WorkerInfo                 # loads the model, builds the KV sender,
                                                # starts the step loop, serves gRPC on a free port
    await ping() -> True                        # liveness (Ray health check)
    await stop()                                # stops gRPC, fails live requests, closes the sender

torch threads = the actor's CPU share (``num_cpus`` rounded, at least 1), so co-located actors on
a small machine do not oversubscribe the cores.
"""

from __future__ import annotations

import logging
import os

import grpc
import torch

from pdserve.auth import internal_token_check
from pdserve.config import EngineConfig
from pdserve.net import engine_config_for, worker_address
from pdserve.worker_info import WorkerInfo
from prefill_worker.engine import PrefillEngine
from prefill_worker.service import serve

log = logging.getLogger(__name__)


def threads_for(num_cpus: float) -> int:
    """torch intra-op threads for a CPU share: ``round(num_cpus)``, at least 1."""
    return max(1, round(num_cpus))


class PrefillActor:
    """One prefill worker. ``config.load`` names the model; ``config.transfer`` the KV transport.

    Raises ValueError when ``num_cpus`` is not positive.
    """

    def __init__(self, worker_id: str, config: EngineConfig, num_cpus: float = 1.0) -> None:
        if not num_cpus > 0:
            raise ValueError(f"num_cpus must be > 0, got {num_cpus}")
        self.worker_id = worker_id
        self.config = config
        self.num_cpus = num_cpus
        torch.set_num_threads(threads_for(num_cpus))
        self.engine: PrefillEngine | None = None
        self._server: grpc.aio.Server | None = None
        self._info: WorkerInfo | None = None

    async def start(self, host: str | None = None) -> WorkerInfo:
        """Build the engine and serve gRPC on a free port. Idempotent.

        ``host``: bind address (default ``config.worker_host``, else this node's IP; see
        pdserve/net.py); the node IP is advertised for a wildcard. Raises ConfigError (bad
        model/config) or RuntimeError (port cannot be bound).
        """
        if self._info is not None:
            return self._info
        where = worker_address(host or self.config.worker_host)  # multi-node: bind/advertise
        config = engine_config_for(self.config, where)
        engine = PrefillEngine.build(config)
        try:
            server, bound = await serve(
                engine,
                self.worker_id,
                host=where.bind,
                interceptors=internal_token_check(config.internal_token),
            )
        except BaseException:
            engine.shutdown()
            raise
        self.engine, self._server = engine, server
        address = where.endpoint(int(bound.rpartition(":")[2]))
        self._info = WorkerInfo(
            worker_id=self.worker_id,
            role="prefill",
            grpc_address=address,
            kv_endpoint="",
            num_blocks=engine.kv.num_blocks,
            block_size=engine.kv.block_size,
            pid=os.getpid(),
            node_address=where.advertise,
        )
        log.info(
            "prefill worker %s serving on %s (%d KV blocks, %d torch threads)",
            self.worker_id,
            address,
            engine.kv.num_blocks,
            torch.get_num_threads(),
        )
        return self._info

    async def ping(self) -> bool:
        """True while the actor is alive (and, once started, its step loop thread runs)."""
        return self.engine is None or self.engine.is_running()

    async def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving: gRPC first (in-flight RPCs get ``grace_s`` seconds), then the engine."""
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        self._info = None
