"""Tokenizers the benchmark datasets use to build prompts of exact token lengths.

``--tokenizer builtin`` selects :class:`WordTokenizer`, which needs no model files: one token per
whitespace-separated pseudo-word, so a prompt of N tokens is N words. It is meant for fake servers
in tests and for servers whose tokenizer is not at hand (token counts are then only approximate on
the server side; the server's ``usage`` still gives the true counts). Any other value is loaded with
:func:`pdserve.tokenizer.load_tokenizer` ('smollm2', a Hugging Face directory or a .gguf file).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Protocol

BUILTIN = "builtin"


class BenchTokenizer(Protocol):
    """What the datasets need from a tokenizer (pdserve.tokenizer.Tokenizer satisfies it)."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


class WordTokenizer:
    """Deterministic pseudo-word tokenizer: ids 0..vocab_size-1 <-> words like 'kalo', 'mitu'.

    ``encode`` splits on whitespace; a word outside the vocabulary maps to a stable id by CRC-32,
    so every word is exactly one token and ``encode(decode(ids)) == ids``.
    """

    def __init__(self) -> None:
        syllables = [c + v for c in _CONSONANTS for v in _VOWELS]  # 70
        self._words = [a + b for a in syllables for b in syllables]  # 4900 two-syllable words
        self._ids = {w: i for i, w in enumerate(self._words)}

    @property
    def vocab_size(self) -> int:
        """Number of distinct words (4900)."""
        return len(self._words)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """One id per whitespace-separated word (no special tokens exist)."""
        return [self._ids.get(w, zlib.crc32(w.encode()) % len(self._words)) for w in text.split()]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Words joined by single spaces. Raises IndexError for an id outside the vocabulary."""
        return " ".join(self._words[i] for i in ids)


def load_bench_tokenizer(name: str) -> BenchTokenizer:
    """``'builtin'`` -> WordTokenizer; anything else -> pdserve.tokenizer.load_tokenizer(name).

    Raises whatever load_tokenizer raises (ConfigError for an unknown model).
    """
    if name == BUILTIN:
        return WordTokenizer()
    from pdserve.tokenizer import load_tokenizer  # imports transformers: only when needed

    return load_tokenizer(name)
