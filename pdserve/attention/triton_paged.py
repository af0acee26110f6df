"""The ``triton`` attention backend: paged Triton kernels that read K/V through the block table.

Per layer: :func:`~pdserve.attention.triton_kernels.kv_write.write_kv` stores the step's new K/V
by slot mapping, then sequences with one query token run the split-K paged decode kernel and the
others (prefill chunks, from position 0 or after cached tokens) the extend kernel, each writing
only its own rows of one output tensor. Nothing gathers a sequence's context into a contiguous
copy (torch_ref does, every step).

Metadata: :class:`TritonMetadata` is built once per step from the plain per-step inputs
(query lengths, tokens already computed, block tables); the slot mapping is the common one. The
backend adapts today's shared :class:`~pdserve.attention.base.AttentionMetadata` by rebuilding
its own from those inputs the first time a step's metadata object reaches it (all layers then
reuse it).

The kernels import ``triton`` when the backend is created, not when this module is imported, so
the registry works without triton; run them on CPU tensors only under ``TRITON_INTERPRET=1`` (set
before triton is first imported).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.attention.base import AttentionBackend, AttentionMetadata, register_backend
from pdserve.config import ConfigError


@dataclass(frozen=True)
class TritonMetadata:
    """Per-step inputs of the Triton kernels, shared by every layer.

    Tensors (on the model's device): query_start_loc int32 [num_seqs + 1]; seq_lens int32
    [num_seqs] (cached + new tokens); block_tables int32 [num_seqs, max_blocks], 0-padded.
    decode_ids / extend_ids: int32 indices of the sequences with one query token / with more,
    None when that group is the whole batch (the kernels then index sequences directly).
    Plain ints (no device sync per layer): num_decodes, num_extends, max_decode_seq_len (longest
    decode context, sizes the split-K grid), max_extend_query_len (longest chunk, sizes the
    extend grid). ``block_size`` in tokens.
    """

    block_size: int
    query_start_loc: torch.Tensor
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
        """From per-sequence plain numbers (validated by AttentionMetadata.build, which every
        step also runs): ``query_lens[i] >= 1`` new tokens after ``num_computed[i]`` cached ones,
        ``block_tables[i]`` covering them."""
        n = len(query_lens)
        qlens = [int(q) for q in query_lens]
        seq_lens = [int(c) + q for c, q in zip(num_computed, qlens, strict=True)]
        starts = [0]
        for q in qlens:
            starts.append(starts[-1] + q)
        width = max([len(t) for t in block_tables] + [1])
        tables = [list(t) + [0] * (width - len(t)) for t in block_tables]
        decodes = [i for i in range(n) if qlens[i] == 1]
        extends = [i for i in range(n) if qlens[i] > 1]

        def ids(group: list[int]) -> torch.Tensor | None:
            if len(group) == n:
                return None
            return torch.tensor(group, dtype=torch.int32, device=device)

        return cls(
            block_size=block_size,
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device).view(n, width),
            decode_ids=ids(decodes),
            extend_ids=ids(extends),
            num_decodes=len(decodes),
            num_extends=len(extends),
            max_decode_seq_len=max([seq_lens[i] for i in decodes] + [0]),
            max_extend_query_len=max([qlens[i] for i in extends] + [0]),
        )

    @classmethod
    def from_common(cls, meta: AttentionMetadata) -> TritonMetadata:
        """Adapter from the shared metadata (one device-to-host copy per step)."""
        starts = meta.query_start_loc.tolist()
        qlens = [b - a for a, b in zip(starts, starts[1:], strict=False)]
        computed = [s - q for s, q in zip(meta.seq_lens.tolist(), qlens, strict=True)]
        return cls.build(
            qlens, computed, meta.block_tables.tolist(), meta.block_size, meta.seq_lens.device
        )


@register_backend("triton")
class TritonBackend(AttentionBackend):
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
        # the last step's shared metadata and ours, so the layers after the first reuse it
        self._step: tuple[AttentionMetadata, TritonMetadata] | None = None

    def metadata(self, meta: AttentionMetadata) -> TritonMetadata:
        """This step's TritonMetadata, built on the first layer and reused by the others."""
        if self._step is None or self._step[0] is not meta:
            self._step = (meta, TritonMetadata.from_common(meta))
        return self._step[1]

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
        tm = self.metadata(meta)
        self._write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)  # every row is written by exactly one of the kernels below
        common = (q, k_cache, v_cache, tm.block_tables, tm.seq_lens, tm.query_start_loc, out)
        if tm.num_decodes:
            self._decode(*common, scale, tm.max_decode_seq_len, tm.decode_ids)
        if tm.num_extends:
            self._extend(*common, scale, tm.max_extend_query_len, tm.extend_ids)
        return out
