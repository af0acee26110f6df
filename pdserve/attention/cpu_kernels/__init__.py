"""C kernels of the ``cpu_paged`` attention backend, exposed as plain functions on CPU tensors.

- ``paged_decode.c``: paged decode attention (one query token per sequence) reading K/V in place
  through the block table, online softmax, GQA without repeating K/V, optional split-K; OpenMP
  threads over (sequence, split). And paged prefill attention (causal chunks, from position 0 or
  after cached tokens), tiled as FlashAttention; OpenMP threads over (chunk, KV head, 16 rows).

The source is compiled on first use (:mod:`pdserve.attention.cpu_build`); :func:`load` says
whether that worked. A call passes data pointers and strides to the library (no torch C++
extension: compiling one takes a minute). What is constant over a step (block tables, lengths,
rows) is a :class:`DecodeBatch`, checked once when the step's metadata is built; each layer's
call then checks only its own tensors, so a step of many layers pays for one validation of
the batch. Every index the kernel follows is range-checked before it runs: a bad table is a
ValueError, never a read outside the pool.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.attention.cpu_build import KernelLibrary, load_library

SOURCE = Path(__file__).with_name("paged_decode.c")

# the C side's dtype codes
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_c_int64, _c_int, _c_float, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
_ARGTYPES = [
    _ptr, _c_int64, _c_int64, _c_int,  # q, q strides (token, head), q dtype
    _ptr, _ptr, _c_int64, _c_int,  # k_cache, v_cache, block stride, kv dtype
    _ptr, _c_int64, _ptr,  # block tables, table row stride, seq_lens
    _ptr, _ptr, _c_int64, _c_int64,  # rows, out, out strides (token, head)
    _c_int, _c_int, _c_int, _c_int, _c_int,  # num_decodes, heads, kv_heads, head_dim, block_size
    _c_float, _c_int, _c_int,  # scale, num_splits, num_threads
]  # fmt: skip


# the library's entry point once loaded (the per-layer calls skip the cache look-up)
_decode_fn: Callable[..., int] | None = None


def load() -> KernelLibrary:
    """The compiled kernel library (compiled and cached on first use); ``.lib`` is None and
    ``.reason`` says why when it cannot be built or loaded here."""
    global _decode_fn
    kl = load_library(SOURCE)
    if kl.lib is not None and kl.lib.pd_paged_decode.argtypes is None:
        kl.lib.pd_paged_decode.argtypes = _ARGTYPES
        kl.lib.pd_paged_decode.restype = ctypes.c_int
        _decode_fn = kl.lib.pd_paged_decode
    return kl


def decode_kernel() -> Callable[..., int]:
    """The loaded ``pd_paged_decode`` entry point, for code that calls it from C
    (:mod:`pdserve.model.cpu_decode`; arguments as :func:`paged_decode_attention` passes them).
    Raises RuntimeError when the library is unavailable (see :func:`load`)."""
    kl = load()
    if kl.lib is None:
        raise RuntimeError(f"paged decode kernel unavailable: {kl.reason}")
    fn: Callable[..., int] = kl.lib.pd_paged_decode
    return fn


@dataclass(frozen=True)
class DecodeBatch:
    """The decode kernel's inputs that are the same for every layer of a step (CPU tensors).

    block_tables: int32 [num_decodes, max_blocks] physical block ids (entries past a sequence's
    last block are never read); seq_lens: int32 [num_decodes] context tokens, each >= 1 and
    within its table row, including the new token (whose K/V the caller writes first); rows:
    int64 [num_decodes] the query/output row of each decode, or None (row i = decode i).
    Build it with :meth:`build`, which checks all of this once.
    """

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    rows: torch.Tensor | None
    block_size: int
    num_decodes: int
    max_seq_len: int
    max_block_id: int  # largest block id a sequence reads (checked against each layer's pool)
    max_row: int  # largest row read (checked against each layer's q)

    @classmethod
    def build(
        cls,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        block_size: int,
        rows: torch.Tensor | None = None,
    ) -> DecodeBatch:
        """Check and convert (int64 tables/lengths become int32, made contiguous). Raises
        ValueError naming the argument when a shape, dtype or length is wrong."""
        tables = block_tables.to(torch.int32).contiguous()
        lens = seq_lens.to(torch.int32).contiguous()
        n = int(lens.shape[0]) if lens.dim() == 1 else -1
        if n < 0 or tables.dim() != 2 or tables.shape[0] != n:
            raise ValueError(
                "block_tables must be [num_decodes, max_blocks], seq_lens [num_decodes]"
            )
        if not (tables.is_cpu and lens.is_cpu):
            raise ValueError("block_tables and seq_lens must be CPU tensors")
        if rows is not None:
            if rows.dtype != torch.int64 or rows.shape != (n,) or not rows.is_contiguous():
                raise ValueError(f"rows must be a contiguous int64 [num_decodes={n}] tensor")
            if n and int(rows.min()) < 0:
                raise ValueError("rows must be >= 0")
        if n == 0:
            return cls(tables, lens, rows, block_size, 0, 0, -1, -1)
        min_len, max_len = int(lens.min()), int(lens.max())
        if min_len < 1 or max_len > tables.shape[1] * block_size:
            raise ValueError(
                f"seq_lens must be in [1, {tables.shape[1] * block_size}] (the tables' "
                f"{tables.shape[1]} blocks of {block_size}); got {min_len}..{max_len}"
            )
        # the blocks each sequence reads: the first ceil(len / block_size) of its row
        used = torch.arange(tables.shape[1]) < ((lens + block_size - 1) // block_size)[:, None]
        read = tables[used]
        if int(read.min()) < 0:
            raise ValueError("block ids must be >= 0")
        max_row = int(rows.max()) if rows is not None else n - 1
        return cls(tables, lens, rows, block_size, n, max_len, int(read.max()), max_row)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: DecodeBatch,
    out: torch.Tensor,
    scale: float,
    num_splits: int = 1,
    num_threads: int | None = None,
) -> None:
    """Decode attention of ``batch.num_decodes`` sequences, one query token each, into ``out``.

    q, out: [num_rows, heads, head_dim] CPU tensors of one dtype (float32, bfloat16 or float16),
    head_dim contiguous; decode ``i`` reads and writes row ``batch.rows[i]`` (or row ``i``);
    other rows of ``out`` are left untouched. k_cache, v_cache: [num_blocks, block_size,
    kv_heads, head_dim], float32, bfloat16 or float16 (need not match q's), each block
    contiguous, one block stride for both; heads a multiple of kv_heads (grouped-query
    attention). ``scale``: softmax scale. ``num_splits``: context partitions per sequence,
    merged at the end (split-K, for few sequences on many threads). ``num_threads``: OpenMP
    threads for this call (default ``torch.get_num_threads()``).

    Raises RuntimeError when the kernel library is unavailable (see :func:`load`), ValueError
    for a shape, dtype, device or range mismatch, MemoryError when split-K scratch cannot be
    allocated.
    """
    fn = _decode_fn
    if fn is None:
        kl = load()
        if kl.lib is None:
            raise RuntimeError(f"paged decode kernel unavailable: {kl.reason}")
        fn = kl.lib.pd_paged_decode
    _check(q, k_cache, v_cache, out, batch)
    if batch.num_decodes == 0:
        return
    qs, ks = q.shape, k_cache.shape
    q_st, o_st = q.stride(), out.stride()
    rows = batch.rows.data_ptr() if batch.rows is not None else None
    rc = fn(
        q.data_ptr(), q_st[0], q_st[1], _DTYPES[q.dtype],
        k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), _DTYPES[k_cache.dtype],
        batch.block_tables.data_ptr(), batch.block_tables.shape[1], batch.seq_lens.data_ptr(),
        rows, out.data_ptr(), o_st[0], o_st[1],
        batch.num_decodes, qs[1], ks[2], qs[2], ks[1],
        scale, max(1, num_splits), num_threads or torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise MemoryError("paged decode kernel: out of memory for split-K partials")


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    batch: DecodeBatch,
) -> None:
    """ValueError naming the first argument the kernel cannot take (cheap: once per layer)."""
    _check_tensors(q, k_cache, v_cache, out, batch.block_size, batch.max_block_id)
    qs = q.shape
    if batch.max_row >= qs[0] or (batch.rows is None and qs[0] != batch.num_decodes):
        raise ValueError(f"q has {qs[0]} rows, the batch reads {batch.num_decodes} decodes")


def _check_tensors(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    block_size: int,
    max_block_id: int,
) -> None:
    """ValueError naming the first of the tensors a kernel cannot take, or a pool that does not
    fit the batch (its block size, or a block id past its end)."""
    if not (q.is_cpu and k_cache.is_cpu and v_cache.is_cpu and out.is_cpu):
        raise ValueError("q, k_cache, v_cache and out must be CPU tensors")
    if q.dtype not in _DTYPES or k_cache.dtype not in _DTYPES:
        raise ValueError(f"dtypes {q.dtype}, {k_cache.dtype}: only float32, bfloat16, float16")
    qs, ks, kst = q.shape, k_cache.shape, k_cache.stride()
    if len(qs) != 3 or out.shape != qs or out.dtype != q.dtype:
        raise ValueError(f"q and out must be [rows, heads, head_dim] of one dtype ({qs})")
    if q.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("q and out must have a contiguous head_dim")
    if len(ks) != 4 or v_cache.shape != ks or v_cache.dtype != k_cache.dtype:
        raise ValueError("k_cache and v_cache must be [num_blocks, block_size, kv_heads, head_dim]")
    if kst[1:] != (ks[2] * ks[3], ks[3], 1) or v_cache.stride() != kst:
        raise ValueError("k_cache and v_cache must be contiguous within each block, alike")
    if ks[3] != qs[2] or qs[1] % ks[2]:
        raise ValueError(f"q [.., {qs[1]}, {qs[2]}] does not fit caches [.., {ks[2]}, {ks[3]}]")
    if ks[1] != block_size:
        raise ValueError(f"caches have blocks of {ks[1]}, the batch {block_size}")
    if max_block_id >= ks[0]:
        raise ValueError(f"block id {max_block_id} is outside the pool ({ks[0]} blocks)")


_PREFILL_ARGTYPES = [
    _ptr, _c_int64, _c_int64, _c_int,  # q, q strides (token, head), q dtype
    _ptr, _ptr, _c_int64, _c_int,  # k_cache, v_cache, block stride, kv dtype
    _ptr, _c_int64,  # block tables, table row stride
    _ptr, _ptr, _ptr, _c_int64,  # starts, q_lens, computed, num_spans
    _ptr, _c_int64, _c_int64,  # out, out strides (token, head)
    _c_int, _c_int, _c_int, _c_int,  # heads, kv_heads, head_dim, block_size
    _c_float, _c_int,  # scale, num_threads
]  # fmt: skip


@dataclass(frozen=True)
class PrefillBatch:
    """The prefill kernel's inputs that are the same for every layer of a step (CPU tensors).

    starts, q_lens, computed: int64 [num_spans], each chunk's first query row, its number of
    query rows (>= 1) and the tokens of its sequence already in the pool before it (its first
    row sits at that position); block_tables: int32 [num_spans, max_blocks], each row covering
    ``computed + q_len`` tokens. Build it with :meth:`build`, which checks all of this once.
    """

    starts: torch.Tensor
    q_lens: torch.Tensor
    computed: torch.Tensor
    block_tables: torch.Tensor
    block_size: int
    max_block_id: int
    max_row: int  # one past the largest query row

    @classmethod
    def build(
        cls,
        starts: list[int],
        q_lens: list[int],
        computed: list[int],
        block_tables: list[torch.Tensor],
        block_size: int,
    ) -> PrefillBatch:
        """Raises ValueError when a length or a table does not fit."""
        n = len(starts)
        if not (len(q_lens) == len(computed) == len(block_tables) == n):
            raise ValueError("starts, q_lens, computed and block_tables must have one entry each")
        width = max((int(t.numel()) for t in block_tables), default=1)
        tables = torch.zeros(n, max(1, width), dtype=torch.int32)
        for i, t in enumerate(block_tables):
            need = -(-(computed[i] + q_lens[i]) // block_size)
            if q_lens[i] < 1 or computed[i] < 0 or t.numel() < need:
                raise ValueError(
                    f"chunk {i}: {q_lens[i]} query rows after {computed[i]} tokens need {need} "
                    f"blocks of {block_size}, its table has {t.numel()}"
                )
            tables[i, : t.numel()] = t.to(torch.int32)
        if n and int(tables.min()) < 0:
            raise ValueError("block ids must be >= 0")
        return cls(
            torch.tensor(starts, dtype=torch.int64),
            torch.tensor(q_lens, dtype=torch.int64),
            torch.tensor(computed, dtype=torch.int64),
            tables,
            block_size,
            int(tables.max()) if n else -1,
            max((s + ql for s, ql in zip(starts, q_lens, strict=True)), default=0),
        )


_WRITE_KV_ARGTYPES = [
    _ptr, _c_int64, _c_int64, _ptr, _c_int64, _c_int64,  # k, its strides, v, its strides
    _ptr, _ptr, _c_int64,  # k_cache, v_cache, block stride
    _ptr, _c_int64, _c_int, _c_int, _c_int, _c_int64, _c_int,  # slots, n, shapes, element bytes
]  # fmt: skip


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> bool:
    """Store k, v [num_tokens, kv_heads, head_dim] at the flat slots ``slot_mapping`` (int64
    [num_tokens]) of the caches [num_blocks, block_size, kv_heads, head_dim], as
    :func:`pdserve.attention.torch_ref.write_kv` does, with one C loop of row copies. Returns
    False, writing nothing, where the loop does not apply (the library unavailable, another
    device, dtypes that differ, a head_dim or cache that is not contiguous, slots not a
    contiguous int64 vector): the caller then writes with torch. Raises ValueError, writing
    nothing, for a slot outside the caches."""
    kl = load()
    n = k.shape[0] if k.dim() == 3 else -1
    if (
        kl.lib is None
        or n < 0
        or not (k.is_cpu and v.is_cpu and k_cache.is_cpu and v_cache.is_cpu and slot_mapping.is_cpu)
        or not (k.dtype == v.dtype == k_cache.dtype == v_cache.dtype)
        or k_cache.dtype not in _DTYPES
        or v.shape != k.shape
        or k_cache.dim() != 4
        or v_cache.shape != k_cache.shape
        or k.shape[1:] != k_cache.shape[2:]
        or k.stride(2) != 1
        or v.stride(2) != 1
        or k_cache.stride()[1:] != (k_cache.shape[2] * k_cache.shape[3], k_cache.shape[3], 1)
        or v_cache.stride() != k_cache.stride()
        or slot_mapping.dtype != torch.int64
        or slot_mapping.shape != (n,)
        or not slot_mapping.is_contiguous()
    ):
        return False
    fn = kl.lib.pd_write_kv
    if fn.argtypes is None:
        fn.argtypes = _WRITE_KV_ARGTYPES
        fn.restype = ctypes.c_int
    ks, kst, vst = k_cache.shape, k.stride(), v.stride()
    rc = fn(
        k.data_ptr(), kst[0], kst[1], v.data_ptr(), vst[0], vst[1],
        k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
        slot_mapping.data_ptr(), n, ks[2], ks[3], ks[1], ks[0], k_cache.element_size(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"a slot of slot_mapping is outside the caches ({ks[0] * ks[1]} slots)")
    return True


def prefill_fits(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether :func:`paged_prefill_attention` takes these shapes (the library loaded here, heads
    a multiple of kv_heads with at most 8 query heads per KV head, head_dim a multiple of 16 up
    to 128)."""
    kl = load()
    return kl.lib is not None and bool(kl.lib.pd_paged_prefill_fits(heads, kv_heads, head_dim))


def set_decode_amx(on: bool) -> bool:
    """Let :func:`paged_decode_attention` run bf16 decodes on the CPU's AMX tiles (``on``, the
    default; query heads a KV head at most 16, head_dim a multiple of 32 up to 256, blocks a
    multiple of 16 tokens) or keep them on the VDPBF16PS path (for benchmarks and tests of that
    path); a process-wide switch. Returns whether bf16 decode now runs on AMX: False wherever the
    library was built without AMX or the OS refuses tile data. Raises RuntimeError when the
    kernel library is unavailable."""
    return _set_amx("pd_set_decode_amx", "paged decode", on)


def set_prefill_amx(on: bool) -> bool:
    """Let :func:`paged_prefill_attention` run bf16 chunks on the CPU's AMX tiles (``on``, the
    default) or keep them on the VDPBF16PS path (for benchmarks and tests of that path); a
    process-wide switch. Returns whether bf16 prefill now runs on AMX: False wherever the library
    was built without AMX (``-march=native`` on a CPU without ``amx_bf16``) or the OS refuses
    tile data. Raises RuntimeError when the kernel library is unavailable."""
    return _set_amx("pd_set_prefill_amx", "paged prefill", on)


def _set_amx(symbol: str, what: str, on: bool) -> bool:
    """Call the library's AMX switch ``symbol`` (int -> int) with ``on``; RuntimeError naming
    ``what`` when the library is unavailable."""
    kl = load()
    if kl.lib is None:
        raise RuntimeError(f"{what} kernel unavailable: {kl.reason}")
    fn = getattr(kl.lib, symbol)
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return bool(fn(int(on)))


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PrefillBatch,
    out: torch.Tensor,
    scale: float,
    num_threads: int | None = None,
) -> None:
    """Causal attention of every prefill chunk of ``batch`` into its rows of ``out``, reading K/V
    from the caches through the chunks' block tables (the caller writes the chunks' own K/V
    first). q, out, k_cache, v_cache as for :func:`paged_decode_attention`; rows of ``out``
    outside the chunks are left untouched. The algorithm and its source: the kernel's comment
    (``paged_decode.c``, "paged prefill attention").

    Raises RuntimeError when the kernel library is unavailable or the shapes are not ones it
    takes (:func:`prefill_fits`), ValueError for a shape, dtype, device or range mismatch,
    MemoryError when its work list cannot be allocated.
    """
    kl = load()
    if kl.lib is None:
        raise RuntimeError(f"paged prefill kernel unavailable: {kl.reason}")
    fn = kl.lib.pd_paged_prefill
    if fn.argtypes is None:
        fn.argtypes = _PREFILL_ARGTYPES
        fn.restype = ctypes.c_int
    _check_tensors(q, k_cache, v_cache, out, batch.block_size, batch.max_block_id)
    qs, ks = q.shape, k_cache.shape
    if batch.max_row > qs[0]:
        raise ValueError(f"q has {qs[0]} rows, the chunks read up to row {batch.max_row - 1}")
    if batch.starts.numel() == 0:
        return
    q_st, o_st = q.stride(), out.stride()
    rc = fn(
        q.data_ptr(), q_st[0], q_st[1], _DTYPES[q.dtype],
        k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), _DTYPES[k_cache.dtype],
        batch.block_tables.data_ptr(), batch.block_tables.shape[1],
        batch.starts.data_ptr(), batch.q_lens.data_ptr(), batch.computed.data_ptr(),
        batch.starts.numel(), out.data_ptr(), o_st[0], o_st[1],
        qs[1], ks[2], qs[2], ks[1], scale, num_threads or torch.get_num_threads(),
    )  # fmt: skip
    if rc == -2:
        raise RuntimeError(f"paged prefill kernel: shapes q {list(qs)}, caches {list(ks)} unfit")
    if rc != 0:
        raise MemoryError("paged prefill kernel: out of memory for its work list")
