"""pdserve/auth.py: the shared-secret interceptors on a real grpc.aio server (health service)."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from pdserve.auth import (
    API_KEY_HEADER,
    INTERNAL_TOKEN_HEADER,
    SecretCheck,
    api_key_check,
    internal_token_check,
    internal_token_metadata,
    secrets_match,
)

pytestmark = pytest.mark.timeout(30)

TOKEN = "s3cret-token"


def test_secrets_match() -> None:
    assert secrets_match(TOKEN, TOKEN) and secrets_match(TOKEN.encode(), TOKEN)
    assert not secrets_match(None, TOKEN) and not secrets_match("", TOKEN)
    assert not secrets_match(TOKEN + "x", TOKEN) and not secrets_match("ünïcode", TOKEN)


def test_no_secret_means_no_interceptor_and_an_empty_secret_is_refused() -> None:
    assert internal_token_check(None) == [] and internal_token_check("") == []
    assert api_key_check(None, lambda _m: True) == []
    assert internal_token_metadata(None) == []
    with pytest.raises(ValueError, match="non-empty"):
        SecretCheck(INTERNAL_TOKEN_HEADER, "")


async def _server(interceptors: list) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(interceptors=interceptors)
    health = health_aio.HealthServicer()
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _check(address: str, **kwargs: object) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(address, **kwargs) as ch:  # type: ignore[arg-type]
        try:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.aio.AioRpcError as e:
            return e.code()
    return grpc.StatusCode.OK


async def test_internal_token_refused_without_it_and_accepted_with_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server, address = await _server(internal_token_check(TOKEN))
    try:
        assert await _check(address) == grpc.StatusCode.UNAUTHENTICATED
        wrong = internal_token_metadata("guess")
        assert await _check(address, interceptors=wrong) == grpc.StatusCode.UNAUTHENTICATED
        good = internal_token_metadata(TOKEN)
        assert await _check(address, interceptors=good) == grpc.StatusCode.OK
        assert "refused /grpc.health.v1.Health/Check" in caplog.text
        assert TOKEN not in caplog.text and "guess" not in caplog.text
    finally:
        await server.stop(0)


async def test_streaming_calls_are_checked_too() -> None:
    server, address = await _server(internal_token_check(TOKEN))
    try:
        for interceptors, expected in (
            ([], grpc.StatusCode.UNAUTHENTICATED),
            (internal_token_metadata(TOKEN), None),
        ):
            async with grpc.aio.insecure_channel(address, interceptors=interceptors) as ch:
                call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest())
                if expected is None:
                    first = await call.read()
                    assert first.status == health_pb2.HealthCheckResponse.SERVING
                    call.cancel()
                else:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call.read()
                    assert err.value.code() == expected
    finally:
        await server.stop(0)


async def test_api_key_needs_the_bearer_prefix_and_protects_only_chosen_methods() -> None:
    protect_check = api_key_check("k1", lambda m: m.endswith("/Check"))
    server, address = await _server(protect_check)
    try:
        async with grpc.aio.insecure_channel(address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            req = health_pb2.HealthCheckRequest()
            for metadata, ok in (
                ((), False),
                (((API_KEY_HEADER, "k1"),), False),  # no "Bearer "
                (((API_KEY_HEADER, "Bearer k2"),), False),
                (((API_KEY_HEADER, "Bearer k1"),), True),
                # RFC 7235: the scheme is case-insensitive (QA D8)
                (((API_KEY_HEADER, "bearer k1"),), True),
                (((API_KEY_HEADER, "BEARER  k1"),), True),
                (((API_KEY_HEADER, "Basic k1"),), False),
                (((API_KEY_HEADER, "bearerk1"),), False),
                (((API_KEY_HEADER, "bearer k1 "),), False),
            ):
                try:
                    await stub.Check(req, timeout=5, metadata=metadata)
                    assert ok, metadata
                except grpc.aio.AioRpcError as e:
                    assert not ok and e.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
            # Watch is not protected by this predicate.
            call = stub.Watch(req)
            assert (await call.read()).status == health_pb2.HealthCheckResponse.SERVING
            call.cancel()
    finally:
        await server.stop(0)
