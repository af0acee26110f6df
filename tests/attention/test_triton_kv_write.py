"""Triton KV write against torch_ref's write_kv, under the Triton interpreter on CPU."""

from __future__ import annotations

import pytest
import torch

from pdserve.attention import torch_ref
from pdserve.attention.triton_kernels.kv_write import write_kv

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    "src,cache", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16)], ids=str
)
def test_write_kv_matches_torch_ref(
    device: torch.device, src: torch.dtype, cache: torch.dtype
) -> None:
    """Same pool contents as torch_ref (cast to the cache dtype); untouched slots unchanged; a
    strided k (a view of a fused qkv output) is read through its strides."""
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, heads, dim, n = 9, 4, 3, 24, 11
    pool = torch.randn(2, num_blocks, block_size, heads, dim, generator=gen).to(cache).to(device)
    qkv = torch.randn(n, 3, heads, dim, generator=gen).to(src).to(device)
    k, v = qkv[:, 1], qkv[:, 2]  # non-contiguous rows, as the model hands them over
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n].to(device)
    ref_k, ref_v = pool.clone().unbind(0)
    torch_ref.write_kv(k, v, ref_k, ref_v, slots)
    k_cache, v_cache = pool.unbind(0)
    write_kv(k, v, k_cache, v_cache, slots.to(torch.int32))
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_negative_slots_are_skipped(device: torch.device) -> None:
    k_cache, v_cache = torch.zeros(2, 2, 4, 1, 16, device=device).unbind(0)
    k = torch.ones(3, 1, 16, device=device)
    write_kv(k, 2 * k, k_cache, v_cache, torch.tensor([5, -1, 0], device=device))
    assert k_cache.view(-1, 16).sum(-1).tolist() == [16, 0, 0, 0, 0, 16, 0, 0]
    assert v_cache.view(-1, 16).sum(-1).tolist() == [32, 0, 0, 0, 0, 32, 0, 0]


def test_bad_shapes_are_named(device: torch.device) -> None:
    k_cache, v_cache = torch.zeros(2, 2, 4, 2, 16, device=device).unbind(0)
    with pytest.raises(ValueError, match="do not fit caches"):
        write_kv(torch.ones(3, 1, 16), torch.ones(3, 1, 16), k_cache, v_cache, torch.arange(3))
