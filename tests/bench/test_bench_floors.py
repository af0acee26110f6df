"""Floor arithmetic (pdserve.bench.floors): parameter counts against transformers, the FLOP and
byte sums against token-by-token brute force, the fewest decode steps, and a run's floors."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from pdserve.bench.floors import (
    ModelCost,
    decode_flops,
    decode_step_floor_ms,
    min_decode_steps,
    model_cost,
    prefill_flops,
    run_floors,
)
from pdserve.config import ModelConfig

pytestmark = pytest.mark.timeout(120)

TINY = dict(
    vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
)  # fmt: skip


@pytest.mark.parametrize(
    "hf_cls, cfg_cls, tied",
    [
        (LlamaForCausalLM, LlamaConfig, True),
        (LlamaForCausalLM, LlamaConfig, False),
        (Qwen2ForCausalLM, Qwen2Config, False),  # bias on q/k/v
    ],
)
def test_model_cost_counts_what_transformers_builds(hf_cls, cfg_cls, tied) -> None:  # type: ignore[no-untyped-def]
    hf_cfg = cfg_cls(**TINY, tie_word_embeddings=tied, architectures=[hf_cls.__name__])
    hf = hf_cls(hf_cfg)
    mc = ModelConfig.from_hf_dict(hf_cfg.to_dict())
    cost = model_cost(mc, "float32")
    assert cost.params == sum(p.numel() for p in hf.parameters())  # tied weights counted once
    layer_linear = sum(
        m.weight.numel()
        for name, m in hf.named_modules()
        if isinstance(m, torch.nn.Linear) and name != "lm_head"
    )
    assert cost.layer_matmul_params == layer_linear
    vh = TINY["vocab_size"] * TINY["hidden_size"]
    assert cost.lm_head_params == cost.embedding_params == vh
    assert cost.attn_flops_per_pair == 4 * 3 * 4 * 8
    assert cost.kv_bytes_per_token == 2 * 3 * 2 * 8 * 4  # K and V, layers, kv heads, fp32
    expected_read = cost.params if tied else cost.params - vh
    assert cost.weight_bytes_per_step == expected_read * 4
    assert model_cost(mc, "bfloat16").dtype_bytes == 2


COST = ModelCost(
    params=1000, layer_matmul_params=800, lm_head_params=100, embedding_params=100, tied=True,
    attn_flops_per_pair=8, kv_elems_per_token=4, dtype_bytes=2,
)  # fmt: skip


def _brute_force_flops(cost: ModelCost, p: int, o: int) -> float:
    """Token by token: prefill token i sees i keys; logits once for the prompt; decode token j
    (j = 1..o-1) sees p + j keys and computes logits."""
    total = 2.0 * cost.lm_head_params
    for i in range(1, p + 1):
        total += 2 * cost.layer_matmul_params + cost.attn_flops_per_pair * i
    for j in range(1, o):
        total += 2 * cost.layer_matmul_params + 2 * cost.lm_head_params
        total += cost.attn_flops_per_pair * (p + j)
    return total


@pytest.mark.parametrize("p, o", [(1, 1), (3, 2), (256, 128), (1500, 8), (64, 1)])
def test_flop_sums_match_token_by_token(p: int, o: int) -> None:
    assert prefill_flops(COST, p) + decode_flops(COST, p, o) == _brute_force_flops(COST, p, o)


def test_min_decode_steps() -> None:
    assert min_decode_steps([127] * 64, 16) == 508  # 4 full waves of 127 steps
    assert min_decode_steps([5, 1], 16) == 5  # the longest request bounds it
    assert min_decode_steps([3, 3, 3], 2) == 5  # 9 tokens, 2 per step
    assert min_decode_steps([0, 0], 4) == 0
    assert min_decode_steps([], 4) == 0
    with pytest.raises(ValueError, match="max_batch"):
        min_decode_steps([1], 0)


def test_run_floors_by_hand() -> None:
    # one request, P=3, O=2: flops 2*3*800 + 2*100 + 8*6 (prefill) + 1600 + 200 + 8*4 (decode)
    f = run_floors(COST, [(3, 2), (5, 0)], max_batch=4, gflops=1e-6, copy_gbs=1e-6)
    assert f.flops == 5048 + 1832  # the failed request (0 output tokens) counts nothing
    assert f.decode_steps == 1
    assert f.bytes_read == 1000 * 2 + 4 * 2 * 4  # weights once + KV of 4 tokens
    assert math.isclose(f.arithmetic_s, 6.88) and math.isclose(f.memory_s, 2.032)
    assert f.floor_s == f.arithmetic_s and f.bound == "compute"
    d = f.to_dict()
    assert d["floor_s"] == f.floor_s and d["bound"] == "compute"
    with pytest.raises(ValueError, match="rates must be > 0"):
        run_floors(COST, [(3, 2)], 4, 0.0, 1.0)


def test_memory_floor_of_batched_decode() -> None:
    # 8 requests of 4 decode steps each, 2 at a time: 16 steps, each reading the weights
    f = run_floors(COST, [(10, 5)] * 8, max_batch=2, gflops=1e9, copy_gbs=1e-6)
    kv_tokens = 8 * (4 * 10 + 4 * 5 / 2)
    assert f.decode_steps == 16
    assert f.bytes_read == 16 * 2000 + kv_tokens * 8
    assert f.bound == "memory"
    untied = ModelCost(**{**vars(COST), "tied": False})
    assert untied.weight_bytes_per_step == (1000 - 100) * 2  # the lookup table is not streamed


def test_decode_step_floor() -> None:
    ms, bound = decode_step_floor_ms(COST, batch=2, context=10, copy_gbs=1e-6, gflops=1.0)
    assert bound == "memory" and math.isclose(ms, (2000 + 2 * 10 * 8) / 1e3 * 1e3)
    ms, bound = decode_step_floor_ms(COST, batch=2, context=10, copy_gbs=1e3, gflops=1e-9)
    assert bound == "compute" and math.isclose(ms, 2 * (1600 + 200 + 80) / 1.0 * 1e3)
