"""ASGI middleware that refuses requests whose head (target + headers) is over a size limit (431).

Two layers bound a request head. uvicorn's h11 parser buffers at most ``max_header_bytes`` of an
*incomplete* head and answers 400 past it (router/server.py sets it), which bounds memory while a
head trickles in; a head that arrives whole in one read is parsed regardless, so this middleware
then enforces the exact limit with 431 and an OpenAI error body naming it.
"""

from __future__ import annotations

from typing import Any

from router.errors import HeadersTooLarge
from router.http.body_limit import send_error

# Bound on a request's head (request target + header names and values), in bytes. 64 KiB is 4x
# h11's default buffer and twice nginx's default (4 x 8 KiB large_client_header_buffers).
MAX_HEADER_BYTES = 64 * 1024


def head_size(scope: dict[str, Any]) -> int:
    """Bytes of the request target and headers (names + values + 4 per header for ': ' CRLF)."""
    size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
    for name, value in scope.get("headers", ()):
        size += len(name) + len(value) + 4
    return size


class HeaderSizeLimit:
    """ASGI middleware: 431 for a request head over ``max_bytes`` (>= 1, ValueError otherwise)."""

    def __init__(self, app: Any, max_bytes: int = MAX_HEADER_BYTES) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_header_bytes must be >= 1, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            size = head_size(scope)
            if size > self.max_bytes:
                err = HeadersTooLarge(
                    f"the request line and headers hold {size} bytes, over the server's limit "
                    f"of {self.max_bytes} bytes"
                )
                await send_error(send, err)
                return
        await self.app(scope, receive, send)
