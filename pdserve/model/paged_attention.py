"""How a model layer reaches the attention backend: the step's context, and an opaque op.

Every layer of one forward attends with the same per-step inputs: the attention backend, the
metadata it built for the step, and the layers' KV caches. A model's ``forward`` opens a
:func:`step_context` with them; each layer then calls :func:`paged_attention` with only its q, k,
v, its layer index and its softmax scale.

Why not pass them down as arguments: a compiled forward (:mod:`pdserve.model.compile`) must not
trace into the backend. The metadata changes structure every step (how many prefill spans, which
rows decode), and the backend may be a C kernel or a Triton launch. Under ``torch.compile``
:func:`paged_attention` therefore goes through the opaque op ``pdserve::paged_attention``
(:mod:`pdserve.model.ops`), which inductor calls as a black box (the same split vLLM's compiled
models make around attention); eagerly it calls the backend directly (no dispatcher round trip).

NOTE: the op writes the layer's new K/V into the pool in place, a side effect its schema does not
declare: declaring the caches as mutated arguments would make the compiled graph functionalize
(copy) the whole pool every step. Nothing inside a compiled graph reads the pool, so no reordering
of the graph can observe the write.

The context is per thread: a process may run a prefill and a decode engine on two threads.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.attention.base import AttentionBackend, AttentionMetadata
from pdserve.model.ops import opaque_op


@dataclass(frozen=True)
class StepContext:
    """What every layer of the running forward attends with.

    ``kv_caches[i]``: layer ``i``'s (k_cache, v_cache), each
    [num_blocks, block_size, num_kv_heads, head_dim].
    """

    backend: AttentionBackend[Any]
    meta: AttentionMetadata
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]


_local = threading.local()


@contextmanager
def step_context(
    backend: AttentionBackend[Any],
    meta: AttentionMetadata,
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> Iterator[None]:
    """Make ``backend``, ``meta`` and ``kv_caches`` what :func:`paged_attention` uses on this
    thread until the block exits (the previous context, if any, is restored)."""
    prev = getattr(_local, "ctx", None)
    _local.ctx = StepContext(backend, meta, kv_caches)
    try:
        yield
    finally:
        _local.ctx = prev


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float
) -> torch.Tensor:
    ctx: StepContext | None = getattr(_local, "ctx", None)
    if ctx is None:
        raise RuntimeError("paged_attention called outside a step_context (no metadata)")
    k_cache, v_cache = ctx.kv_caches[layer]
    return ctx.backend.forward(q, k, v, k_cache, v_cache, ctx.meta, scale)


def _attend_fresh(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float
) -> torch.Tensor:
    out = _attend(q, k, v, layer, scale).contiguous()  # as the fake below promises the graph
    # the op promises a tensor that shares no memory with its inputs (pdserve.model.ops)
    ptr = out.untyped_storage().data_ptr()
    if any(ptr == t.untyped_storage().data_ptr() for t in (q, k, v)):
        out = out.clone()
    return out


def _attend_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float
) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


_paged_attention_op = opaque_op(
    "paged_attention",
    "(Tensor q, Tensor k, Tensor v, int layer, float scale) -> Tensor",
    _attend_fresh,
    _attend_fake,
)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float
) -> torch.Tensor:
    """Layer ``layer``'s attention in the current :func:`step_context`: writes k, v into its
    caches at the step's slot mapping and attends (see ``AttentionBackend.forward``).

    q [num_tokens, num_heads, head_dim]; k, v [num_tokens, num_kv_heads, head_dim] (RoPE applied).
    Returns [num_tokens, num_heads, head_dim] in q's dtype. Raises RuntimeError outside a
    step context.
    """
    if torch.compiler.is_compiling():
        out: torch.Tensor = _paged_attention_op(q, k, v, layer, scale)
        return out
    return _attend(q, k, v, layer, scale)
