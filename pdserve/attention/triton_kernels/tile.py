"""Tile helpers shared by the decode and extend kernels (``@triton.jit`` device functions).

``load_kv_tile`` reads ``BLOCK_N`` consecutive tokens of one KV head through a block table;
``attend_tile`` scores a query tile against one K tile and folds it, with the V tile, into the
running max / sum / output (the FlashAttention-2 recurrence, Dao 2023, in base 2);
``sequence_of`` maps a program to its sequence. ``interpret_upcast`` says when tiles must be
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


@triton.jit
def sequence_of(i, seq_ids_ptr, HAS_SEQ_IDS: tl.constexpr):
    """The batch index (int64) of the ``i``-th sequence a kernel attends: ``seq_ids[i]`` when a
    subset was given, else ``i``."""
    if HAS_SEQ_IDS:
        seq = tl.load(seq_ids_ptr + i).to(tl.int64)
    else:
        seq = i.to(tl.int64)
    return seq


@triton.jit
def attend_tile(
    q,
    m_i,
    l_i,
    acc,
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
    pos,
    n_mask,
    visible,
    kv_head,
    offs_d,
    d_mask,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    block_size,
    scale_log2,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One K/V tile for query rows ``q`` [M, D]: tokens ``pos`` [N] (``n_mask`` in range),
    ``visible`` [M, N] or [1, N] says which keys each row may see. ``scale_log2`` = softmax scale
    * log2(e). Returns the new (m_i, l_i, acc)."""
    k = load_kv_tile(
        k_cache_ptr, table_ptr, pos, n_mask, kv_head, offs_d, d_mask,
        stride_kb, stride_ks, stride_kh, block_size,
    )  # fmt: skip
    s = dot(q, tl.trans(k), DOT_PRECISION, UPCAST) * scale_log2  # [M, N]
    s = tl.where(visible, s, float("-inf"))
    v = load_kv_tile(
        v_cache_ptr, table_ptr, pos, n_mask, kv_head, offs_d, d_mask,
        stride_vb, stride_vs, stride_vh, block_size,
    )  # fmt: skip
    return online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION, UPCAST)
