"""Admission limits and max_tokens resolution (pure)."""

from __future__ import annotations

import pytest

from router.admission import AdmissionController, resolve_max_tokens
from router.errors import BadRequest, ContextLengthExceeded, Overloaded


def test_resolve_max_tokens() -> None:
    assert resolve_max_tokens(10, None, 100) == 90
    assert resolve_max_tokens(10, 90, 100) == 90
    with pytest.raises(ContextLengthExceeded) as e:
        resolve_max_tokens(10, 91, 100)
    assert "10 tokens" in e.value.message and "91" in e.value.message
    assert "100" in e.value.message and e.value.param == "max_tokens"
    with pytest.raises(ContextLengthExceeded, match="leaving no room"):
        resolve_max_tokens(100, None, 100)
    with pytest.raises(BadRequest, match="empty"):
        resolve_max_tokens(0, 5, 100)


def test_request_limit_then_release() -> None:
    ac = AdmissionController(max_queued_requests=2, max_queued_tokens=10_000)
    t1, t2 = ac.admit(10), ac.admit(20)
    with pytest.raises(Overloaded) as e:
        ac.admit(5)
    assert e.value.status == 429 and e.value.retry_after_s == 1
    assert "--max-queued-requests 2" in e.value.message
    assert ac.num_rejected == 1
    t1.release()
    t1.release()  # idempotent
    assert (ac.num_queued, ac.queued_tokens) == (1, 20)
    ac.admit(5)
    t2.release()


def test_token_limit_but_an_empty_queue_always_admits() -> None:
    ac = AdmissionController(max_queued_requests=100, max_queued_tokens=100)
    full = ac.admit(100)  # alone it may fill the whole token budget
    with pytest.raises(Overloaded, match="--max-queued-tokens 100"):
        ac.admit(1)
    full.release()
    ac.admit(60)
    with pytest.raises(Overloaded):
        ac.admit(41)
    ac.admit(40)


def test_a_request_larger_than_the_token_limit_is_400_not_429() -> None:
    """QA W3: it could never be admitted while others queue, so 429 would repeat forever."""
    ac = AdmissionController(max_queued_requests=100, max_queued_tokens=100)
    for busy in (False, True):
        with pytest.raises(BadRequest, match="--max-queued-tokens 100") as info:
            ac.admit(101, prompt_param="messages")
        assert info.value.param == "messages" and "101 prompt tokens" in info.value.message
        if not busy:
            ac.admit(10)
    assert ac.num_queued == 1 and ac.queued_tokens == 10


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="max_queued_requests"):
        AdmissionController(0, 10)
    with pytest.raises(ValueError, match="max_queued_tokens"):
        AdmissionController(10, 0)
