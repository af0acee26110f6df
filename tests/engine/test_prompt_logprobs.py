"""ModelRunner prompt logprobs: chunk by chunk, sliced, equal to a one-shot full-logits forward."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import runner as runner_mod
from pdserve.engine.batch import ScheduledSeq
from pdserve.sampling_params import SamplingParams
from tests.engine.test_runner import BS, _runner
from tests.model.tiny_models import PagedForward

pytestmark = pytest.mark.timeout(120)


def test_chunked_prompt_logprobs_equal_full_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner_mod, "PROMPT_LOGPROB_ROWS", 3)  # several slices per chunk
    prompt = torch.randint(3, 128, (19,), generator=torch.Generator().manual_seed(0)).tolist()
    other = [5, 6, 7, 8, 9]
    r = _runner()
    ref_logits = PagedForward(r.model, num_blocks=8, block_size=BS)([prompt], [0], [range(5)])[0]
    ref = torch.log_softmax(ref_logits, dim=-1)  # [19, vocab]

    p = SamplingParams(temperature=0.0, prompt_logprobs=2)
    table = list(range(10, 15))
    got = []
    for a, b in ((0, 7), (7, 15), (15, 19)):
        batch = [
            ScheduledSeq("a", prompt[a:b], a, table, b == 19, p, prompt_token_ids=prompt),
            ScheduledSeq("b", other, 0, [20, 21], True, SamplingParams(temperature=0.0), other),
        ]
        out = r.run(batch)
        assert "b" not in out.prompt_logprobs  # only requests that ask
        chunk = out.prompt_logprobs["a"]
        assert chunk.start == a + 1  # prompt token 0 has no logprob
        got.extend(chunk.tokens)
    assert [t.token_id for t in got] == prompt[1:]
    for j, t in enumerate(got):  # token j+1 given tokens 0..j
        assert t.logprob == pytest.approx(ref[j, prompt[j + 1]].item(), abs=1e-4)
        assert t.rank == int((ref_logits[j] >= ref_logits[j, prompt[j + 1]]).sum())  # 1-based
        vals, ids = ref[j].topk(2)
        assert [i for i, _ in t.top_logprobs] == ids.tolist()
        assert [v for _, v in t.top_logprobs] == pytest.approx(vals.tolist(), abs=1e-4)
    # the final chunk still sampled token 1 as usual
    assert out.tokens[0] is not None and out.tokens[0].token_id == int(ref_logits[-1].argmax())


def test_rows_past_the_prompt_predict_nothing() -> None:
    # a re-prefill: prompt of 4 tokens then 3 generated ones; only prompt tokens 1..3 are scored
    r = _runner()
    tokens = [10, 11, 12, 13, 20, 21, 22]
    p = SamplingParams(temperature=0.0, prompt_logprobs=0)
    s = ScheduledSeq("a", tokens, 0, [0, 1], True, p, prompt_token_ids=tokens[:4])
    lp = r.run([s]).prompt_logprobs["a"]
    assert lp.start == 1 and [t.token_id for t in lp.tokens] == [11, 12, 13]
    assert all(t.top_logprobs == () for t in lp.tokens)
    tail = ScheduledSeq("b", tokens[4:], 4, [0, 1], True, p, prompt_token_ids=tokens[:4])
    assert "b" not in r.run([tail]).prompt_logprobs
