"""Per-request limits enforced by the router before any worker sees the request (QA D4, D5, D7):
each is an OpenAI-style 400 naming the field and the limit."""

from __future__ import annotations

import pytest
from test_http_gateway import assert_openai_error, env, post_with

from pdserve.structured.limits import MAX_CHOICES, MAX_REGEX_SIZE
from pdserve.tokenizer import Tokenizer
from router.errors import BadRequest

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize(
    ("field", "value", "limit", "param"),
    [
        ("guided_regex", "a{1000000}", MAX_REGEX_SIZE, "guided_regex"),
        ("guided_choice", ["a"] * 2500, MAX_CHOICES, "guided_choice"),
        ("guided_json", {"type": "string", "pattern": "a{99999}"}, MAX_REGEX_SIZE, "guided_json"),
        (
            "structured_outputs",
            {"regex": "(ab){99999}"},
            MAX_REGEX_SIZE,
            "structured_outputs.regex",
        ),
    ],
)
async def test_costly_structured_output_is_refused_at_the_router(
    tokenizer: Tokenizer, path: str, field: str, value: object, limit: int, param: str
) -> None:
    async with env(tokenizer) as e:
        r = await post_with(e, path, field, value)
        assert str(limit) in assert_openai_error(r, 400, param)["message"]
        assert not e.cluster.decodes[0].requests and not e.cluster.prefills[0].requests


async def test_a_spec_over_the_mask_budget_is_refused(tokenizer: Tokenizer) -> None:
    """The router times the spec's first token mask; over budget is a 400 naming the field."""
    async with env(tokenizer) as e:
        body = {"prompt": "hi", "guided_regex": "[0-9]+", "max_tokens": 4}
        r = await e.client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        e.router.prompts.max_mask_ms = 0.0
        r = await e.client.post("/v1/completions", json=body)
        assert "ms per token" in assert_openai_error(r, 400, "guided_regex")["message"]


@pytest.mark.parametrize("value", [1e39, 3.5e38, 1e5, 1e-50, 1e-40, 0.0, -1.0])
async def test_repetition_penalty_out_of_range_names_the_limit(
    tokenizer: Tokenizer, value: float
) -> None:
    """QA D7.1: 1e39 was 'got inf' from the worker after a prefill; 1e-50 acted as no penalty."""
    async with env(tokenizer) as e:
        body = {"prompt": "hi", "repetition_penalty": value, "max_tokens": 4}
        r = await e.client.post("/v1/completions", json=body)
        msg = assert_openai_error(r, 400, "repetition_penalty")["message"]
        assert "[0.0001, 10000]" in msg and "inf" not in msg
        assert not e.cluster.decodes[0].requests
        for ok in (1e-4, 1.3, 1e4):
            r = await e.client.post("/v1/completions", json={**body, "repetition_penalty": ok})
            assert r.status_code == 200, r.text


# -- prompts too long to fit, refused before tokenizing (QA D5) --------------------------------


async def test_the_length_precheck_never_refuses_a_prompt_that_fits(tokenizer: Tokenizer) -> None:
    from router.prompts import PromptPreparer

    prompts = PromptPreparer(tokenizer)
    try:
        max_len = 64
        bound = prompts.max_prompt_bytes(max_len)
        hf = tokenizer.hf
        longest = max(range(len(hf)), key=lambda i: len(hf.decode([i]).encode()))
        texts = (
            [hf.decode([longest]) * n for n in (max_len - 2, max_len, max_len + 1)]
            + ["hello " * n for n in (10, bound // 6, bound // 6 + 1, bound)]
            + ["é" * bound]
        )
        for text in texts:
            try:
                await prompts.text(text, param="prompt", max_model_len=max_len)
            except BadRequest as e:  # refused before tokenizing: it truly did not fit
                assert e.code == "context_length_exceeded" and e.param == "prompt"
                assert len(tokenizer.encode(text)) > max_len
    finally:
        prompts.close()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/tokenize"])
async def test_a_huge_prompt_is_refused_without_tokenizing_it(
    tokenizer: Tokenizer, path: str
) -> None:
    from test_prompts import RecordingTokenizer

    from router.prompts import PromptPreparer

    async with env(tokenizer, max_model_len=512) as e:
        rec = RecordingTokenizer(tokenizer)
        e.router.prompts = PromptPreparer(rec)  # type: ignore[arg-type]
        huge = "hello " * 2_000_000  # 12 MB: ~9.5 s to tokenize
        field = "messages" if "chat" in path else "prompt"
        prompt = {"messages": [{"role": "user", "content": huge}]} if "chat" in path else {}
        r = await e.client.post(path, json={"prompt": huge, **prompt, "max_tokens": 4})
        err = assert_openai_error(r, 400, field)
        assert err["code"] == "context_length_exceeded" and "512 tokens" in err["message"]
        assert "encode" not in str(rec.threads) and not rec.threads  # never tokenized
        assert not e.cluster.decodes[0].requests
