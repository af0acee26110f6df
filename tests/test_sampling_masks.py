"""Sampler: logit_bias and allowed_token_ids (validation, effect, and reported logprobs)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.batch import ScheduledSeq
from pdserve.sampling import Sampler
from pdserve.sampling_params import SamplingError, SamplingParams


def seq(**params: object) -> ScheduledSeq:
    return ScheduledSeq("r", [0], 0, [0], True, SamplingParams(**params))  # type: ignore[arg-type]


def test_logit_bias_forces_and_bans() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    greedy = logits.argmax(dim=-1).tolist()
    s = Sampler(50)
    out = s(
        logits,
        [
            seq(temperature=0.0, logit_bias=((7, 100.0),)),
            seq(temperature=0.0, logit_bias=((greedy[1], -100.0),)),
            seq(temperature=0.0),
        ],
    )
    assert out[0].token_id == 7
    assert out[1].token_id != greedy[1]
    assert out[1].token_id == logits[1].topk(2).indices[1].item()
    assert out[2].token_id == greedy[2]  # a neighbour's bias does not leak into this row


def test_logit_bias_with_random_sampling_and_raw_logprobs() -> None:
    logits = torch.zeros(1, 20)
    out = Sampler(20)(
        logits, [seq(temperature=1.0, seed=3, logit_bias=((4, 100.0),), logprobs=True)]
    )
    assert out[0].token_id == 4
    # reported logprobs are the model's own (uniform here), before the bias
    assert out[0].logprob == pytest.approx(-torch.tensor(20.0).log().item(), abs=1e-5)


def test_allowed_token_ids_restrict_the_choice() -> None:
    torch.manual_seed(1)
    logits = torch.randn(8, 64)
    allowed = (3, 9, 40)
    out = Sampler(64)(
        logits, [seq(temperature=1.0, seed=i, allowed_token_ids=allowed) for i in range(8)]
    )
    assert {t.token_id for t in out} <= set(allowed)
    g = Sampler(64)(logits[:1], [seq(temperature=0.0, allowed_token_ids=allowed)])
    assert g[0].token_id == max(allowed, key=lambda t: logits[0, t].item())


def test_distribution_reflects_bias_and_mask() -> None:
    logits = torch.zeros(1, 4)
    d = Sampler(4).distribution(logits, [seq(allowed_token_ids=(1, 2), logit_bias=((2, 1.0),))])
    e = torch.tensor(1.0).exp().item()
    assert d[0].tolist() == pytest.approx([0.0, 1 / (1 + e), e / (1 + e), 0.0], abs=1e-6)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logit_bias", ((1, 101.0),)),
        ("logit_bias", ((1, float("nan")),)),
        ("logit_bias", ((-1, 1.0),)),
        ("logit_bias", ((1, 1.0), (1, 2.0))),
        ("allowed_token_ids", ()),
        ("allowed_token_ids", (-2,)),
        ("prompt_logprobs", 21),
        ("prompt_logprobs", -1),
    ],
)
def test_bad_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(SamplingError) as e:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert e.value.field == field and field in str(e.value)


def test_vocabulary_checks_name_the_key() -> None:
    s = Sampler(100)
    with pytest.raises(SamplingError, match="'logit_bias' key '100'") as e:
        s.check(SamplingParams(logit_bias=((5, 1.0), (100, 1.0))))
    assert e.value.field == "logit_bias"
    with pytest.raises(SamplingError, match="allowed_token_ids") as e2:
        s.check(SamplingParams(allowed_token_ids=(1, 500)))
    assert e2.value.field == "allowed_token_ids"
    s.check(SamplingParams(logit_bias=((99, -100.0),), allowed_token_ids=(0, 99)))
