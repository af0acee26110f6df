"""Streaming detokenization: text for each new token id, computed from a short window of ids.

Decoding token by token is wrong in two ways: a multi-byte UTF-8 character (emoji, CJK) split
across tokens decodes to U+FFFD halves, and SentencePiece-style decoders strip or add the leading
space of a piece depending on what precedes it. The standard remedy (the "offset" technique used by
text-generation-inference and vLLM) decodes a window ``ids[start:]`` that begins a few tokens
*before* the new ones and emits only the characters beyond those already sent.

State, with ``full = decode(ids[start:])``:

- ``start``: first id of the window; the ids before it are forgotten.
- ``sent``: how many characters of ``full`` were emitted (or were prompt context). Invariant: the
  first ``sent`` characters of ``full`` do not change when ids are appended, because the window
  only ever ends in complete characters when it is rebased and everything before a trailing
  incomplete UTF-8 sequence is final.
- A trailing run of U+FFFD in ``full`` is held back: it is (the start of) a character whose
  remaining bytes are still to come. After ``MAX_PENDING_TOKENS`` tokens without the window ever
  ending cleanly the bytes cannot be a split character any more and are emitted as they are.
- When the window ends cleanly and has grown past ``CONTEXT_TOKENS + REBASE_EVERY`` ids, it is
  rebased to its last ``CONTEXT_TOKENS`` ids, so each step decodes a bounded number of ids: O(1)
  per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
CONTEXT_TOKENS = 4  # ids kept before new ones so leading spaces decode as in context
REBASE_EVERY = 8  # rebase the window after this many ids beyond the context
MAX_PENDING_TOKENS = 16  # a split UTF-8 char needs at most 4 bytes, i.e. 3 more tokens


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns a stream of output token ids into a stream of text pieces.

    ``prompt_ids``: the prompt; its last ``CONTEXT_TOKENS`` ids give the first output token the
    context it decodes in (so a SentencePiece "▁Paris" after a prompt yields " Paris", as in the
    full text). With no prompt ids the joined pieces + ``flush()`` equal exactly
    ``tokenizer.decode(output_ids, skip_special_tokens)``; with prompt ids they equal
    ``decode(prompt + output)[len(decode(prompt)):]`` (identical for byte-level BPE tokenizers).
    No piece ends in a U+FFFD produced by a character split across tokens.
    """

    def __init__(
        self,
        tokenizer: _Decoder,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_ids[-CONTEXT_TOKENS:]) if CONTEXT_TOKENS else []
        text = self._decode(context) if context else ""
        if text.endswith(REPLACEMENT_CHAR):  # the prompt ends inside a character: no context
            context, text = [], ""
        self._ids: list[int] = context
        self._start = 0
        self._sent = len(text)
        self._pending = 0  # tokens added since the window last ended in a complete character
        self.num_tokens = 0  # output ids added so far

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Append one output id; return the text that became final (possibly "")."""
        self._ids.append(token_id)
        self.num_tokens += 1
        full = self._decode(self._ids[self._start :])
        end = len(full)
        while end > self._sent and full[end - 1] == REPLACEMENT_CHAR:
            end -= 1
        piece = full[self._sent : end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        if not full.endswith(REPLACEMENT_CHAR):
            self._pending = 0
            if len(self._ids) - self._start > CONTEXT_TOKENS + REBASE_EVERY:
                self._rebase(len(self._ids) - CONTEXT_TOKENS)
        else:
            self._pending += 1
            if self._pending > MAX_PENDING_TOKENS:  # not a split character: invalid bytes
                piece += full[self._sent :]
                self._pending = 0
                self._rebase(len(self._ids))
        return piece

    def _rebase(self, start: int) -> None:
        """Make ``ids[start:]`` the window; everything in it counts as sent."""
        del self._ids[:start]
        self._start = 0
        self._sent = len(self._decode(self._ids)) if self._ids else 0

    def flush(self) -> str:
        """Text still held back (an incomplete character at the very end); ends the stream."""
        full = self._decode(self._ids[self._start :]) if self._ids else ""
        piece = full[self._sent :]
        self._sent = len(full)
        self._pending = 0
        return piece
