"""Tile helpers shared by the decode and extend kernels (``@triton.jit`` device functions).

``load_kv_tile`` reads ``BLOCK_N`` consecutive tokens of one KV head through a block table;
``online_softmax_step`` folds one tile of scores into the running max / sum / output (the
FlashAttention-2 recurrence, Dao 2023, in base 2). ``interpret_upcast`` says when tiles must be
widened to fp32 before ``tl.dot``: Triton's CPU interpreter stores bf16 as raw uint16 words and
multiplies those (wrong results), so under ``TRITON_INTERPRET=1`` bf16 tiles are upcast (exact)
and the probabilities still rounded to bf16 first, which reproduces the tensor-core numerics
(bf16 products, fp32 sums). Compiled kernels never upcast. The interpreter also rounds fp32 to
bf16 toward zero (compiled Triton: to nearest even), a difference well inside the bf16 tolerance
of the outputs and probabilities it touches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs


def interpret_upcast(dtype: torch.dtype) -> bool:
    """True when bf16 tiles must be upcast before ``tl.dot`` (bf16 under the CPU interpreter)."""
    return dtype == torch.bfloat16 and bool(knobs.runtime.interpret)


@triton.jit
def dot(a, b, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a [M, K] @ b [K, N] in fp32 (see the module docstring for UPCAST)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def load_kv_tile(
    cache_ptr,
    table_ptr,
    pos,
    n_mask,
    kv_head,
    offs_d,
    d_mask,
    stride_b,
    stride_s,
    stride_h,
    block_size,
):
    """Tokens ``pos`` [BLOCK_N] (masked by ``n_mask``) of one KV head from a
    [num_blocks, block_size, kv_heads, head_dim] cache through the sequence's block table row
    ``table_ptr``: [BLOCK_N, BLOCK_D], 0 where masked."""
    block = tl.load(table_ptr + pos // block_size, mask=n_mask, other=0).to(tl.int64)
    offset = (pos % block_size).to(tl.int64)
    ptrs = (
        cache_ptr
        + block[:, None] * stride_b
        + offset[:, None] * stride_s
        + kv_head * stride_h
        + offs_d[None, :]
    )
    return tl.load(ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)


@triton.jit
def online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Fold scores ``s`` [M, N] (log2 units, -inf = hidden; each row's max finite once any key
    was visible) and values ``v`` [N, D] into the running max ``m_i`` [M], sum ``l_i`` [M] and
    output ``acc`` [M, D] (fp32). Returns the new (m_i, l_i, acc)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST)
    return m_new, l_i, acc
