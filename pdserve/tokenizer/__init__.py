"""Tokenizer, chat template, streaming detokenizer and stop-string matcher.

- ``hf``: ``load_tokenizer`` / ``Tokenizer`` (HF tokenizer, chat template, EOS ids; GGUF or HF dir)
- ``detokenizer``: ``IncrementalDetokenizer`` (token ids -> text pieces, no split-character U+FFFD)
- ``stop``: ``StopMatcher`` (stop strings inside or across pieces, holding back possible prefixes)
"""

from __future__ import annotations

from pdserve.tokenizer.detokenizer import IncrementalDetokenizer
from pdserve.tokenizer.hf import (
    DISK_CACHE_DIR,
    Tokenizer,
    TokenizerError,
    clear_tokenizer_cache,
    load_chat_template,
    load_tokenizer,
)
from pdserve.tokenizer.stop import StopMatcher

__all__ = [
    "DISK_CACHE_DIR",
    "IncrementalDetokenizer",
    "StopMatcher",
    "Tokenizer",
    "TokenizerError",
    "clear_tokenizer_cache",
    "load_chat_template",
    "load_tokenizer",
]
