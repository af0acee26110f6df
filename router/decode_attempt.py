"""One decode attempt: an open ``Decode`` stream on one decode worker, and its wire helpers.

A sequence makes one attempt per placement (the first, and one per re-placement after a
preemption or a lost worker). The attempt holds the worker's router-side reservation in the
:class:`router.pool.WorkerPool` until it is closed.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from pdserve.v1 import worker_pb2 as pb
from router.background import spawn
from router.pool import WorkerPool, WorkerState
from router.worker_client import unless_closed

# Errors that mean "this worker is (probably) down", as opposed to "busy" or "bad request".
WORKER_DOWN = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
    }
)


class DecodeAttempt:
    """An open Decode stream on one worker (one placement attempt) and its reservation.

    ``blocks``: KV blocks the prompt needs there; ``accepted`` is set by the first event.
    ``local_tokens``: prompt tokens the decode worker prefills itself (0 = none: the KV comes
    from a prefill worker); the pool counts them on that worker until :meth:`prefilled` (or
    :meth:`close`).

    While a prefill worker computes the prompt the router also watches this stream
    (:meth:`read_ahead`), so a decode worker lost in that time is noticed at once and the
    prefill aborted, instead of the prefill worker finding out by a KV send that times out.
    """

    def __init__(
        self,
        pool: WorkerPool,
        worker: WorkerState,
        call: grpc.aio.UnaryStreamCall,
        attempt_id: str,
        blocks: int,
        local_tokens: int = 0,
    ) -> None:
        self.pool = pool
        self.worker = worker
        self.call = call
        self.attempt_id = attempt_id
        self.blocks = blocks
        self.accepted: pb.Accepted | None = None
        self.open = True
        self.local_tokens = local_tokens  # still prefilling them on the decode worker
        self._ahead: asyncio.Task[Any] | None = None  # the next event, read in the background
        self._tick = pool.reserve(worker, blocks=blocks, local_prefill_tokens=local_tokens)

    def prefilled(self) -> None:
        """A local prefill produced its first token: the worker no longer counts it. Idempotent."""
        if self.local_tokens:
            self.pool.prefilled_locally(self.worker, self.local_tokens)
            self.local_tokens = 0

    def close(self, abort: bool, timeout_s: float) -> None:
        """Release the reservation; with ``abort`` cancel the stream and send Abort (in the
        background, within ``timeout_s`` seconds). Idempotent."""
        if not self.open:
            return
        self.open = False
        self.prefilled()
        self.pool.release(self.worker, self._tick)
        if self._ahead is not None:
            self._ahead.cancel()
            self._ahead = None
        if abort:
            self.call.cancel()
            spawn(self.worker.client.abort(self.attempt_id, timeout_s))

    def read_ahead(self) -> asyncio.Task[Any]:
        """Start reading the stream's next event in the background (at most one read at a time:
        a second call returns the same task); the next :meth:`read` returns its event. The task
        ends with the event, ``grpc.aio.EOF`` or the stream's ``grpc.aio.AioRpcError``."""
        if self._ahead is None:
            self._ahead = asyncio.ensure_future(
                unless_closed(self.call.read(), self.worker.worker_id)
            )
            self._ahead.add_done_callback(_retrieve)
        return self._ahead

    async def read(self, timeout_s: float) -> Any:
        """The stream's next event (``grpc.aio.EOF`` at the end): :func:`read_event`, or the one
        :meth:`read_ahead` is reading."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return await read_event(self.call, timeout_s, self.worker.worker_id)
        async with asyncio.timeout(timeout_s):  # cancelling this await cancels the read too
            return await ahead


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Mark a background read's outcome as seen: a read cancelled with its attempt, or whose
    stream broke after the attempt was closed, is nobody's error."""
    if not task.cancelled():
        task.exception()


async def read_event(call: grpc.aio.UnaryStreamCall, timeout_s: float, worker_id: str) -> Any:
    """``await call.read()`` within ``timeout_s`` seconds (raises TimeoutError). A stream whose
    channel was closed under it (``worker_id`` removed from the pool) raises an UNAVAILABLE
    ``grpc.aio.AioRpcError``, not CancelledError (router/worker_client.py).

    NOTE: not ``asyncio.wait_for``: on Python 3.11 it returns the result and swallows a
    cancellation that arrives just as the read completes, so a sequence whose client left would
    keep decoding to max_tokens. ``asyncio.timeout`` always delivers the cancellation.
    """
    async with asyncio.timeout(timeout_s):  # its cancellation counts as the caller's
        return await unless_closed(call.read(), worker_id)


_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def status_from_code(value: int) -> grpc.StatusCode:
    """The ``grpc.StatusCode`` for an integer code (UNKNOWN if out of range)."""
    return _STATUS_BY_NUMBER.get(value, grpc.StatusCode.UNKNOWN)
