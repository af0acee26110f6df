"""Paged decode attention: one query token per sequence over its paged context (Triton kernels).

Algorithm (in our words): each program owns one (sequence, KV head, split) triple. The query heads
that share the KV head (GQA group) are one tile of rows, so every K/V tile read through the block
table serves the whole group (the grouping of SGLang's/vLLM's grouped decode kernels). Scores are
folded into a running max / sum / output in fp32 (the online softmax of FlashAttention-2, Dao
2023). Long contexts are cut into ``num_splits`` contiguous token ranges attended in parallel,
each leaving a normalised partial output and its log-sum-exp; a second kernel merges them,
weighting each split by ``exp(lse_split - lse_max)`` (FlashDecoding's split-K, Dao et al. 2023;
vLLM's paged attention v2 partitions the same way). With one split the first kernel writes the
output directly and the merge is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.attention.triton_kernels import LOG2E, dot_precision, head_block
from pdserve.attention.triton_kernels.tile import attend_tile, interpret_upcast, sequence_of

BLOCK_N = 64  # context tokens per K/V tile
MIN_SPLIT_TOKENS = 256  # a split shorter than this costs more in the merge than it saves


@triton.jit
def _decode_partial_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    seq_ids_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale_log2,
    split_size,
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
    stride_pi,
    stride_ph,
    stride_ps,
    stride_li,
    stride_lh,
    group_size,
    head_dim,
    block_size,
    HAS_SEQ_IDS: tl.constexpr,
    DIRECT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    i = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = sequence_of(i, seq_ids_ptr, HAS_SEQ_IDS)
    seq_len = tl.load(seq_lens_ptr + seq)
    row = tl.load(query_start_loc_ptr + seq).to(tl.int64)  # the sequence's one query row
    start = split * split_size
    end = tl.minimum(start + split_size, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * group_size + offs_g
    g_mask = offs_g < group_size
    d_mask = offs_d < head_dim
    q = tl.load(
        q_ptr + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_G, BLOCK_D]

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max (log2 units)
    l_i = tl.zeros([BLOCK_G], tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table, pos, n_mask, n_mask[None, :],
            kv_head, offs_d, d_mask, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
            stride_vh, block_size, scale_log2, DOT_PRECISION, UPCAST,
        )  # fmt: skip

    out_mask = g_mask[:, None] & d_mask[None, :]
    if DIRECT:
        o = acc / l_i[:, None]
        dst = out_ptr + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # an empty split (past the sequence's end) leaves lse = -inf and weight 0 in the merge
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o = acc / l_safe[:, None]
        dst = part_out_ptr + i * stride_pi + heads[:, None] * stride_ph + split * stride_ps
        tl.store(dst + offs_d[None, :], o, mask=out_mask)
        lse = m_i + tl.log2(l_safe)
        tl.store(part_lse_ptr + i * stride_li + heads * stride_lh + split, lse, mask=g_mask)


@triton.jit
def _decode_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    query_start_loc_ptr,
    seq_ids_ptr,
    stride_pi,
    stride_ph,
    stride_ps,
    stride_li,
    stride_lh,
    stride_ot,
    stride_oh,
    num_splits,
    head_dim,
    HAS_SEQ_IDS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i = tl.program_id(0)
    head = tl.program_id(1)
    seq = sequence_of(i, seq_ids_ptr, HAS_SEQ_IDS)
    row = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < head_dim
    lse = tl.load(
        part_lse_ptr + i * stride_li + head * stride_lh + offs_s,
        mask=s_mask,
        other=float("-inf"),
    )  # [BLOCK_S]
    weight = tl.exp2(lse - tl.max(lse, 0))  # split 0 is never empty, so the max is finite
    parts = tl.load(
        part_out_ptr + i * stride_pi + head * stride_ph + offs_s[:, None] * stride_ps + offs_d,
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    o = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    dst = out_ptr + row * stride_ot + head * stride_oh + offs_d
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=d_mask)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (the interpreter runs serially)."""
    if device.type != "cuda":
        return 1
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def decode_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, sms: int, max_splits: int = 64
) -> int:
    """How many splits to cut each context into: enough (sequence, KV head, split) programs to
    give every SM two, but no split under MIN_SPLIT_TOKENS tokens and at most ``max_splits``
    (the FlashDecoding rule: split only when batch x heads alone leaves the GPU idle)."""
    programs = max(1, num_seqs * num_kv_heads)
    want = -(-2 * sms // programs)
    return max(1, min(want, -(-max_seq_len // MIN_SPLIT_TOKENS), max_splits))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    max_seq_len: int,
    seq_ids: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> None:
    """Attend each decoding sequence's one query token over its whole paged context, into ``out``.

    Shapes and dtypes: q, out [num_tokens, num_heads, head_dim] (bf16/fp16/fp32, head_dim axis
    contiguous); k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim] (the query's
    dtype), already holding this step's K/V; block_tables int32 [num_seqs, max_blocks];
    seq_lens int32 [num_seqs] (context length including the new token, >= 1); query_start_loc
    int32 [num_seqs + 1] (the sequence's query row is ``query_start_loc[seq]``). ``seq_ids``
    (int32 [n], optional) picks the sequences to attend, e.g. the decodes of a mixed batch; None =
    all ``num_seqs``. ``max_seq_len``: max of their seq_lens (sizes the grid without a device
    sync). ``num_splits``: split-K factor, None = :func:`decode_splits`. ``scale``: softmax scale.
    Only the rows of the chosen sequences are written.

    Grid: (n, num_kv_heads, num_splits) for the partial kernel, fp32 accumulation, writing
    ``out`` directly when num_splits == 1, else partials [n, num_heads, num_splits, head_dim] +
    log-sum-exp merged by a (n, num_heads) kernel. Raises ValueError on bad shapes.
    """
    n = int(seq_ids.shape[0]) if seq_ids is not None else int(seq_lens.shape[0])
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads or k_cache.shape[-1] != head_dim or out.shape != q.shape:
        raise ValueError(
            f"paged_decode_attention: q {tuple(q.shape)}, cache {tuple(k_cache.shape)} and out "
            f"{tuple(out.shape)} do not fit"
        )
    if n == 0:
        return
    group = num_heads // num_kv_heads
    splits = num_splits or decode_splits(n, num_kv_heads, max_seq_len, num_sms(q.device))
    split_size = -(-max(1, max_seq_len) // splits)
    split_size = -(-split_size // BLOCK_N) * BLOCK_N  # whole tiles per split
    splits = -(-max(1, max_seq_len) // split_size)
    direct = splits == 1
    block_d = head_block(head_dim)
    if direct:
        part_out = part_lse = out  # unused
    else:
        part_out = torch.empty(n, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(n, num_heads, splits, dtype=torch.float32, device=q.device)
    ids = seq_ids if seq_ids is not None else seq_lens
    _decode_partial_kernel[(n, num_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, ids,
        out, part_out, part_lse,
        scale * LOG2E, split_size,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        group, head_dim, k_cache.shape[1],
        HAS_SEQ_IDS=seq_ids is not None,
        DIRECT=direct,
        DOT_PRECISION=dot_precision(q.dtype == torch.float32),
        UPCAST=interpret_upcast(q.dtype),
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=BLOCK_N,
    )  # fmt: skip
    if direct:
        return
    _decode_merge_kernel[(n, num_heads)](
        part_out, part_lse, out, query_start_loc, ids,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        splits, head_dim,
        HAS_SEQ_IDS=seq_ids is not None,
        BLOCK_S=triton.next_power_of_2(splits),
        BLOCK_D=block_d,
    )  # fmt: skip
