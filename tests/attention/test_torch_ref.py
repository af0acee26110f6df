"""torch_ref attention over a paged pool equals naive attention over contiguous K/V."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.attention.base import FlatBatch, get_backend
from pdserve.config import ConfigError

pytestmark = pytest.mark.timeout(60)

H, HKV, D, BS, NB = 4, 2, 8, 4, 40


def _naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int) -> torch.Tensor:
    """q [n, H, D] at positions offset.., k/v [offset + n, HKV, D] -> [n, H, D], by definition."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    allowed = torch.arange(k.shape[0])[None, :] <= (offset + torch.arange(q.shape[0]))[:, None]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def test_mixed_batch_matches_naive_and_writes_slots() -> None:
    gen = torch.Generator().manual_seed(0)
    backend = get_backend("torch_ref")
    k_cache, v_cache = torch.zeros(2, NB, BS, HKV, D).unbind(0)
    # (cached tokens, new tokens, block table): decode, chunk after cache, fresh prefill, decode
    seqs = [(9, 1, [7, 3, 11]), (6, 7, [0, 5, 20, 21]), (0, 10, [30, 31, 32]), (1, 1, [39])]
    full_k = [torch.randn(c + n, HKV, D, generator=gen) for c, n, _ in seqs]
    full_v = [torch.randn(c + n, HKV, D, generator=gen) for c, n, _ in seqs]
    for (c, _, table), fk, fv in zip(seqs, full_k, full_v, strict=True):
        for p in range(c):  # earlier tokens already in the pool
            k_cache[table[p // BS], p % BS] = fk[p]
            v_cache[table[p // BS], p % BS] = fv[p]
    q = torch.randn(sum(n for _, n, _ in seqs), H, D, generator=gen)
    k = torch.cat([fk[c:] for (c, _, _), fk in zip(seqs, full_k, strict=True)])
    v = torch.cat([fv[c:] for (c, _, _), fv in zip(seqs, full_v, strict=True)])
    meta = backend.build_metadata(
        [n for _, n, _ in seqs], [c for c, _, _ in seqs], [t for _, _, t in seqs], BS
    )
    assert meta.num_decodes == 2 and len(meta.prefills) == 2
    assert meta.query_start_loc.tolist() == [0, 1, 8, 18, 19]
    out = backend.forward(q, k, v, k_cache, v_cache, meta, 1 / math.sqrt(D))

    start = 0
    for (c, n, table), fk, fv in zip(seqs, full_k, full_v, strict=True):
        ref = _naive(q[start : start + n], fk, fv, c)
        assert torch.allclose(out[start : start + n], ref, atol=1e-5)
        for p in range(c, c + n):  # new K/V landed at their slots
            assert torch.equal(k_cache[table[p // BS], p % BS], fk[p])
            assert torch.equal(v_cache[table[p // BS], p % BS], fv[p])
        start += n


def test_decode_only_batch() -> None:
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = torch.randn(2, NB, BS, HKV, D, generator=gen).unbind(0)
    lens, tables = [5, 13, 2], [[3, 4], [10, 11, 12, 13], [0]]
    q = torch.randn(3, H, D, generator=gen)
    k, v = torch.randn(2, 3, HKV, D, generator=gen).unbind(0)
    meta = get_backend().build_metadata([1, 1, 1], [n - 1 for n in lens], tables, BS)
    assert meta.num_decodes == 3 and not meta.prefills
    out = get_backend().forward(q, k, v, k_cache, v_cache, meta, 1 / math.sqrt(D))
    for i, (n, table) in enumerate(zip(lens, tables, strict=True)):
        fk = torch.cat([k_cache[b] for b in table])[:n]
        fv = torch.cat([v_cache[b] for b in table])[:n]
        assert torch.allclose(out[i : i + 1], _naive(q[i : i + 1], fk, fv, n - 1), atol=1e-5)


def test_bf16_decode_attends_in_float32() -> None:
    """A bf16 pool and query: the result is the fp32 attention of the bf16 values, rounded once."""
    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache = torch.randn(2, NB, BS, HKV, D, generator=gen).bfloat16().unbind(0)
    lens, tables = [7, 1, 16], [[2, 8], [5], [1, 9, 17, 33]]
    q = torch.randn(3, H, D, generator=gen).bfloat16()
    k, v = torch.randn(2, 3, HKV, D, generator=gen).bfloat16().unbind(0)
    meta = get_backend().build_metadata([1, 1, 1], [n - 1 for n in lens], tables, BS)
    assert meta.decode_bias.dtype == torch.float32
    # a one-token prompt (len 1) is no decode; the two decodes get [2, 1, 1, 4 blocks * 4 tokens]:
    # 0 over each context, -inf over the padding
    real = torch.arange(16)[None, :] < torch.tensor([7, 16])[:, None]
    assert torch.equal(meta.decode_bias.view(2, 16) == 0, real)
    out = get_backend().forward(q, k, v, k_cache, v_cache, meta, 1 / math.sqrt(D))
    assert out.dtype == torch.bfloat16
    for i, (n, table) in enumerate(zip(lens, tables, strict=True)):
        fk = torch.cat([k_cache[b] for b in table])[:n].float()
        fv = torch.cat([v_cache[b] for b in table])[:n].float()
        ref = _naive(q[i : i + 1].float(), fk, fv, n - 1)
        torch.testing.assert_close(out[i : i + 1].float(), ref, atol=1e-2, rtol=1e-2)


def test_positions_and_slot_mapping() -> None:
    meta = get_backend().build_metadata([3, 1], [2, 4], [[5, 9], [1, 2]], 4)
    assert meta.positions.tolist() == [2, 3, 4, 4]
    assert meta.slot_mapping.tolist() == [22, 23, 36, 8]
    assert meta.query_start_loc.tolist() == [0, 3, 4]
    # the chunk after 2 cached tokens sees keys 0..2+r; the decode group holds sequence 1
    (span,) = meta.prefills
    assert (span.start, span.end, span.seq_len) == (0, 3, 5)
    assert span.block_ids.tolist() == [5, 9] and span.mask is not None
    assert span.mask.tolist()[0] == [True, True, True, False, False]
    assert meta.decode_rows.tolist() == [3] and meta.decode_blocks.tolist() == [[1, 2]]


def test_flat_batch_pads_tables_for_backends() -> None:
    b = FlatBatch.build([3, 1], [2, 4], [[5, 9], [1, 2, 7]], 4)
    assert b.block_tables.tolist() == [[5, 9, 0], [1, 2, 7]]  # 0-padded; padding is never read
    assert b.seq_lens.tolist() == [5, 5] and b.num_seqs == 2


def test_bad_metadata_is_named() -> None:
    with pytest.raises(ValueError, match="sequence 1: block table has 1 blocks but 5 tokens"):
        get_backend().build_metadata([2, 5], [0, 0], [[0], [1]], 4)
    with pytest.raises(ValueError, match="sequence 0: query_len must be >= 1"):
        FlatBatch.build([0], [0], [[0]], 4)
    with pytest.raises(ConfigError, match="attention backend 'flash' is not available"):
        get_backend("flash")
