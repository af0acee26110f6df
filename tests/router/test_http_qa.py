"""Regressions from QA of the HTTP gateway: validation edges, leaks and stream shapes.

Each test names the QA finding it pins (C1, L1, ... in the router QA issue).
"""

from __future__ import annotations

import pytest
from fake_workers import VOCAB
from test_http_gateway import MSGS, assert_openai_error, env, sse_events

from pdserve import metrics
from pdserve.tokenizer import Tokenizer
from router.lifecycle import drain_background

pytestmark = pytest.mark.timeout(60)


def _gauges() -> tuple[float, float]:
    return metrics.REQUESTS_RUNNING._value.get(), metrics.REQUESTS_WAITING._value.get()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_k", 2**40),
        ("min_tokens", 2**40),
        ("max_tokens", 2**40),
        ("stop_token_ids", [2147483648]),
        ("stop_token_ids", [VOCAB]),  # W1: in int32 but outside the vocabulary
        ("seed", 2**63),
        ("seed", -1),
    ],
)
async def test_out_of_range_integers_are_400(
    tokenizer: Tokenizer, field: str, value: object, stream: bool
) -> None:
    """C1/W1: integers beyond int32 / the vocabulary are a 400 naming the field, not a 500."""
    async with env(tokenizer) as e:
        before = _gauges()
        body = {"messages": MSGS, field: value, "stream": stream}
        r = await e.client.post("/v1/chat/completions", json=body)
        err = assert_openai_error(r, 400, field)
        assert str(2**31 - 1) in err["message"] or "2^63" in err["message"] or str(VOCAB) in (
            err["message"]
        )
        assert e.router.admission.num_queued == 0 and _gauges() == before
        r = await e.client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 4})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("field", "literal"),
    [
        ("temperature", "NaN"),
        ("temperature", "Infinity"),
        ("top_p", "NaN"),
        ("presence_penalty", "-Infinity"),
        ("frequency_penalty", "NaN"),
        ("repetition_penalty", "Infinity"),
        ("min_p", "NaN"),
    ],
)
async def test_non_finite_floats_are_400(tokenizer: Tokenizer, field: str, literal: str) -> None:
    """W4: bare NaN/Infinity literals parse as JSON; they must be refused naming the field."""
    async with env(tokenizer) as e:
        raw = f'{{"messages": [{{"role": "user", "content": "hi"}}], "{field}": {literal}}}'
        r = await e.client.post(
            "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
        )
        err = assert_openai_error(r, 400, field)
        assert "finite" in err["message"]


async def test_temperature_and_min_tokens_ranges(tokenizer: Tokenizer) -> None:
    """W4: temperature follows OpenAI's [0, 2]; min_tokens may not exceed max_tokens."""
    async with env(tokenizer) as e:
        r = await e.client.post("/v1/chat/completions", json={"messages": MSGS, "temperature": 2.5})
        assert "[0, 2]" in assert_openai_error(r, 400, "temperature")["message"]
        r = await e.client.post(
            "/v1/chat/completions", json={"messages": MSGS, "temperature": 2, "max_tokens": 2}
        )
        assert r.status_code == 200, r.text
        r = await e.client.post(
            "/v1/completions", json={"prompt": "hi", "min_tokens": 5, "max_tokens": 4}
        )
        assert "max_tokens (4)" in assert_openai_error(r, 400, "min_tokens")["message"]
        # max_tokens unset = the rest of the context (512 here): min_tokens beyond it is a 400 too
        r = await e.client.post("/v1/completions", json={"prompt": "hi", "min_tokens": 600})
        assert_openai_error(r, 400, "min_tokens")


@pytest.mark.parametrize("stream", [False, True])
async def test_failure_to_start_releases_ticket_and_gauges(
    tokenizer: Tokenizer, stream: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L1: a request that fails while starting its sequences gives its queue place back."""
    async with env(tokenizer, max_queued_requests=1) as e:
        before = _gauges()

        def broken(*_args: object) -> None:
            raise RuntimeError("injected: lifecycle cannot start")

        with monkeypatch.context() as m:
            m.setattr(e.router, "_lifecycle", broken)
            for _ in range(3):
                r = await e.client.post(
                    "/v1/chat/completions", json={"messages": MSGS, "stream": stream}
                )
                if stream:
                    assert any("error" in ev for ev in sse_events(r.text) if isinstance(ev, dict))
                else:
                    assert_openai_error(r, 500)
        await drain_background()
        assert e.router.admission.num_queued == 0 and e.router.admission.queued_tokens == 0
        assert _gauges() == before
        r = await e.client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 4})
        assert r.status_code == 200, r.text
