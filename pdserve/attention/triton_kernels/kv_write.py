"""KV write: scatter a step's new K/V rows into the paged pool by slot mapping (Triton kernel)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    num_kv_heads,
    head_dim,
    block_size,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # a padding token: nothing to store
        return
    block = slot // block_size
    offset = slot % block_size
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < num_kv_heads)[:, None] & (offs_d < head_dim)[None, :]
    src = offs_h[:, None] * stride_kh + offs_d[None, :]
    k = tl.load(k_ptr + token * stride_kt + src, mask=mask)
    dst = block * stride_kcb + offset * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    src = offs_h[:, None] * stride_vh + offs_d[None, :]
    v = tl.load(v_ptr + token * stride_vt + src, mask=mask)
    dst = block * stride_vcb + offset * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store each new token's K/V at its pool slot (in place), cast to the cache dtype.

    Shapes: k, v [num_tokens, num_kv_heads, head_dim] (any float dtype; last dim contiguous);
    k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim] (bf16/fp16/fp32, last dim
    contiguous); slot_mapping int32/int64 [num_tokens], slot = block * block_size + offset, a
    negative slot skips the token (padding, as in vLLM's reshape_and_cache). Grid: one program per
    token, each copying its [num_kv_heads, head_dim] K and V tiles. Equals
    :func:`pdserve.attention.torch_ref.write_kv` (an ``index_copy_`` into the flattened pool).
    Raises ValueError on mismatched shapes.
    """
    num_tokens, heads, dim = k.shape
    if v.shape != k.shape or k_cache.shape[-2:] != (heads, dim) or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"write_kv: k {tuple(k.shape)}, v {tuple(v.shape)} do not fit caches "
            f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"write_kv: slot_mapping must be [{num_tokens}]")
    for t in (k, v, k_cache, v_cache):
        if t.stride(-1) != 1:
            raise ValueError("write_kv: the head_dim axis must be contiguous")
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        heads, dim, k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_D=triton.next_power_of_2(dim),
    )  # fmt: skip
