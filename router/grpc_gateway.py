"""Public gRPC API (proto/pdserve/v1/generate.proto): ``Generation`` + grpc.health.v1 + reflection.

``Generate`` streams one ``Chunk`` per output token (text may be "" while a stop string is
pending; ``tokens`` carries the id and, when asked, log-probabilities), then ``Complete`` with the
finish reason, usage and full text. Errors found before generation starts (bad input, unknown
model, admission) end the call with a gRPC status: INVALID_ARGUMENT, NOT_FOUND,
RESOURCE_EXHAUSTED (queue full), ...; a failure after chunks were sent is a final
``GenerateError`` message (HTTP-like code). A cancelled call aborts the request on every worker.

Wire defaults differ from the HTTP API where proto3 forces them: ``temperature`` 0 (greedy),
``max_tokens`` 0 = the rest of the context, ``skip_special_tokens`` false.

Health: the empty service name and ``pdserve.v1.Generation`` report SERVING while at least one
decode worker is up, NOT_SERVING otherwise.

With an API key, ``pdserve.v1.Generation`` calls need ``authorization: Bearer KEY`` metadata
(UNAUTHENTICATED otherwise, checked in constant time by pdserve/auth.py); health and reflection
stay open, like ``/health`` on the HTTP API.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from pdserve import metrics, rpc
from pdserve.auth import api_key_check
from pdserve.config import ServeConfig
from pdserve.sampling_params import SamplingError, SamplingParams
from pdserve.structured.strict import closed_spec
from pdserve.v1 import common_pb2 as cpb
from pdserve.v1 import generate_pb2 as gpb
from pdserve.v1 import generate_pb2_grpc as gpb_grpc
from router.chat_tools import ToolSetup
from router.errors import BadRequest, ModelNotFound, RouterError
from router.grpc_chat import ChatInputs, chat_inputs, grpc_field_names
from router.readiness import is_ready
from router.request_id import check_request_id, request_context
from router.serving import Router

log = logging.getLogger(__name__)

SERVICE_NAME = gpb.DESCRIPTOR.services_by_name["Generation"].full_name


class GenerationService(gpb_grpc.GenerationServicer):
    """``pdserve.v1.Generation`` over a Router."""

    def __init__(self, router: Router) -> None:
        self.router = router

    async def _prompt(
        self, request: gpb.GenerateRequest, chat: ChatInputs | None = None
    ) -> list[int]:
        """Token ids of the request's input, prepared off the event loop (router.prompts)."""
        kind = request.WhichOneof("input")
        if kind == "text":
            return await self.router.prompts.text(
                request.text, param="text", max_model_len=self.router.max_model_len
            )
        if kind == "chat":
            assert chat is not None
            return await self.router.prompts.chat(
                chat.messages,
                param="chat",
                control_prefix="chat.",
                max_model_len=self.router.max_model_len,
                **chat.controls,
            )
        if kind == "token_ids":
            return list(request.token_ids.ids)
        raise BadRequest("one of 'text', 'chat' or 'token_ids' must be set", param="input")

    def _sampling(
        self, request: gpb.GenerateRequest, tools: ToolSetup | None = None
    ) -> SamplingParams:
        wire = cpb.SamplingParams()
        wire.CopyFrom(request.sampling)
        rest_of_context = wire.max_tokens == 0
        if rest_of_context:
            wire.max_tokens = 1  # placeholder so validation passes; replaced by None below
        if wire.HasField("structured"):
            wire.structured.field = "sampling.structured"  # what its errors name
        try:
            params = rpc.sampling_from_proto(wire)
            if params.structured is not None:  # closed as on the HTTP path
                params = dataclasses.replace(params, structured=closed_spec(params.structured))
            tool_spec = tools.spec() if tools else None
            if tool_spec is not None and params.structured is not None:
                raise BadRequest(
                    "'sampling.structured' cannot be combined with a tool_choice that forces a "
                    "call",
                    param="sampling.structured",
                )
            return dataclasses.replace(
                params,
                structured=params.structured or tool_spec,
                max_tokens=None if rest_of_context else params.max_tokens,
                stop=tuple(request.stop),
                skip_special_tokens=request.skip_special_tokens,
            )
        except SamplingError as e:
            raise BadRequest(str(e), param=e.field) from None

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: gpb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gpb.GenerateResponse]:
        rid = request.request_id or f"gen-{uuid.uuid4().hex}"
        try:
            check_request_id(rid)
            if request.model and request.model != self.router.model_name:
                raise ModelNotFound(
                    f"the model '{request.model}' does not exist; this server serves "
                    f"'{self.router.model_name}'",
                    param="model",
                )
            if any(not s for s in request.stop):
                raise BadRequest("'stop' strings must be non-empty", param="stop")
            chat = None
            if request.WhichOneof("input") == "chat":
                chat = chat_inputs(request.chat, self.router.tool_parser)
                if chat.tools is not None:
                    chat.tools.check_visible(await self.router.prompts.renders_tools())
            sampling = self._sampling(request, chat.tools if chat else None)
            prompt = await self._prompt(request, chat)
            if sampling.structured is not None:
                await self.router.prompts.check_structured(
                    sampling.structured, sampling.allowed_token_ids
                )
            field = request.WhichOneof("input") or "input"  # errors name the prompt's field
            # the workers' id for the call is the gateway's own: a client's request_id need not
            # be unique (a retry, a reuse), and two live sequences may not share an id on a
            # worker; the record is filed under the client's id, apart per call (as HTTP does)
            seq_id = f"gen-{uuid.uuid4().hex}" if request.request_id else rid
            with request_context(rid):
                stream = self.router.submit(seq_id, prompt, sampling, prompt_param=field)
        except RouterError as e:
            if request.WhichOneof("input") == "chat":
                e = grpc_field_names(e)
            metrics.REQUEST_ERRORS.labels(code=str(e.status)).inc()
            await context.abort(e.grpc_code, e.message)
            return
        text: list[str] = []
        reason = "stop"
        prompt_lps_sent = sampling.prompt_logprobs is None
        try:
            async for d in stream:
                text.append(d.text)
                if d.finish_reason is not None:
                    reason = d.finish_reason
                    if not d.text and not d.tokens and prompt_lps_sent:
                        continue
                chunk = gpb.Chunk(text=d.text, tokens=[rpc.token_to_proto(t) for t in d.tokens])
                if not prompt_lps_sent:  # they arrive with token 1
                    prompt_lps_sent = True
                    lps = stream.prompt_logprobs or ()
                    chunk.prompt_logprobs.extend(rpc.token_to_proto(t) for t in lps)
                yield gpb.GenerateResponse(request_id=rid, chunk=chunk)
            full = "".join(text)
            calls: list[gpb.ToolCall] = []
            if chat is not None and chat.tools is not None:
                parsed = chat.tools.split(full)
                full = parsed.content or ""
                calls = [gpb.ToolCall(id=c.id, name=c.name, arguments=c.arguments)
                         for c in parsed.tool_calls]  # fmt: skip
                reason = chat.tools.finish_reason(reason, bool(calls))
            yield gpb.GenerateResponse(
                request_id=rid,
                complete=gpb.Complete(
                    finish_reason=reason,
                    text=full,
                    tool_calls=calls,
                    usage=gpb.Usage(
                        prompt_tokens=len(stream.prompt_token_ids),
                        completion_tokens=stream.completion_tokens,
                        cached_tokens=stream.cached_tokens,
                    ),
                ),
            )
        except RouterError as e:
            metrics.REQUEST_ERRORS.labels(code=str(e.status)).inc()
            yield gpb.GenerateResponse(
                request_id=rid, error=gpb.GenerateError(code=e.status, message=e.message)
            )
        finally:
            stream.close_nowait()

    async def ListModels(  # noqa: N802 - gRPC method name
        self, request: gpb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> gpb.ListModelsResponse:
        if not is_ready(self.router.pool):
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "the server is not ready: no decode worker is up yet"
            )
        return gpb.ListModelsResponse(
            models=[
                gpb.ModelInfo(id=self.router.model_name, max_model_len=self.router.max_model_len)
            ]
        )


class _Undecodable:
    """What a request that is not a valid message of its method's type deserialises to."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _tolerant(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError, bad UTF-8, ...
            return _Undecodable(e)

    return parse


class MalformedRequestCheck(grpc.aio.ServerInterceptor):
    """Answers a request whose bytes are not a valid message of its method's type (corrupt wire
    format, a string field that is not UTF-8) with INVALID_ARGUMENT naming the decoding error,
    where grpcio alone would answer UNKNOWN and log a traceback per call. Unary-unary and
    unary-stream methods (all the public API has)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        if handler.unary_unary is not None:
            inner_unary = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                await _refuse_undecodable(request, context)
                return await inner_unary(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary, _tolerant(handler.request_deserializer), handler.response_serializer
            )
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                await _refuse_undecodable(request, context)
                async for response in inner_stream(request, context):
                    yield response

            return grpc.unary_stream_rpc_method_handler(
                stream, _tolerant(handler.request_deserializer), handler.response_serializer
            )
        return handler


async def _refuse_undecodable(request: Any, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, _Undecodable):
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the request is not a valid message of this method's type: {request.error}",
        )


class GrpcGateway:
    """The gRPC server: Generation, health and reflection on ``host:port``.

    ``port`` 0 picks a free port (see ``port`` after ``start``). ``api_key``: required on
    Generation calls (None = open).
    """

    def __init__(
        self,
        router: Router,
        host: str = ServeConfig.host,
        port: int = ServeConfig.grpc_port,
        api_key: str | None = None,
    ) -> None:
        self.router = router
        self.host = host
        self.port = port
        self.server = grpc.aio.server(
            interceptors=[
                *api_key_check(api_key, lambda m: m.startswith(f"/{SERVICE_NAME}/")),
                MalformedRequestCheck(),
            ],
            options=[
                ("grpc.max_receive_message_length", 64 * 1024 * 1024),
                ("grpc.max_send_message_length", 64 * 1024 * 1024),
            ],
        )
        self.health = health_aio.HealthServicer()
        gpb_grpc.add_GenerationServicer_to_server(GenerationService(router), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME),
            self.server,
        )  # fmt: skip
        self._watcher: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Bind and serve. Raises RuntimeError when the port cannot be bound."""
        bound = self.server.add_insecure_port(f"{self.host}:{self.port}")
        if bound == 0:
            raise RuntimeError(f"gRPC gateway cannot bind {self.host}:{self.port} (--grpc-port)")
        self.port = bound
        await self.server.start()
        await self._update_health()
        self._watcher = asyncio.get_running_loop().create_task(self._watch_health())

    async def _update_health(self) -> None:
        up = is_ready(self.router.pool)
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if up
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def _watch_health(self) -> None:
        while True:
            await self.router.pool.wait_changed(2.0)
            try:
                await self._update_health()
            except Exception:  # noqa: BLE001 - keep watching
                log.exception("health update failed")

    async def stop(self, grace_s: float = 2.0) -> None:
        """Stop serving; in-flight calls get ``grace_s`` seconds."""
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
