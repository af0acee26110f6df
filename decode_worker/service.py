"""DecodeService on grpc.aio (proto/pdserve/v1/worker.proto): the wire face of a DecodeEngine.

``Decode`` is a server stream: ``Accepted`` first, then ``Tokens`` events, then exactly one of
``Finished`` | ``Preempted`` | ``Error``. A request the engine refuses before ``Accepted`` ends the
RPC with a status (RESOURCE_EXHAUSTED for no KV room, INVALID_ARGUMENT, UNAVAILABLE, ...). When the
stream is cancelled (the router went away or gave the request up) the handler aborts the request,
which frees its blocks at once (or at the end of the step being computed).

Engine events arrive on the engine's thread and are handed to this server's event loop with
``loop.call_soon_threadsafe``; the handler then only awaits its own queue.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict

import grpc

from decode_worker.engine import DecodeEngine
from decode_worker.request import (
    DecodeEvent,
    DecodeRequest,
    FinishedEvent,
    PreemptedEvent,
    TokensEvent,
)
from pdserve import rpc
from pdserve.engine.actor import serve_grpc
from pdserve.engine.errors import EngineError
from pdserve.engine.faults import abort_unless_dropped, delay_stats
from pdserve.engine.request import wire_arrival, wire_deadline
from pdserve.sampling_params import SamplingError
from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


def request_from_proto(m: pb.DecodeRequest) -> DecodeRequest:
    """Wire request -> engine request. ``deadline_unix_ms`` 0 = the default lease
    (DEFAULT_LEASE_S); ``kv_timeout_s`` 0 = the engine's default.

    Raises SamplingError naming a bad sampling field.
    """
    return DecodeRequest(
        request_id=m.request_id,
        prompt_token_ids=tuple(m.prompt_token_ids),
        sampling=rpc.sampling_from_proto(m.sampling),
        num_output_tokens=m.num_output_tokens,
        prefill_locally=m.prefill_locally,
        deadline=wire_deadline(m.deadline_unix_ms, time.time()),
        kv_timeout_s=m.kv_timeout_s if m.kv_timeout_s > 0 else None,
        arrival_time=wire_arrival(m.age_ms, time.monotonic()),
    )


def event_to_proto(ev: DecodeEvent) -> pb.DecodeEvent:
    """Engine event -> wire event."""
    if isinstance(ev, TokensEvent):
        msg = rpc.tokens_to_proto(ev.tokens)
        msg.prompt_logprobs.extend(rpc.token_to_proto(t) for t in ev.prompt_logprobs)
        return pb.DecodeEvent(tokens=msg)
    if isinstance(ev, FinishedEvent):
        return pb.DecodeEvent(
            finished=pb.Finished(reason=ev.reason, num_output_tokens=ev.num_output_tokens)
        )
    if isinstance(ev, PreemptedEvent):
        return pb.DecodeEvent(
            preempted=pb.Preempted(output_token_ids=list(ev.output_token_ids), reason=ev.reason)
        )
    return pb.DecodeEvent(
        error=pb.ErrorEvent(code=rpc.status_code(ev.code).value[0], message=ev.message)
    )


class LoopMailbox:
    """Events from the engine's thread for the asyncio queues of one event loop, handed over in
    batches: :meth:`sink` makes a request's sink (which only queues), and the engine calls
    :meth:`flush` once after each round of deliveries (see :mod:`decode_worker.engine`), which
    wakes the loop once for the whole round."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue[DecodeEvent], DecodeEvent]] = []
        self._scheduled = False

    def sink(self, queue: asyncio.Queue[DecodeEvent]) -> Callable[[DecodeEvent], None]:
        """A sink for ``queue`` (its ``batch`` attribute is this mailbox)."""

        def put(ev: DecodeEvent) -> None:
            with self._lock:
                self._items.append((queue, ev))

        put.batch = self  # type: ignore[attr-defined]
        return put

    def flush(self) -> None:
        """Wake the loop to deliver what is queued (no-op when nothing is, or a wake-up is
        already pending)."""
        with self._lock:
            if not self._items or self._scheduled:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop closed (server shutting down)
            pass

    def _deliver(self) -> None:
        with self._lock:
            items, self._items, self._scheduled = self._items, [], False
        for queue, ev in items:
            queue.put_nowait(ev)


class DecodeService(pb_grpc.DecodeServiceServicer):
    """gRPC servicer over one :class:`DecodeEngine` (whose step loop must be running)."""

    def __init__(self, engine: DecodeEngine) -> None:
        self.engine = engine
        self._mailboxes: dict[asyncio.AbstractEventLoop, LoopMailbox] = {}

    def _mailbox(self) -> LoopMailbox:
        """The mailbox of the running event loop (one per loop; the server has one)."""
        loop = asyncio.get_running_loop()
        box = self._mailboxes.get(loop)
        if box is None:
            box = self._mailboxes[loop] = LoopMailbox(loop)
        return box

    async def Decode(  # noqa: N802 - gRPC method name
        self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.DecodeEvent]:
        """Reserve, then stream this request's events (see the module docstring)."""
        try:
            req = request_from_proto(request)
        except SamplingError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        queue: asyncio.Queue[DecodeEvent] = asyncio.Queue()
        sink = self._mailbox().sink(queue)
        try:
            acc = self.engine.add_request(req, sink)
        except EngineError as e:
            await context.abort(rpc.status_code(e.code), e.message)
        done = False
        try:
            yield pb.DecodeEvent(
                accepted=pb.Accepted(
                    transfer_id=acc.transfer_id,
                    kv_endpoint=acc.kv_endpoint,
                    decode_worker_id=acc.decode_worker_id,
                    num_reserved_blocks=acc.num_reserved_blocks,
                    cached_tokens=acc.cached_tokens,
                )
            )
            while True:
                ev = await queue.get()
                done = not isinstance(ev, TokensEvent)
                yield event_to_proto(ev)
                if done:
                    return
        finally:
            if not done:  # cancelled stream (router gone) or the server is stopping
                if abort_unless_dropped(self.engine.faults, self.engine.abort, req.request_id):
                    log.info("decode stream for %s closed early; request aborted", req.request_id)

    async def Abort(  # noqa: N802 - gRPC method name
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        """Drop a request; unknown ids are a no-op (found=False)."""
        found = abort_unless_dropped(self.engine.faults, self.engine.abort, request.request_id)
        return pb.AbortResponse(found=found)

    async def GetStats(  # noqa: N802 - gRPC method name
        self, request: pb.StatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.DecodeStats:
        """Engine counters (see DecodeEngineStats)."""
        # NOTE: DecodeEngineStats' fields are named as the message's, so a new one fails here
        await delay_stats(self.engine.faults)
        return pb.DecodeStats(**asdict(self.engine.stats()))


def add_to_server(engine: DecodeEngine, server: grpc.aio.Server) -> DecodeService:
    """Register a DecodeService for ``engine`` on ``server``; returns the servicer."""
    service = DecodeService(engine)
    pb_grpc.add_DecodeServiceServicer_to_server(service, server)
    return service


async def serve(
    engine: DecodeEngine,
    host: str = "127.0.0.1",
    port: int = 0,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> tuple[grpc.aio.Server, str]:
    """Start a grpc.aio server with the DecodeService on ``host:port`` (0 = a free port).

    ``interceptors``: e.g. the internal-token check (pdserve/auth.py). Starts the engine's step
    loop too. Returns (server, "host:port"). Raises RuntimeError when the port cannot be bound.
    """
    return await serve_grpc(engine, lambda s: add_to_server(engine, s), host, port, interceptors)
