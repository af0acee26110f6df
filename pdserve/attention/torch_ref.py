"""Reference attention backend: ``torch.nn.functional.scaled_dot_product_attention`` over K/V
gathered from the paged pool.

Decodes (one query token each) run as one batched SDPA call over their block tables gathered into a
0-padded ``[num_decodes, max_len, kv_heads, head_dim]`` tensor with a length mask. Prefill chunks run
one SDPA call per sequence: a chunk starting at position 0 attends causally to its own fresh K/V
(no gather); a chunk continuing after cached tokens gathers its blocks and uses an explicit mask
(key ``j`` visible to query row ``r`` iff ``j <= num_computed + r``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.attention.base import AttentionBackend, AttentionMetadata, register_backend


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


@register_backend("torch_ref")
class TorchRefBackend(AttentionBackend):
    """SDPA over gathered blocks (CPU and CUDA; exact reference for other backends)."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        gqa = q.shape[1] != k.shape[1]
        if meta.num_decodes == q.shape[0]:
            # decode-only step: no per-sequence work at all
            return self._decode(q, k_cache, v_cache, meta, scale, gqa)
        out = torch.empty_like(q)
        if meta.num_decodes:
            rows = meta.decode_rows
            out.index_copy_(0, rows, self._decode(q[rows], k_cache, v_cache, meta, scale, gqa))
        for span in meta.prefills:
            qs = q[span.start : span.end].transpose(0, 1)  # [H, q_len, D]
            if span.mask is None:
                ks = k[span.start : span.end].transpose(0, 1)
                vs = v[span.start : span.end].transpose(0, 1)
                o = F.scaled_dot_product_attention(
                    qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa
                )
            else:
                ks = _gather(k_cache, span.block_ids)[: span.seq_len].transpose(0, 1)
                vs = _gather(v_cache, span.block_ids)[: span.seq_len].transpose(0, 1)
                o = F.scaled_dot_product_attention(
                    qs,
                    ks.to(q.dtype),
                    vs.to(q.dtype),
                    attn_mask=span.mask,
                    scale=scale,
                    enable_gqa=gqa,
                )
            out[span.start : span.end] = o.transpose(0, 1)
        return out

    @staticmethod
    def _decode(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        gqa: bool,
    ) -> torch.Tensor:
        """q [num_decodes, H, D] -> [num_decodes, H, D] over each sequence's gathered context."""
        ks = _gather(k_cache, meta.decode_blocks).transpose(1, 2).to(q.dtype)  # [N, Hkv, L, D]
        vs = _gather(v_cache, meta.decode_blocks).transpose(1, 2).to(q.dtype)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), ks, vs, attn_mask=meta.decode_mask, scale=scale, enable_gqa=gqa
        )  # [N, H, 1, D]
        return o.squeeze(2)
