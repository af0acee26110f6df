"""The torch.compile'd decoder (pdserve/model/compile.py) against the eager model: tiny random
Llama and Qwen2 models, fp32 and bf16, chunked prefill mixed with decodes, every batch size."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch
from tiny_models import TINY

from decode_worker.offline import OfflineEngine
from pdserve.config import CacheConfig, EngineConfig, LoadConfig, ModelConfig, SchedulerConfig
from pdserve.engine.batch import ScheduledSeq
from pdserve.engine.runner import ModelRunner
from pdserve.model import compile as model_compile
from pdserve.model.layers import RotaryEmbedding, apply_rotary
from pdserve.model.paged_attention import paged_attention
from pdserve.sampling_params import SamplingParams

# two inductor compiles of a 2-layer model (fp32 Llama, bf16 Qwen2; C++ kernels built by gcc):
# 30-70 s each on 2 busy cores with a cold cache, seconds with inductor's on-disk cache warm
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

QWEN = replace(TINY, architecture="Qwen2ForCausalLM", tie_word_embeddings=False)


def _engine(model: ModelConfig, dtype: str, compiled: bool) -> OfflineEngine:
    cfg = EngineConfig(
        load=LoadConfig(model="dummy", load_format="dummy", dtype=dtype, torch_compile=compiled),
        cache=CacheConfig(block_size=4, num_blocks=96),
        # 16-token steps: prompts are chunked and batched with other sequences' decodes
        scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8),
    )
    return OfflineEngine(cfg, model)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, 96, (n,), generator=gen).tolist() for n in (21, 1, 9, 40, 5)]


@pytest.mark.parametrize(("model", "dtype"), [(TINY, "float32"), (QWEN, "bfloat16")])
def test_compiled_greedy_tokens_equal_eager(model: ModelConfig, dtype: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    compiled = _engine(model, dtype, compiled=True)
    assert compiled.runner.compile_seconds > 0
    eager = _engine(model, dtype, compiled=False)
    assert eager.runner.compile_seconds == 0
    prompts = _prompts()
    want = [o.output_token_ids for o in eager.generate(prompts, params)]
    # all prompts at once (batch sizes 1..5, chunks mixed with decodes), then one alone
    assert [o.output_token_ids for o in compiled.generate(prompts, params)] == want
    assert compiled.generate(prompts[3:4], params)[0].output_token_ids == want[3]


def test_compiled_logits_close_to_eager() -> None:
    runners = {
        c: ModelRunner(
            EngineConfig(
                load=LoadConfig(
                    model="dummy", load_format="dummy", dtype="float32", torch_compile=c
                ),
                cache=CacheConfig(block_size=4, num_blocks=32),
            ),
            TINY,
        )
        for c in (False, True)
    }
    tokens = torch.randint(3, 96, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=1)
    out = {}
    for c, r in runners.items():
        # a prefill chunk of 29 tokens, then a decode, with the 30th token
        first = r.compute_logits([ScheduledSeq("a", tokens[:29], 0, list(range(8)), True, params)])
        then = r.compute_logits([ScheduledSeq("a", tokens[29:], 29, list(range(8)), True, params)])
        out[c] = torch.cat([first, then])
    torch.testing.assert_close(out[True], out[False], atol=1e-4, rtol=1e-4)


def test_compile_failure_leaves_the_model_eager(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no C++ compiler\nsecond line")

    monkeypatch.setattr("pdserve.engine.runner.compile_model", broken)
    with caplog.at_level(logging.WARNING):
        engine = _engine(TINY, "float32", compiled=True)
    assert engine.runner.compile_seconds == 0
    assert "running eagerly" in caplog.text and "no C++ compiler" in caplog.text
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    assert len(engine.generate([[5, 6, 7]], params)[0].output_token_ids) == 3


def test_compile_model_restores_eager_forward_when_warmup_fails() -> None:
    runner = _engine(TINY, "float32", compiled=False).runner
    decoder = runner.model.decoder()

    def warmup() -> None:
        raise ValueError("warm-up failed")

    with pytest.raises(ValueError, match="warm-up failed"):
        model_compile.compile_model(runner.model, warmup=warmup)
    assert "forward" not in vars(decoder)  # the class's eager forward again


def test_paged_attention_needs_a_step_context() -> None:
    q = torch.zeros(1, 2, 8)
    with pytest.raises(RuntimeError, match="step_context"):
        paged_attention(q, q, q, 0, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_table_and_swap_equal_the_per_step_formula(dtype: torch.dtype) -> None:
    """The cached table and the roll-based rotation give bit-identical results to computing
    cos/sin per step and rotating with cat(-x2, x1) (transformers' rotate_half)."""
    dim, theta = 16, 10000.0
    rope = RotaryEmbedding(dim, theta, None, max_positions=300)
    positions = torch.tensor([0, 1, 7, 299, 150])
    cos, sin = rope(positions, dtype)
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    emb = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((emb, emb), -1)[:, None, :]
    ref_cos, ref_sin = emb.cos().to(dtype), emb.sin().to(dtype)
    assert torch.equal(cos, ref_cos)
    x = torch.randn(5, 3, dim).to(dtype)
    half = dim // 2
    ref = x * ref_cos + torch.cat((-x[..., half:], x[..., :half]), -1) * ref_sin
    assert torch.equal(apply_rotary(x, cos, sin), ref)
