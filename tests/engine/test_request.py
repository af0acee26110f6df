"""EngineRequest.validate and EngineSeq: the validation, ScheduledSeq construction and stop check
both workers share."""

from __future__ import annotations

import pytest

from pdserve.engine.errors import DEADLINE_EXCEEDED, INVALID_ARGUMENT, EngineError
from pdserve.engine.request import EngineRequest
from pdserve.engine.sequence import EngineSeq
from pdserve.sampling_params import SamplingError, SamplingParams

pytestmark = pytest.mark.timeout(30)

SP = SamplingParams(temperature=0.0, max_tokens=4)


def _check(req: EngineRequest, now: float | None = None) -> EngineError:
    def no_big_stop_ids(sp: SamplingParams) -> None:
        if any(t >= 100 for t in sp.stop_token_ids):
            raise SamplingError("stop_token_ids", "'stop_token_ids' outside [0, 100)")

    with pytest.raises(EngineError) as e:
        req.validate(vocab_size=100, max_model_len=8, check_sampling=no_big_stop_ids, now=now)
    return e.value


def test_validate_names_the_field_and_the_limit() -> None:
    cases = {
        "'request_id' is empty": EngineRequest("", (1,), SP),
        "'prompt_token_ids' is empty": EngineRequest("a", (), SP),
        "contains 100, outside the vocabulary [0, 100)": EngineRequest("a", (1, 100), SP),
        "contains -1": EngineRequest("a", (-1,), SP),
        "prompt has 8 tokens; max_model_len is 8, so at most 7": EngineRequest("a", (1,) * 8, SP),
        "'num_output_tokens' must be in [0, 3) for 3 tokens, got 3": EngineRequest(
            "a", (1, 2, 3), SP, num_output_tokens=3
        ),
        "'max_tokens' (4) leaves nothing to generate after 4": EngineRequest(
            "a", (1,) * 6, SP, num_output_tokens=4
        ),
        "'stop_token_ids' outside [0, 100)": EngineRequest(
            "a", (1,), SamplingParams(stop_token_ids=(100,))
        ),
    }
    for message, req in cases.items():
        err = _check(req)
        assert err.code == INVALID_ARGUMENT and message in err.message, (message, err)
    late = _check(EngineRequest("a", (1,), SP, deadline=10.0), now=10.0)
    assert late.code == DEADLINE_EXCEEDED
    EngineRequest("a", (1, 2), SP, num_output_tokens=1, deadline=11.0).validate(
        vocab_size=100, max_model_len=8, now=10.0
    )


def test_seq_splits_prompt_and_output_and_schedules_chunks() -> None:
    seq = EngineSeq(EngineRequest("a", (5, 6, 7, 8, 9), SP, num_output_tokens=2))
    assert seq.prompt_token_ids == [5, 6, 7] and seq.output_token_ids == [8, 9]
    first = seq.schedule(3, [4, 2])
    assert (first.token_ids, first.num_computed, first.sample) == ([5, 6, 7], 0, False)
    assert first.block_table == [4, 2] and first.output_token_ids == [8, 9]
    seq.num_computed = 3
    last = seq.schedule(2, [4, 2])
    assert (last.token_ids, last.num_computed, last.sample) == ([8, 9], 3, True)
    assert seq.num_remaining_prompt_tokens == 2


def test_stop_check() -> None:
    def seq(**kw: object) -> EngineSeq[EngineRequest]:
        sp = SamplingParams(temperature=0.0, **kw)  # type: ignore[arg-type]
        return EngineSeq(EngineRequest("a", (1, 2, 3), sp))

    assert seq(max_tokens=5).append_token(99, {99}, 64) == "stop"
    assert seq(max_tokens=5, ignore_eos=True).append_token(99, {99}, 64) is None
    assert seq(max_tokens=5, stop_token_ids=(7,)).append_token(7, {99}, 64) == "stop"
    s = seq(max_tokens=5, min_tokens=2, stop_token_ids=(7,))
    assert s.append_token(7, {99}, 64) is None and s.append_token(7, {99}, 64) == "stop"
    s = seq(max_tokens=2)
    assert s.append_token(4, {99}, 64) is None and s.append_token(4, {99}, 64) == "length"
    assert seq(max_tokens=9).append_token(4, {99}, 4) == "length"  # 3 + 1 = max_model_len
    s = seq(max_tokens=9)
    s.append_token(4, (), 64)
    assert s.token_ids == [1, 2, 3, 4] and s.output_token_ids == [4]
