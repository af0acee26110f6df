"""Prefill/extend attention over the paged pool for packed variable-length query chunks (Triton).

Algorithm (in our words): the step's K/V is written to the pool first, so a chunk of ``q_len``
new tokens after ``prefix = seq_len - q_len`` cached tokens reads every key (cached prefix and its
own new part) through the block table. Each program owns one KV head of one sequence and
``BLOCK_M // group`` query tokens; its ``BLOCK_M`` rows are those tokens times the ``group`` query
heads sharing the KV head, so each K/V tile is read once for the whole GQA group (the packing of
vLLM's unified Triton attention). It walks the keys in ``BLOCK_N`` tiles up to the last key its
rows may see, keeping an fp32 running max / sum / output (FlashAttention-2's online softmax, Dao
2023). Key ``j`` is visible to chunk token ``t`` (position ``prefix + t``) iff
``j <= prefix + t``: the whole cached prefix plus the causal part of the chunk (the masking of vLLM's prefix-prefill and SGLang's extend
kernels, which split the same work into a prefix pass and a fresh-K/V pass).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.attention.triton_kernels import LOG2E, dot_precision, head_block
from pdserve.attention.triton_kernels.tile import attend_tile, interpret_upcast, sequence_of

BLOCK_M = 64  # query rows (tokens x GQA group heads) per program
BLOCK_N = 64  # keys per tile


@triton.jit
def _extend_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    seq_ids_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    group_size,
    head_dim,
    block_size,
    HAS_SEQ_IDS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    i = tl.program_id(2)
    seq = sequence_of(i, seq_ids_ptr, HAS_SEQ_IDS)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int64) - q_start
    tokens_per_tile = BLOCK_M // group_size
    first = tile * tokens_per_tile  # first query token of this tile
    if first >= q_len:  # the grid is sized for the longest chunk
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len

    # row r of the tile is query token first + r // group_size, query head
    # kv_head * group_size + r % group_size: the whole GQA group shares each K/V tile
    offs_m = tl.arange(0, BLOCK_M)
    token = first + offs_m // group_size
    heads = kv_head * group_size + offs_m % group_size
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    m_mask = (offs_m < tokens_per_tile * group_size) & (token < q_len)
    d_mask = offs_d < head_dim
    q_rows = q_start + token
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    q_pos = prefix + token  # position of each row's token in its sequence

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # keys up to the tile's last token, exclusive
    kv_end = tl.minimum(seq_len, prefix + first + tokens_per_tile)
    table = block_tables_ptr + seq * stride_bt
    for n0 in range(0, kv_end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < kv_end
        # every row sees key 0, so each row's running max is finite after the first tile
        visible = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table, pos, n_mask, visible,
            kv_head, offs_d, d_mask, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
            stride_vh, block_size, scale_log2, DOT_PRECISION, UPCAST,
        )  # fmt: skip

    o = acc / l_i[:, None]
    dst = out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def paged_extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    max_query_len: int,
    seq_ids: torch.Tensor | None = None,
) -> None:
    """Attend packed query chunks to their cached prefix plus their own causal part, into ``out``.

    Shapes and dtypes: q, out [num_tokens, num_heads, head_dim] (bf16/fp16/fp32, head_dim axis
    contiguous), sequence ``s`` owning rows ``query_start_loc[s]:query_start_loc[s + 1]``;
    k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim] (the query's dtype), already
    holding every token of the chunks; block_tables int32 [num_seqs, max_blocks]; seq_lens int32
    [num_seqs] (cached + new tokens); query_start_loc int32 [num_seqs + 1]. ``seq_ids`` (int32
    [n], optional) picks the sequences to attend (None = all); ``max_query_len`` is the longest of
    their chunks (sizes the grid without a device sync). ``scale``: softmax scale. Only the
    chosen sequences' rows are written.

    Grid: (cdiv(max_query_len, block_m // group), num_kv_heads, n) with group = num_heads //
    num_kv_heads and block_m = max(BLOCK_M, next_power_of_2(group)); fp32 accumulation. Raises
    ValueError on bad shapes.
    """
    n = int(seq_ids.shape[0]) if seq_ids is not None else int(seq_lens.shape[0])
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads or k_cache.shape[-1] != head_dim or out.shape != q.shape:
        raise ValueError(
            f"paged_extend_attention: q {tuple(q.shape)}, cache {tuple(k_cache.shape)} and out "
            f"{tuple(out.shape)} do not fit"
        )
    if n == 0 or max_query_len == 0:
        return
    ids = seq_ids if seq_ids is not None else seq_lens
    group = num_heads // num_kv_heads
    block_m = max(BLOCK_M, triton.next_power_of_2(group))  # at least one token per tile
    grid = (triton.cdiv(max_query_len, block_m // group), num_kv_heads, n)
    _extend_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, ids,
        scale * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        group, head_dim, k_cache.shape[1],
        HAS_SEQ_IDS=seq_ids is not None,
        DOT_PRECISION=dot_precision(q.dtype == torch.float32),
        UPCAST=interpret_upcast(q.dtype),
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_D=head_block(head_dim),
    )  # fmt: skip
