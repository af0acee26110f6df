"""PrefillActor: the prefill worker as a Ray actor (DESIGN §8).

The lifecycle (start, ping, stop), the torch thread count and the off-event-loop model load come
from :class:`~pdserve.engine.actor.WorkerActor`; this class says how to build and serve a
:class:`PrefillEngine` (its KV sender is built with it).
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from pdserve.config import EngineConfig
from pdserve.engine.actor import WorkerActor
from prefill_worker import service
from prefill_worker.engine import PrefillEngine


class PrefillActor(WorkerActor[PrefillEngine]):
    """One prefill worker. ``config.load`` names the model; ``config.transfer`` the KV transport.

    Raises ValueError when ``num_cpus`` is not positive.
    """

    role = "prefill"

    def niceness_for(self, config: EngineConfig) -> int:
        """``config.prefill_niceness``: below the decode workers it may share CPUs with."""
        return config.prefill_niceness

    def build_engine(self, config: EngineConfig) -> PrefillEngine:
        """Load the model and build the KV sender (runs in a worker thread)."""
        return PrefillEngine.build(config, name=self.worker_id, faults=self.faults)

    async def serve(
        self,
        engine: PrefillEngine,
        host: str,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    ) -> tuple[grpc.aio.Server, str]:
        """Start the step loop and the PrefillService on a free port of ``host``."""
        return await service.serve(engine, self.worker_id, host=host, interceptors=interceptors)
