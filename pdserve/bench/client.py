"""One streamed request to an OpenAI-compatible server, timed chunk by chunk.

The request always asks for ``stream: true`` with ``stream_options.include_usage`` so the server's
token counts (``usage.completion_tokens`` / ``prompt_tokens``) come back in a last chunk. Timing
follows ``vllm bench serve`` (definitions in :mod:`pdserve.bench.metrics`): the clock starts just
before the HTTP request is sent, and every network read is stamped once when it arrives, so several
SSE events delivered in one read share one timestamp.

A request fails when the HTTP status is not 200, the connection or stream breaks, the stream holds
an ``error`` object, or it ends without a single chunk carrying ``choices``.
"""

from __future__ import annotations

import codecs
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pdserve.bench.metrics import RequestOutput

CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"
ENDPOINTS = (CHAT_ENDPOINT, COMPLETIONS_ENDPOINT)


class SSEDecoder:
    """Incremental Server-Sent Events decoder (WHATWG HTML "server-sent events" parsing).

    Feed raw bytes as they arrive; get back the ``data`` payload of every event completed so far.
    Handles ``\\n``, ``\\r\\n`` and ``\\r`` line ends, comment lines (``:``), multi-line data
    (joined with ``\\n``) and UTF-8 characters split across reads. Other fields (event, id, retry)
    are ignored, as an OpenAI stream does not use them.
    """

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")()
        self._pending = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        """Decode ``chunk``; return the data strings of the events it completed, in order."""
        self._pending += self._utf8.decode(chunk)
        events: list[str] = []
        while True:
            cut = _line_end(self._pending)
            if cut is None:
                break
            line, self._pending = self._pending[: cut[0]], self._pending[cut[1] :]
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
                continue
            if line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            if name == "data":
                self._data.append(value[1:] if value.startswith(" ") else value)
        return events

    def close(self) -> list[str]:
        """End of stream: return an event left without its closing blank line, if any."""
        tail = self.feed(b"\n\n") if (self._pending or self._data) else []
        return tail


def _line_end(buf: str) -> tuple[int, int] | None:
    """(start, end) of the first line terminator in ``buf``, or None if no complete line."""
    nl, cr = buf.find("\n"), buf.find("\r")
    if cr < 0 or 0 <= nl < cr:
        return None if nl < 0 else (nl, nl + 1)
    if cr + 1 == len(buf):
        return None  # maybe the first half of \r\n: wait for more
    return (cr, cr + 2) if buf[cr + 1] == "\n" else (cr, cr + 1)


@dataclass(frozen=True)
class RequestSpec:
    """One benchmark request. ``messages`` (chat) takes precedence over ``prompt`` on chat."""

    prompt: str
    prompt_len: int  # tokens, as counted by the bench tokenizer
    output_len: int  # max_tokens
    messages: list[dict[str, str]] | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)


def build_payload(
    endpoint: str, model: str, spec: RequestSpec, ignore_eos: bool = False
) -> dict[str, Any]:
    """JSON body for ``endpoint`` ('/v1/chat/completions' or '/v1/completions').

    Raises ValueError for any other endpoint.
    """
    body: dict[str, Any] = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": spec.output_len,
    }
    if endpoint.endswith("chat/completions"):
        body["messages"] = spec.messages or [{"role": "user", "content": spec.prompt}]
        # Newer name of the same limit; servers that know both take either.
        body["max_completion_tokens"] = spec.output_len
    elif endpoint.endswith("completions"):
        body["prompt"] = spec.prompt
    else:
        raise ValueError(f"--endpoint {endpoint!r} must end in /chat/completions or /completions")
    if ignore_eos:
        body["ignore_eos"] = True
    body.update(spec.extra_body)
    return body


def _chunk_text(choice: dict[str, Any]) -> str:
    """Text of one streamed choice: ``delta.content`` (chat) or ``text`` (completions)."""
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return str(delta.get("content") or "")
    return str(choice.get("text") or "")


async def send_request(
    session: aiohttp.ClientSession,
    url: str,
    payload: dict[str, Any],
    prompt_len: int,
    headers: dict[str, str] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> RequestOutput:
    """POST ``payload`` to ``url`` and time the SSE stream. Never raises for server errors.

    Returns a RequestOutput with ``success`` False and ``error`` set when the request failed;
    ``output_tokens`` is ``usage.completion_tokens`` when the server reported usage, else 0 (the
    caller fills it from a local count).
    """
    out = RequestOutput(prompt_len=prompt_len)
    decoder = SSEDecoder()
    text_parts: list[str] = []
    st = clock()
    out.start_time = st
    try:
        async with session.post(url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                body = (await resp.text())[:300]
                out.error = f"HTTP {resp.status} {resp.reason or ''}: {body}".strip()
                return out
            done = False
            async for raw in resp.content.iter_any():
                now = clock()
                for event in decoder.feed(raw):
                    done = _handle_event(event, now, st, out, text_parts) or done
                if out.error or done:
                    break
            else:
                for event in decoder.close():
                    _handle_event(event, clock(), st, out, text_parts)
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, ValueError) as e:
        out.error = f"{type(e).__name__}: {e}"
        out.generated_text = "".join(text_parts)
        return out
    out.generated_text = "".join(text_parts)
    if out.error:
        return out
    if out.num_chunks == 0:
        out.error = "stream ended without any chunk carrying choices"
        return out
    out.success = True
    return out


def _handle_event(
    event: str, now: float, st: float, out: RequestOutput, text_parts: list[str]
) -> bool:
    """Apply one SSE data payload to ``out``; True for the ``[DONE]`` sentinel.

    Raises json.JSONDecodeError for a payload that is not JSON.
    """
    if event.strip() == "[DONE]":
        return True
    data = json.loads(event)
    if not isinstance(data, dict):
        raise ValueError(f"stream event is not a JSON object: {event[:100]!r}")
    if data.get("error"):
        err = data["error"]
        msg = err.get("message", err) if isinstance(err, dict) else err
        out.error = f"error event in stream: {msg}"
        return False
    choices = data.get("choices")
    if choices:
        if out.num_chunks == 0:
            out.ttft = now - st
        else:
            out.itl.append((now - st) - out.latency)
        out.latency = now - st
        out.num_chunks += 1
        text_parts.append(_chunk_text(choices[0]))
    usage = data.get("usage")
    if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
        out.output_tokens = int(usage["completion_tokens"])
        out.usage_reported = True
        if usage.get("prompt_tokens") is not None:
            out.prompt_len = int(usage["prompt_tokens"])
    return False
