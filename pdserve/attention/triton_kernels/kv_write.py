"""KV write: scatter a step's new K/V rows into the paged pool by slot mapping (Triton kernel)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 16  # tokens per program


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_vt,
    stride_kc_slot,
    stride_vc_slot,
    num_tokens,
    row_size,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = tokens < num_tokens
    # a negative slot is a padding token: nothing to store
    slots = tl.load(slot_mapping_ptr + tokens, mask=t_mask, other=-1).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)  # one token's [num_kv_heads * head_dim] elements
    mask = (t_mask & (slots >= 0))[:, None] & (offs_e < row_size)[None, :]
    k = tl.load(k_ptr + tokens[:, None] * stride_kt + offs_e[None, :], mask=mask)
    tl.store(k_cache_ptr + slots[:, None] * stride_kc_slot + offs_e[None, :], k, mask=mask)
    v = tl.load(v_ptr + tokens[:, None] * stride_vt + offs_e[None, :], mask=mask)
    tl.store(v_cache_ptr + slots[:, None] * stride_vc_slot + offs_e[None, :], v, mask=mask)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store each new token's K/V at its pool slot (in place).

    Shapes: k, v [num_tokens, num_kv_heads, head_dim] (any float dtype, cast to the cache dtype
    by torch first when it differs; each token's heads x head_dim contiguous, rows may be strided
    as in a view of a fused qkv output); k_cache, v_cache [num_blocks, block_size, num_kv_heads,
    head_dim] (bf16/fp16/fp32, a slot's heads x head_dim contiguous); slot_mapping int32/int64
    [num_tokens], slot = block * block_size + offset, a negative slot skips the token (padding,
    as in vLLM's reshape_and_cache). Grid: cdiv(num_tokens, BLOCK_T) programs, each copying
    BLOCK_T tokens' K and V rows. Equals :func:`pdserve.attention.torch_ref.write_kv` (an
    ``index_copy_`` into the flattened pool). Raises ValueError on mismatched shapes.
    """
    num_tokens, heads, dim = k.shape
    if v.shape != k.shape or k_cache.shape[-2:] != (heads, dim) or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"write_kv: k {tuple(k.shape)}, v {tuple(v.shape)} do not fit caches "
            f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"write_kv: slot_mapping must be [{num_tokens}]")
    for t in (k_cache, v_cache):
        if t.stride(2) != dim or t.stride(3) != 1 or t.stride(0) != t.shape[1] * t.stride(1):
            raise ValueError("write_kv: each cache block must be one contiguous run of slots")
    if num_tokens == 0:
        return
    # NOTE: a dtype change is done here, not in the kernel: Triton's CPU interpreter rounds fp32
    # to bf16 toward zero where torch (and compiled Triton) round to nearest even. The model
    # hands K/V over in the pool's dtype, so this copy never happens on the serving path.
    k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    if k.stride(1) != dim or k.stride(2) != 1:
        k = k.contiguous()
    if v.stride(1) != dim or v.stride(2) != 1:
        v = v.contiguous()
    _write_kv_kernel[(triton.cdiv(num_tokens, BLOCK_T),)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), v.stride(0), k_cache.stride(1), v_cache.stride(1),
        num_tokens, heads * dim,
        BLOCK_T=BLOCK_T,
        BLOCK_E=triton.next_power_of_2(heads * dim),
    )  # fmt: skip
