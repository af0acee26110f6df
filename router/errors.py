"""Errors the router reports to clients, with their HTTP status, OpenAI error type and gRPC code.

Both gateways turn a :class:`RouterError` into their own wire form: the HTTP gateway into an
OpenAI error body ``{"error": {"message", "type", "param", "code"}}`` with ``status``; the gRPC
gateway into ``grpc_code`` (before the first chunk) or a ``GenerateError`` (mid-stream).
"""

from __future__ import annotations

import grpc

MAX_MESSAGE_CHARS = 1000  # an error message that quotes the request is cut to this


def safe_message(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` fit to send back: lone surrogates (from JSON ``\\udfff`` escapes in the request,
    which UTF-8 cannot encode) written as ``\\udfff`` text, and at most ``limit`` characters,
    so an error never fails to encode nor echoes a large input back."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    if len(text) <= limit:
        return text
    return f"{text[: limit - 40]}... ({len(text) - limit + 40} characters cut)"


class RouterError(Exception):
    """A request-level failure.

    ``status``: HTTP status code. ``type``/``code``: OpenAI ``error.type`` and ``error.code``.
    ``param``: the request field at fault, or None. ``retry_after_s``: seconds for a
    ``Retry-After`` header (429/503 only). ``message`` and ``param`` are passed through
    :func:`safe_message`: they often quote the request.
    """

    status: int = 500
    type: str = "server_error"
    code: str | None = None
    grpc_code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(
        self, message: str, *, param: str | None = None, retry_after_s: int | None = None
    ) -> None:
        message = safe_message(message)
        super().__init__(message)
        self.message = message
        self.param = None if param is None else safe_message(param, 200)
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, dict[str, str | None]]:
        """The OpenAI-shaped error body."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class BadRequest(RouterError):
    """400: the request is malformed or out of range; ``param`` names the field."""

    status = 400
    type = "invalid_request_error"
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class ContextLengthExceeded(BadRequest):
    """400: prompt + max_tokens exceed ``--max-model-len``."""

    code = "context_length_exceeded"


class Unauthorized(RouterError):
    """401: the Bearer key is missing or wrong."""

    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"
    grpc_code = grpc.StatusCode.UNAUTHENTICATED


class PayloadTooLarge(RouterError):
    """413: the request body is over the gateway's size limit."""

    status = 413
    type = "invalid_request_error"
    code = "request_too_large"
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class ModelNotFound(RouterError):
    """404: the request names a model this router does not serve."""

    status = 404
    type = "invalid_request_error"
    code = "model_not_found"
    grpc_code = grpc.StatusCode.NOT_FOUND


class Overloaded(RouterError):
    """429: admission refused the request (queue full); ``retry_after_s`` is set."""

    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class NoWorkers(RouterError):
    """503: no healthy worker can take the request right now."""

    status = 503
    type = "service_unavailable"
    code = "no_workers"
    grpc_code = grpc.StatusCode.UNAVAILABLE


class ShuttingDown(RouterError):
    """503: the router is stopping (SIGTERM / Ctrl-C); a request in flight was ended, or a new
    one refused. Another router, or this one once restarted, can take it."""

    status = 503
    type = "service_unavailable"
    code = "server_shutting_down"
    grpc_code = grpc.StatusCode.UNAVAILABLE


class RequestTimeout(RouterError):
    """504: the request's deadline (``--request-timeout``) passed before it finished."""

    status = 504
    type = "timeout"
    code = "request_timeout"
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED


class WorkerFailure(RouterError):
    """500: workers kept failing for this request after the bounded retries."""

    status = 500
    type = "server_error"
    code = "worker_failure"
    grpc_code = grpc.StatusCode.INTERNAL


class Conflict(RouterError):
    """409: the operation clashes with one in progress (e.g. two /admin/scale at once)."""

    status = 409
    type = "conflict"
    code = "operation_in_progress"
    grpc_code = grpc.StatusCode.ABORTED


class InsufficientResources(RouterError):
    """503: the cluster has no room (CPU/GPU) for the workers asked for."""

    status = 503
    type = "service_unavailable"
    code = "insufficient_resources"
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class RequestNotFound(RouterError):
    """No record of that request id (never seen, or older than the last N kept)."""

    status = 404
    type = "invalid_request_error"
    code = "request_not_found"
    grpc_code = grpc.StatusCode.NOT_FOUND


class NoClusterControl(RouterError):
    """404: an /admin cluster route on a router without the cluster controller (a router that
    joined with ``pdserve router``: the head router, ``pdserve serve``, owns the workers)."""

    status = 404
    type = "invalid_request_error"
    code = "not_the_head_router"
    grpc_code = grpc.StatusCode.NOT_FOUND


class HeadersTooLarge(RouterError):
    """431: the request line and headers together are over the gateway's size limit."""

    status = 431
    type = "invalid_request_error"
    code = "request_header_fields_too_large"
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
