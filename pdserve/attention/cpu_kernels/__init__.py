"""C kernels of the ``cpu_paged`` attention backend, exposed as plain functions on CPU tensors.

- ``paged_decode.c``: paged decode attention (one query token per sequence) reading K/V in place
  through the block table, online softmax, GQA without repeating K/V, optional split-K; OpenMP
  threads over (sequence, KV head, split).

The source is compiled on first use (:mod:`pdserve.attention.cpu_build`); :func:`load` says
whether that worked. The functions here check shapes and dtypes, then pass data pointers and
strides to the library (no torch C++ extension: compiling one takes a minute).
"""

from __future__ import annotations

import ctypes
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


def load() -> KernelLibrary:
    """The compiled kernel library (compiled and cached on first use); ``.lib`` is None and
    ``.reason`` says why when it cannot be built or loaded here."""
    kl = load_library(SOURCE)
    if kl.lib is not None and kl.lib.pd_paged_decode.argtypes is None:
        kl.lib.pd_paged_decode.argtypes = _ARGTYPES
        kl.lib.pd_paged_decode.restype = ctypes.c_int
    return kl


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    rows: torch.Tensor | None = None,
    num_splits: int = 1,
    num_threads: int | None = None,
) -> None:
    """Decode attention of ``num_decodes`` sequences with one query token each, into ``out``.

    q, out: [num_rows, heads, head_dim] CPU tensors of one dtype (float32, bfloat16 or float16),
    head_dim contiguous; decode ``i`` reads and writes row ``rows[i]`` (int64 [num_decodes]),
    or row ``i`` when ``rows`` is None (then num_decodes = num_rows). Other rows of ``out`` are
    left untouched.
    k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim], any of the three dtypes (need
    not match q's), each block contiguous (one block stride for both). block_tables: int32 [num_decodes, max_blocks] (int64 is
    converted); seq_lens: int32 [num_decodes], each >= 1 and covered by its table row: the
    context including the new token, whose K/V must already be in the pool.
    ``scale``: softmax scale. ``num_splits``: context partitions per sequence, merged at the
    end (split-K, for few sequences on many threads). ``num_threads``: OpenMP threads for this
    call (default ``torch.get_num_threads()``).

    Raises RuntimeError when the kernel library is unavailable (see :func:`load`) and
    ValueError for a shape, dtype or device mismatch. Block ids and lengths are not
    range-checked here (the caller built them from the pool's own block tables).
    """
    kl = load()
    if kl.lib is None:
        raise RuntimeError(f"paged decode kernel unavailable: {kl.reason}")
    if block_tables.dtype != torch.int32:
        block_tables = block_tables.to(torch.int32)
    if seq_lens.dtype != torch.int32:
        seq_lens = seq_lens.to(torch.int32)
    block_tables = block_tables.contiguous()
    seq_lens = seq_lens.contiguous()
    n = int(seq_lens.shape[0])
    _check(q, k_cache, v_cache, block_tables, out, rows, n)
    if n == 0:
        return
    heads, head_dim = q.shape[1], q.shape[2]
    num_blocks, block_size, kv_heads = k_cache.shape[:3]
    rc = kl.lib.pd_paged_decode(
        q.data_ptr(), q.stride(0), q.stride(1), _DTYPES[q.dtype],
        k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), _DTYPES[k_cache.dtype],
        block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(),
        rows.data_ptr() if rows is not None else None, out.data_ptr(), out.stride(0), out.stride(1),
        n, heads, kv_heads, head_dim, block_size,
        scale, max(1, num_splits), num_threads or torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise MemoryError("paged decode kernel: out of memory for split-K partials")


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    out: torch.Tensor,
    rows: torch.Tensor | None,
    n: int,
) -> None:
    """ValueError naming the first argument the kernel cannot take."""
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "out": out}
    for name, t in tensors.items():
        if t.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor (got {t.device})")
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name} dtype {t.dtype} is not float32, bfloat16 or float16")
    if q.dim() != 3 or out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"q and out must be [rows, heads, head_dim] of one dtype ({q.shape})")
    if q.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("q and out must have a contiguous head_dim")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError("k_cache and v_cache must be [num_blocks, block_size, kv_heads, head_dim]")
    for t in (k_cache, v_cache):  # each block [block_size, kv_heads, head_dim] contiguous
        if t.stride()[1:] != (t.shape[2] * t.shape[3], t.shape[3], 1):
            raise ValueError("k_cache and v_cache must be contiguous within each block")
    if k_cache.stride(0) != v_cache.stride(0):
        raise ValueError("k_cache and v_cache must share their block stride")
    heads, head_dim, kv_heads = q.shape[1], q.shape[2], k_cache.shape[2]
    if k_cache.shape[3] != head_dim or heads % kv_heads:
        raise ValueError(
            f"q [.., {heads}, {head_dim}] does not fit caches [.., {kv_heads}, {k_cache.shape[3]}]"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != n:
        raise ValueError(f"block_tables must be [num_decodes={n}, max_blocks]")
    if rows is None:
        if q.shape[0] != n:
            raise ValueError(f"without rows, q must have one row per decode ({q.shape[0]} != {n})")
    elif rows.dtype != torch.int64 or rows.shape != (n,) or not rows.is_contiguous():
        raise ValueError(f"rows must be a contiguous int64 [num_decodes={n}] tensor")
