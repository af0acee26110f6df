"""Fixtures of the prefill worker tests."""

from __future__ import annotations

import pytest
from prefill_tiny import OneShot


@pytest.fixture(scope="session")
def one_shot() -> OneShot:
    """One reference runner for the whole session (same dummy weights as the engines)."""
    return OneShot()
