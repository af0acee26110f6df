"""Helpers for model tests: tiny random Hugging Face checkpoints and a paged forward."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import gguf
import torch
from gguf.quants import dequantize, quantize
from transformers import PreTrainedModel

from pdserve.config import ModelConfig
from pdserve.kv_cache.pool import KVPool
from pdserve.model.registry import CausalLM

# A 2-layer GQA Llama for dummy weights (tied embeddings): fast on 2 cores, compiles in seconds.
TINY = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=128,
    tie_word_embeddings=True,
)


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Give every parameter (biases and norm scales too) non-trivial seeded values, so that a
    weight left unloaded or loaded into the wrong place shows in the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.05
            p.copy_(noise + 1.0 if "norm" in name else noise * 2)


def save_hf(model: PreTrainedModel, path: Path, **kwargs: object) -> Path:
    """save_pretrained as safetensors and return the directory."""
    model.save_pretrained(path, **kwargs)
    return path


class PagedForward:
    """Runs a CausalLM over a private KVPool with explicit per-sequence block tables."""

    def __init__(self, model: CausalLM, num_blocks: int = 64, block_size: int = 4) -> None:
        cfg = model.config
        dtype = next(model.parameters()).dtype
        self.model, self.block_size = model, block_size
        self.pool = KVPool(
            cfg.num_hidden_layers,
            num_blocks,
            block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            dtype,
        )
        self.caches = [self.pool.layer(i) for i in range(cfg.num_hidden_layers)]

    @torch.no_grad()
    def __call__(
        self,
        chunks: Sequence[Sequence[int]],
        num_computed: Sequence[int],
        tables: Sequence[Sequence[int]],
    ) -> list[torch.Tensor]:
        """One packed forward; returns per-sequence logits [len(chunk), vocab] (float32)."""
        ids = torch.tensor([t for c in chunks for t in c], dtype=torch.int64)
        pos = torch.cat(
            [torch.arange(n, n + len(c)) for c, n in zip(chunks, num_computed, strict=True)]
        )
        meta = self.model.attn_backend.build_metadata(
            [len(c) for c in chunks], num_computed, tables, self.block_size
        )
        logits = self.model.compute_logits(self.model(ids, pos, meta, self.caches)).float()
        return list(logits.split([len(c) for c in chunks]))


def gguf_values(weight: torch.Tensor, qtype: str) -> torch.Tensor:
    """``weight`` (2-D, columns a multiple of 32) as pdserve's GGUF loader would hold it after a
    round trip through a file of ``qtype`` (e.g. "Q4_1"): quantised and dequantised by gguf-py,
    fp32."""
    t = gguf.GGMLQuantizationType[qtype]
    w = dequantize(quantize(weight.detach().float().numpy(), t), t)
    return torch.from_numpy(w.copy())
