"""Prompt and output logging, off unless ``--log-prompts`` is given.

Prompts and outputs are user data: no other log line of the router or the workers carries their
text or token ids (tests/router/test_prompt_log.py checks that with a marker string). With
``--log-prompts`` each request logs, at INFO on the ``router.prompt_log`` logger, one line with its
prompt when admitted and one per sequence with its output when it finishes, like vLLM's request
logger. Texts are cut to ``max_chars`` characters so one request cannot flood the log.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from pdserve.tokenizer import Tokenizer
from pdserve.types import SampledToken

log = logging.getLogger(__name__)

MAX_LOGGED_CHARS = 2048  # characters of a prompt or output per log line


class PromptLog:
    """Logs prompts/outputs only when ``enabled``; costs nothing (no detokenizing) otherwise."""

    def __init__(
        self, tokenizer: Tokenizer, enabled: bool = False, max_chars: int = MAX_LOGGED_CHARS
    ) -> None:
        self.tokenizer = tokenizer
        self.enabled = enabled
        self.max_chars = max_chars

    def _text(self, token_ids: Sequence[int]) -> str:
        text = self.tokenizer.decode(list(token_ids), skip_special_tokens=False)
        if len(text) > self.max_chars:
            return f"{text[: self.max_chars]}... ({len(text)} characters)"
        return text

    def prompt(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Log the prompt of an admitted request (``token_ids``: its prompt tokens)."""
        if self.enabled:
            log.info(
                "%s: prompt (%d tokens): %r", request_id, len(token_ids), self._text(token_ids)
            )

    def output(self, request_id: str, tokens: Sequence[SampledToken], finish_reason: str) -> None:
        """Log one finished sequence's output (``tokens``: every output token)."""
        if self.enabled:
            ids = [t.token_id for t in tokens]
            log.info(
                "%s: output (%d tokens, finish_reason %s): %r",
                request_id, len(ids), finish_reason, self._text(ids),
            )  # fmt: skip
