"""Logits of pdserve's Llama/Qwen2 equal transformers' on tiny random checkpoints (fp32)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import PagedForward, randomize_, save_hf
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from pdserve.config import LoadConfig
from pdserve.model.llama import LlamaForCausalLM, Qwen2ForCausalLM
from pdserve.model.loader import load_model, load_model_config

pytestmark = pytest.mark.timeout(120)

BASE: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

CONFIGS = {
    "llama-gqa": LlamaConfig(**BASE, num_key_value_heads=2, rope_theta=1000.0),
    "llama-mha-tied": LlamaConfig(**BASE, num_key_value_heads=4, tie_word_embeddings=True),
    "llama3-rope-scaling": LlamaConfig(
        **BASE, num_key_value_heads=1, rope_theta=500.0, rope_scaling=LLAMA3_ROPE
    ),
    "llama-attention-bias": LlamaConfig(**BASE, num_key_value_heads=2, attention_bias=True),
    "mistral-gqa": MistralConfig(**BASE, num_key_value_heads=2, sliding_window=None),
    "qwen2-gqa-bias": Qwen2Config(**BASE, num_key_value_heads=2, tie_word_embeddings=False),
}
TOL = 1e-4


def _checkpoint(name: str, path: Path) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(CONFIGS[name], dtype=torch.float32).eval()
    randomize_(hf)
    return save_hf(hf, path), hf


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers(name: str, tmp_path: Path) -> None:
    path, hf = _checkpoint(name, tmp_path / name)
    model = load_model(LoadConfig(model=str(path), dtype="float32"))
    expected_cls = Qwen2ForCausalLM if name.startswith("qwen2") else LlamaForCausalLM
    assert type(model) is expected_cls
    if name.startswith("llama3"):
        assert model.config.rope_scaling is not None
        assert model.config.rope_scaling.rope_type == "llama3"
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 96, (n,), generator=gen) for n in (37, 5, 70)]
    with torch.no_grad():
        ref = [hf(p[None]).logits[0] for p in prompts]

    fwd = PagedForward(model, num_blocks=64, block_size=4)
    tables = [list(range(0, 10)), list(range(10, 12)), list(range(12, 30))]
    # 1) every prompt prefilled in one packed batch
    out = fwd([p.tolist() for p in prompts], [0, 0, 0], tables)
    for o, r in zip(out, ref, strict=True):
        assert (o - r).abs().max().item() < TOL

    # 2) the same prompts again, in another layout: chunked prefill mixed with decodes
    tables = [list(range(30, 40)), list(range(40, 42)), list(range(42, 60))]
    p0, p1, p2 = (p.tolist() for p in prompts)
    out = fwd([p0[:20], p1[:4], p2[:33]], [0, 0, 0], tables)
    assert (out[0] - ref[0][:20]).abs().max().item() < TOL
    out = fwd([p0[20:36], p1[4:5], p2[33:69]], [20, 4, 33], tables)  # chunk, decode, chunk
    assert (out[0] - ref[0][20:36]).abs().max().item() < TOL
    assert (out[1] - ref[1][4:5]).abs().max().item() < TOL
    assert (out[2] - ref[2][33:69]).abs().max().item() < TOL
    out = fwd([p0[36:37], p2[69:70]], [36, 69], [tables[0], tables[2]])  # decodes only
    assert (out[0] - ref[0][36:37]).abs().max().item() < TOL
    assert (out[1] - ref[2][69:70]).abs().max().item() < TOL


def test_sharded_checkpoint_loads_the_same(tmp_path: Path) -> None:
    path, hf = _checkpoint("llama-gqa", tmp_path / "single")
    sharded = save_hf(hf, tmp_path / "sharded", max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    a = load_model(LoadConfig(model=str(path)))
    b = load_model(LoadConfig(model=str(sharded)))
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb and torch.equal(pa, pb)


def test_transformers5_rope_parameters_are_read(tmp_path: Path) -> None:
    path, _ = _checkpoint("llama3-rope-scaling", tmp_path / "m")
    cfg = load_model_config(LoadConfig(model=str(path)))
    assert cfg.rope_theta == 500.0
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 8.0
    assert cfg.rope_scaling.original_max_position_embeddings == 32


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_close_to_fp32(dtype: str, tmp_path: Path) -> None:
    path, _ = _checkpoint("qwen2-gqa-bias", tmp_path / "m")
    ref_model = load_model(LoadConfig(model=str(path), dtype="float32"))
    model = load_model(LoadConfig(model=str(path), dtype=dtype))
    assert next(model.parameters()).dtype == getattr(torch, dtype)
    tokens = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = PagedForward(ref_model)([tokens], [0], [list(range(10))])[0]
    fwd = PagedForward(model)
    out = fwd([tokens[:25]], [0], [list(range(10))])[0]
    out = torch.cat([out, fwd([tokens[25:]], [25], [list(range(10))])[0]])
    assert fwd.pool.kv.dtype == getattr(torch, dtype)
    # half precision: same ranking of the top token nearly everywhere, small absolute error
    assert (out - ref).abs().max().item() < 0.15 * ref.abs().max().item()
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9
