"""Attention tests run the Triton kernels on CPU tensors through Triton's interpreter.

Triton decides interpreted vs compiled when it decorates a kernel, so this file imports the
kernel modules with ``TRITON_INTERPRET=1`` set (pytest imports it during collection, before any
test runs) and then puts the environment back: nothing outside tests/attention sees the
variable. The ``interpret`` fixture below sets it again around each test here, since the backend
selector and the bf16 upcast read it at call time. On a machine with CUDA (and the variable
unset), nothing is set and the same tests run the compiled kernels on the GPU
(bench/gpu_smoke.sh).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "") == "1" or not torch.cuda.is_available()
DEVICE = torch.device("cpu" if INTERPRET else "cuda")

if INTERPRET:
    _before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import pdserve.attention.triton_kernels.decode  # noqa: F401
        import pdserve.attention.triton_kernels.extend  # noqa: F401
        import pdserve.attention.triton_kernels.kv_write  # noqa: F401
    finally:
        if _before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _before


@pytest.fixture(autouse=True)
def interpret(monkeypatch: pytest.MonkeyPatch) -> Iterator[bool]:
    """``TRITON_INTERPRET=1`` for the duration of each attention test when not on CUDA."""
    if INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield INTERPRET


class PagedCase:
    """One step's attention inputs over a random paged pool, and torch_ref's answer.

    ``seqs``: (cached tokens, new tokens) per sequence. The pool (float32 random, cast to
    ``dtype``) has spare blocks and each sequence gets randomly chosen blocks, so a kernel that
    reads the wrong block reads garbage. Cached tokens are whatever the pool holds; the new
    tokens' K/V are random and already written by torch_ref (``ref`` is its output).
    """

    def __init__(
        self,
        seqs: list[tuple[int, int]],
        heads: int,
        kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        seed: int = 0,
    ) -> None:
        from pdserve.attention.base import get_backend
        from pdserve.attention.triton_paged import TritonMetadata

        gen = torch.Generator().manual_seed(seed)
        need = [-(-(c + n) // block_size) for c, n in seqs]
        num_blocks = sum(need) + 5
        perm = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables, at = [], 0
        for nb in need:
            self.tables.append(perm[at : at + nb])
            at += nb
        num_tokens = sum(n for _, n in seqs)

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)

        self.k_cache = rand(num_blocks, block_size, kv_heads, head_dim)
        self.v_cache = rand(num_blocks, block_size, kv_heads, head_dim)
        self.q = rand(num_tokens, heads, head_dim)
        self.k = rand(num_tokens, kv_heads, head_dim)
        self.v = rand(num_tokens, kv_heads, head_dim)
        self.scale = head_dim**-0.5
        qlens, computed = [n for _, n in seqs], [c for c, _ in seqs]
        self.meta = get_backend("torch_ref").build_metadata(
            qlens, computed, self.tables, block_size, DEVICE
        )
        self.tmeta = TritonMetadata.build(qlens, computed, self.tables, block_size, DEVICE)
        self.ref = get_backend("torch_ref").forward(
            self.q, self.k, self.v, self.k_cache, self.v_cache, self.meta, self.scale
        )

    def poisoned(self) -> torch.Tensor:
        """An output buffer full of NaN: rows a kernel fails to write stay NaN."""
        return torch.full_like(self.q, float("nan"))

    def err(self, out: torch.Tensor, rows: slice | torch.Tensor = slice(None)) -> float:
        """||out - ref|| / ||ref|| over ``rows``, in float32 (NaN if out has NaN there)."""
        o, r = out[rows].float(), self.ref[rows].float()
        return float((o - r).norm() / r.norm())

    @property
    def tolerance(self) -> float:
        """The issue's relative error bound: 1e-3 in fp32, 1e-2 in bf16/fp16."""
        return 1e-3 if self.q.dtype == torch.float32 else 1e-2


@pytest.fixture
def paged_case() -> type[PagedCase]:
    """The PagedCase class (a fixture, so test modules need not import this conftest)."""
    return PagedCase


@pytest.fixture
def device() -> torch.device:
    """Where the kernels' tensors live: CPU under the interpreter, else the GPU."""
    return DEVICE
