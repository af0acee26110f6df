"""The ``cpu_paged`` attention backend: decodes and prefill chunks read the paged KV pool in place
with compiled C kernels.

Per layer: the step's new K/V are stored by slot mapping (as ``torch_ref`` does), then every
sequence with one query token (a decode, or a one-token prompt) goes to the paged decode kernel
(:mod:`pdserve.attention.cpu_kernels`), which streams each sequence's blocks through its block
table with an online softmax, groups the query heads that share a KV head, and writes straight
into its rows of the output. Nothing is gathered or cast per step: ``torch_ref`` copies every
decode's context into a fresh float32 tensor in every layer. Prefill chunks (longer queries) go
to the paged prefill kernel (FlashAttention's tiled loop, reading earlier tokens' K/V through
the block table as the decode kernel does: 1.5x torch's SDPA for a 270-token SmolLM2 prompt on
one Zen 4 core), or to ``torch_ref``'s per-sequence SDPA for head shapes it does not take
(:func:`~pdserve.attention.cpu_kernels.prefill_fits`).

The kernel is compiled on first use (:mod:`pdserve.attention.cpu_build`); creating the backend
raises ConfigError when it cannot be built, and ``--attention-backend auto`` then keeps
``torch_ref`` (pdserve.attention.selector).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.attention import cpu_kernels
from pdserve.attention.base import AttentionBackend, AttentionMetadata, FlatBatch, register_backend
from pdserve.attention.cpu_kernels import DecodeBatch, PrefillBatch
from pdserve.attention.torch_ref import PrefillSpan, attend_prefills, prefill_spans, write_kv
from pdserve.config import ConfigError

# split-K policy (FlashDecoding): with fewer sequences than about this many per thread (the
# kernel's work item is one sequence, all its heads), each sequence's context is split so every
# thread gets work; a split is never shorter than MIN_SPLIT_TOKENS (below that the merge costs
# more than the balance gains)
ITEMS_PER_THREAD = 4
MIN_SPLIT_TOKENS = 256
# Below this many KV rows read per call (context tokens x KV heads, all decodes) the kernel runs on
# the calling thread alone: it then takes well under a millisecond, while waking a second OpenMP
# thread on a busy 2-core machine was measured at ~11 ms per call (the woken thread waits for a
# core: 0.47 ms on one thread vs 11.7 ms on two, batch 16 x context 270, load average 4).
MIN_PARALLEL_KV_ROWS = 1 << 18


def kernel_threads(num_decodes: int, kv_heads: int, max_seq_len: int) -> int:
    """Threads for one decode-kernel call: ``torch.get_num_threads()`` when the call reads at
    least MIN_PARALLEL_KV_ROWS KV rows, else 1."""
    if num_decodes * kv_heads * max_seq_len < MIN_PARALLEL_KV_ROWS:
        return 1
    return torch.get_num_threads()


def num_splits(num_decodes: int, max_seq_len: int, num_threads: int) -> int:
    """Context partitions per sequence for the decode kernel (1 = no split-K): enough work
    items (sequence, split) for ``num_threads`` threads, each split at least MIN_SPLIT_TOKENS
    tokens long."""
    if num_threads <= 1 or num_decodes == 0:
        return 1
    want = -(-ITEMS_PER_THREAD * num_threads // num_decodes)
    return max(1, min(want, max_seq_len // MIN_SPLIT_TOKENS))


@dataclass(frozen=True)
class CpuPagedMetadata(AttentionMetadata):
    """The common metadata plus what the decode kernel and the prefill path read (CPU tensors).

    ``decode``: the sequences with one query token (decodes, and one-token prompts): their rows,
    int32 block tables and context lengths, checked once for every layer
    (:class:`~pdserve.attention.cpu_kernels.DecodeBatch`). ``prefills``: the other sequences,
    attended one by one as in torch_ref.
    """

    decode: DecodeBatch
    prefills: tuple[PrefillSpan, ...]
    prefill_batch: PrefillBatch | None  # the prefills for the prefill kernel (None: no prefills)


@register_backend("cpu_paged")
class CpuPagedBackend(AttentionBackend[CpuPagedMetadata]):
    """Paged decode and prefill kernels in C (OpenMP over sequences x context splits, and over
    chunk x KV head x query tiles); CPU tensors only. Raises ConfigError when the kernels cannot be
    built on this machine."""

    def __init__(self) -> None:
        kl = cpu_kernels.load()
        if kl.lib is None:
            raise ConfigError(f"--attention-backend cpu_paged cannot build its kernel: {kl.reason}")

    def build_metadata(
        self,
        query_lens: Sequence[int],
        num_computed: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: str | torch.device = "cpu",
    ) -> CpuPagedMetadata:
        """Split the batch into the decode group and per-sequence prefill spans (see
        CpuPagedMetadata). Raises ValueError like :meth:`FlatBatch.build`."""
        b = FlatBatch.build(query_lens, num_computed, block_tables, block_size)
        decode_idx = [i for i in range(b.num_seqs) if b.query_lens[i] == 1]
        if len(decode_idx) == b.num_seqs:
            rows, seq_lens, tables = None, b.seq_lens, b.block_tables
        else:
            idx = torch.tensor(decode_idx, dtype=torch.int64)
            rows, seq_lens, tables = b.query_start_loc[idx], b.seq_lens[idx], b.block_tables[idx]
        width = -(-int(seq_lens.max()) // block_size) if decode_idx else 1
        spans = prefill_spans(b, set(decode_idx), device)
        return CpuPagedMetadata(
            **b.common(device),
            decode=DecodeBatch.build(tables[:, :width], seq_lens, block_size, rows),
            prefills=spans,
            prefill_batch=PrefillBatch.build(
                [s.start for s in spans],
                [s.end - s.start for s in spans],
                [s.num_computed for s in spans],
                [s.block_ids for s in spans],
                block_size,
            )
            if spans
            else None,  # a decode-only step builds nothing for the prefill kernel
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: CpuPagedMetadata,
        scale: float,
    ) -> torch.Tensor:
        if not cpu_kernels.write_kv(k, v, k_cache, v_cache, meta.slot_mapping):
            write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)  # each row is written by the kernel or by one prefill span
        d = meta.decode
        if d.num_decodes:
            threads = kernel_threads(d.num_decodes, k_cache.shape[2], d.max_seq_len)
            splits = num_splits(d.num_decodes, d.max_seq_len, threads)
            cpu_kernels.paged_decode_attention(q, k_cache, v_cache, d, out, scale, splits, threads)
        if meta.prefill_batch is not None:
            if _prefill_fits(q.shape[1], k_cache.shape[2], q.shape[2]):
                cpu_kernels.paged_prefill_attention(
                    q, k_cache, v_cache, meta.prefill_batch, out, scale
                )
            else:
                attend_prefills(q, k, v, k_cache, v_cache, meta.prefills, out, scale)
        return out


@functools.cache
def _prefill_fits(heads: int, kv_heads: int, head_dim: int) -> bool:
    return cpu_kernels.prefill_fits(heads, kv_heads, head_dim)
