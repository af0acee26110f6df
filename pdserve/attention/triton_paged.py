"""The ``triton`` attention backend: paged Triton kernels that read K/V through the block table.

Per layer: :func:`~pdserve.attention.triton_kernels.kv_write.write_kv` stores the step's new K/V
by slot mapping, then sequences with one query token run the split-K paged decode kernel and the
others (prefill chunks, from position 0 or after cached tokens) the extend kernel, each writing
only its own rows of one output tensor. Nothing gathers a sequence's context into a contiguous
copy (torch_ref does, every step).

Metadata: ``build_metadata`` makes a :class:`TritonMetadata` once per step from the plain
per-step inputs (query lengths, tokens already computed, block tables): the common fields
(positions, slot mapping) plus the int32 index tensors and launch sizes the kernels read.

The kernels import ``triton`` when the backend is created, not when this module is imported, so
the registry works without triton; run them on CPU tensors only under ``TRITON_INTERPRET=1`` (set
before triton is first imported).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.attention.base import AttentionBackend, AttentionMetadata, FlatBatch, register_backend
from pdserve.config import ConfigError


@dataclass(frozen=True)
class TritonMetadata(AttentionMetadata):
    """The common metadata plus the Triton kernels' per-step inputs, shared by every layer.

    Tensors (on the model's device): query_start_loc_i32 int32 [num_seqs + 1]; seq_lens int32
    [num_seqs] (cached + new tokens); block_tables int32 [num_seqs, max_blocks], 0-padded.
    decode_ids / extend_ids: int32 indices of the sequences with one query token / with more,
    None when that group is the whole batch (the kernels then index sequences directly).
    Plain ints (no device sync per layer): num_decodes, num_extends, max_decode_seq_len (longest
    decode context, sizes the split-K grid), max_extend_query_len (longest chunk, sizes the
    extend grid).
    """

    query_start_loc_i32: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    decode_ids: torch.Tensor | None
    extend_ids: torch.Tensor | None
    num_decodes: int
    num_extends: int
    max_decode_seq_len: int
    max_extend_query_len: int

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        num_computed: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: str | torch.device = "cpu",
    ) -> TritonMetadata:
        """From per-sequence plain numbers: ``query_lens[i] >= 1`` new tokens after
        ``num_computed[i]`` cached ones, ``block_tables[i]`` covering them. Raises ValueError
        like :meth:`FlatBatch.build`."""
        b = FlatBatch.build(query_lens, num_computed, block_tables, block_size)
        n, qlens = b.num_seqs, b.query_lens
        seq_lens = b.seq_lens.tolist()
        decodes = [i for i in range(n) if qlens[i] == 1]
        extends = [i for i in range(n) if qlens[i] > 1]

        def ids(group: list[int]) -> torch.Tensor | None:
            if len(group) == n:
                return None
            return torch.tensor(group, dtype=torch.int32, device=device)

        def i32(t: torch.Tensor) -> torch.Tensor:
            return t.to(dtype=torch.int32, device=device)

        return cls(
            **b.common(device),
            query_start_loc_i32=i32(b.query_start_loc),
            seq_lens=i32(b.seq_lens),
            block_tables=i32(b.block_tables),
            decode_ids=ids(decodes),
            extend_ids=ids(extends),
            num_decodes=len(decodes),
            num_extends=len(extends),
            max_decode_seq_len=max([seq_lens[i] for i in decodes] + [0]),
            max_extend_query_len=max([qlens[i] for i in extends] + [0]),
        )


@register_backend("triton")
class TritonBackend(AttentionBackend[TritonMetadata]):
    """Paged decode (split-K) and extend kernels in Triton (CUDA; CPU under TRITON_INTERPRET=1).

    Raises ConfigError when triton cannot be imported. Inputs as :meth:`AttentionBackend.forward`;
    the caches must be in the query's dtype (the pool is allocated in the model dtype).
    """

    def __init__(self) -> None:
        try:
            from pdserve.attention.triton_kernels import decode, extend, kv_write
        except ImportError as e:
            raise ConfigError(f"--attention-backend triton needs triton ({e})") from None
        self._write_kv = kv_write.write_kv
        self._decode = decode.paged_decode_attention
        self._extend = extend.paged_extend_attention

    def build_metadata(
        self,
        query_lens: Sequence[int],
        num_computed: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: str | torch.device = "cpu",
    ) -> TritonMetadata:
        """See :meth:`TritonMetadata.build`."""
        return TritonMetadata.build(query_lens, num_computed, block_tables, block_size, device)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: TritonMetadata,
        scale: float,
    ) -> torch.Tensor:
        tm = meta
        self._write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)  # every row is written by exactly one of the kernels below
        common = (q, k_cache, v_cache, tm.block_tables, tm.seq_lens, tm.query_start_loc_i32, out)
        if tm.num_decodes:
            self._decode(*common, scale, tm.max_decode_seq_len, tm.decode_ids)
        if tm.num_extends:
            self._extend(*common, scale, tm.max_extend_query_len, tm.extend_ids)
        return out
