"""Building blocks shared by the decoder-only architectures (Llama family, Qwen2).

Every layer works on flat packed tokens: activations are ``[num_tokens, ...]`` with no batch or
padding dimension; where a token sits in its sequence is given by ``positions``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.config import RopeScaling
from pdserve.model.paged_attention import paged_attention


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019), statistics in float32.

    x [..., hidden] -> [..., hidden] in x's dtype: ``weight * (x / sqrt(mean(x^2) + eps))``.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class MergedLinear(nn.Linear):
    """A linear layer whose output rows stack several logical projections (e.g. q|k|v, gate|up).

    ``output_sizes``: rows of each logical projection, in order; checkpoints that store them apart
    are loaded shard by shard (see ``pdserve.model.loader``). One matmul instead of several.
    """

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool) -> None:
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = tuple(int(s) for s in output_sizes)

    def shard_offset(self, index: int) -> tuple[int, int]:
        """(first row, number of rows) of logical projection ``index``."""
        return sum(self.output_sizes[:index]), self.output_sizes[index]


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies float32 [head_dim // 2] of rotary position embeddings (Su et al. 2021).

    Base: ``theta ** (-2i / head_dim)``. 'linear' scaling divides every frequency by ``factor``.
    'llama3' scaling (Llama 3.1 report, "RoPE scaling" of the Meta reference code): wavelengths
    longer than ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``,
    those shorter than ``original / high_freq_factor`` are kept, and the band between is a linear
    blend of the two, weighted by where ``original / wavelength`` falls between the two factors.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None or scaling.rope_type == "default":
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3
    orig = scaling.original_max_position_embeddings
    lo, hi, factor = scaling.low_freq_factor, scaling.high_freq_factor, scaling.factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > orig / lo, inv_freq / factor, inv_freq)
    blend = (orig / wavelen - lo) / (hi - lo)
    blended = (1 - blend) * scaled / factor + blend * scaled
    in_band = (wavelen >= orig / hi) & (wavelen <= orig / lo)
    return torch.where(in_band, blended, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables of every position, built once; a step looks its positions up in them.

    Uses the "rotate half" layout of Hugging Face checkpoints: dimension ``i`` pairs with
    ``i + head_dim / 2`` (GGUF's interleaved layout is converted at load time). The table covers
    positions ``0 .. max_positions - 1`` (the engine keeps sequences within the model's
    ``max_position_embeddings``); its values are those of computing ``cos(p * inv_freq)`` per step
    in float32 and casting, so the lookup changes no result. The sine half that multiplies the
    first half of a rotated vector is stored negated (see :func:`apply_rotary`).
    """

    def __init__(
        self, head_dim: int, theta: float, scaling: RopeScaling | None, max_positions: int
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling
        self.max_positions = max_positions
        self._freq_factors: torch.Tensor | None = None
        # [max_positions, 2, head_dim] (cos | signed sin) in the model dtype, built on first use
        # (the model is created on the meta device and filled by the loader)
        self._table: torch.Tensor | None = None

    def set_freq_factors(self, factors: torch.Tensor) -> None:
        """Divide every inverse frequency by ``factors`` float32 [head_dim // 2] (how GGUF files
        carry Llama 3.1-style scaling). Raises ValueError on a shape mismatch."""
        if tuple(factors.shape) != (self.head_dim // 2,):
            raise ValueError(
                f"rope frequency factors must have shape ({self.head_dim // 2},), "
                f"got {tuple(factors.shape)}"
            )
        self._freq_factors = factors.float()
        self._table = None

    def _build(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling)
        if self._freq_factors is not None:
            inv_freq = inv_freq / self._freq_factors
        positions = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim // 2]
        cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
        table = torch.stack((torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)), dim=1)
        return table.to(device)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 [num_tokens] (each < ``max_positions``) -> (cos, signed sin), each
        [num_tokens, 1, head_dim] in ``dtype`` (strided views of one lookup)."""
        rows = self.rows(positions, dtype)[:, :, None, :]  # [num_tokens, 2, 1, head_dim]
        return rows[:, 0], rows[:, 1]

    def rows(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """positions int64 [num_tokens] -> a new contiguous [num_tokens, 2, head_dim] tensor in
        ``dtype``: each position's cos row and signed-sin row. Raises IndexError for a position
        outside ``0 .. max_positions - 1``."""
        table = self._table
        if table is None or table.device != positions.device or table.dtype != dtype:
            table = self._table = self._build(positions.device, dtype)
        return table.index_select(0, positions)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [num_tokens, heads, head_dim] by position (rotate-half layout).

    ``sin`` is the signed table of :class:`RotaryEmbedding` (``-sin`` on the first half), so
    ``rotate_half(x) * sin_hf`` = ``cat(-x2, x1) * sin_hf`` becomes ``roll(x, half) * sin``: the
    same products (negation is exact) from one halves swap instead of a negation and a
    concatenation (the roll is also the fastest swap on CPU, at every token count).
    """
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


class Attention(nn.Module):
    """Multi-head / grouped-query self-attention with RoPE over the paged KV cache.

    ``qkv_bias``: bias on the fused q|k|v projection (Qwen2); ``o_bias``: bias on the output
    projection. ``layer_index``: which of the step's KV caches is this layer's. The attention
    itself is the step's backend, reached through :func:`pdserve.model.paged_attention.paged_attention`.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qkv_bias: bool,
        o_bias: bool,
        layer_index: int,
    ) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = MergedLinear(
            hidden_size, (self.q_size, self.kv_size, self.kv_size), bias=qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, hidden_size, bias=o_bias)
        self.scale = head_dim**-0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, hidden], cos/sin [num_tokens, 1, head_dim] (:class:`RotaryEmbedding`)
        -> [num_tokens, hidden]; writes this layer's new K/V (inside a step context)."""
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = apply_rotary(q.view(n, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(n, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        o = paged_attention(q, k, v, self.layer_index, self.scale)
        return self.o_proj(o.reshape(n, self.q_size))


class GatedMLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): ``down(silu(gate(x)) * up(x))``, gate|up fused."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = MergedLinear(
            hidden_size, (intermediate_size, intermediate_size), bias=False
        )
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, hidden] -> [num_tokens, hidden]."""
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
