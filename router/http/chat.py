"""The ``/v1/chat/completions`` handler.

The conversation goes through the chat template with vLLM's controls (``add_generation_prompt``,
``continue_final_message``, ``chat_template_kwargs``, ``documents``) and the request's ``tools``,
prepared off the event loop by the router's shared :class:`~router.prompts.PromptPreparer`, which
also compiles a structured-output spec once so a bad one is a 400 before any worker sees it.
``tool_choice`` ``required`` or a named function becomes that spec (:mod:`router.chat_tools`);
the output is split into ``content`` and ``tool_calls``, whole or streamed.

A streamed choice's first chunk carries ``"role": "assistant"`` with its first token's text
(nothing is sent before the first token exists, so TTFT measured by clients is real); with
vLLM's chat ``echo`` and a final assistant message, that message's text leads the first chunk's
content (and the whole message's). ``prompt_logprobs`` (vLLM) is returned on the whole response.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from router.chat_tools import tool_setup
from router.http.handlers import check_model, sampling_params
from router.http.prompt_logprobs import vllm_prompt_logprobs
from router.http.responses import Logprobs, chat_chunk_choice, chat_message, sse, usage
from router.http.streams import CLIENT_CLOSED, collect_or_disconnect, event_stream
from router.openai_protocol import ChatCompletionRequest
from router.serving import ChoiceDelta, Router


async def chat_completion(
    router: Router, logprobs: Logprobs, body: ChatCompletionRequest, request: Request
) -> Response:
    """Answer one chat completion request (JSON, or SSE when ``body.stream``). Raises
    RouterError subclasses (BadRequest naming the field, ...) before anything is sent."""
    check_model(router, body.model)
    tools = tool_setup(body.tools, body.tool_choice, body.parallel_tool_calls, router.tool_parser)
    if tools is not None:
        tools.check_visible(await router.prompts.renders_tools())
    sampling = sampling_params(
        functools.partial(body.to_sampling_params, tools.spec() if tools else None)
    )
    conversation = body.conversation()
    prompt = await router.prompts.chat(
        conversation,
        param="messages",
        max_model_len=router.max_model_len,
        add_generation_prompt=body.add_generation_prompt,
        tools=list(tools.tools) if tools else None,
        **body.template_controls(),
    )
    if sampling.structured is not None:
        await router.prompts.check_structured(sampling.structured, sampling.allowed_token_ids)
    # vLLM's chat echo: the reply starts with the last message when it is the assistant's
    last = conversation[-1]
    echo = (last["content"] or "") if body.echo and last["role"] == "assistant" else ""
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    stream = router.submit(rid, prompt, sampling, prompt_param="messages")
    head = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": stream.created,
        "model": router.model_name,
    }
    top = sampling.top_logprobs

    if body.stream:
        extra = {"usage": None} if body.include_usage else {}
        splitters = [tools.streamer() if tools else None for _ in range(sampling.n)]
        opened: set[int] = set()  # choices whose first chunk (with the role) went out

        def chunk(delta: ChoiceDelta) -> str | None:
            lp = None
            if delta.tokens and sampling.logprobs:
                lp = logprobs.chat(delta.tokens, top)
            first = delta.index not in opened
            opened.add(delta.index)
            choice = chat_chunk_choice(
                delta, delta.index, lp, first, splitters[delta.index], echo if first else ""
            )
            if not (first or choice["delta"] or lp or choice["finish_reason"]):
                return None  # nothing to say yet (a tool call being parsed): no empty chunk
            return sse({**head, "system_fingerprint": None, "choices": [choice], **extra})

        async def events() -> AsyncIterator[str]:
            async for d in stream:
                if (c := chunk(d)) is not None:
                    yield c
            if body.include_usage:
                yield sse({**head, "choices": [], "usage": usage([stream])})

        return event_stream(events(), [stream])

    choices = await collect_or_disconnect(request, [stream], [0])
    if choices is None:
        return Response(status_code=CLIENT_CLOSED)
    data = []
    for i, c in enumerate(choices):
        message, finish = chat_message(tools, echo + c.text, c.finish_reason)
        data.append(
            {
                "index": i,
                "message": message,
                "logprobs": logprobs.chat(c.tokens, top) if sampling.logprobs else None,
                "finish_reason": finish,
                "stop_reason": c.stop_reason,
            }
        )
    out = {
        **head,
        "object": "chat.completion",
        "system_fingerprint": None,
        "choices": data,
        "usage": usage([stream]),
    }
    if sampling.prompt_logprobs is not None:
        out["prompt_logprobs"] = vllm_prompt_logprobs(
            prompt, stream.prompt_logprobs or (), logprobs.token_text
        )
    return JSONResponse(out)
