"""The triton backend end to end: mixed batches through the model interface, and a tiny Llama
generating the same greedy tokens as with torch_ref (Triton interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from decode_worker.offline import OfflineEngine
from pdserve.attention.base import get_backend
from pdserve.attention.triton_paged import TritonBackend
from pdserve.config import CacheConfig, EngineConfig, LoadConfig, ModelConfig, SchedulerConfig
from pdserve.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mixed_batch_matches_torch_ref(paged_case, dtype: torch.dtype) -> None:
    """Decodes (one after a 1-token context), a prefix-cached chunk, a fresh prefill and a
    one-token prompt in one step: every row equals torch_ref, the pool holds the same K/V."""
    seqs = [(9, 1), (13, 6), (0, 11), (1, 1), (0, 1)]
    case = paged_case(seqs, 6, 2, 32, 4, dtype)
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    new = case.meta.slot_mapping
    k_cache.view(-1, 2, 32)[new] = float("nan")  # the backend must write the new K/V itself
    v_cache.view(-1, 2, 32)[new] = float("nan")
    backend = get_backend("triton")
    assert isinstance(backend, TritonBackend)
    out = backend.forward(case.q, case.k, case.v, k_cache, v_cache, case.tmeta, case.scale)
    assert case.err(out) < case.tolerance
    assert torch.equal(k_cache, case.k_cache) and torch.equal(v_cache, case.v_cache)


def test_build_metadata() -> None:
    backend = TritonBackend()
    tm = backend.build_metadata([1, 3], [4, 0], [[2, 5], [7]], 4)
    assert tm.query_start_loc_i32.tolist() == [0, 1, 4] and tm.seq_lens.tolist() == [5, 3]
    assert tm.query_start_loc_i32.dtype == torch.int32 and tm.seq_lens.dtype == torch.int32
    assert tm.block_tables.dtype == torch.int32 and tm.block_tables.tolist() == [[2, 5], [7, 0]]
    assert (tm.num_decodes, tm.num_extends, tm.max_decode_seq_len) == (1, 1, 5)
    # the common fields the model reads: positions (RoPE) and the slot mapping (KV write)
    assert tm.positions.tolist() == [4, 0, 1, 2] and tm.slot_mapping.tolist() == [20, 28, 29, 30]
    tm2 = backend.build_metadata([1, 1], [4, 8], [[2, 5], [7, 1, 3]], 4)
    assert tm2.decode_ids is None and tm2.num_extends == 0
    with pytest.raises(ValueError, match="sequence 0: block table has 1 blocks"):
        backend.build_metadata([1], [4], [[2]], 4)


TINY = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=128,
    hidden_size=96,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    eos_token_ids=(2,),
)


def _generate(backend: str, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of TINY (dummy weights, fp32) with ``backend``: all prompts in one run with
    chunked prefill (16-token steps), then the first prompt again (a prefix cache hit)."""
    engine = OfflineEngine(
        EngineConfig(
            load=LoadConfig(
                model="dummy", load_format="dummy", dtype="float32", attention_backend=backend
            ),
            cache=CacheConfig(block_size=4, num_blocks=64),
            scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8),
        ),
        TINY,
    )
    attn = engine.runner.model.attn_backend
    assert attn.name == backend
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = engine.generate(prompts, params) + engine.generate(prompts[:1], params)
    assert engine.stats.prefill_tokens < len(prompts[0])  # the rerun extended a cached prefix
    return [o.output_token_ids for o in outs]


def test_tiny_llama_greedy_tokens_equal_torch_ref() -> None:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (21, 5, 9)]
    assert _generate("triton", prompts) == _generate("torch_ref", prompts)
