"""``x-request-id``: every HTTP response carries one; the per-request record is keyed by it.

A client may send its own ``x-request-id`` (1-128 characters of ``[A-Za-z0-9._:-]``, as proxies
and tracing systems generate); the router then uses it unchanged. Otherwise, or when the header
holds other characters (a proxy's id in another alphabet must not cost the request), the router
makes one (``req-`` + 32 hex digits). A header over :data:`MAX_REQUEST_ID_CHARS` bytes is
refused with a 400 naming it and the limit (on :data:`PROBE_PATHS` it is replaced instead): ids are kept in the request log and written to
the logs, and no id generator makes one that long, so it is a client's mistake to report. The
gRPC API's ``request_id`` must meet the same rule (:func:`check_request_id`). The id is echoed in the response
header and made available to the serving code of the same request through a context variable
(:func:`current_request_id`), so ``router/serving.py`` files the request's record under it. A
client id is not unique (clients retry with it, or reuse it by mistake), so each HTTP request
(and each gRPC call, :func:`request_context`) also gets a scope of its own
(:func:`current_request_scope`): the record log keeps requests that share an id apart by it (see
:mod:`router.request_log`), and the workers never see a client's id as a sequence id.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
import uuid
from collections.abc import Iterator
from typing import Any

from router.errors import BadRequest

HEADER = "x-request-id"
MAX_REQUEST_ID_CHARS = 128
ALLOWED_CHARS = "A-Z a-z 0-9 . _ : -"  # as messages spell the class below
_VALID = re.compile(rf"[A-Za-z0-9._:\-]{{1,{MAX_REQUEST_ID_CHARS}}}")
_current: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "pdserve_request_id", default=None
)
_scope: contextvars.ContextVar[object | None] = contextvars.ContextVar(
    "pdserve_request_scope", default=None
)


def current_request_id() -> str | None:
    """The id of the request being served (an HTTP request's ``x-request-id``, a gRPC call's
    ``request_id`` while it is submitted; None outside one)."""
    return _current.get()


def current_request_scope() -> object | None:
    """An object unique to the HTTP request being served (None outside one): two requests that
    carry the same ``x-request-id`` have different scopes."""
    return _scope.get()


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


@contextlib.contextmanager
def request_context(rid: str) -> Iterator[None]:
    """Within the block, :func:`current_request_id` is ``rid`` and :func:`current_request_scope`
    an object of this call's own: the request's record is filed under ``rid``, apart from other
    requests that carry the same id (the HTTP middleware's per-request setting; the gRPC
    gateway's around a call's submit)."""
    token = _current.set(rid)
    scope_token = _scope.set(object())
    try:
        yield
    finally:
        _scope.reset(scope_token)
        _current.reset(token)


def _too_long(field: str, length: int, unit: str = "characters") -> BadRequest:
    return BadRequest(
        f"'{field}' is {length} {unit} long; at most {MAX_REQUEST_ID_CHARS} are allowed",
        param=field,
    )


# Paths a load balancer or a scraper polls: an over-long id there is replaced, never refused
# (a proxy adding a long trace id must not fail a liveness probe)
PROBE_PATHS = frozenset({"/health", "/metrics"})


def check_request_id(rid: str, field: str = "request_id") -> None:
    """Raise BadRequest naming ``field`` unless ``rid`` is 1-:data:`MAX_REQUEST_ID_CHARS`
    characters of ``[A-Za-z0-9._:-]`` (the ``x-request-id`` rule; the request log's ``~``
    suffixes rely on it)."""
    if len(rid) > MAX_REQUEST_ID_CHARS:
        raise _too_long(field, len(rid))
    if not _VALID.fullmatch(rid):
        raise BadRequest(
            f"'{field}' may hold only the characters {ALLOWED_CHARS} (1 to "
            f"{MAX_REQUEST_ID_CHARS} of them)",
            param=field,
        )


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

        if len(text) > MAX_REQUEST_ID_CHARS and scope.get("path") not in PROBE_PATHS:
            # NOTE: imported here: router.http imports this module (serving.py does too)
            from router.http.body_limit import send_error

            await send_error(send_with_id, _too_long(HEADER, len(text), "bytes"))
            return

        with request_context(rid):
            await self.app(scope, receive, send_with_id)
