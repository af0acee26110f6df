"""The ``/v1/completions`` handler (OpenAI's legacy text completions).

One request stream per prompt (texts or token-id lists), ``n`` choices each, numbered prompt by
prompt. ``echo`` puts the prompt text before each choice's text; with ``logprobs`` it also puts
the prompt tokens' logprobs (the first one null) before the completion's, as OpenAI's legacy API
does. Those come back with token 1, so a streamed echo then waits for the choice's first token
instead of going out at once. ``max_tokens: 0`` with ``echo`` scores the prompt without
generating: workers still sample one token, which is dropped here (text, logprobs and usage).
vLLM's ``prompt_logprobs`` is returned per choice on the whole response.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from router.errors import RouterError
from router.http.handlers import check_model, sampling_params
from router.http.prompt_logprobs import (
    echo_logprobs,
    end_offset,
    join_logprobs,
    vllm_prompt_logprobs,
)
from router.http.responses import Logprobs, completion_chunk_choice, sse, usage
from router.http.streams import CLIENT_CLOSED, collect_or_disconnect, event_stream, merge
from router.openai_protocol import CompletionRequest
from router.serving import ChoiceDelta, RequestStream, Router


async def _prepare(router: Router, prompt: str | list[int], echo: bool) -> tuple[list[int], str]:
    """(token ids, text to echo) of one completions prompt."""
    if isinstance(prompt, str):
        return (
            await router.prompts.text(prompt, param="prompt", max_model_len=router.max_model_len),
            prompt,
        )
    router.check_token_ids(prompt, "prompt")  # before decoding them for echo
    return prompt, (await router.prompts.decode(prompt) if echo else "")


async def text_completion(
    router: Router, logprobs: Logprobs, body: CompletionRequest, request: Request
) -> Response:
    """Answer one completions request (JSON, or SSE when ``body.stream``). Raises RouterError
    subclasses (BadRequest naming the field, ...) before anything is sent."""
    check_model(router, body.model)
    sampling = sampling_params(body.to_sampling_params)
    prompts = body.prompts()
    router.check_num_sequences(len(prompts), sampling.n)
    if sampling.structured is not None:
        await router.prompts.check_structured(sampling.structured, sampling.allowed_token_ids)
    rid = f"cmpl-{uuid.uuid4().hex}"
    encoded = [await _prepare(router, p, body.echo) for p in prompts]
    streams: list[RequestStream] = []
    try:
        for k, (ids, _) in enumerate(encoded):
            sub = rid if len(encoded) == 1 else f"{rid}-p{k}"
            streams.append(router.submit(sub, ids, sampling))
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
        "model": router.model_name,
    }
    top = sampling.top_logprobs
    echo = [text if body.echo else "" for _, text in encoded for _ in range(n)]
    only = body.echo_only  # max_tokens 0: the one token workers sample is dropped
    # with logprobs, the echo waits for the prompt logprobs (they come with token 1)
    late_echo = body.echo and sampling.logprobs

    def prompt_part(k: int) -> dict[str, list[Any]]:
        ids = encoded[k][0]
        return echo_logprobs(ids, streams[k].prompt_logprobs or (), top, logprobs.token_text)

    def usage_body() -> dict[str, Any]:
        u = usage(streams)
        if only:
            u["total_tokens"] -= u["completion_tokens"]
            u["completion_tokens"] = 0
        return u

    if body.stream:
        extra = {"usage": None} if body.include_usage else {}
        lp_at = [0] * len(echo)  # text_offset of each choice's next token
        echoed = [not e for e in echo]

        def chunk(index: int, text: str, d: ChoiceDelta | None, k: int = 0) -> str:
            if d is not None and only:  # nothing generated: only the finish goes out
                text, d = "", dataclasses.replace(d, text="", tokens=())
            lp = None
            if d is not None and d.tokens and sampling.logprobs:
                lp = logprobs.completion(d.tokens, top, lp_at[index])
                lp_at[index] = end_offset(lp, lp_at[index])
            elif d is None and late_echo:
                lp = prompt_part(k)
                lp_at[index] = end_offset(lp, 0)
            choice = completion_chunk_choice(index, text, d, lp)
            return sse({**head, "choices": [choice], **extra})

        async def events() -> AsyncIterator[str]:
            if not late_echo:
                for i, e in enumerate(echo):
                    if e:
                        echoed[i] = True
                        yield chunk(i, e, None)
            async for k, d in merge(streams):
                i = offsets[k] + d.index
                if not echoed[i]:
                    echoed[i] = True
                    yield chunk(i, echo[i], None, k)
                if not only or d.finish_reason is not None:
                    yield chunk(i, d.text, d)
            if body.include_usage:
                yield sse({**head, "choices": [], "usage": usage_body()})

        return event_stream(events(), streams)

    choices = await collect_or_disconnect(request, streams, offsets)
    if choices is None:
        return Response(status_code=CLIENT_CLOSED)
    data: list[dict[str, Any]] = []
    for i, c in enumerate(choices):
        k = i // n
        if only:
            c.text, c.tokens = "", []
        lp = None
        if sampling.logprobs:
            head_lp = prompt_part(k) if body.echo else None
            start = end_offset(head_lp, 0) if head_lp is not None else 0
            tail = logprobs.completion(c.tokens, top, start)
            lp = tail if head_lp is None else join_logprobs(head_lp, tail)
        item = {
            "index": i,
            "text": echo[i] + c.text,
            "logprobs": lp,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        if sampling.prompt_logprobs is not None and body.prompt_logprobs is not None:
            item["prompt_logprobs"] = vllm_prompt_logprobs(
                encoded[k][0], streams[k].prompt_logprobs or (), logprobs.token_text
            )
        data.append(item)
    return JSONResponse({**head, "choices": data, "usage": usage_body()})
