"""Shared-secret checks on gRPC: the internal token (workers) and the API key (public gRPC API).

Two secrets, one mechanism:

* **Internal token** (``--internal-token`` / ``PDSERVE_INTERNAL_TOKEN``): every call to a worker's
  gRPC services carries ``x-pdserve-internal-token: TOKEN`` metadata, and every KV channel
  handshake carries the token in its hello (kv_transfer). It keeps anything else on the network
  from driving a worker: placing requests, reserving KV blocks, aborting other users' requests,
  or pushing bytes into a decode worker's KV cache.
* **API key** (``--api-key`` / ``PDSERVE_API_KEY``): clients of the public gRPC API send
  ``authorization: Bearer KEY`` metadata, as on the HTTP API.

A call without the right value ends with UNAUTHENTICATED before any handler runs (so it leaves no
state behind). Comparisons are constant-time (:func:`hmac.compare_digest`). Neither the expected
nor the presented value is ever logged: refusals log the method and the peer only.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Sequence
from typing import Any

import grpc

log = logging.getLogger(__name__)

INTERNAL_TOKEN_HEADER = "x-pdserve-internal-token"
API_KEY_HEADER = "authorization"


def secrets_match(presented: str | bytes | None, expected: str | bytes) -> bool:
    """Constant-time equality of two secrets (False when ``presented`` is None)."""
    if presented is None:
        return False
    a = presented.encode() if isinstance(presented, str) else presented
    b = expected.encode() if isinstance(expected, str) else expected
    return hmac.compare_digest(a, b)


def bearer_credentials(value: str | bytes | None) -> bytes | None:
    """The credentials of an ``Authorization: Bearer <token>`` value, or None for another scheme.

    The scheme is matched case-insensitively (RFC 7235 section 2.1: ``bearer`` and ``BEARER``
    are ``Bearer``); one or more spaces separate it from the token.
    """
    if value is None:
        return None
    raw = value.encode() if isinstance(value, str) else value
    scheme, _, token = raw.partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return token.lstrip(b" ")


def _refuse(method: str, what: str) -> grpc.RpcMethodHandler:
    """A handler that ends any call with UNAUTHENTICATED (works for unary and streaming)."""

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
        log.warning("refused %s from %s: %s", method, context.peer(), what)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, what)

    return grpc.unary_unary_rpc_method_handler(deny)


class SecretCheck(grpc.aio.ServerInterceptor):
    """Refuses calls whose ``header`` metadata is not ``prefix + secret`` (UNAUTHENTICATED);
    with ``bearer``, ``Bearer <secret>`` with the scheme in any case (``prefix`` unused).

    ``protects(method)``: which full method names ('/pkg.Service/Method') need the secret
    (default: all). ``hint``: what the refusal message tells the caller to send.
    """

    def __init__(
        self,
        header: str,
        secret: str,
        *,
        prefix: str = "",
        bearer: bool = False,
        hint: str = "",
        protects: Callable[[str], bool] = lambda _method: True,
    ) -> None:
        if not secret:
            raise ValueError("the secret must be non-empty")
        self._header = header.lower()
        self._expected = (secret if bearer else prefix + secret).encode()
        self._bearer = bearer
        self._protects = protects
        self._what = f"missing or incorrect {header} metadata" + (f": {hint}" if hint else "")

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        method = str(handler_call_details.method)
        if not self._protects(method):
            return await continuation(handler_call_details)
        presented = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == self._header:
                presented = value
                break
        if self._bearer:
            presented = bearer_credentials(presented)
        if not secrets_match(presented, self._expected):
            return _refuse(method, self._what)
        return await continuation(handler_call_details)


def internal_token_check(token: str | None) -> list[grpc.aio.ServerInterceptor]:
    """Server interceptors for a worker: [] without a token (open, one-machine default)."""
    if not token:
        return []
    return [
        SecretCheck(
            INTERNAL_TOKEN_HEADER,
            token,
            hint="start the router with the workers' --internal-token / PDSERVE_INTERNAL_TOKEN",
        )
    ]


def api_key_check(
    api_key: str | None, protects: Callable[[str], bool]
) -> list[grpc.aio.ServerInterceptor]:
    """Server interceptors for the public gRPC API: [] without a key."""
    if not api_key:
        return []
    return [
        SecretCheck(
            API_KEY_HEADER,
            api_key,
            bearer=True,
            hint="send 'authorization: Bearer <key>' (the key given by --api-key)",
            protects=protects,
        )
    ]


class _AddMetadata:
    """Adds fixed metadata pairs to a call's details (base of the client interceptors below).

    NOTE: grpc.aio files an interceptor under the first call type it implements only, so each
    call type needs its own interceptor object.
    """

    def __init__(self, pairs: Sequence[tuple[str, str]]) -> None:
        self._pairs = tuple(pairs)

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *self._pairs)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


class _UnaryUnaryMetadata(_AddMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(
        self, continuation: Any, client_call_details: Any, request: Any
    ) -> Any:
        return await continuation(self._details(client_call_details), request)


class _UnaryStreamMetadata(_AddMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(
        self, continuation: Any, client_call_details: Any, request: Any
    ) -> Any:
        return await continuation(self._details(client_call_details), request)


def internal_token_metadata(token: str | None) -> list[grpc.aio.ClientInterceptor]:
    """Client interceptors that present ``token`` on every call ([] without a token)."""
    if not token:
        return []
    pairs = [(INTERNAL_TOKEN_HEADER, token)]
    return [_UnaryUnaryMetadata(pairs), _UnaryStreamMetadata(pairs)]
