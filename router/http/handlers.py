"""The OpenAI endpoints' request handlers: ``/v1/chat/completions`` and ``/v1/completions``.

Each handler checks the model name and sampling, prepares the prompt(s) through the router's
shared :class:`~router.prompts.PromptPreparer` (off the event loop), submits one request stream
per prompt and answers with one JSON body or a Server-Sent Events stream. Streams send one
``data:`` chunk per output token (its text may be "" while a stop string is pending),
``finish_reason`` null until the sequence's last chunk, then ``data: [DONE]``; a chat choice's
first chunk carries ``"role": "assistant"`` together with its first token's text (nothing is sent
before the first token exists, so TTFT measured by clients is real), and
``stream_options.include_usage`` adds ``"usage": null`` to every chunk and one final chunk with
empty ``choices`` and the usage.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pdserve.sampling_params import SamplingError, SamplingParams
from router.errors import BadRequest, ModelNotFound, RouterError
from router.http.responses import (
    Logprobs,
    chat_chunk_choice,
    completion_chunk_choice,
    sse,
    usage,
)
from router.http.streams import CLIENT_CLOSED, collect_or_disconnect, event_stream, merge
from router.openai_protocol import ChatCompletionRequest, CompletionRequest
from router.serving import ChoiceDelta, RequestStream, Router


def check_model(router: Router, model: str | None) -> None:
    """Raise ModelNotFound (404) when ``model`` is set and is not the served model."""
    if model and model != router.model_name:
        raise ModelNotFound(
            f"the model '{model}' does not exist; this server serves '{router.model_name}'",
            param="model",
        )


def sampling_params(build: Callable[[], SamplingParams]) -> SamplingParams:
    """``build()``, with a SamplingError turned into BadRequest naming the field."""
    try:
        return build()
    except SamplingError as e:
        raise BadRequest(str(e), param=e.field) from None


class OpenAIGateway:
    """Request handlers bound to one Router. Build the app with :func:`router.http.build_app`."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.logprobs = Logprobs(router.tokenizer)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        check_model(self.router, body.model)
        sampling = sampling_params(body.to_sampling_params)
        prompt = await self.router.prompts.chat(body.conversation(), param="messages")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        stream = self.router.submit(rid, prompt, sampling, prompt_param="messages")
        head = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": stream.created,
            "model": self.router.model_name,
        }
        top = sampling.top_logprobs

        if body.stream:
            extra = {"usage": None} if body.include_usage else {}

            opened: set[int] = set()  # choices whose first chunk (with the role) went out

            def chunk(delta: ChoiceDelta) -> str:
                lp = None
                if delta.tokens and sampling.logprobs:
                    lp = self.logprobs.chat(delta.tokens, top)
                first = delta.index not in opened
                opened.add(delta.index)
                choice = chat_chunk_choice(delta, delta.index, lp, first)
                return sse({**head, "system_fingerprint": None, "choices": [choice], **extra})

            async def events() -> AsyncIterator[str]:
                async for d in stream:
                    yield chunk(d)
                if body.include_usage:
                    yield sse({**head, "choices": [], "usage": usage([stream])})

            return event_stream(events(), [stream])

        choices = await collect_or_disconnect(request, [stream], [0])
        if choices is None:
            return Response(status_code=CLIENT_CLOSED)
        data = [
            {
                "index": i,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": self.logprobs.chat(c.tokens, top) if sampling.logprobs else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for i, c in enumerate(choices)
        ]
        return JSONResponse(
            {
                **head,
                "object": "chat.completion",
                "system_fingerprint": None,
                "choices": data,
                "usage": usage([stream]),
            }
        )

    async def _prepare(self, prompt: str | list[int], echo: bool) -> tuple[list[int], str]:
        """(token ids, text to echo) of one completions prompt."""
        if isinstance(prompt, str):
            return await self.router.prompts.text(prompt, param="prompt"), prompt
        self.router.check_token_ids(prompt, "prompt")  # before decoding them for echo
        return prompt, (await self.router.prompts.decode(prompt) if echo else "")

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        check_model(self.router, body.model)
        sampling = sampling_params(body.to_sampling_params)
        prompts = body.prompts()
        self.router.check_num_sequences(len(prompts), sampling.n)
        rid = f"cmpl-{uuid.uuid4().hex}"
        encoded = [await self._prepare(p, body.echo) for p in prompts]
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
        head = {
            "id": rid,
            "object": "text_completion",
            "created": streams[0].created,
            "model": self.router.model_name,
        }
        top = sampling.top_logprobs
        echo = [text if body.echo else "" for _, text in encoded for _ in range(n)]

        if body.stream:
            extra = {"usage": None} if body.include_usage else {}
            sent = [0] * len(echo)  # characters streamed per choice (for text_offset)

            def chunk(index: int, text: str, d: ChoiceDelta | None) -> str:
                lp = None
                if d is not None and d.tokens and sampling.logprobs:
                    lp = self.logprobs.completion(d.tokens, top, sent[index])
                sent[index] += len(text)
                choice = completion_chunk_choice(index, text, d, lp)
                return sse({**head, "choices": [choice], **extra})

            async def events() -> AsyncIterator[str]:
                for i, e in enumerate(echo):
                    if e:
                        yield chunk(i, e, None)
                async for k, d in merge(streams):
                    yield chunk(offsets[k] + d.index, d.text, d)
                if body.include_usage:
                    yield sse({**head, "choices": [], "usage": usage(streams)})

            return event_stream(events(), streams)

        choices = await collect_or_disconnect(request, streams, offsets)
        if choices is None:
            return Response(status_code=CLIENT_CLOSED)
        data: list[dict[str, Any]] = []
        for i, c in enumerate(choices):
            lp = None
            if sampling.logprobs:
                lp = self.logprobs.completion(c.tokens, top, len(echo[i]))
            data.append(
                {
                    "index": i,
                    "text": echo[i] + c.text,
                    "logprobs": lp,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        return JSONResponse({**head, "choices": data, "usage": usage(streams)})
