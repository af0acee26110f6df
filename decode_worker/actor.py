"""DecodeActor: the decode worker as a Ray actor (DESIGN §8).

The lifecycle (start, ping, stop), the torch thread count and the off-event-loop model load come
from :class:`~pdserve.engine.actor.WorkerActor`; this class says how to build and serve a
:class:`DecodeEngine` (its KV receiver opens with it, and its endpoint goes in
``WorkerInfo.kv_endpoint``). ``allow_local_prefill``: unified mode (requests with
``prefill_locally`` are prefilled here); the cluster turns it on so a decode worker can serve
whole requests when no prefill worker is up.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from decode_worker import service
from decode_worker.engine import DecodeEngine
from pdserve.config import EngineConfig
from pdserve.engine.actor import WorkerActor


class DecodeActor(WorkerActor[DecodeEngine]):
    """One decode worker. ``config.load`` names the model; ``config.transfer`` the KV transport
    (its ``host`` is where the KV receiver listens). Raises ValueError when ``num_cpus`` <= 0."""

    role = "decode"

    def __init__(
        self,
        worker_id: str,
        config: EngineConfig,
        num_cpus: float = 1.0,
        allow_local_prefill: bool = False,
    ) -> None:
        super().__init__(worker_id, config, num_cpus)
        self.allow_local_prefill = allow_local_prefill

    def build_engine(self, config: EngineConfig) -> DecodeEngine:
        """Load the model and open the KV receiver (runs in a worker thread)."""
        return DecodeEngine.build(
            config,
            worker_id=self.worker_id,
            allow_local_prefill=self.allow_local_prefill,
            faults=self.faults,
        )

    async def serve(
        self,
        engine: DecodeEngine,
        host: str,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    ) -> tuple[grpc.aio.Server, str]:
        """Start the step loop and the DecodeService on a free port of ``host``."""
        return await service.serve(engine, host=host, interceptors=interceptors)

    def kv_endpoint(self, engine: DecodeEngine) -> str:
        """The KV receiver's 'host:port'."""
        return engine.kv_endpoint
