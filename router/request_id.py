"""``x-request-id``: every HTTP response carries one; the per-request record is keyed by it.

A client may send its own ``x-request-id`` (1-128 characters of ``[A-Za-z0-9._:-]``, as proxies
and tracing systems generate); the router then uses it unchanged. Otherwise, or when the header
is malformed, the router makes one (``req-`` + 32 hex digits). The id is echoed in the response
header and made available to the serving code of the same request through a context variable
(:func:`current_request_id`), so ``router/serving.py`` files the request's record under it. A
client id is not unique (clients retry with it, or reuse it by mistake), so each HTTP request
also gets a scope of its own (:func:`current_request_scope`): the record log keeps requests that
share an id apart by it (see :mod:`router.request_log`).
"""

from __future__ import annotations

import contextvars
import re
import uuid
from typing import Any

HEADER = "x-request-id"
_VALID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
_current: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "pdserve_request_id", default=None
)
_scope: contextvars.ContextVar[object | None] = contextvars.ContextVar(
    "pdserve_request_scope", default=None
)


def current_request_id() -> str | None:
    """The ``x-request-id`` of the HTTP request being served (None outside one, e.g. gRPC)."""
    return _current.get()


def current_request_scope() -> object | None:
    """An object unique to the HTTP request being served (None outside one): two requests that
    carry the same ``x-request-id`` have different scopes."""
    return _scope.get()


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


class RequestIdMiddleware:
    """ASGI middleware: choose the request's id, expose it, add it to the response headers."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope.get("headers", ()) if k == HEADER.encode()), b"")
        text = given.decode("latin-1")
        rid = text if _VALID.fullmatch(text) else new_request_id()
        raw = rid.encode()

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k != HEADER.encode()]
                message = {**message, "headers": [*headers, (HEADER.encode(), raw)]}
            await send(message)

        token = _current.set(rid)
        scope_token = _scope.set(object())
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            _scope.reset(scope_token)
            _current.reset(token)
