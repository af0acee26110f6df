"""Reference attention backend: ``torch.nn.functional.scaled_dot_product_attention`` over K/V
gathered from the paged pool.

Decodes (one query token each) run as two batched float32 matmuls (scores, then probabilities x V)
over their block tables gathered into a 0-padded ``[num_decodes, kv_heads, max_len, head_dim]``
tensor with an additive length mask (faster than SDPA for one query row). Prefill chunks run
one SDPA call per sequence: a chunk starting at position 0 attends causally to its own fresh K/V
(no gather); a chunk continuing after cached tokens gathers its blocks and uses an explicit mask
(key ``j`` visible to query row ``r`` iff ``j <= num_computed + r``).

Prefill SDPA gets 4-D ``[1, heads, len, head_dim]`` inputs in the model dtype: torch's CPU flash
kernel (which accumulates in float32 for bfloat16 inputs) takes only 4-D inputs, and 3-D ones fall
back to the unfused math kernel, 3-7x slower for a 256-token chunk (SmolLM2-135M shapes, one
thread, measured on an AMX Xeon: bf16 0.66 ms per sequence and layer against 4.55 ms cast to
float32 on the math path; float32 1.45 against 3.00 ms).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.attention.base import AttentionBackend, AttentionMetadata, FlatBatch, register_backend


@dataclass(frozen=True)
class PrefillSpan:
    """A sequence attended on its own: a prefill chunk (``query_len > 1``, from position 0 or
    after cached tokens) or a one-token prompt.

    ``start``/``end``: its query rows in the flat batch. ``num_computed``: tokens already in the
    pool before this step. ``seq_len``: ``num_computed + (end - start)``. ``block_ids``: the blocks
    covering ``seq_len`` tokens, int64 [ceil(seq_len / block_size)]. ``mask``: bool
    [query_len, seq_len] (True = may attend) when the chunk continues after cached tokens, else
    None (plain causal attention over the chunk itself).
    """

    start: int
    end: int
    num_computed: int
    seq_len: int
    block_ids: torch.Tensor
    mask: torch.Tensor | None


@dataclass(frozen=True)
class TorchRefMetadata(AttentionMetadata):
    """The common metadata plus torch_ref's own (tensors on the model's device).

    Decode group (sequences with one query token and cached context), batched:
      decode_rows:   int64 [num_decodes] their rows in the flat batch.
      decode_blocks: int64 [num_decodes, max_decode_blocks] their block tables (0-padded).
      decode_bias:   float32 [num_decodes, 1, 1, max_decode_blocks * block_size]: 0 for a real
                     context token, -inf for padding (added to the scores).
    ``prefills``: the other sequences, attended one by one (one SDPA call per sequence, never per
    token).
    """

    decode_rows: torch.Tensor
    decode_blocks: torch.Tensor
    decode_bias: torch.Tensor
    prefills: tuple[PrefillSpan, ...]

    @property
    def num_decodes(self) -> int:
        """Sequences in the batched decode group."""
        return int(self.decode_rows.shape[0])


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store k, v [num_tokens, kv_heads, head_dim] at flat slots of the
    [num_blocks, block_size, kv_heads, head_dim] caches (in place)."""
    heads, dim = k_cache.shape[-2:]
    k_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, block_size, H, D], block_ids int64 [..., n] -> [..., n * block_size, H, D]."""
    out = cache.index_select(0, block_ids.reshape(-1))
    return out.view(*block_ids.shape[:-1], -1, *cache.shape[-2:])


def _gather_heads_first(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, block_size, H, D], block_ids int64 [N, n] -> float32 [N, H, n * block_size,
    D], contiguous (gather, head transpose and cast in two copies)."""
    rows = cache.index_select(0, block_ids.reshape(-1))  # [N * n, block_size, H, D]
    n_seq, heads, dim = block_ids.shape[0], cache.shape[-2], cache.shape[-1]
    rows = rows.view(n_seq, -1, heads, dim).transpose(1, 2)
    out = torch.empty(rows.shape, dtype=torch.float32, device=cache.device)
    return out.copy_(rows)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """SDPA over [..., heads, len, head_dim] tensors (GQA when k has fewer heads than q); causal
    when ``mask`` is None. Output in q's dtype."""
    dtype = q.dtype
    k, v = k.to(dtype), v.to(dtype)
    # 4-D inputs: torch's CPU flash kernel takes only [batch, heads, len, dim]; 3-D inputs fall
    # back to the unfused math path (3-7x slower for prefill chunks)
    o = F.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=mask, is_causal=mask is None, scale=scale,
        enable_gqa=q.shape[-3] != k.shape[-3],
    )  # fmt: skip
    return o[0]


def prefill_spans(
    b: FlatBatch, attended_elsewhere: set[int], device: str | torch.device
) -> tuple[PrefillSpan, ...]:
    """A :class:`PrefillSpan` for every sequence of ``b`` not in ``attended_elsewhere`` (the
    indices a backend's batched decode path covers), in batch order."""
    spans = []
    for i in range(b.num_seqs):
        if i in attended_elsewhere:
            continue
        q, c = b.query_lens[i], b.num_computed[i]
        mask = None
        if c > 0:
            # query row r sits at position c + r and may see keys 0 .. c + r
            mask = torch.arange(c + q)[None, :] <= (c + torch.arange(q))[:, None]
            mask = mask.to(device)
        start = int(b.query_start_loc[i])
        blocks = b.block_tables[i, : -(-(c + q) // b.block_size)].to(device)
        spans.append(PrefillSpan(start, start + q, c, c + q, blocks, mask))
    return tuple(spans)


def attend_prefills(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    spans: Sequence[PrefillSpan],
    out: torch.Tensor,
    scale: float,
) -> None:
    """Write the attention of each span's query rows into ``out`` (one SDPA call per span):
    q, out [num_tokens, H, D]; k, v [num_tokens, Hkv, D] the step's new K/V (already in the
    caches, which a chunk after cached tokens reads through its block ids)."""
    for span in spans:
        qs = q[span.start : span.end].transpose(0, 1)  # [H, q_len, D]
        if span.mask is None:  # chunk from position 0: its own fresh K/V, causal
            ks = k[span.start : span.end].transpose(0, 1)
            vs = v[span.start : span.end].transpose(0, 1)
        else:
            ks = _gather(k_cache, span.block_ids)[: span.seq_len].transpose(0, 1)
            vs = _gather(v_cache, span.block_ids)[: span.seq_len].transpose(0, 1)
        out[span.start : span.end] = _sdpa(qs, ks, vs, span.mask, scale).transpose(0, 1)


@register_backend("torch_ref")
class TorchRefBackend(AttentionBackend[TorchRefMetadata]):
    """SDPA over gathered blocks (CPU and CUDA; exact reference for other backends)."""

    def build_metadata(
        self,
        query_lens: Sequence[int],
        num_computed: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: str | torch.device = "cpu",
    ) -> TorchRefMetadata:
        """Split the batch into the decode group and per-sequence prefill spans (see
        TorchRefMetadata). Raises ValueError like :meth:`FlatBatch.build`."""
        b = FlatBatch.build(query_lens, num_computed, block_tables, block_size)
        qlens, ctx = b.query_lens, b.num_computed
        decode_idx = [i for i in range(b.num_seqs) if qlens[i] == 1 and ctx[i] > 0]
        prefills = prefill_spans(b, set(decode_idx), device)
        tables = b.block_tables
        d_idx = torch.tensor(decode_idx, dtype=torch.int64)
        d_seq_lens = b.seq_lens[d_idx]
        d_nblocks = int(-(-int(d_seq_lens.max()) // block_size)) if decode_idx else 1
        d_real = torch.arange(d_nblocks * block_size)[None, :] < d_seq_lens[:, None]
        d_real = d_real.view(len(decode_idx), 1, 1, d_nblocks * block_size)
        d_bias = torch.zeros(d_real.shape).masked_fill_(~d_real, float("-inf"))
        return TorchRefMetadata(
            **b.common(device),
            decode_rows=b.query_start_loc[d_idx].to(device),
            decode_blocks=tables[d_idx, :d_nblocks].to(device),
            decode_bias=d_bias.to(device),
            prefills=prefills,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: TorchRefMetadata,
        scale: float,
    ) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.num_decodes == q.shape[0]:
            # decode-only step: no per-sequence work at all
            return self._decode(q, k_cache, v_cache, meta, scale)
        out = torch.empty_like(q)
        if meta.num_decodes:
            rows = meta.decode_rows
            out.index_copy_(0, rows, self._decode(q[rows], k_cache, v_cache, meta, scale))
        attend_prefills(q, k, v, k_cache, v_cache, meta.prefills, out, scale)
        return out

    @staticmethod
    def _decode(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: TorchRefMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q [num_decodes, H, D] -> [num_decodes, H, D] over each sequence's gathered context.

        Two batched float32 matmuls with the query heads of a KV head grouped as rows (GQA without
        repeating K/V) and the additive length mask ``meta.decode_bias``; for one query token per
        sequence this beats SDPA's flash kernel, whose per-call set-up dominates at short contexts.
        """
        n, heads, dim = q.shape
        kv_heads = k_cache.shape[-2]
        ks = _gather_heads_first(k_cache, meta.decode_blocks)  # [N, Hkv, L, D] float32
        vs = _gather_heads_first(v_cache, meta.decode_blocks)
        qg = q.view(n, kv_heads, heads // kv_heads, dim).float() * scale  # [N, Hkv, G, D]
        scores = torch.matmul(qg, ks.transpose(-1, -2)).add_(meta.decode_bias)  # [N, Hkv, G, L]
        o = torch.matmul(scores.softmax(dim=-1), vs)  # [N, Hkv, G, D]
        return o.view(n, heads, dim).to(q.dtype)
