"""The C paged decode and prefill kernels against attention by definition (float64) on random
paged pools."""

from __future__ import annotations

import ctypes
import platform
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch
from attention_pools import shuffled_block_tables

from pdserve import env
from pdserve.attention import cpu_kernels
from pdserve.attention.cpu_build import find_compiler, load_library
from pdserve.attention.cpu_kernels import DecodeBatch, PrefillBatch

pytestmark = pytest.mark.timeout(300)

T = TypeVar("T")
U = TypeVar("U")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module", autouse=True)
def kernel_built() -> None:
    kl = cpu_kernels.load()
    assert kl.lib is not None, kl.reason  # CI has gcc: a build failure here is a defect


def random_pool(
    lens: list[int],
    kv_heads: int,
    head_dim: int,
    block_size: int,
    kv_dtype: torch.dtype,
    gen: torch.Generator,
) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """(block tables, k_cache, v_cache): random K/V for sequences of ``lens`` tokens in a pool
    whose blocks are shuffled (each table out of order, spare blocks holding garbage)."""
    tables, num_blocks = shuffled_block_tables(lens, block_size, gen, spare=3)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k = torch.randn(shape, generator=gen).to(kv_dtype)
    return tables, k, torch.randn(shape, generator=gen).to(kv_dtype)


class Pool:
    """Random K/V for sequences of ``lens`` tokens in a pool whose blocks are shuffled (each
    table out of order, spare blocks holding garbage), plus one query row per sequence."""

    def __init__(
        self,
        lens: list[int],
        heads: int,
        kv_heads: int,
        head_dim: int,
        block_size: int,
        kv_dtype: torch.dtype,
        q_dtype: torch.dtype,
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.tables, self.k_cache, self.v_cache = random_pool(
            lens, kv_heads, head_dim, block_size, kv_dtype, gen
        )
        num_blocks = self.k_cache.shape[0]
        self.q = torch.randn(len(lens), heads, head_dim, generator=gen).to(q_dtype)
        self.lens, self.block_size, self.scale = lens, block_size, head_dim**-0.5
        width = max(len(t) for t in self.tables)
        self.block_tables = torch.tensor(
            [t + [num_blocks + 99] * (width - len(t)) for t in self.tables], dtype=torch.int32
        )  # padding is an invalid block id: the kernel must never read it
        self.seq_lens = torch.tensor(lens, dtype=torch.int32)

    def poison_unused(self) -> None:
        """NaN into every pool slot outside the sequences' contexts (freed blocks, the unwritten
        tail of a last block), so a kernel that reads one shows it."""
        used = torch.zeros(self.k_cache.shape[:2], dtype=torch.bool)
        for table, n in zip(self.tables, self.lens, strict=True):
            for t in range(n):
                used[table[t // self.block_size], t % self.block_size] = True
        self.k_cache[~used] = float("nan")
        self.v_cache[~used] = float("nan")

    def reference(self, i: int) -> torch.Tensor:
        """Decode i's attention [heads, head_dim] by definition, in float64."""
        n, table = self.lens[i], self.tables[i]
        k = self.k_cache[table].flatten(0, 1)[:n].double()  # [n, kv_heads, D]
        v = self.v_cache[table].flatten(0, 1)[:n].double()
        q = self.q[i].double()  # [heads, D]
        group = q.shape[0] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        probs = (torch.einsum("hd,nhd->hn", q, k) * self.scale).softmax(-1)
        return torch.einsum("hn,nhd->hd", probs, v)

    def batch(self, rows: torch.Tensor | None = None) -> DecodeBatch:
        return DecodeBatch.build(self.block_tables, self.seq_lens, self.block_size, rows)

    def run(self, num_splits: int = 1, num_threads: int | None = None) -> torch.Tensor:
        out = torch.full_like(self.q, float("nan"))
        cpu_kernels.paged_decode_attention(
            self.q, self.k_cache, self.v_cache, self.batch(), out, self.scale, num_splits,
            num_threads,
        )  # fmt: skip
        return out

    def error(self, out: torch.Tensor) -> float:
        """max over decodes of ||out_i - ref_i|| / ||ref_i||."""
        errs = []
        for i in range(len(self.lens)):
            ref = self.reference(i)
            errs.append(float((out[i].double() - ref).norm() / ref.norm()))
        return max(errs)


def amx_off_then_on(
    switch: Callable[[bool], bool], off: Callable[[], T], on: Callable[[], U]
) -> tuple[T, bool, U]:
    """(off() with the kernel's AMX ``switch`` off, whether AMX is on once switched on, on() then);
    the switch is left on. AMX must be on exactly where the CPU has it and the build targets it."""
    from pdserve.cpu import has_amx_bf16

    try:
        assert switch(False) is False
        first = off()
        state = switch(True)
        assert state == (has_amx_bf16() and "-march=native" in cpu_kernels.load().flags)
        return first, state, on()
    finally:
        switch(True)


def tolerance(q_dtype: torch.dtype) -> float:
    """fp32 accumulation gives ~1e-6; a half-precision output is rounded once (2^-8 relative)."""
    return 2e-5 if q_dtype == torch.float32 else 8e-3


# lengths: 1 token, block multiples (16, 32, 64), one past and one short of a block, long
LENS = [1, 16, 17, 31, 64, 203, 1000]


@pytest.mark.parametrize("kv_dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (8, 8, 128, 16), (8, 1, 80, 32), (16, 2, 32, 1), (12, 1, 40, 8)],
    ids=["gqa3-d64", "mha-d128", "gqa8-d80", "gqa8-d32-bs1", "gqa12-d40-bs8"],
)
def test_decode_matches_definition(
    kv_dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int
) -> None:
    """Head sizes with and without a vector-width remainder (40, 80), GQA ratios 1..12 (12 runs
    in two passes of query heads), block sizes 1..32, one KV dtype = the query dtype."""
    pool = Pool(LENS, heads, kv_heads, head_dim, block_size, kv_dtype, kv_dtype)
    assert pool.error(pool.run(num_threads=1)) < tolerance(kv_dtype)


@pytest.mark.parametrize(
    ("kv_dtype", "q_dtype"),
    [
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.float16, torch.float32),
    ],
    ids=str,
)
def test_kv_dtype_may_differ_from_query(kv_dtype: torch.dtype, q_dtype: torch.dtype) -> None:
    pool = Pool([5, 77], 4, 2, 64, 16, kv_dtype, q_dtype, seed=1)
    out = pool.run()
    assert out.dtype == q_dtype and pool.error(out) < tolerance(q_dtype)


@pytest.mark.parametrize("num_splits", [2, 3, 8, 100])
def test_split_k_and_threads_agree(num_splits: int) -> None:
    """Split-K (including more splits than a short sequence has blocks: empty splits) on 2
    threads equals the single-pass answer on one thread."""
    pool = Pool([1, 40, 700, 2047], 6, 2, 64, 16, torch.float32, torch.float32, seed=2)
    single = pool.run(num_threads=1)
    assert pool.error(single) < tolerance(torch.float32)
    split = pool.run(num_splits=num_splits, num_threads=2)
    torch.testing.assert_close(split, single, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 1, 32), (2, 2, 96)])
def test_slots_outside_the_contexts_are_never_used(
    kv_dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> None:
    """Every pool slot that is not part of a sequence's context holds NaN (a freed block, the
    unwritten tail of a last block): odd context lengths end tiles mid-pair, where the bf16
    values pass (two tokens per VDPBF16PS) must use a zero row, not the slot after."""
    pool = Pool([1, 3, 17, 33, 255, 301], heads, kv_heads, head_dim, 16, kv_dtype, kv_dtype, seed=6)
    pool.poison_unused()
    for splits in (1, 3):
        out = pool.run(num_splits=splits, num_threads=1)
        assert not out.isnan().any()
        assert pool.error(out) < tolerance(kv_dtype)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (32, 8, 64, 16), (16, 1, 128, 32), (8, 8, 256, 16), (24, 1, 64, 16)],
    ids=["gqa3-d64", "gqa4-two-passes", "gqa16-d128-bs32", "mha-d256", "gqa24-not-amx"],
)
def test_decode_on_amx_tiles_matches_the_other_path(
    heads: int, kv_heads: int, head_dim: int, block_size: int
) -> None:
    """Where the CPU has AMX, bf16 decode runs on its tiles (attend_range_amx: one pass of up to
    16 query heads, more KV heads in more passes, split-K and two threads too); it and the
    VDPBF16PS path both match attention by definition, to the same bound, and slots outside
    the contexts (NaN here) are never used. Elsewhere the switch reports that AMX is off."""
    lens = [1, 15, 16, 17, 255, 256, 257, 600]
    pool = Pool(lens, heads, kv_heads, head_dim, block_size, torch.bfloat16, torch.bfloat16, 9)
    pool.poison_unused()
    other, on, (amx, amx_split) = amx_off_then_on(
        cpu_kernels.set_decode_amx,
        lambda: pool.run(num_threads=1),
        lambda: (pool.run(num_threads=2), pool.run(num_splits=3, num_threads=2)),
    )
    for out in (other, amx, amx_split):
        assert not out.isnan().any()
        assert pool.error(out) < tolerance(torch.bfloat16)
    torch.testing.assert_close(amx_split, amx, atol=2e-2, rtol=2e-2)
    took_amx = on and heads // kv_heads <= 16
    assert torch.equal(amx, other) != took_amx  # a different path ran exactly where it fits


def test_long_context_bf16() -> None:
    pool = Pool([32768, 3], 4, 1, 64, 16, torch.bfloat16, torch.bfloat16, seed=3)
    assert pool.error(pool.run(num_splits=4, num_threads=2)) < tolerance(torch.bfloat16)


def test_rows_select_decodes_and_leave_other_rows_alone() -> None:
    """With ``rows`` the kernel reads and writes only those rows of a larger batch."""
    pool = Pool([9, 30], 4, 2, 32, 4, torch.float32, torch.float32, seed=4)
    q = torch.randn(5, 4, 32)
    q[[3, 1]] = pool.q
    out = torch.full_like(q, float("nan"))
    batch = pool.batch(rows=torch.tensor([3, 1]))
    cpu_kernels.paged_decode_attention(q, pool.k_cache, pool.v_cache, batch, out, pool.scale)
    assert pool.error(out[[3, 1]]) < tolerance(torch.float32)
    assert out[[0, 2, 4]].isnan().all()


def test_int64_tables_and_strided_query_are_accepted() -> None:
    pool = Pool([12, 3], 4, 2, 32, 4, torch.bfloat16, torch.bfloat16, seed=5)
    wide = torch.randn(2, 4, 48).bfloat16()
    wide[:, :, :32] = pool.q
    q = wide[:, :, :32]  # head stride 48, not contiguous
    out = torch.empty(2, 4, 32, dtype=torch.bfloat16)
    batch = DecodeBatch.build(pool.block_tables.long(), pool.seq_lens.long(), 4)
    assert batch.block_tables.dtype == torch.int32 and batch.seq_lens.dtype == torch.int32
    cpu_kernels.paged_decode_attention(q, pool.k_cache, pool.v_cache, batch, out, pool.scale)
    assert pool.error(out) < tolerance(torch.bfloat16)


def test_bad_arguments_are_named() -> None:
    pool = Pool([4, 6], 4, 2, 32, 4, torch.float32, torch.float32)
    q, kc, vc, batch = pool.q, pool.k_cache, pool.v_cache, pool.batch()
    out = torch.empty_like(q)
    run = cpu_kernels.paged_decode_attention
    with pytest.raises(ValueError, match="q and out must be"):
        run(q, kc, vc, batch, out.bfloat16(), pool.scale)
    with pytest.raises(ValueError, match="does not fit caches"):
        run(q[:, :3], kc, vc, batch, out[:, :3], pool.scale)
    with pytest.raises(ValueError, match="only float32, bfloat16, float16"):
        run(q.int(), kc, vc, batch, out.int(), pool.scale)
    with pytest.raises(ValueError, match="contiguous within each block"):
        run(q, kc.transpose(1, 2), vc.transpose(1, 2), batch, out, pool.scale)
    with pytest.raises(ValueError, match="caches have blocks of 4, the batch 8"):
        run(q, kc, vc, DecodeBatch.build(pool.block_tables, pool.seq_lens, 8), out, pool.scale)
    with pytest.raises(ValueError, match="q has 2 rows, the batch reads 2 decodes"):
        run(q, kc, vc, pool.batch(rows=torch.tensor([0, 2])), out, pool.scale)
    with pytest.raises(ValueError, match="q has 1 rows"):
        run(q[:1], kc, vc, batch, out[:1], pool.scale)
    # every index the kernel would follow is range-checked first
    far = pool.block_tables.clone()
    far[1, 0] = kc.shape[0]
    with pytest.raises(ValueError, match=f"block id {kc.shape[0]} is outside the pool"):
        run(q, kc, vc, DecodeBatch.build(far, pool.seq_lens, 4), out, pool.scale)
    far[1, 0] = -1
    with pytest.raises(ValueError, match="block ids must be >= 0"):
        DecodeBatch.build(far, pool.seq_lens, 4)
    with pytest.raises(ValueError, match=r"seq_lens must be in \[1, 8\]"):
        DecodeBatch.build(pool.block_tables, torch.tensor([4, 9]), 4)
    with pytest.raises(ValueError, match=r"seq_lens must be in \[1, 8\]"):
        DecodeBatch.build(pool.block_tables, torch.tensor([0, 1]), 4)
    with pytest.raises(ValueError, match="rows must be"):
        pool.batch(rows=torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="block_tables must be"):
        DecodeBatch.build(pool.block_tables, pool.seq_lens[:1], 4)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 targets only")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"], ids=["avx2-8-lanes", "sse-4-lanes"])
def test_narrower_vector_builds_match_definition(
    march: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel built for an older target than this CPU (AVX2: 8-float vectors and no
    VDPBF16PS; baseline x86-64: 4-float vectors) gives the same answers: CI and serving machines
    differ, and -march=native picks one of these paths on each."""
    real, why = find_compiler()
    assert real is not None, why
    cc = tmp_path / f"cc-{march}"
    cc.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do shift; [ "$a" = -march=native ] && a=-march='
        + march
        + '; set -- "$@" "$a"; done\n'
        f'exec {real[0]} "$@"\n'
    )
    cc.chmod(0o755)
    monkeypatch.setenv(env.CC, str(cc))
    monkeypatch.setenv(env.KERNEL_CACHE, str(tmp_path / "kernels"))
    kl = load_library(cpu_kernels.SOURCE)
    assert kl.lib is not None and "-march=native" in kl.flags, kl.reason
    fn = kl.lib.pd_paged_decode
    fn.argtypes, fn.restype = cpu_kernels._ARGTYPES, ctypes.c_int
    monkeypatch.setattr(cpu_kernels, "_decode_fn", fn)
    for dtype in DTYPES:
        for heads, kv_heads, head_dim, block_size in [(9, 3, 64, 16), (12, 1, 40, 8)]:
            pool = Pool([1, 17, 300], heads, kv_heads, head_dim, block_size, dtype, dtype)
            assert pool.error(pool.run(num_threads=1)) < tolerance(dtype), (dtype, heads)
        chunks = Chunks([(0, 40), (100, 7), (0, 1)], 9, 3, 64, 16, dtype, dtype)
        assert chunks.error(chunks.run(num_threads=1)) < tolerance(dtype), dtype


# ---------------------------------------------------------------------------- the prefill kernel


class Chunks:
    """Prefill chunks (``computed`` tokens already in the pool, then ``q_len`` query rows) in one
    flat batch, their K/V (earlier tokens' and their own) in a pool of shuffled blocks."""

    def __init__(
        self,
        spans: list[tuple[int, int]],
        heads: int,
        kv_heads: int,
        head_dim: int,
        block_size: int,
        kv_dtype: torch.dtype,
        q_dtype: torch.dtype,
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.tables, self.k_cache, self.v_cache = random_pool(
            [c + n for c, n in spans], kv_heads, head_dim, block_size, kv_dtype, gen
        )
        rows = sum(n for _, n in spans) + 2  # two rows no chunk owns
        self.q = torch.randn(rows, heads, head_dim, generator=gen).to(q_dtype)
        self.spans, self.block_size, self.scale = spans, block_size, head_dim**-0.5
        self.starts = [sum(n for _, n in spans[:i]) + 1 for i in range(len(spans))]

    def batch(self) -> PrefillBatch:
        return PrefillBatch.build(
            self.starts,
            [n for _, n in self.spans],
            [c for c, _ in self.spans],
            [torch.tensor(t) for t in self.tables],
            self.block_size,
        )

    def run(self, num_threads: int | None = None) -> torch.Tensor:
        out = torch.full_like(self.q, float("nan"))
        cpu_kernels.paged_prefill_attention(
            self.q, self.k_cache, self.v_cache, self.batch(), out, self.scale, num_threads
        )
        return out

    def reference(self, i: int) -> torch.Tensor:
        """Chunk i's causal attention [q_len, heads, head_dim] by definition, in float64."""
        (c, n), table, start = self.spans[i], self.tables[i], self.starts[i]
        k = self.k_cache[table].flatten(0, 1)[: c + n].double()  # [c + n, kv_heads, D]
        v = self.v_cache[table].flatten(0, 1)[: c + n].double()
        q = self.q[start : start + n].double()  # [n, heads, D]
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * self.scale
        visible = torch.arange(c + n)[None, :] <= (c + torch.arange(n))[:, None]  # [n, c + n]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        return torch.einsum("hqk,khd->qhd", probs, v)

    def error(self, out: torch.Tensor) -> float:
        """max over chunks and rows of ||out_r - ref_r|| / ||ref_r||; rows no chunk owns must
        be untouched (NaN)."""
        errs = []
        for i, (_, n) in enumerate(self.spans):
            ref, got = self.reference(i), out[self.starts[i] : self.starts[i] + n].double()
            errs.append(float(((got - ref).norm(dim=-1) / ref.norm(dim=-1)).max()))
        assert out[0].isnan().all() and out[-1].isnan().all()
        return max(errs)


# (computed, q_len): from position 0 (one token, a block, one past, a long prompt) and after
# cached tokens (a prefix-cache hit mid-block, a chunk after a chunk)
SPANS = [(0, 1), (0, 16), (0, 17), (0, 270), (33, 5), (100, 40), (16, 16)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (8, 8, 128, 16), (16, 2, 32, 1), (12, 3, 48, 8)],
)
def test_prefill_matches_definition(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int
) -> None:
    chunks = Chunks(SPANS, heads, kv_heads, head_dim, block_size, dtype, dtype)
    assert chunks.error(chunks.run(num_threads=1)) < tolerance(dtype)


@pytest.mark.parametrize(
    ("kv_dtype", "q_dtype"),
    [
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
        (torch.float32, torch.bfloat16),
    ],
    ids=str,
)
def test_prefill_kv_dtype_may_differ_from_query(
    kv_dtype: torch.dtype, q_dtype: torch.dtype
) -> None:
    chunks = Chunks(SPANS, 9, 3, 64, 16, kv_dtype, q_dtype)
    assert chunks.error(chunks.run(num_threads=1)) < tolerance(q_dtype)


def test_prefill_threads_agree_bit_for_bit() -> None:
    chunks = Chunks(SPANS, 9, 3, 64, 16, torch.bfloat16, torch.bfloat16, seed=1)
    one, two = chunks.run(num_threads=1), chunks.run(num_threads=2)
    assert torch.equal(one[1:-1], two[1:-1])  # each (chunk, KV head, rows) item on its own


def test_prefill_shapes_it_does_not_take_are_refused() -> None:
    assert cpu_kernels.prefill_fits(9, 3, 64) and cpu_kernels.prefill_fits(8, 1, 128)
    assert not cpu_kernels.prefill_fits(9, 1, 64)  # 9 query heads per KV head (at most 8)
    assert not cpu_kernels.prefill_fits(8, 8, 40)  # head_dim not a multiple of 16
    assert not cpu_kernels.prefill_fits(8, 8, 256)  # head_dim past 128
    chunks = Chunks([(0, 5)], 8, 8, 40, 16, torch.float32, torch.float32)
    with pytest.raises(RuntimeError, match="unfit"):
        chunks.run()


def test_prefill_bad_arguments_are_named() -> None:
    chunks = Chunks([(0, 20), (10, 3)], 9, 3, 64, 16, torch.float32, torch.float32)
    with pytest.raises(ValueError, match="blocks of 16, its table has 1"):
        PrefillBatch.build([0], [20], [0], [torch.tensor([0])], 16)
    with pytest.raises(ValueError, match="one entry each"):
        PrefillBatch.build([0, 1], [20], [0], [torch.tensor([0, 1])], 16)
    with pytest.raises(ValueError, match="must be >= 0"):
        PrefillBatch.build([0], [2], [0], [torch.tensor([-1])], 16)
    out = torch.empty_like(chunks.q)
    small = chunks.k_cache[:1]
    with pytest.raises(ValueError, match="outside the pool"):
        cpu_kernels.paged_prefill_attention(
            chunks.q, small, small.clone(), chunks.batch(), out, 0.1
        )
    with pytest.raises(ValueError, match="rows"):
        cpu_kernels.paged_prefill_attention(
            chunks.q[:5], chunks.k_cache, chunks.v_cache, chunks.batch(), out[:5], 0.1
        )
    with pytest.raises(ValueError, match="blocks of"):
        cpu_kernels.paged_prefill_attention(
            chunks.q, chunks.k_cache.view(-1, 8, 3, 64), chunks.v_cache.view(-1, 8, 3, 64),
            chunks.batch(), out, 0.1,
        )  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 8, 128), (16, 2, 32), (12, 3, 48)]
)
def test_prefill_never_reads_slots_past_a_chunk(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> None:
    """Every pool slot past a chunk's last position holds NaN: tiles that end mid-tile (and, in
    the bf16 path, mid key pair) must read zero rows there, never the slots."""
    spans = [(0, 1), (0, 63), (0, 65), (7, 70), (100, 29)]
    chunks = Chunks(spans, heads, kv_heads, head_dim, 16, dtype, dtype, seed=7)
    used = torch.zeros(chunks.k_cache.shape[:2], dtype=torch.bool)
    for (c, n), table in zip(spans, chunks.tables, strict=True):
        for t in range(c + n):
            used[table[t // 16], t % 16] = True
    chunks.k_cache[~used] = float("nan")
    chunks.v_cache[~used] = float("nan")
    out = chunks.run(num_threads=1)
    assert not out[1:-1].isnan().any()
    assert chunks.error(out) < tolerance(dtype)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 8, 128), (16, 2, 32), (12, 2, 96)]
)
def test_prefill_on_amx_tiles_matches_the_other_path(
    heads: int, kv_heads: int, head_dim: int
) -> None:
    """Where the CPU has AMX, bf16 prefill runs on its tiles (prefill_item_amx); both that and
    the VDPBF16PS path match attention by definition, to the same bound. Elsewhere the switch
    reports that AMX is off."""
    spans = [(0, 1), (0, 63), (0, 65), (7, 70), (100, 29), (0, 270), (1000, 50)]
    chunks = Chunks(spans, heads, kv_heads, head_dim, 16, torch.bfloat16, torch.bfloat16, seed=5)
    other, on, amx = amx_off_then_on(
        cpu_kernels.set_prefill_amx,
        lambda: chunks.run(num_threads=1),
        lambda: chunks.run(num_threads=2),
    )
    assert chunks.error(other) < tolerance(torch.bfloat16)
    assert chunks.error(amx) < tolerance(torch.bfloat16)
    assert not on or not torch.equal(amx[1:-1], other[1:-1])  # a different path did run


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_kv_matches_torch_ref(dtype: torch.dtype) -> None:
    """The C KV write stores what torch_ref's index_copy_ stores, reading k and v as strided
    views of one packed qkv tensor (as the model hands them over), into shuffled slots."""
    from pdserve.attention.torch_ref import write_kv as torch_write_kv

    g = torch.Generator().manual_seed(7)
    n, heads, kv_heads, d, blocks, bs = 37, 6, 2, 32, 12, 8
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(n, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d :].view(n, kv_heads, d)
    slots = torch.randperm(blocks * bs, generator=g)[:n]
    caches = [torch.randn(blocks, bs, kv_heads, d, generator=g).to(dtype) for _ in range(2)]
    ref = [c.clone() for c in caches]
    assert cpu_kernels.write_kv(k, v, caches[0], caches[1], slots)
    torch_write_kv(k, v, ref[0], ref[1], slots)
    assert torch.equal(caches[0], ref[0]) and torch.equal(caches[1], ref[1])


def test_write_kv_refuses_a_bad_slot_and_leaves_other_cases_to_torch() -> None:
    k = torch.randn(3, 2, 16)
    kc, vc = torch.zeros(4, 4, 2, 16), torch.zeros(4, 4, 2, 16)
    with pytest.raises(ValueError, match="outside the caches"):
        cpu_kernels.write_kv(k, k, kc, vc, torch.tensor([0, 16, 1]))
    assert not kc.any() and not vc.any()  # nothing written, not even the good slots
    with pytest.raises(ValueError, match="outside the caches"):
        cpu_kernels.write_kv(k, k, kc, vc, torch.tensor([0, -1, 1]))
    # another dtype (torch converts) or int32 slots: not taken, nothing written
    assert not cpu_kernels.write_kv(k.bfloat16(), k.bfloat16(), kc, vc, torch.tensor([0, 1, 2]))
    assert not cpu_kernels.write_kv(k, k, kc, vc, torch.tensor([0, 1, 2], dtype=torch.int32))
    assert not kc.any()
