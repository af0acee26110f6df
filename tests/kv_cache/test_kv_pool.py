"""KVPool: layout, gather/scatter round trips on non-contiguous block tables."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pdserve.kv_cache.pool import KVPool

L, NB, BS, H, D = 2, 8, 16, 3, 4


def _pool(dtype: torch.dtype = torch.float32) -> KVPool:
    return KVPool(L, NB, BS, H, D, dtype)


def test_layout_and_bytes() -> None:
    pool = _pool(torch.bfloat16)
    assert pool.kv.shape == (L, 2, NB, BS, H, D)
    k, v = pool.layer(1)
    assert k.shape == v.shape == (NB, BS, H, D)
    assert k.data_ptr() == pool.kv[1, 0].data_ptr()  # views, not copies
    assert pool.bytes_per_token() == 2 * L * H * D * 2
    with pytest.raises(ValueError, match="num_blocks must be > 0"):
        KVPool(L, 0, BS, H, D, torch.float32)


@pytest.mark.parametrize("num_tokens", [1, 17, 40])
def test_scatter_gather_round_trip(num_tokens: int) -> None:
    pool = _pool()
    blocks = [5, 2, 7]  # non-contiguous, out of order
    pool.kv.fill_(-1.0)
    kv = torch.randn(L, 2, num_tokens, H, D)
    pool.scatter(blocks, kv)
    out = pool.gather(blocks, num_tokens)
    assert out.shape == (L, 2, num_tokens, H, D) and out.is_contiguous()
    torch.testing.assert_close(out, kv, rtol=0, atol=0)
    # Token t sits in block blocks[t // BS] at offset t % BS; nothing else was written.
    for t in (0, num_tokens - 1):
        torch.testing.assert_close(pool.kv[:, :, blocks[t // BS], t % BS], kv[:, :, t])
    touched = torch.zeros(NB, BS, dtype=torch.bool)
    for t in range(num_tokens):
        touched[blocks[t // BS], t % BS] = True
    assert bool((pool.kv[:, :, ~touched] == -1.0).all())
    # The gathered tensor is a copy.
    out.zero_()
    torch.testing.assert_close(pool.gather(blocks, num_tokens), kv)


def test_scatter_casts_dtype_and_validates() -> None:
    pool = _pool(torch.bfloat16)
    kv = torch.randn(L, 2, 3, H, D)
    pool.scatter([1], kv)
    torch.testing.assert_close(pool.gather([1], 3), kv.to(torch.bfloat16))
    with pytest.raises(ValueError, match="shape"):
        pool.scatter([1], torch.randn(L, 2, 3, H, D + 1))
    with pytest.raises(ValueError, match="need 2 blocks"):
        pool.scatter([1], torch.randn(L, 2, 17, H, D))
    with pytest.raises(ValueError, match="out of range"):
        pool.gather([NB], 1)
    with pytest.raises(ValueError, match="repeat"):
        pool.scatter([1, 1], torch.randn(L, 2, 20, H, D))
    assert pool.gather([], 0).shape == (L, 2, 0, H, D)


def _huge_kib_in(start: int, end: int) -> int:
    """AnonHugePages (KiB) of this process's mappings that overlap [start, end)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            a, b = (int(x, 16) for x in head.split("-"))
            inside = a < end and b > start
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1])
    return total


def test_a_large_pool_is_zeroed_on_huge_pages() -> None:
    """A 60 MiB pool asks for transparent huge pages before zeroing it, and (where the kernel's
    THP mode allows: `always` or `madvise`) gets them; its contents are zeros either way."""
    pool = KVPool(4, 1280, 16, 3, 64, torch.bfloat16)
    assert pool.nbytes == 4 * 2 * 1280 * 16 * 3 * 64 * 2
    assert not pool.kv.any()
    if not sys.platform.startswith("linux"):
        assert not pool.huge_pages
        return
    assert pool.huge_pages
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    assert pool.kv.data_ptr() % (2 << 20) == 0
    if "[never]" not in mode:
        start = pool.kv.data_ptr()
        assert _huge_kib_in(start, start + pool.nbytes) >= 16 * 1024, mode
    assert not KVPool(1, 1, 16, 1, 8, torch.float32).huge_pages  # under 2 MiB: nothing to ask


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and glibc's mallopt")
def test_a_pool_gets_huge_pages_where_malloc_would_reuse_faulted_heap() -> None:
    """A full test run once gave a 60 MiB pool 0 KiB of huge pages: malloc had handed back heap
    memory freed tensors had already faulted in on 4 KiB pages, where the advice changes nothing.
    Forced here (in a child process: mallopt is process-wide) by raising glibc's mmap threshold
    and faulting and freeing 128 MiB of heap first."""
    script = textwrap.dedent(
        f"""
        import ctypes, sys
        import torch
        ctypes.CDLL(None).mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD: big blocks from the heap
        scratch = [torch.ones(64 << 20, dtype=torch.uint8) for _ in range(2)]
        del scratch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_kv_pool import _huge_kib_in
        from pdserve.kv_cache.pool import KVPool
        pool = KVPool(4, 1280, 16, 3, 64, torch.bfloat16)
        start = pool.kv.data_ptr()
        print(int(pool.huge_pages), _huge_kib_in(start, start + pool.nbytes))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    assert out[0] == "1"
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    if "[never]" not in mode:
        assert int(out[1]) >= 16 * 1024, mode
