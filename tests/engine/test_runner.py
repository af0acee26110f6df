"""ModelRunner on tiny random ('dummy') weights: mixed batches, chunking, prefix cache, sampling."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import CacheConfig, ConfigError, EngineConfig, LoadConfig, ModelConfig
from pdserve.engine.batch import ScheduledSeq
from pdserve.engine.runner import ModelRunner
from pdserve.sampling_params import SamplingParams
from pdserve.types import SampledToken

pytestmark = pytest.mark.timeout(120)

TINY = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    eos_token_ids=(2,),
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
BS = 4


def _runner(num_blocks: int = 48, model: ModelConfig = TINY, seed: int = 0) -> ModelRunner:
    cfg = EngineConfig(
        load=LoadConfig(model="dummy", load_format="dummy", dtype="float32", seed=seed),
        cache=CacheConfig(block_size=BS, num_blocks=num_blocks),
    )
    return ModelRunner(cfg, model)


def _seq(rid: str, tokens: list[int], computed: int, table: list[int], sample: bool = True):
    return ScheduledSeq(rid, tokens, computed, table, sample, GREEDY, prompt_token_ids=tokens)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_runner_geometry_and_dummy_seed() -> None:
    r = _runner(num_blocks=10)
    assert (r.num_blocks, r.block_size, r.dtype) == (10, BS, torch.float32)
    assert tuple(r.kv_pool.kv.shape) == (2, 2, 10, BS, 2, 16)
    same = _runner(num_blocks=10)
    other = _runner(num_blocks=10, seed=1)
    w = r.model.model.embed_tokens.weight
    assert torch.equal(w, same.model.model.embed_tokens.weight)
    assert not torch.equal(w, other.model.model.embed_tokens.weight)


def test_chunked_prefill_and_decode_match_one_shot() -> None:
    prompt = _prompt(23, 0)
    one = _runner()
    ref = one.compute_logits([_seq("a", prompt, 0, list(range(6)))])

    r = _runner()
    table = list(range(10, 16))
    out = r.execute([_seq("a", prompt[:9], 0, table, sample=False)])
    assert out == [None]
    out = r.execute([_seq("a", prompt[9:17], 9, table, sample=False)])
    logits = r.compute_logits([_seq("a", prompt[17:], 17, table)])
    assert (logits - ref).abs().max().item() < 1e-5

    # the next decode step sees the same context either way
    tok = int(ref.argmax())
    a = one.compute_logits([_seq("a", [tok], 23, list(range(6)))])
    b = r.compute_logits([_seq("a", [tok], 23, table)])
    assert (a - b).abs().max().item() < 1e-5


def test_mixed_batch_equals_each_alone() -> None:
    prompts = [_prompt(n, i) for i, n in enumerate((13, 4, 30))]
    tables = [[0, 1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11, 12, 13]]
    batch = _runner()
    # step 1: prompt 0 whole, prompt 1 whole, prompt 2 first chunk (not sampled)
    got = batch.execute(
        [
            _seq("0", prompts[0], 0, tables[0]),
            _seq("1", prompts[1], 0, tables[1]),
            _seq("2", prompts[2][:20], 0, tables[2], sample=False),
        ]
    )
    assert got[2] is None and all(isinstance(t, SampledToken) for t in got[:2])
    t0, t1 = got[0].token_id, got[1].token_id  # type: ignore[union-attr]
    # step 2: two decodes + the rest of prompt 2
    logits = batch.compute_logits(
        [
            _seq("0", [t0], 13, tables[0]),
            _seq("1", [t1], 4, tables[1]),
            _seq("2", prompts[2][20:], 20, tables[2]),
        ]
    )
    for i, (p, t) in enumerate(((prompts[0], t0), (prompts[1], t1), (prompts[2], None))):
        alone = _runner()
        ids = p + ([t] if t is not None else [])
        ref = alone.compute_logits([_seq(str(i), ids, 0, list(range(10)))])
        assert (logits[i] - ref[0]).abs().max().item() < 1e-5


def test_prefix_cache_hit_computes_only_uncached_tokens() -> None:
    r = _runner()
    shared = _prompt(8, 7)  # exactly 2 full blocks
    first = shared + _prompt(5, 8)
    second = shared + _prompt(6, 9)
    r.execute([_seq("first", first, 0, [0, 1, 2, 3])])

    seen: list[int] = []
    original = r.model.forward

    def counting(input_ids, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(int(input_ids.shape[0]))
        return original(input_ids, *args, **kwargs)

    r.model.forward = counting  # type: ignore[method-assign]
    # blocks 0 and 1 hold the shared prefix's KV; only the 6 new tokens are computed
    hit = r.compute_logits([_seq("second", second[8:], 8, [0, 1, 5, 6])])
    assert seen == [6]
    cold = _runner().compute_logits([_seq("second", second, 0, [0, 1, 2, 3])])
    assert (hit - cold).abs().max().item() < 1e-5


def test_greedy_sampling_is_argmax_and_logprob_reported() -> None:
    r = _runner()
    p = _prompt(11, 3)
    logits = _runner().compute_logits([_seq("x", p, 0, [0, 1, 2])])
    params = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2)
    (tok,) = r.execute([ScheduledSeq("x", p, 0, [0, 1, 2], True, params, p)])
    assert tok is not None and tok.token_id == int(logits.argmax())
    expected = torch.log_softmax(logits.float(), -1)[0, tok.token_id].item()
    assert tok.logprob == pytest.approx(expected, abs=1e-4)
    assert tok.top_logprobs[0][0] == tok.token_id and len(tok.top_logprobs) == 2


def test_bad_batches_are_named() -> None:
    r = _runner(num_blocks=8)
    assert r.execute([]) == []
    with pytest.raises(ValueError, match="request a: block table has 1 blocks, 6 tokens need 2"):
        r.execute([_seq("a", _prompt(6, 0), 0, [0])])
    with pytest.raises(ValueError, match=r"request b: token id outside \[0, 128\)"):
        r.execute([_seq("b", [5, 128], 0, [0])])
    with pytest.raises(ValueError, match=r"request c: block id outside \[0, 8\)"):
        r.execute([_seq("c", [5, 6], 0, [8])])
    with pytest.raises(ValueError, match="request d: no tokens scheduled"):
        r.execute([_seq("d", [], 0, [0])])


def test_unsupported_architecture_is_one_line() -> None:
    bad = ModelConfig(**{**TINY.__dict__, "architecture": "GPT2LMHeadModel"})
    with pytest.raises(ConfigError) as e:
        _runner(model=bad)
    msg = str(e.value)
    assert "'GPT2LMHeadModel' is not supported" in msg and "LlamaForCausalLM" in msg
    assert "\n" not in msg
