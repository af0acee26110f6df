"""Prefill engine prompt logprobs: gathered over chunks, and a cached prefix is skipped (the
request computes every prompt token) so a repeated prompt gets the same logprobs."""

from __future__ import annotations

import pytest
from prefill_tiny import TINY, prompt, tiny_config

from pdserve.sampling_params import SamplingParams
from prefill_worker.engine import PrefillEngine
from prefill_worker.request import PrefillRequest

pytestmark = pytest.mark.timeout(120)


def test_prompt_logprobs_over_chunks_and_past_the_prefix_cache() -> None:
    eng = PrefillEngine.build(tiny_config(max_num_batched_tokens=32), model_config=TINY)
    p = tuple(prompt(100, seed=1))
    plain = SamplingParams(temperature=0)
    asks = SamplingParams(temperature=0, prompt_logprobs=2)
    warm = eng.add_request(PrefillRequest("warm", p, plain))
    eng.run_until_idle()
    assert warm.result(0).cached_tokens == 0 and warm.result(0).prompt_logprobs == ()

    again = eng.add_request(PrefillRequest("again", p, plain))
    scored = eng.add_request(PrefillRequest("scored", p, asks))
    eng.run_until_idle()
    assert again.result(0).cached_tokens > 0  # the cache serves requests that do not ask
    r = scored.result(0)
    assert r.cached_tokens == 0  # ... and is skipped by one that does
    assert [t.token_id for t in r.prompt_logprobs] == list(p[1:])
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in r.prompt_logprobs)
    assert r.token == warm.result(0).token
    second = eng.add_request(PrefillRequest("second", p, asks))
    eng.run_until_idle()
    # the same values whatever the batch and chunking (up to float rounding: the flash SDPA
    # kernel's accumulation order follows the chunk it is given)
    again_lps = second.result(0).prompt_logprobs
    assert [(t.token_id, [i for i, _ in t.top_logprobs]) for t in again_lps] == [
        (t.token_id, [i for i, _ in t.top_logprobs]) for t in r.prompt_logprobs
    ]
    flat = [v for t in again_lps for v in (t.logprob, *(lp for _, lp in t.top_logprobs))]
    ref = [v for t in r.prompt_logprobs for v in (t.logprob, *(lp for _, lp in t.top_logprobs))]
    assert flat == pytest.approx(ref, abs=1e-5)
    eng.check_integrity()
    eng.shutdown()
