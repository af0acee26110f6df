"""Llama family (Llama 2/3, Mistral, SmolLM2) and Qwen2: pre-norm decoder, RoPE, GQA, SwiGLU.

Parameter names follow Hugging Face checkpoints (``model.layers.N.self_attn.qkv_proj`` is the fused
``q_proj|k_proj|v_proj``; ``mlp.gate_up_proj`` the fused ``gate_proj|up_proj``;
``packed_modules_mapping`` tells the loader how to fill them). Qwen2 differs only by the bias on
the q/k/v projections.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.attention.base import AttentionBackend, AttentionMetadata, get_backend
from pdserve.config import ModelConfig
from pdserve.model.layers import Attention, GatedMLP, RMSNorm, RotaryEmbedding
from pdserve.model.paged_attention import step_context
from pdserve.model.registry import CausalLM, register_model

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]


class DecoderLayer(nn.Module):
    """``h = x + attn(norm(x)); out = h + mlp(norm(h))``."""

    def __init__(self, cfg: ModelConfig, qkv_bias: bool, o_bias: bool, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            layer_index=layer_index,
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, hidden] -> [num_tokens, hidden]."""
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """Embedding, decoder layers and the final norm: the part of a forward that
    :mod:`pdserve.model.compile` may compile (tensor inputs only, all of the step's token count)."""

    def __init__(self, cfg: ModelConfig, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, qkv_bias, o_bias, i) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """input_ids int64 [num_tokens], cos/sin [num_tokens, 1, head_dim] -> final-norm hidden
        states [num_tokens, hidden] (attending inside the caller's step context)."""
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


@register_model("LlamaForCausalLM", "MistralForCausalLM")
class LlamaForCausalLM(CausalLM):
    """Decoder-only causal LM over flat packed tokens and a paged KV cache.

    Llama with ``attention_bias`` has biases on q/k/v and o; Qwen2 (subclass) only on q/k/v.
    """

    packed_modules_mapping: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, backend: AttentionBackend | None = None) -> None:
        nn.Module.__init__(self)
        self.config = config
        qkv_bias, o_bias = self.projection_biases(config)
        self.attn_backend: AttentionBackend = backend or get_backend()
        self.model = LlamaModel(config, qkv_bias, o_bias)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings
        )
        # None = tied: logits from the embedding matrix (a transform such as
        # pdserve.model.cpu_linear.pack_linears may install a packed copy here)
        self.lm_head: nn.Module | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @staticmethod
    def projection_biases(config: ModelConfig) -> tuple[bool, bool]:
        """(bias on q/k/v, bias on o_proj)."""
        return config.attention_bias, config.attention_bias

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: KVCaches,
    ) -> torch.Tensor:
        """input_ids, positions int64 [num_tokens]; ``kv_caches[i]`` = layer i's (k_cache,
        v_cache) [num_blocks, block_size, kv_heads, head_dim]. Returns the final-norm hidden
        states [num_tokens, hidden]."""
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"{len(kv_caches)} KV caches for {len(self.model.layers)} layers")
        cos, sin = self.rotary_emb(positions, self.model.embed_tokens.weight.dtype)
        with step_context(self.attn_backend, meta, kv_caches):
            return self.decoder()(input_ids, cos, sin)

    def decoder(self) -> nn.Module:
        return self.model

    def input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> logits [n, vocab] (model dtype)."""
        if self.lm_head is not None:
            return self.lm_head(hidden)
        return F.linear(hidden, self.model.embed_tokens.weight)

    def set_rope_freq_factors(self, factors: torch.Tensor) -> None:
        self.rotary_emb.set_freq_factors(factors)


@register_model("Qwen2ForCausalLM")
class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5: Llama layout with a bias on the q/k/v projections only."""

    @staticmethod
    def projection_biases(config: ModelConfig) -> tuple[bool, bool]:
        return True, False
