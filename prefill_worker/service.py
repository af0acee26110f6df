"""PrefillService on grpc.aio (proto/pdserve/v1/worker.proto): the wire face of a PrefillEngine.

``Prefill`` queues the request on the engine (whose step loop runs in its own thread) and awaits
the request's future; it returns token 1 with its logprob(s), cached_tokens, queue/compute/transfer
milliseconds and the KV transfer record. A refused request ends the RPC with a status:
INVALID_ARGUMENT (empty prompt, prompt over the model limit, sampling values out of range, no KV
target), RESOURCE_EXHAUSTED, ALREADY_EXISTS, ABORTED (the prompt was computed but its KV could
not reach the decode worker: retry the sequence elsewhere), UNAVAILABLE (shutting down),
DEADLINE_EXCEEDED, CANCELLED (aborted). When the caller cancels the RPC the request is aborted,
freeing its blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict

import grpc

from pdserve import rpc
from pdserve.engine.actor import serve_grpc
from pdserve.engine.errors import INVALID_ARGUMENT, EngineError
from pdserve.engine.faults import abort_unless_dropped, delay_stats
from pdserve.engine.request import wire_arrival, wire_deadline
from pdserve.sampling_params import SamplingError
from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc as pb_grpc
from prefill_worker.engine import PrefillEngine
from prefill_worker.request import KVTarget, PrefillRequest, PrefillResult

log = logging.getLogger(__name__)


def request_from_proto(m: pb.PrefillRequest) -> PrefillRequest:
    """Wire request -> engine request. ``deadline_unix_ms`` 0 = the default lease (DEFAULT_LEASE_S).

    Raises EngineError(INVALID_ARGUMENT) naming a bad sampling field, a missing request id or
    a missing KV target.
    """
    try:
        sampling = rpc.sampling_from_proto(m.sampling)
    except SamplingError as e:
        raise EngineError(INVALID_ARGUMENT, str(e)) from None
    if not m.request_id:
        raise EngineError(INVALID_ARGUMENT, "'request_id' is empty")
    if not m.HasField("target") or not m.target.kv_endpoint:
        raise EngineError(
            INVALID_ARGUMENT, "'target.kv_endpoint' is required: where to send the KV"
        )
    return PrefillRequest(
        request_id=m.request_id,
        prompt_token_ids=tuple(m.prompt_token_ids),
        sampling=sampling,
        target=KVTarget(
            transfer_id=m.target.transfer_id,
            kv_endpoint=m.target.kv_endpoint,
            decode_worker_id=m.target.decode_worker_id,
        ),
        num_output_tokens=m.num_output_tokens,
        deadline=wire_deadline(m.deadline_unix_ms, time.time()),
        arrival_time=wire_arrival(m.age_ms, time.monotonic()),
    )


def result_to_proto(r: PrefillResult) -> pb.PrefillResponse:
    """Engine result -> wire response."""
    resp = pb.PrefillResponse(
        request_id=r.request_id,
        token=rpc.token_to_proto(r.token),
        prompt_logprobs=[rpc.token_to_proto(t) for t in r.prompt_logprobs],
        cached_tokens=r.cached_tokens,
        queue_ms=r.queue_ms,
        compute_ms=r.compute_ms,
        transfer_ms=r.transfer_ms,
    )
    if r.transfer is not None:
        resp.transfer.CopyFrom(rpc.record_to_proto(r.transfer))
        # NOTE: the wire carries the outcome's value ("ok"); str() of a str-valued enum is
        # "TransferOutcome.OK" on Python >= 3.11, so set it explicitly.
        resp.transfer.outcome = r.transfer.outcome.value
    return resp


class PrefillService(pb_grpc.PrefillServiceServicer):
    """gRPC servicer over one :class:`PrefillEngine` (whose step loop must be running)."""

    def __init__(self, engine: PrefillEngine, worker_id: str) -> None:
        self.engine = engine
        self.worker_id = worker_id

    async def Prefill(  # noqa: N802 - gRPC method name
        self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> pb.PrefillResponse:
        """Prefill one prompt and send its KV; see the module docstring for the status codes."""
        try:
            req = request_from_proto(request)
            fut = self.engine.add_request(req)
        except EngineError as e:
            await context.abort(rpc.status_code(e.code), e.message)
        try:
            result = await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            # The caller went away (or the server is stopping): free what the request holds.
            if abort_unless_dropped(self.engine.faults, self.engine.abort, req.request_id):
                log.info("prefill RPC for %s cancelled; request aborted", req.request_id)
            raise
        except EngineError as e:
            await context.abort(rpc.status_code(e.code), e.message)
        return result_to_proto(result)

    async def Abort(  # noqa: N802 - gRPC method name
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        """Drop a request at any stage; unknown ids are a no-op (found=False)."""
        found = abort_unless_dropped(self.engine.faults, self.engine.abort, request.request_id)
        return pb.AbortResponse(found=found)

    async def GetStats(  # noqa: N802 - gRPC method name
        self, request: pb.StatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.PrefillStats:
        """Queue, KV, prefix-cache and throughput counters (see PrefillEngineStats)."""
        # NOTE: PrefillEngineStats' fields are named as the message's, so a new one fails here
        await delay_stats(self.engine.faults)
        return pb.PrefillStats(worker_id=self.worker_id, **asdict(self.engine.stats()))


def add_to_server(engine: PrefillEngine, server: grpc.aio.Server, worker_id: str) -> PrefillService:
    """Register a PrefillService for ``engine`` on ``server``; returns the servicer."""
    service = PrefillService(engine, worker_id)
    pb_grpc.add_PrefillServiceServicer_to_server(service, server)
    return service


async def serve(
    engine: PrefillEngine,
    worker_id: str,
    host: str = "127.0.0.1",
    port: int = 0,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> tuple[grpc.aio.Server, str]:
    """Start a grpc.aio server with the PrefillService on ``host:port`` (0 = a free port).

    ``interceptors``: e.g. the internal-token check (pdserve/auth.py). Starts the engine's step
    loop too. Returns (server, "host:port"). Raises RuntimeError when the port cannot be bound.
    """
    return await serve_grpc(
        engine, lambda s: add_to_server(engine, s, worker_id), host, port, interceptors
    )
