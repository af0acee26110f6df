"""A cap on concurrent streaming (Server-Sent Events) responses: ``--max-concurrent-streams``.

Every open SSE response holds a connection, a task and a request's output queue for as long as
the client keeps reading, however slowly; admission (router/admission.py) only bounds requests
until their first token. Past the cap a new ``"stream": true`` request is refused with 429 and
``Retry-After`` before it is tokenized or admitted; non-streaming requests are not counted.

Mechanism: the route reserves a slot with :meth:`StreamLimiter.reserve` once the body says
``stream``; :class:`StreamSlotRelease`, an ASGI middleware around the whole app, frees it when the
request's ASGI call returns, which covers every way out (stream finished, error response, client
disconnect at any point), so a slot can never leak.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from router.errors import Overloaded

DEFAULT_MAX_CONCURRENT_STREAMS = 1024
STREAM_RETRY_AFTER_S = 1  # streams end at unpredictable times; ask clients to retry soon
_SCOPE_KEY = "pdserve.stream_slot"  # set in the ASGI scope of a request that holds a slot


class StreamLimiter:
    """Counts open streaming responses; ``max_streams`` >= 1 (ValueError otherwise)."""

    def __init__(self, max_streams: int = DEFAULT_MAX_CONCURRENT_STREAMS) -> None:
        if max_streams < 1:
            raise ValueError(f"max_concurrent_streams must be >= 1, got {max_streams}")
        self.max_streams = max_streams
        self.num_open = 0
        self.num_rejected = 0

    def reserve(self, request: Request) -> None:
        """Take a slot for ``request`` (idempotent per request).

        Raises Overloaded (429, ``Retry-After``) naming ``stream`` and the limit when all are taken.
        """
        if request.scope.get(_SCOPE_KEY):
            return
        if self.num_open >= self.max_streams:
            self.num_rejected += 1
            raise Overloaded(
                f"the server has {self.num_open} streaming responses open (limit "
                f"--max-concurrent-streams {self.max_streams}); retry later or send "
                "'stream': false",
                param="stream",
                retry_after_s=STREAM_RETRY_AFTER_S,
            )
        self.num_open += 1
        request.scope[_SCOPE_KEY] = True

    def release(self, scope: dict[str, Any]) -> None:
        """Free the slot ``scope``'s request holds, if any (idempotent)."""
        if scope.pop(_SCOPE_KEY, False):
            self.num_open -= 1


class StreamSlotRelease:
    """ASGI middleware: when a request's call into the app returns, free its stream slot."""

    def __init__(self, app: Any, limiter: StreamLimiter) -> None:
        self.app = app
        self.limiter = limiter

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.limiter.release(scope)
