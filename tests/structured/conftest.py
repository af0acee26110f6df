"""A grammar compiler over the bundled SmolLM2 tokenizer (loaded once per session)."""

from __future__ import annotations

import pytest

from pdserve.structured.grammar import GrammarCompiler
from pdserve.tokenizer import Tokenizer, load_tokenizer


@pytest.fixture(scope="session")
def smol_tokenizer() -> Tokenizer:
    return load_tokenizer("smollm2")


@pytest.fixture(scope="session")
def compiler(smol_tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(smol_tokenizer.hf, 49152, smol_tokenizer.eos_token_ids, cache_size=4)
