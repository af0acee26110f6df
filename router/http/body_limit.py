"""ASGI middleware that refuses request bodies over a size limit (413, OpenAI error body).

The declared ``Content-Length`` is checked first; a body without one (chunked) is counted while
it is read, so an over-long body is refused before any of it is parsed. A body still arriving
when the server starts to stop is answered with a 503 'shutting down' at once (else the server's
graceful-shutdown timeout would cancel the request and the client get a bare 500).
"""

from __future__ import annotations

import asyncio
from typing import Any

from pdserve import metrics
from router.errors import PayloadTooLarge, RouterError, ShuttingDown
from router.http.responses import dumps

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024  # 32 MiB: far above any prompt max_model_len admits


async def send_error(send: Any, err: RouterError) -> None:
    """Answer with ``err``'s status and OpenAI error body from ASGI middleware (before the app
    runs), closing the connection: the rest of the request is not read."""
    metrics.REQUEST_ERRORS.labels(code=str(err.status)).inc()
    payload = dumps(err.body()).encode()
    await send(
        {
            "type": "http.response.start",
            "status": err.status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


class BodySizeLimit:
    """ASGI middleware: refuse request bodies over ``max_bytes`` with 413 and an OpenAI body.

    The declared ``Content-Length`` is checked first; a body without one (chunked) is counted
    while it is read. The body is buffered here (the JSON handlers read it whole anyway) and
    replayed to the app, so an over-long body is refused before any of it is parsed.
    """

    def __init__(self, app: Any, max_bytes: int, stopping: asyncio.Event | None = None) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes
        self.stopping = stopping

    async def _receive_or_stop(self, receive: Any) -> dict[str, Any] | None:
        """The next ASGI message, or None once ``stopping`` is set (the body still arriving)."""
        if self.stopping is None:
            message: dict[str, Any] = await receive()
            return message
        if self.stopping.is_set():
            return None
        got = asyncio.ensure_future(receive())
        stop = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait((got, stop), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if got.done():
            return got.result()  # type: ignore[no-any-return]
        got.cancel()
        return None

    async def _refuse(self, send: Any) -> None:
        err = PayloadTooLarge(
            f"the request body exceeds the server's limit of {self.max_bytes} bytes"
        )
        await send_error(send, err)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.max_bytes:
                    await self._refuse(send)
                    return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await self._receive_or_stop(receive)
            if message is None:
                await send_error(send, ShuttingDown("the server is shutting down; send the "
                                                    "request to another server"))  # fmt: skip
                return
            if message["type"] != "http.request":  # the client left while sending
                await self.app(scope, _replay([], message, receive), send)
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(chunks, None, receive), send)


def _replay(chunks: list[bytes], first: dict[str, Any] | None, receive: Any) -> Any:
    """An ASGI ``receive`` that returns the buffered body (or ``first``), then defers to
    ``receive`` (so disconnects are still seen)."""
    pending: list[dict[str, Any]] = (
        [first] if first is not None else [
            {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        ]
    )  # fmt: skip

    async def replayed() -> dict[str, Any]:
        if pending:
            return pending.pop()
        return await receive()

    return replayed
