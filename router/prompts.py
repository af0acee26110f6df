"""Prompt preparation for both gateways: text and chat conversations to token ids, off the loop.

The HTTP and gRPC gateways both turn a request's prompt into token ids here (tokenize, chat
template, and, for echo, token ids back to text). The work runs on one dedicated thread: it takes
milliseconds per prompt but seconds for a multi-MB one, which must never stall the event loop
(health checks, other streams).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pdserve.tokenizer import Tokenizer, TokenizerError
from router.errors import BadRequest

_T = TypeVar("_T")


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


class PromptPreparer:
    """Tokenizes prompts for the gateways on one thread of its own.

    NOTE: one thread, so the (Rust) tokenizer is never used by two preparations at once.
    Errors are BadRequest naming the request field (``param``) the prompt came from.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    async def _run(self, fn: Callable[..., _T], *args: Any) -> _T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, functools.partial(fn, *args))

    async def text(self, text: str, param: str) -> list[int]:
        """Token ids of a plain-text prompt (no chat template)."""
        check_text(text, param)
        try:
            return await self._run(self.tokenizer.encode, text)
        except TokenizerError as e:
            raise BadRequest(str(e), param=param) from None

    async def chat(self, messages: Sequence[Mapping[str, str]], param: str) -> list[int]:
        """Token ids of a conversation (``{'role', 'content'}`` dicts, oldest first) with the
        model's chat template applied and the assistant turn opened."""
        for m in messages:
            check_text(m["content"], param)
        conversation = [dict(m) for m in messages]
        try:
            return await self._run(self.tokenizer.apply_chat_template, conversation)
        except TokenizerError as e:
            raise BadRequest(str(e), param=param) from None

    async def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` (for echo); the ids must already be checked against the vocab."""
        return await self._run(self.tokenizer.decode, list(token_ids))

    def close(self) -> None:
        """Stop the thread once queued work is done."""
        self._thread.shutdown(wait=False)
