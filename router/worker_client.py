"""gRPC client for one worker (PrefillService or DecodeService, proto/pdserve/v1/worker.proto).

The router talks to workers only through this class (and Ray, in cluster.py, to start them).
Calls return wire messages; the lifecycle converts them with :mod:`pdserve.rpc`.

NOTE: grpc.aio ends a call whose channel was closed under it with ``asyncio.CancelledError``,
which reads like the caller's own cancellation (a client that left). Calls here turn that into
an UNAVAILABLE :class:`grpc.aio.AioRpcError` (:func:`channel_closed`), so the
lifecycle retries or re-places the request instead of silently dropping it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import TypeVar

import grpc

from pdserve.auth import internal_token_metadata
from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc as pb_grpc
from pdserve.worker_info import WorkerInfo

log = logging.getLogger(__name__)

# Channel options: large messages are never expected (token ids only), but top-logprobs for long
# outputs can exceed the 4 MiB default; keepalive pings find a dead peer behind an idle stream.
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]

_T = TypeVar("_T")
ROLES = ("prefill", "decode")


def cancelled_by_caller() -> bool:
    """Whether the running task is being cancelled (its own cancellation, not a closed channel)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def channel_closed(worker_id: str) -> grpc.aio.AioRpcError:
    """The UNAVAILABLE error that stands for a call ended by closing its channel."""
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        details=f"the router closed its channel to worker {worker_id} during the call",
    )


async def unless_closed(call: Awaitable[_T], worker_id: str) -> _T:
    """``await call``; a cancellation that is not the caller's own (the channel to
    ``worker_id`` was closed under the call) is raised as :func:`channel_closed` instead."""
    try:
        return await call
    except asyncio.CancelledError:
        if cancelled_by_caller():
            raise
        raise channel_closed(worker_id) from None


class WorkerClient:
    """A channel and stub for ``info.grpc_address``. Raises ValueError for an unknown role.

    ``internal_token``: presented on every call (pdserve/auth.py); None = none.
    """

    def __init__(self, info: WorkerInfo, internal_token: str | None = None) -> None:
        if info.role not in ROLES:
            raise ValueError(f"worker {info.worker_id}: role {info.role!r} is not one of {ROLES}")
        self.info = info
        self._channel = grpc.aio.insecure_channel(
            info.grpc_address,
            options=_CHANNEL_OPTIONS,
            interceptors=internal_token_metadata(internal_token),
        )
        self._prefill = pb_grpc.PrefillServiceStub(self._channel)
        self._decode = pb_grpc.DecodeServiceStub(self._channel)

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def role(self) -> str:
        return self.info.role

    async def prefill(self, request: pb.PrefillRequest, timeout_s: float) -> pb.PrefillResponse:
        """Run one prefill. Raises grpc.aio.AioRpcError on failure or after ``timeout_s``
        (UNAVAILABLE when the channel is closed during the call)."""
        return await unless_closed(
            self._prefill.Prefill(request, timeout=timeout_s), self.worker_id
        )

    def decode(self, request: pb.DecodeRequest) -> grpc.aio.UnaryStreamCall:
        """Open a Decode stream; read it with ``await call.read()`` (``grpc.aio.EOF`` at the end).

        Cancelling the call (``call.cancel()``) tells the worker the router went away.
        """
        return self._decode.Decode(request)

    async def abort(self, request_id: str, timeout_s: float = 2.0) -> bool:
        """Idempotent Abort; returns whether the worker held state. Never raises for RPC errors."""
        req = pb.AbortRequest(request_id=request_id)
        try:
            if self.role == "prefill":
                resp = await self._prefill.Abort(req, timeout=timeout_s)
            else:
                resp = await self._decode.Abort(req, timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            log.warning("abort %s on %s failed: %s", request_id, self.worker_id, e.code().name)
            return False
        except grpc.aio.UsageError:  # the worker was removed and its channel closed: nothing held
            log.debug("abort %s on %s: channel closed (worker removed)", request_id, self.worker_id)
            return False
        return bool(resp.found)

    async def get_stats(self, timeout_s: float = 2.0) -> pb.PrefillStats | pb.DecodeStats:
        """The worker's GetStats. Raises grpc.aio.AioRpcError when it does not answer."""
        if self.role == "prefill":
            return await self._prefill.GetStats(pb.StatsRequest(), timeout=timeout_s)
        return await self._decode.GetStats(pb.StatsRequest(), timeout=timeout_s)

    async def close(self) -> None:
        """Close the channel; in-flight calls fail (see the module docstring). The pool closes a
        removed worker's channel only once the router has no call left on it."""
        await self._channel.close()
