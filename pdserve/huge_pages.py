"""Tensors on transparent huge pages (2 MiB on x86-64), for the big CPU tensors a decode step
streams through: the KV pool (:mod:`pdserve.kv_cache.pool`) and the skinny GEMM's weight panels
(:mod:`pdserve.model.cpu_linear`). With 4 KiB pages every 4 KiB of such a stream needs its own
TLB entry (a page walk each time one is missing), and the hardware prefetchers stop at 4 KiB
boundaries; Linux's default THP mode (``madvise``) gives huge pages only to memory that asks.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import sys
from collections.abc import Sequence

import torch

HUGE_PAGE_BYTES = 2 << 20  # x86-64's transparent huge page (PMD) size
_MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask Linux to back ``t``'s memory with transparent huge pages (``madvise(MADV_HUGEPAGE)``
    over the 2 MiB-aligned part of it). It only helps for pages not yet faulted in: pages
    faulted in afterwards come as 2 MiB pages where the kernel's THP mode is ``always`` or
    ``madvise`` (the common default), so a decode step's reads of a KV pool of hundreds of MB
    through scattered blocks miss the TLB far less. Returns whether the advice was taken (False
    off Linux, for tensors not on the CPU or under 2 MiB, or when the call fails); never raises.

    Measured (``bench/cpu_attention.py --step --step-small-pages``, session 14): SmolLM2's
    decode step of 16 sequences, bf16, one thread: attention 10.1 against 10.8 ms a step, the
    step 46.4 against 47.0 ms (docs/benchmarks.md).
    """
    if not sys.platform.startswith("linux") or t.device.type != "cpu":
        return False
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    lo = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    hi = end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if hi <= lo:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        return bool(madvise(lo, hi - lo, _MADV_HUGEPAGE) == 0)
    except (OSError, AttributeError):
        return False


def empty_on_huge_pages(shape: Sequence[int], dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """An uninitialised CPU tensor of ``shape`` on never-touched memory with the huge-page advice
    given (:func:`advise_huge_pages`): on Linux, for 2 MiB or more, its own anonymous ``mmap``
    with the tensor's start rounded up to a 2 MiB boundary (the tensor keeps the mapping alive;
    it is unmapped when the last view goes). Elsewhere, or smaller: ``torch.empty``.

    Why its own mapping: ``torch.empty`` goes through malloc, which may hand back heap memory a
    freed tensor had already faulted in on 4 KiB pages; advice on those pages changes nothing
    (seen in a full test run: a 60 MiB pool got 0 KiB of huge pages). Returns
    ``(tensor, huge_pages)``, ``huge_pages`` being whether the advice was taken. Raises
    MemoryError when the mapping cannot be made.
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if not sys.platform.startswith("linux") or nbytes < HUGE_PAGE_BYTES:
        return torch.empty(tuple(shape), dtype=dtype), False
    # anonymous and private (Python maps shared by default: shmem, whose THP setting differs)
    try:
        mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE)
    except OSError as e:
        raise MemoryError(f"cannot map {nbytes} bytes for a tensor of shape {shape}: {e}") from e
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    t = raw[offset : offset + nbytes].view(dtype).view(tuple(shape))
    return t, advise_huge_pages(t)
