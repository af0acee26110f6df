"""OfflineEngine scheduling on a tiny dummy model: chunking, batching and preemption never change
greedy output; finish reasons; every block is returned."""

from __future__ import annotations

import pytest
import torch

from decode_worker.offline import OfflineEngine
from pdserve.config import CacheConfig, EngineConfig, LoadConfig, ModelConfig, SchedulerConfig
from pdserve.engine.errors import EngineError
from pdserve.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(120)

TINY = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=96,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    max_position_embeddings=128, eos_token_ids=(2,),
)  # fmt: skip
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _engine(num_blocks: int = 64, batched_tokens: int = 512, **sched: int) -> OfflineEngine:
    cfg = EngineConfig(
        load=LoadConfig(model="dummy", load_format="dummy", dtype="float32", seed=3),
        cache=CacheConfig(block_size=4, num_blocks=num_blocks),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=batched_tokens, max_model_len=128, **sched
        ),
    )
    return OfflineEngine(cfg, TINY)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 17, 30, 9)]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    eng = _engine()
    return [eng.generate([p], GREEDY)[0].output_token_ids for p in _prompts()]


def test_batched_and_chunked_equal_alone(reference: list[list[int]]) -> None:
    eng = _engine(batched_tokens=8)  # every prompt but the first is chunked
    outs = eng.generate(_prompts(), GREEDY)
    assert [o.output_token_ids for o in outs] == reference
    assert all(o.finish_reason == "length" and len(o.output_token_ids) == 12 for o in outs)
    assert eng.stats.prefill_tokens == sum(map(len, _prompts()))
    assert eng.stats.decode_tokens > 0 and eng.stats.preemptions == 0
    assert eng.kv.num_free_blocks == eng.runner.num_blocks


def test_preemption_recomputes_to_the_same_output(reference: list[list[int]]) -> None:
    # 4 requests need 4 + 8 + 11 + 6 = 29 blocks at the end; 16 blocks force preemptions
    eng = _engine(num_blocks=16)
    outs = eng.generate(_prompts(), GREEDY)
    assert eng.stats.preemptions > 0
    assert [o.output_token_ids for o in outs] == reference
    assert eng.kv.num_free_blocks == 16
    eng.kv.check_integrity()


def test_max_num_seqs_limits_the_batch(reference: list[list[int]]) -> None:
    eng = _engine(max_num_seqs=2)
    seen: list[int] = []
    execute = eng.runner.execute
    eng.runner.execute = lambda batch: seen.append(len(batch)) or execute(batch)  # type: ignore[method-assign]
    outs = eng.generate(_prompts(), GREEDY)
    assert max(seen) == 2
    assert [o.output_token_ids for o in outs] == reference


def test_finish_reasons(reference: list[list[int]]) -> None:
    eng = _engine()
    p = _prompts()[1]
    first = reference[1][0]
    stop = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=(first,))
    (out,) = eng.generate([p], stop)
    assert out.finish_reason == "stop" and out.output_token_ids == [first]
    later = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=(first,), min_tokens=3)
    (out,) = eng.generate([p], later)
    assert len(out.output_token_ids) >= 3 and first not in out.output_token_ids[:3]
    eos = OfflineEngine(eng.config, runner=eng.runner, eos_token_ids=(first,))
    (out,) = eos.generate([p], SamplingParams(temperature=0.0, max_tokens=12))
    assert out.finish_reason == "stop" and out.output_token_ids == [first]
    (out,) = eng.generate([p], SamplingParams(temperature=0.0, max_tokens=12, logprobs=True))
    assert len(out.logprobs) == len(out.output_token_ids) and all(lp <= 0 for lp in out.logprobs)
    long = list(range(3, 123))  # 120 tokens; max_model_len 128 leaves 8
    (out,) = eng.generate([long], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    assert out.finish_reason == "length" and len(out.output_token_ids) == 8


def test_bad_requests() -> None:
    eng = _engine()
    with pytest.raises(EngineError, match="prompt 0: prompt has 128 tokens; max_model_len is 128"):
        eng.generate([list(range(128))], GREEDY)
    with pytest.raises(EngineError, match="prompt 1: 'prompt_token_ids' is empty"):
        eng.generate([[5], []], GREEDY)
    with pytest.raises(EngineError, match="prompt 0: 'stop_token_ids'"):
        eng.generate([[5]], SamplingParams(stop_token_ids=(999,)))
    with pytest.raises(EngineError, match="prompt 0: 'n' must be 1"):
        eng.generate([[5]], SamplingParams(n=2))
    with pytest.raises(RuntimeError, match="KV cache too small"):
        _engine(num_blocks=2).generate([list(range(3, 20))], GREEDY)
