"""OpenAI response bodies: chunks, whole responses, logprobs and usage, as plain dicts.

Shapes follow the OpenAI API reference. Chat logprobs are ``{"content": [{"token", "logprob",
"bytes", "top_logprobs"}]}``; completion logprobs are ``{"tokens", "token_logprobs",
"top_logprobs", "text_offset"}``. A chat choice with tools carries ``message.tool_calls`` (or,
streamed, ``delta.tool_calls`` as the call is generated) and ``finish_reason: "tool_calls"``
instead of ``"stop"``, as OpenAI's, except under a named ``tool_choice`` (``"stop"``, as OpenAI
answers; :meth:`router.chat_tools.ToolSetup.finish_reason`). Bodies are plain dicts (no pydantic round trip on the hot
path: one chunk per streamed token).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

from pdserve.tokenizer import Tokenizer
from pdserve.types import SampledToken
from router.chat_tools import ToolSetup, ToolStream
from router.http.prompt_logprobs import legacy_top_logprobs
from router.serving import ChoiceDelta, RequestStream


def dumps(obj: object) -> str:
    """Compact JSON, non-ASCII kept as is."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse(obj: object) -> str:
    """One Server-Sent Events ``data:`` event holding ``obj`` as JSON."""
    return f"data: {dumps(obj)}\n\n"


def usage(streams: Sequence[RequestStream]) -> dict[str, Any]:
    """The ``usage`` object of a request made of ``streams`` (one per prompt)."""
    prompt = sum(len(s.prompt_token_ids) for s in streams)
    completion = sum(s.completion_tokens for s in streams)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in streams)},
    }


class Logprobs:
    """Logprobs bodies; token texts are cached (special tokens shown, as OpenAI does)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one gateway per process
    def token_text(self, token_id: int) -> str:
        """Text of one token as OpenAI shows it in logprobs."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def chat(self, tokens: Sequence[SampledToken], top: int) -> dict[str, Any]:
        """Chat ``logprobs`` of ``tokens`` with ``top`` alternatives each."""

        def entry(tid: int, lp: float) -> dict[str, Any]:
            s = self.token_text(tid)
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

        content = []
        for t in tokens:
            item = entry(t.token_id, t.logprob)
            item["top_logprobs"] = [entry(i, lp) for i, lp in t.top_logprobs[:top]]
            content.append(item)
        return {"content": content, "refusal": None}

    def completion(self, tokens: Sequence[SampledToken], top: int, offset: int) -> dict[str, Any]:
        """Completion ``logprobs``; ``offset``: characters of the choice's text before them."""
        texts = [self.token_text(t.token_id) for t in tokens]
        offsets = []
        for s in texts:
            offsets.append(offset)
            offset += len(s)
        return {
            "tokens": texts,
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [legacy_top_logprobs(t, top, self.token_text) for t in tokens],
            "text_offset": offsets,
        }


def chat_chunk_choice(
    delta: ChoiceDelta,
    index: int,
    logprobs: dict[str, Any] | None,
    first: bool = False,
    tools: ToolStream | None = None,
    echo: str = "",
) -> dict[str, Any]:
    """One choice of a ``chat.completion.chunk``. ``first``: the choice's first chunk, which
    carries the assistant role with the first token's text (so no chunk precedes the first
    token and clients measure TTFT from real output, as with vLLM's server), after ``echo`` (the
    echoed final assistant message, vLLM's chat ``echo``). ``tools``: the choice's tool-call
    splitter when the request has tools."""
    body = _tool_delta(tools, delta)
    if first:
        body = {"role": "assistant", **body, "content": echo + body.get("content", "")}
    choice: dict[str, Any] = {"index": index, "delta": body, "logprobs": logprobs}
    choice["finish_reason"] = _finish_reason(tools, delta.finish_reason)
    if delta.finish_reason is not None:
        choice["stop_reason"] = delta.stop_reason
    return choice


def _tool_delta(splitter: ToolStream | None, delta: ChoiceDelta) -> dict[str, Any]:
    """A streamed chat ``delta``: content, and the tool-call entries the choice's ``splitter``
    gives (:class:`router.chat_tools.ToolStream`) when the request has tools."""
    if splitter is None:
        return {"content": delta.text} if delta.text else {}
    content, calls = splitter.feed(delta.text)
    if delta.finish_reason is not None:
        more, late = splitter.finish()
        content, calls = content + more, calls + late
    out: dict[str, Any] = {"content": content} if content else {}
    if calls:
        out["tool_calls"] = calls
    return out


def _finish_reason(splitter: ToolStream | None, reason: str | None) -> str | None:
    """The streamed choice's finish_reason (:meth:`ToolSetup.finish_reason`)."""
    if splitter is None or reason is None:
        return reason
    return splitter.setup.finish_reason(reason, splitter.num_calls > 0)


def chat_message(
    tools: ToolSetup | None, text: str, finish: str | None
) -> tuple[dict[str, Any], str | None]:
    """(the assistant ``message``, finish_reason) of a complete chat choice."""
    if tools is None:
        return {"role": "assistant", "content": text}, finish
    parsed = tools.split(text)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        message["tool_calls"] = [c.to_openai() for c in parsed.tool_calls]
    if finish is None:
        return message, finish
    return message, tools.finish_reason(finish, bool(parsed.tool_calls))


def completion_chunk_choice(
    index: int, text: str, delta: ChoiceDelta | None, logprobs: dict[str, Any] | None
) -> dict[str, Any]:
    """One choice of a streamed ``text_completion``; ``delta`` None for echoed prompt text."""
    choice: dict[str, Any] = {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": None if delta is None else delta.finish_reason,
    }
    if delta is not None and delta.finish_reason is not None:
        choice["stop_reason"] = delta.stop_reason
    return choice
