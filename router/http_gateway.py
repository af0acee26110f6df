"""OpenAI-compatible HTTP gateway (FastAPI): chat and text completions, models, health, metrics.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models`` (and
``/v1/models/{id}``), ``POST /tokenize`` and ``POST /detokenize`` (router/utility_routes.py),
``GET /health`` (200 when a decode worker is up, else 503), ``GET /metrics`` (Prometheus text),
and, when a cluster controller is attached, ``GET /admin/workers`` and ``POST /admin/scale``.
With an API key, every ``/v1`` and ``/admin`` route needs ``Authorization: Bearer <key>`` (401
otherwise); ``/health`` and ``/metrics`` stay open for probes and scrapers.

Semantics follow the OpenAI API reference:

* Streaming is Server-Sent Events, one ``data:`` chunk per output token (its text may be "" while
  a stop string is pending), ``finish_reason`` null until the sequence's last chunk, then
  ``data: [DONE]``. Chat streams open each choice with a ``{"role": "assistant", "content": ""}``
  delta. ``stream_options.include_usage`` adds ``"usage": null`` to every chunk and one final
  chunk with empty ``choices`` and the usage.
* ``logprobs``: chat returns ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``;
  completions return ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``.
* Every error is ``{"error": {"message", "type", "param", "code"}}``: 400 for bad input (also
  what FastAPI would report as 422), 401, 404, 429 with ``Retry-After``, 500, 503, 504. A failure
  after a stream started is sent as one ``data: {"error": ...}`` event before ``[DONE]``.
* A client that disconnects aborts its request on every worker (stream or not).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve import metrics
from pdserve.sampling_params import SamplingError, SamplingParams
from pdserve.tokenizer import TokenizerError
from pdserve.types import SampledToken
from router.chat_tools import ToolSetup, ToolStream, tool_setup
from router.errors import (
    BadRequest,
    InsufficientResources,
    ModelNotFound,
    RouterError,
    Unauthorized,
)
from router.openai_protocol import ChatCompletionRequest, CompletionRequest
from router.prompt_logprobs import echo_logprobs, join_logprobs, vllm_prompt_logprobs
from router.serving import ChoiceDelta, RequestStream, Router
from router.tool_parsers import select_parser
from router.utility_routes import add_utility_routes, model_card

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_UNION_TAGS = ("str", "int", "float", "bool", "list", "dict", "none")
_STARTED = time.time()
# Status for a request whose client went away (nginx's convention; the client never sees it).
_CLIENT_CLOSED = 499


class ClusterControl(Protocol):
    """What ``/admin`` needs from the worker pool owner (router/cluster.py)."""

    def describe(self) -> list[dict[str, Any]]: ...

    async def scale(self, role: str, count: int) -> None: ...


class ScaleRequest(BaseModel):
    """POST /admin/scale body: run ``count`` workers of ``role`` ('prefill' | 'decode')."""

    model_config = ConfigDict(strict=True, extra="forbid")
    role: str
    count: int


def _dumps(obj: object) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _sse(obj: object) -> str:
    return f"data: {_dumps(obj)}\n\n"


def error_response(err: RouterError) -> JSONResponse:
    """The OpenAI-shaped JSON error for ``err`` (with Retry-After when set)."""
    metrics.REQUEST_ERRORS.labels(code=str(err.status)).inc()
    headers = {"Retry-After": str(err.retry_after_s)} if err.retry_after_s else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """(message, param) for the first pydantic error, phrased for API users."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    e = errors[0]
    if e.get("type") == "json_invalid":
        detail = (e.get("ctx") or {}).get("error", "")
        return f"the request body is not valid JSON: {detail}".rstrip(": "), None
    loc = [p for p in e.get("loc", ()) if p != "body"]
    if not loc and e.get("type") in ("model_type", "model_attributes_type", "dict_type"):
        return (
            "the request body must be a JSON object (send it with "
            "'Content-Type: application/json')",
            None,
        )
    parts: list[str] = []
    for p in loc:
        if isinstance(p, str) and ("[" in p or p in _UNION_TAGS):
            break  # a pydantic union-member tag, not a field
        parts.append(str(p))
    param = ".".join(parts) or None
    if e.get("type") == "missing":
        return (f"'{param}' is required" if param else "the request body is required"), param
    got = e.get("input")
    shown = "" if isinstance(got, (dict, list, bytes)) else f" (got {_short_repr(got)})"
    return f"'{param}': {e.get('msg', 'invalid value')}{shown}", param


def _short_repr(value: object, limit: int = 64) -> str:
    """``repr(value)`` cut to ``limit`` characters: errors never echo a large input back."""
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def check_text(text: str, param: str) -> None:
    """Raise BadRequest naming ``param`` when ``text`` is not encodable as UTF-8.

    JSON ``\\udc80`` escapes (and raw CESU-style bytes such as ED A0 80, which Python's JSON
    decoder accepts) produce lone UTF-16 surrogates that no tokenizer can encode.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(
            f"'{param}' is not valid Unicode: it holds a lone surrogate "
            f"U+{ord(text[e.start]):04X} at character {e.start}",
            param=param,
        ) from None


@dataclass
class _Choice:
    """Accumulated output of one choice (non-streaming responses and completion offsets)."""

    text: str = ""
    tokens: list[SampledToken] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class OpenAIGateway:
    """Request handlers bound to one Router. Build the app with :func:`build_app`."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.tokenizer = router.tokenizer
        # NOTE: one thread, so the (Rust) tokenizer is never used by two threads at once; work
        # here takes milliseconds per prompt but seconds for a multi-MB one, which must not stall
        # the event loop (health checks, other streams).
        self._tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self.chat_template = router.config.chat_template
        self.tool_parser = select_parser(
            router.config.tool_call_parser, self.chat_template or self.tokenizer.hf.chat_template
        )

    async def _in_tokenizer_thread(self, fn: Callable[..., _T], *args: Any) -> _T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize_pool, functools.partial(fn, *args))

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one gateway per process
    def token_text(self, token_id: int) -> str:
        """Text of one token as OpenAI shows it in logprobs (special tokens included)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # -- logprobs shapes -----------------------------------------------------------------------

    def chat_logprobs(self, tokens: Sequence[SampledToken], top: int) -> dict[str, Any]:
        def entry(tid: int, lp: float) -> dict[str, Any]:
            s = self.token_text(tid)
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

        content = []
        for t in tokens:
            item = entry(t.token_id, t.logprob)
            item["top_logprobs"] = [entry(i, lp) for i, lp in t.top_logprobs[:top]]
            content.append(item)
        return {"content": content, "refusal": None}

    def completion_logprobs(
        self, tokens: Sequence[SampledToken], top: int, offset: int
    ) -> dict[str, Any]:
        texts = [self.token_text(t.token_id) for t in tokens]
        offsets = []
        for s in texts:
            offsets.append(offset)
            offset += len(s)
        return {
            "tokens": texts,
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [
                {self.token_text(i): lp for i, lp in t.top_logprobs[:top]} for t in tokens
            ],
            "text_offset": offsets,
        }

    # -- request preparation ---------------------------------------------------------------------

    def _check_model(self, model: str | None) -> None:
        if model and model != self.router.model_name:
            raise ModelNotFound(
                f"the model '{model}' does not exist; this server serves "
                f"'{self.router.model_name}'",
                param="model",
            )

    @staticmethod
    def _sampling(build: Callable[[], SamplingParams]) -> SamplingParams:
        try:
            return build()
        except SamplingError as e:
            raise BadRequest(str(e), param=e.field) from None

    def _usage(self, streams: Sequence[RequestStream]) -> dict[str, Any]:
        prompt = sum(len(s.prompt_token_ids) for s in streams)
        completion = sum(s.completion_tokens for s in streams)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in streams)},
        }

    # -- chat ---------------------------------------------------------------------------------------

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        tools = tool_setup(body.tools, body.tool_choice, body.parallel_tool_calls, self.tool_parser)
        sampling = self._sampling(
            functools.partial(body.to_sampling_params, tools.spec() if tools else None)
        )
        conversation = body.conversation()
        for m in conversation:
            check_text(m["content"] or "", "messages")
        render = functools.partial(
            self.tokenizer.apply_chat_template,
            conversation,
            body.add_generation_prompt,
            tools=list(tools.tools) if tools else None,
            chat_template=self.chat_template,
            **body.template_controls(),
        )
        try:
            prompt = await self._in_tokenizer_thread(render)
        except TokenizerError as e:
            raise BadRequest(str(e), param=e.param or "messages") from None
        if sampling.structured is not None:
            await self._in_tokenizer_thread(self.router.check_structured, sampling.structured)
        # vLLM's chat echo: the reply starts with the last message when it is the assistant's
        last = conversation[-1]
        echo = (last["content"] or "") if body.echo and last["role"] == "assistant" else ""
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        stream = self.router.submit(rid, prompt, sampling, prompt_param="messages")
        model = self.router.model_name
        head = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": stream.created,
            "model": model,
        }
        top = sampling.top_logprobs

        if body.stream:
            splitters = [tools.streamer() if tools else None for _ in range(sampling.n)]

            def chunk(delta: ChoiceDelta | None, index: int, **extra: Any) -> str:
                choice: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": None}
                if delta is None:
                    choice["delta"] = {"role": "assistant", "content": echo}
                else:
                    choice["delta"] = _tool_delta(splitters[index], delta)
                    if delta.tokens and sampling.logprobs:
                        choice["logprobs"] = self.chat_logprobs(delta.tokens, top)
                    choice["finish_reason"] = _finish_reason(splitters[index], delta.finish_reason)
                    if delta.finish_reason is not None:
                        choice["stop_reason"] = delta.stop_reason
                out = {**head, "system_fingerprint": None, "choices": [choice], **extra}
                return _sse(out)

            extra = {"usage": None} if body.include_usage else {}

            async def events() -> AsyncIterator[str]:
                for i in range(sampling.n):
                    yield chunk(None, i, **extra)
                async for d in stream:
                    yield chunk(d, d.index, **extra)
                if body.include_usage:
                    yield _sse({**head, "choices": [], "usage": self._usage([stream])})

            return _event_stream(events(), [stream])

        choices = await _collect_or_disconnect(request, [stream], [0])
        if choices is None:
            return Response(status_code=_CLIENT_CLOSED)
        data = []
        for i, c in enumerate(choices):
            message, finish = _chat_message(tools, echo + c.text, c.finish_reason)
            data.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": self.chat_logprobs(c.tokens, top) if sampling.logprobs else None,
                    "finish_reason": finish,
                    "stop_reason": c.stop_reason,
                }
            )
        out = {
            "id": rid,
            "object": "chat.completion",
            "created": stream.created,
            "model": model,
            "system_fingerprint": None,
            "choices": data,
            "usage": self._usage([stream]),
        }
        if sampling.prompt_logprobs is not None:
            out["prompt_logprobs"] = vllm_prompt_logprobs(
                prompt, stream.prompt_logprobs or (), self.token_text
            )
        return JSONResponse(out)

    # -- text completions -----------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        sampling = self._sampling(body.to_sampling_params)
        prompts = body.prompts()
        self.router.check_num_sequences(len(prompts), sampling.n)
        if sampling.structured is not None:
            await self._in_tokenizer_thread(self.router.check_structured, sampling.structured)
        rid = f"cmpl-{uuid.uuid4().hex}"
        encoded: list[tuple[list[int], str]] = []
        for p in prompts:
            if isinstance(p, str):
                check_text(p, "prompt")
                encoded.append((await self._in_tokenizer_thread(self.tokenizer.encode, p), p))
            else:
                self.router.check_token_ids(p, "prompt")  # before decoding them for echo
                echo_text = ""
                if body.echo:
                    echo_text = await self._in_tokenizer_thread(self.tokenizer.decode, p)
                encoded.append((p, echo_text))
        streams: list[RequestStream] = []
        try:
            for k, (ids, _) in enumerate(encoded):
                sub = rid if len(encoded) == 1 else f"{rid}-p{k}"
                streams.append(self.router.submit(sub, ids, sampling))
        except RouterError:
            for s in streams:
                s.close_nowait()
            raise
        n = sampling.n
        offsets = [k * n for k in range(len(streams))]
        model = self.router.model_name
        created = streams[0].created
        head = {"id": rid, "object": "text_completion", "created": created, "model": model}
        top = sampling.top_logprobs
        echo = [encoded[k][1] if body.echo else "" for k in range(len(encoded)) for _ in range(n)]
        only = body.echo_only  # max_tokens 0: the one token workers sample is dropped
        # with logprobs, the echo waits for the prompt logprobs (they come with token 1)
        late_echo = body.echo and sampling.logprobs

        def prompt_part(k: int) -> dict[str, list[Any]]:
            ids = encoded[k][0]
            return echo_logprobs(ids, streams[k].prompt_logprobs or (), top, self.token_text)

        def usage() -> dict[str, Any]:
            u = self._usage(streams)
            if only:
                u["total_tokens"] -= u["completion_tokens"]
                u["completion_tokens"] = 0
            return u

        if body.stream:
            extra = {"usage": None} if body.include_usage else {}
            sent = [0] * len(echo)  # characters streamed per choice (for text_offset)
            echoed = [not e for e in echo]

            def chunk(index: int, text: str, d: ChoiceDelta | None, k: int = 0) -> str:
                if d is not None and only:  # nothing generated: only the finish goes out
                    text, d = "", dataclasses.replace(d, text="", tokens=())
                lp = None
                if d is not None and d.tokens and sampling.logprobs:
                    lp = self.completion_logprobs(d.tokens, top, sent[index])
                elif d is None and late_echo:
                    lp = prompt_part(k)
                sent[index] += len(text)
                choice = {
                    "index": index,
                    "text": text,
                    "logprobs": lp,
                    "finish_reason": None if d is None else d.finish_reason,
                }
                if d is not None and d.finish_reason is not None:
                    choice["stop_reason"] = d.stop_reason
                return _sse({**head, "choices": [choice], **extra})

            async def events() -> AsyncIterator[str]:
                if not late_echo:
                    for i, e in enumerate(echo):
                        if e:
                            echoed[i] = True
                            yield chunk(i, e, None)
                async for k, d in _merge(streams):
                    i = offsets[k] + d.index
                    if not echoed[i]:
                        echoed[i] = True
                        yield chunk(i, echo[i], None, k)
                    if not only or d.finish_reason is not None:
                        yield chunk(i, d.text, d)
                if body.include_usage:
                    yield _sse({**head, "choices": [], "usage": usage()})

            return _event_stream(events(), streams)

        choices = await _collect_or_disconnect(request, streams, offsets)
        if choices is None:
            return Response(status_code=_CLIENT_CLOSED)
        data = []
        for i, c in enumerate(choices):
            k = i // n
            if only:
                c.text, c.tokens = "", []
            lp = None
            if sampling.logprobs:
                lp = self.completion_logprobs(c.tokens, top, len(echo[i]))
                if body.echo:
                    lp = join_logprobs(prompt_part(k), lp)
            item = {
                "index": i,
                "text": echo[i] + c.text,
                "logprobs": lp,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            if sampling.prompt_logprobs is not None and body.prompt_logprobs is not None:
                item["prompt_logprobs"] = vllm_prompt_logprobs(
                    encoded[k][0], streams[k].prompt_logprobs or (), self.token_text
                )
            data.append(item)
        return JSONResponse({**head, "choices": data, "usage": usage()})


def _tool_delta(splitter: ToolStream | None, delta: ChoiceDelta) -> dict[str, Any]:
    """A streamed chat ``delta``: content, and tool calls once complete (``splitter`` set)."""
    if splitter is None:
        return {"content": delta.text} if delta.text else {}
    content, calls = splitter.feed(delta.text)
    if delta.finish_reason is not None:
        more, late = splitter.finish()
        content, calls = content + more, calls + late
    out: dict[str, Any] = {"content": content} if content else {}
    if calls:
        first = splitter.num_calls - len(calls)
        out["tool_calls"] = [c.to_openai(first + j) for j, c in enumerate(calls)]
    return out


def _finish_reason(splitter: ToolStream | None, reason: str | None) -> str | None:
    """``tool_calls`` instead of ``stop`` when the choice made calls."""
    if reason == "stop" and splitter is not None and splitter.num_calls:
        return "tool_calls"
    return reason


def _chat_message(
    tools: ToolSetup | None, text: str, finish: str | None
) -> tuple[dict[str, Any], str | None]:
    """(the assistant ``message``, finish_reason) of a complete chat choice."""
    if tools is None:
        return {"role": "assistant", "content": text}, finish
    parsed = tools.split(text)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        message["tool_calls"] = [c.to_openai() for c in parsed.tool_calls]
        if finish == "stop":
            finish = "tool_calls"
    return message, finish


async def _merge(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, ChoiceDelta]]:
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


async def _collect(streams: Sequence[RequestStream], offsets: Sequence[int]) -> list[_Choice]:
    choices = [_Choice() for _ in range(sum(s.n for s in streams))]
    async for k, d in _merge(streams):
        c = choices[offsets[k] + d.index]
        c.text += d.text
        c.tokens.extend(d.tokens)
        if d.finish_reason is not None:
            c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
    return choices


async def _collect_or_disconnect(
    request: Request, streams: Sequence[RequestStream], offsets: Sequence[int]
) -> list[_Choice] | None:
    """Run the streams to the end; if the client disconnects first, abort them and return None.

    Raises the first RouterError of a stream.
    """

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(_collect(streams, offsets))
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


def _event_stream(events: AsyncIterator[str], streams: Sequence[RequestStream]) -> Response:
    """SSE response around ``events``; errors become an error event; disconnects abort."""

    async def body() -> AsyncIterator[str]:
        try:
            async for e in events:
                yield e
        except RouterError as err:
            metrics.REQUEST_ERRORS.labels(code=str(err.status)).inc()
            yield _sse(err.body())
        finally:
            for s in streams:  # synchronous: runs even inside a cancelled scope (disconnect)
                s.close_nowait()
        yield "data: [DONE]\n\n"

    return StreamingResponse(
        body(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024  # 32 MiB: far above any prompt max_model_len admits


class BodySizeLimit:
    """ASGI middleware: refuse request bodies over ``max_bytes`` with 413 and an OpenAI body.

    The declared ``Content-Length`` is checked first; a body without one (chunked) is counted
    while it is read. The body is buffered here (the JSON handlers read it whole anyway) and
    replayed to the app, so an over-long body is refused before any of it is parsed.
    """

    def __init__(self, app: Any, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def _refuse(self, send: Any) -> None:
        err = RouterError(
            f"the request body exceeds the server's limit of {self.max_bytes} bytes",
        )
        err.status, err.type, err.code = 413, "invalid_request_error", "request_too_large"
        metrics.REQUEST_ERRORS.labels(code="413").inc()
        payload = _dumps(err.body()).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})

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
            message = await receive()
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


def build_app(
    router: Router,
    api_key: str | None = None,
    control: ClusterControl | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """The FastAPI application serving ``router``.

    ``api_key``: require ``Authorization: Bearer <api_key>`` on /v1 and /admin routes.
    ``control``: enables /admin/workers and /admin/scale. ``max_body_bytes``: larger request
    bodies get 413 (bytes).
    """
    app = FastAPI(title="pdserve", description="OpenAI-compatible API of a pdserve cluster")
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    gateway = OpenAIGateway(router)
    expected = f"Bearer {api_key}".encode() if api_key else None

    async def require_key(request: Request) -> None:
        if expected is None:
            return
        got = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(got, expected):
            raise Unauthorized(
                "missing or incorrect API key: send 'Authorization: Bearer <key>' "
                "(the key given by --api-key / PDSERVE_API_KEY)"
            )

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_key)])
    add_utility_routes(
        app, v1, router, gateway._in_tokenizer_thread, dependencies=[Depends(require_key)]
    )

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await gateway.chat(body, request)

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await gateway.completions(body, request)

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(router)]}

    app.include_router(v1)

    @app.get("/health")
    async def health() -> JSONResponse:
        decode = router.pool.workers("decode")
        prefill = router.pool.workers("prefill")
        ok = bool(decode)
        return JSONResponse(
            {
                "status": "ok" if ok else "unavailable",
                "decode_workers": len(decode),
                "prefill_workers": len(prefill),
            },
            status_code=200 if ok else 503,
        )

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.CONTENT_TYPE)

    if control is not None:
        admin = APIRouter(prefix="/admin", dependencies=[Depends(require_key)])

        @admin.get("/workers")
        async def workers() -> dict[str, Any]:
            return {"workers": control.describe()}

        @admin.post("/scale")
        async def scale(body: ScaleRequest) -> dict[str, Any]:
            if body.role not in ("prefill", "decode"):
                raise BadRequest(
                    f"'role' must be 'prefill' or 'decode', got {body.role!r}", param="role"
                )
            if body.count < (1 if body.role == "decode" else 0):
                raise BadRequest(
                    f"'count' must be >= {1 if body.role == 'decode' else 0} for {body.role}",
                    param="count",
                )
            try:
                await control.scale(body.role, body.count)
            except ValueError as e:
                raise BadRequest(str(e), param="count") from None
            except RuntimeError as e:  # a new worker failed to start (RouterErrors pass through)
                raise InsufficientResources(f"scaling {body.role} failed: {e}") from None
            return {"workers": control.describe()}

        app.include_router(admin)

    @app.exception_handler(RouterError)
    async def on_router_error(_request: Request, exc: RouterError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(BadRequest(message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = RouterError(str(exc.detail))
        err.status = exc.status_code
        err.type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(err)

    @app.exception_handler(Exception)
    async def on_unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return error_response(RouterError(f"internal server error: {type(exc).__name__}"))

    return app
