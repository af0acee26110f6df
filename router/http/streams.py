"""Driving request streams for HTTP responses: merge, collect, SSE, and client disconnects.

A client that disconnects aborts its request on every worker (stream or not). A failure after a
stream started is sent as one ``data: {"error": ...}`` event before ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from pdserve import metrics
from pdserve.types import SampledToken
from router.errors import RouterError
from router.http.responses import sse
from router.serving import ChoiceDelta, RequestStream

# Status for a request whose client went away (nginx's convention; the client never sees it).
CLIENT_CLOSED = 499


@dataclass
class Choice:
    """Accumulated output of one choice (non-streaming responses and completion offsets)."""

    text: str = ""
    tokens: list[SampledToken] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


async def merge(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, ChoiceDelta]]:
    """Interleave several request streams as (stream index, delta) in arrival order."""
    if len(streams) == 1:
        try:
            async for d in streams[0]:
                yield 0, d
        finally:
            streams[0].close_nowait()
        return
    queue: asyncio.Queue[tuple[int, ChoiceDelta] | BaseException | None] = asyncio.Queue()

    async def pump(k: int, s: RequestStream) -> None:
        try:
            async for d in s:
                queue.put_nowait((k, d))
            queue.put_nowait(None)
        except RouterError as e:
            queue.put_nowait(e)
        finally:
            s.close_nowait()

    tasks = [asyncio.ensure_future(pump(k, s)) for k, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()


async def collect(streams: Sequence[RequestStream], offsets: Sequence[int]) -> list[Choice]:
    """Run the streams to the end; choice ``offsets[k] + i`` is sequence i of stream k."""
    choices = [Choice() for _ in range(sum(s.n for s in streams))]
    async for k, d in merge(streams):
        c = choices[offsets[k] + d.index]
        c.text += d.text
        c.tokens.extend(d.tokens)
        if d.finish_reason is not None:
            c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
    return choices


async def collect_or_disconnect(
    request: Request, streams: Sequence[RequestStream], offsets: Sequence[int]
) -> list[Choice] | None:
    """Run the streams to the end; if the client disconnects first, abort them and return None.

    Raises the first RouterError of a stream.
    """

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(collect(streams, offsets))
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
        for s in streams:  # idempotent; releases tickets and gauges whatever happened
            s.close_nowait()
    if not work.done() or work.cancelled():
        return None
    return work.result()


def event_stream(events: AsyncIterator[str], streams: Sequence[RequestStream]) -> Response:
    """SSE response around ``events``; errors become an error event; disconnects abort."""

    async def body() -> AsyncIterator[str]:
        try:
            async for e in events:
                yield e
        except RouterError as err:
            metrics.REQUEST_ERRORS.labels(code=str(err.status)).inc()
            yield sse(err.body())
        finally:
            for s in streams:  # synchronous: runs even inside a cancelled scope (disconnect)
                s.close_nowait()
        yield "data: [DONE]\n\n"

    return StreamingResponse(
        body(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
