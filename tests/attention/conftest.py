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
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from attention_pools import shuffled_block_tables

from pdserve.attention.base import AttentionBackend, AttentionMetadata
from pdserve.config import CacheConfig, EngineConfig, LoadConfig, ModelConfig, SchedulerConfig
from pdserve.sampling_params import SamplingParams

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

    ``seqs``: (cached tokens, new tokens) per sequence; tensors on ``device`` (default: where the
    Triton kernels run). The pool (float32 random, cast to
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
        device: torch.device = DEVICE,
    ) -> None:
        from pdserve.attention.base import get_backend
        from pdserve.attention.triton_paged import TritonMetadata

        gen = torch.Generator().manual_seed(seed)
        lens = [c + n for c, n in seqs]
        self.tables, num_blocks = shuffled_block_tables(lens, block_size, gen, spare=5)
        num_tokens = sum(n for _, n in seqs)

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(dtype).to(device)

        self.k_cache = rand(num_blocks, block_size, kv_heads, head_dim)
        self.v_cache = rand(num_blocks, block_size, kv_heads, head_dim)
        self.q = rand(num_tokens, heads, head_dim)
        self.k = rand(num_tokens, kv_heads, head_dim)
        self.v = rand(num_tokens, kv_heads, head_dim)
        self.scale = head_dim**-0.5
        qlens, computed = [n for _, n in seqs], [c for c, _ in seqs]
        self.meta = get_backend("torch_ref").build_metadata(
            qlens, computed, self.tables, block_size, device
        )
        self.tmeta = TritonMetadata.build(qlens, computed, self.tables, block_size, device)
        self.ref = get_backend("torch_ref").forward(
            self.q, self.k, self.v, self.k_cache, self.v_cache, self.meta, self.scale
        )

    def assert_backend_matches(
        self, backend: AttentionBackend[Any], meta: AttentionMetadata
    ) -> None:
        """``backend.forward`` of this step (on copies of the pools whose new-token slots hold
        NaN, so the backend must write the new K/V itself) is within tolerance of torch_ref on
        every row, and leaves the pools equal to torch_ref's."""
        k_cache, v_cache = self.k_cache.clone(), self.v_cache.clone()
        heads, dim = k_cache.shape[-2:]
        k_cache.view(-1, heads, dim)[self.meta.slot_mapping] = float("nan")
        v_cache.view(-1, heads, dim)[self.meta.slot_mapping] = float("nan")
        out = backend.forward(self.q, self.k, self.v, k_cache, v_cache, meta, self.scale)
        assert not out.isnan().any()
        assert self.err(out) < self.tolerance
        assert torch.equal(k_cache, self.k_cache) and torch.equal(v_cache, self.v_cache)

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


TINY = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=128,
    hidden_size=96,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    eos_token_ids=(2,),
)


def _greedy_tokens(backend: str, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of TINY (dummy weights, fp32) with ``backend``: all prompts in one run with
    chunked prefill (16-token steps), then the first prompt again (a prefix cache hit)."""
    from decode_worker.offline import OfflineEngine

    engine = OfflineEngine(
        EngineConfig(
            load=LoadConfig(
                model="dummy", load_format="dummy", dtype="float32", attention_backend=backend
            ),
            cache=CacheConfig(block_size=4, num_blocks=64),
            scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8),
        ),
        TINY,
    )
    attn = engine.runner.model.attn_backend
    assert attn.name == backend
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = engine.generate(prompts, params) + engine.generate(prompts[:1], params)
    assert engine.stats.prefill_tokens < len(prompts[0])  # the rerun extended a cached prefix
    return [o.output_token_ids for o in outs]


@pytest.fixture
def greedy_tokens() -> Callable[[str, list[list[int]]], list[list[int]]]:
    """``greedy_tokens(backend, prompts)``: a tiny random Llama's greedy continuations of
    ``prompts`` through the engine with that attention backend (see _greedy_tokens)."""
    return _greedy_tokens
