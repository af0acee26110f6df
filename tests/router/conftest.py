"""Shared fixtures for router tests: the bundled SmolLM2 tokenizer (loaded once per session)."""

from __future__ import annotations

import pytest

from pdserve.tokenizer import Tokenizer, load_tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return load_tokenizer("smollm2")
