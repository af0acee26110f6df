"""Legacy completion logprobs of echoed prompts: the chosen token is always in top_logprobs."""

from __future__ import annotations

from pdserve.types import SampledToken
from router.http.prompt_logprobs import echo_logprobs, legacy_top_logprobs


def text(i: int) -> str:
    return f"<{i}>"


def test_top_logprobs_hold_the_chosen_token_even_outside_the_top() -> None:
    t = SampledToken(token_id=7, logprob=-3.0, top_logprobs=((1, -0.1), (2, -0.9)))
    assert legacy_top_logprobs(t, 0, text) == {"<7>": -3.0}
    assert legacy_top_logprobs(t, 1, text) == {"<1>": -0.1, "<7>": -3.0}
    assert legacy_top_logprobs(t, 2, text) == {"<1>": -0.1, "<2>": -0.9, "<7>": -3.0}
    inside = SampledToken(token_id=2, logprob=-0.9, top_logprobs=((1, -0.1), (2, -0.9)))
    assert legacy_top_logprobs(inside, 2, text) == {"<1>": -0.1, "<2>": -0.9}


def test_echo_with_logprobs_0_lists_each_prompt_token() -> None:
    lps = [SampledToken(token_id=5, logprob=-1.5), SampledToken(token_id=6, logprob=-2.5)]
    out = echo_logprobs([4, 5, 6], lps, 0, text)
    assert out["tokens"] == ["<4>", "<5>", "<6>"]
    assert out["token_logprobs"] == [None, -1.5, -2.5]
    assert out["top_logprobs"] == [None, {"<5>": -1.5}, {"<6>": -2.5}]
    assert out["text_offset"] == [0, 3, 6]
