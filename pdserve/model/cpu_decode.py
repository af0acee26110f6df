"""Decode steps of a Llama-family model on CPU as one C call per step (``fused decode``).

A compiled decode step of a small model is mostly small calls: for SmolLM2-135M, 30 layers of
four opaque linear calls, one opaque attention call and five generated elementwise loops, each a
trip through the dispatcher, Python argument checks and ctypes. A py-spy profile of a served bf16
decode worker (session 17, docs/benchmarks.md) put ~9 ms of a ~50 ms step there, on the one core
the step runs on. :class:`FusedDecode` runs a decode-only step's decoder layers and final norm in
one call into ``cpu_kernels/decode_layers.c``, which calls the same skinny GEMM and paged decode
attention kernels the compiled model reaches through Python, and does the elementwise steps itself
with the eager model's bf16 roundings (see that file). Where the LM head is packed like the layers,
the logits come out of the same call. The embedding lookup, the RoPE table lookup and sampling stay
in Python (once per step).

Where the step runs on one thread and the process may use more than one CPU
(:func:`helper_applies`), the C step shares each matmul's panel ranges and the attention's
sequences with a helper thread at ``SCHED_IDLE`` priority, taking back whatever the helper has not
finished in time (the protocol: "the idle-core helper" in ``decode_layers.c``). Each
:class:`FusedDecode` owns a C context (scratch, staged block tables, the helper's output mirror)
that lives until the object is collected. ``PDSERVE_CPU_DECODE_HELPER=0`` turns the helper off.

It applies where the compiled path would run those kernels anyway: a model of exactly the Llama
layers of :mod:`pdserve.model.llama` (Llama, Mistral, SmolLM2, Qwen2) in fp32 or bf16 with every
decoder linear packed with skinny panels (:mod:`pdserve.model.cpu_linear`; each linear's panels
in their own format: fp32, bf16, or fp32 weights held as GGUF-style codes), the ``cpu_paged``
attention backend, KV caches in the model dtype, and a step of decodes only whose batch size is in
:func:`~pdserve.model.cpu_linear.skinny_rows`. Every other step (prefill chunks, mixed batches,
larger batches) takes the model's forward. ``PDSERVE_CPU_FUSED_DECODE=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import logging
import os
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import cast

import torch

from pdserve import env
from pdserve.attention.base import AttentionMetadata
from pdserve.attention.cpu_build import load_library
from pdserve.attention.cpu_kernels import decode_kernel
from pdserve.attention.cpu_paged import CpuPagedBackend, CpuPagedMetadata, kernel_threads
from pdserve.attention.cpu_paged import num_splits as decode_splits
from pdserve.model.cpu_linear import (
    PackedLinear,
    panels_format,
    skinny_gemm,
    skinny_rows,
    skinny_split,
)
from pdserve.model.layers import Attention, GatedMLP, RMSNorm
from pdserve.model.llama import DecoderLayer, LlamaForCausalLM, LlamaModel

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels") / "decode_layers.c"

# the C side's dtype codes
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}

_P = ctypes.c_void_p


class _Layer(ctypes.Structure):
    _fields_ = [
        (name, _P)
        for name in (
            "input_norm", "post_norm", "qkv", "qkv_bias", "o", "o_bias", "gate_up", "down",
            "k_cache", "v_cache",
        )
    ] + [
        (name, ctypes.c_int) for name in ("qkv_fmt", "o_fmt", "gate_up_fmt", "down_fmt")
    ]  # fmt: skip


class _Model(ctypes.Structure):
    _fields_ = [
        ("dtype", ctypes.c_int),
        ("hidden", ctypes.c_int),
        ("heads", ctypes.c_int),
        ("kv_heads", ctypes.c_int),
        ("head_dim", ctypes.c_int),
        ("intermediate", ctypes.c_int),
        ("block_size", ctypes.c_int),
        ("num_layers", ctypes.c_int),
        ("blk_stride", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("linear", _P),
        ("prepare", _P),
        ("panels", _P),
        ("prep_bytes", _P),
        ("attend", _P),
        ("layers", ctypes.POINTER(_Layer)),
        ("final_norm", _P),
        ("lm_head", _P),
        ("vocab", ctypes.c_int),
        ("lm_head_fmt", ctypes.c_int),
    ]


_ARGTYPES = [
    _P, _P, ctypes.c_int64, _P, _P,  # context, x, B, rope, slots
    _P, ctypes.c_int64, _P, _P,  # tables, table stride, seq_lens, logits
    ctypes.c_int, ctypes.c_int, ctypes.c_int,  # num_splits, attention threads, GEMM threads
]  # fmt: skip


def _library() -> tuple[ctypes.CDLL | None, str | None]:
    kl = load_library(SOURCE)
    if kl.lib is None:
        return None, kl.reason
    lib = kl.lib
    if lib.pd_decode_layers.argtypes is None:
        lib.pd_decode_layers.argtypes, lib.pd_decode_layers.restype = _ARGTYPES, ctypes.c_int
        lib.pd_decode_ctx_new.argtypes = [ctypes.POINTER(_Model), ctypes.c_int64, ctypes.c_int]
        lib.pd_decode_ctx_new.restype = _P
        lib.pd_decode_ctx_free.argtypes, lib.pd_decode_ctx_free.restype = [_P], None
        lib.pd_decode_helper_stats.argtypes = [ctypes.POINTER(ctypes.c_uint64)] * 2
        lib.pd_decode_helper_stats.restype = None
        lib.pd_decode_helper_ops.argtypes = [ctypes.POINTER(ctypes.c_uint64)] * 2
        lib.pd_decode_helper_ops.restype = None
        lib.pd_decode_helper_set_delay.argtypes = [ctypes.c_int64]
        lib.pd_decode_helper_set_delay.restype = None
    return lib, None


def _counter_pair(name: str) -> tuple[int, int]:
    """The two uint64 counters the library's ``name`` reports; (0, 0) where it cannot be built."""
    lib, _ = _library()
    if lib is None:
        return 0, 0
    a, b = ctypes.c_uint64(), ctypes.c_uint64()
    getattr(lib, name)(ctypes.byref(a), ctypes.byref(b))
    return a.value, b.value


def helper_stats() -> tuple[int, int]:
    """The idle-core helper's counters in this process: (chunks it computed, chunks it had claimed
    that the step took back because it was late). (0, 0) where the library cannot be built."""
    return _counter_pair("pd_decode_helper_stats")


def helper_op_counts() -> tuple[int, int]:
    """The ops (matmuls and attention calls) of steps that shared with the idle-core helper, in
    this process: (ops handed out to the helper too, ops the step ran whole because the helper was
    not running on a CPU then). (0, 0) where the library cannot be built."""
    return _counter_pair("pd_decode_helper_ops")


def set_helper_delay(seconds: float) -> None:
    """Tests: make the helper nap ``seconds`` after each chunk it claims (0: never), as if the OS
    had preempted it, so steps must take its chunks back. No-op where the library cannot be
    built."""
    lib, _ = _library()
    if lib is not None:
        lib.pd_decode_helper_set_delay(int(seconds * 1e9))


def helper_applies() -> bool:
    """Whether steps may share their work with the idle-core helper here: on unless
    ``PDSERVE_CPU_DECODE_HELPER=0``, and this process may run on more than one CPU."""
    return env.cpu_decode_helper() and len(os.sched_getaffinity(0)) > 1


def _addr(fn: Callable[..., int]) -> int:
    """The C address of a loaded ctypes function."""
    return int(ctypes.cast(fn, ctypes.c_void_p).value or 0)  # type: ignore[arg-type]


def _parts(
    layer: torch.nn.Module,
) -> tuple[RMSNorm, RMSNorm, PackedLinear, PackedLinear, PackedLinear, PackedLinear]:
    """A decoder layer's (input norm, post-attention norm, qkv, o, gate_up, down), typed (the
    caller has checked the types: :func:`_unfit`)."""
    dl = cast(DecoderLayer, layer)
    attn, mlp = cast(Attention, dl.self_attn), cast(GatedMLP, dl.mlp)
    return (
        cast(RMSNorm, dl.input_layernorm), cast(RMSNorm, dl.post_attention_layernorm),
        cast(PackedLinear, attn.qkv_proj), cast(PackedLinear, attn.o_proj),
        cast(PackedLinear, mlp.gate_up_proj), cast(PackedLinear, mlp.down_proj),
    )  # fmt: skip


def _panels(linear: PackedLinear) -> int:
    panels = linear.skinny_weight
    assert panels is not None  # checked by _unfit
    return panels.data_ptr()


def _format(linear: PackedLinear) -> int:
    """The weight format (the skinny kernel's SK_* code) of a linear's panels."""
    panels = linear.skinny_weight
    assert panels is not None  # checked by _unfit
    return panels_format(panels)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class FusedDecode:
    """One model's decode steps as one C call (see the module docstring). Build it with
    :meth:`create`; call :meth:`applies` and then the object itself once per step."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        lib: ctypes.CDLL,
    ) -> None:
        cfg = model.config
        dtype = model.model.embed_tokens.weight.dtype
        self.model = model
        self.dtype = dtype
        self.kv_caches = list(kv_caches)  # the C step holds their pointers: keep them alive
        self.num_blocks = int(kv_caches[0][0].shape[0])
        self.block_size = int(kv_caches[0][0].shape[1])
        self.kv_heads = cfg.num_key_value_heads
        self.rows = skinny_rows(dtype)
        self._fn = lib.pd_decode_layers
        layers = [_parts(layer) for layer in model.model.layers]
        self._layers = (_Layer * len(layers))()
        for i, (norm1, norm2, qkv, o, gate_up, down) in enumerate(layers):
            k_cache, v_cache = kv_caches[i]
            self._layers[i] = _Layer(
                norm1.weight.data_ptr(), norm2.weight.data_ptr(),
                _panels(qkv), _ptr(qkv.bias), _panels(o), _ptr(o.bias),
                _panels(gate_up), _panels(down), k_cache.data_ptr(), v_cache.data_ptr(),
                *(_format(m) for m in (qkv, o, gate_up, down)),
            )  # fmt: skip
        scale = cast(Attention, cast(DecoderLayer, model.model.layers[0]).self_attn).scale
        prepare, panels, prep_bytes = skinny_split()
        lm_head = _fusable_lm_head(model)
        # the logits come out of the C step too where the LM head is packed like the layers
        self.vocab = cfg.vocab_size if lm_head is not None else 0
        self._model = _Model(
            _DTYPES[dtype], cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.intermediate_size, self.block_size, len(layers),
            int(kv_caches[0][0].stride(0)), float(layers[0][0].eps), float(scale),
            _addr(skinny_gemm()), _addr(prepare), _addr(panels), _addr(prep_bytes),
            _addr(decode_kernel()), self._layers, model.model.norm.weight.data_ptr(),
            None if lm_head is None else _panels(lm_head), self.vocab,
            0 if lm_head is None else _format(lm_head),
        )  # fmt: skip
        self.helper = helper_applies()
        ctx = lib.pd_decode_ctx_new(ctypes.byref(self._model), self.rows[1], int(self.helper))
        if not ctx:
            raise MemoryError("fused decode: could not allocate the step's context")
        self._ctx = int(ctx)
        # Free the context when this object goes, holding until then what the helper thread may
        # still read (the model struct, the weights, the caches): pd_decode_ctx_free first waits
        # for the helper to leave every op of this context.
        keep = (self._model, self._layers, model, self.kv_caches)
        self._finalizer = weakref.finalize(self, _free_context, lib, self._ctx, keep)

    @classmethod
    def create(
        cls,
        model: torch.nn.Module,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[FusedDecode | None, str]:
        """(a FusedDecode, "") when ``model`` and ``kv_caches`` (layer i's (k_cache, v_cache),
        each [num_blocks, block_size, kv_heads, head_dim]) fit the C step, else (None, why not)."""
        if not env.cpu_fused_decode():
            return None, f"turned off by {env.CPU_FUSED_DECODE}"
        why = _unfit(model, kv_caches)
        if why:
            return None, why
        lib, reason = _library()
        if lib is None:
            return None, f"its kernel cannot be built: {reason}"
        return cls(model, kv_caches, lib), ""  # type: ignore[arg-type]

    def applies(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        """Whether this step (its metadata and token count) is one the C step runs: decodes
        only (one token each, in batch order), a batch size the skinny kernel takes."""
        if not isinstance(meta, CpuPagedMetadata) or meta.prefill_batch is not None:
            return False
        d = meta.decode
        lo, hi = self.rows
        return d.rows is None and d.num_decodes == num_tokens and lo <= num_tokens <= hi

    def __call__(
        self, input_ids: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids int64 [B] (one token per decode, in the order of ``meta``; a step
        :meth:`applies` to) -> (the final-norm hidden states [B, hidden], the logits [B, vocab]
        or None where the LM head is not fused), both in the model dtype; each layer's new K/V
        is written into its cache at ``meta.slot_mapping``. Raises TypeError for
        metadata of another backend, ValueError for a block id past the pool, IndexError for a
        token id or position outside the embedding or RoPE table, MemoryError when the kernel's
        scratch memory cannot be allocated, RuntimeError after the context was freed (at
        interpreter exit, while a daemon step loop still runs)."""
        if not isinstance(meta, CpuPagedMetadata):
            raise TypeError(f"fused decode needs cpu_paged metadata, got {type(meta).__name__}")
        d = meta.decode
        if d.max_block_id >= self.num_blocks or d.block_size != self.block_size:
            raise ValueError(
                f"decode batch reads block {d.max_block_id} of blocks of {d.block_size}; the "
                f"pool has {self.num_blocks} blocks of {self.block_size}"
            )
        b = int(input_ids.shape[0])
        if d.rows is not None or d.num_decodes != b or meta.slot_mapping.shape != (b,):
            raise ValueError(f"fused decode: {b} token ids for a step that is not {b} decodes")
        slots = meta.slot_mapping
        if slots.dtype != torch.int64 or not slots.is_contiguous():
            slots = slots.to(torch.int64).contiguous()
        x = self.model.model.embed_tokens(input_ids).contiguous()
        rope = self.model.rotary_emb.rows(meta.positions, self.dtype)
        threads = torch.get_num_threads()
        attend_threads = kernel_threads(b, self.kv_heads, d.max_seq_len)
        logits = torch.empty(b, self.vocab, dtype=self.dtype) if self.vocab else None
        rc = self._fn(
            self._ctx, x.data_ptr(), b, rope.data_ptr(), slots.data_ptr(),
            d.block_tables.data_ptr(), d.block_tables.shape[1], d.seq_lens.data_ptr(),
            None if logits is None else logits.data_ptr(),
            decode_splits(b, d.max_seq_len, attend_threads), attend_threads, threads,
        )  # fmt: skip
        if rc == -3:
            raise RuntimeError("fused decode step called after its context was freed")
        if rc != 0:
            what = "its scratch" if rc == -1 else "a kernel's scratch (GEMM or attention)"
            raise MemoryError(f"fused decode step failed ({rc}): could not allocate {what}")
        return x, logits


def _free_context(lib: ctypes.CDLL, ctx: int, keep: object) -> None:
    """weakref.finalize's callback: ``keep`` (what the helper may still read) outlives the free."""
    lib.pd_decode_ctx_free(ctx)
    del keep


def _fusable_lm_head(model: LlamaForCausalLM) -> PackedLinear | None:
    """The model's LM head when the C step can run it (packed with skinny panels, no bias, the
    config's shape), else None."""
    head, cfg = model.lm_head, model.config
    if (
        isinstance(head, PackedLinear)
        and head.skinny_weight is not None
        and head.bias is None
        and (head.out_features, head.in_features) == (cfg.vocab_size, cfg.hidden_size)
    ):
        return head
    return None


def _unfit(model: torch.nn.Module, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> str:
    """Why ``model`` and its caches do not fit the C step ("" when they do)."""
    if not isinstance(model, LlamaForCausalLM) or type(model.model) is not LlamaModel:
        return f"{type(model).__name__} is not a Llama-family model of pdserve.model.llama"
    if not isinstance(model.attn_backend, CpuPagedBackend):
        return f"attention backend {type(model.attn_backend).__name__} is not cpu_paged"
    dtype = model.model.embed_tokens.weight.dtype
    if dtype not in _DTYPES or model.model.embed_tokens.weight.device.type != "cpu":
        return f"model dtype {dtype} (fp32 and bf16 on CPU only)"
    layers = model.model.layers
    if len(kv_caches) != len(layers) or not layers:
        return f"{len(kv_caches)} KV caches for {len(layers)} layers"
    first = kv_caches[0][0]
    cfg = model.config
    if first.dim() != 4 or tuple(first.shape[2:]) != (cfg.num_key_value_heads, cfg.head_dim):
        return f"KV cache shape {tuple(first.shape)} does not fit the model's KV heads"
    eps = None
    for i, layer in enumerate(layers):
        dl = cast(DecoderLayer, layer)
        if not (
            type(layer) is DecoderLayer
            and type(dl.self_attn) is Attention
            and type(dl.mlp) is GatedMLP
            and type(dl.input_layernorm) is RMSNorm
            and type(dl.post_attention_layernorm) is RMSNorm
        ):
            return f"layer {i} is not the plain Llama decoder layer"
        if not all(
            isinstance(m, PackedLinear) and m.skinny_weight is not None
            for m in (dl.self_attn.qkv_proj, dl.self_attn.o_proj, dl.mlp.gate_up_proj,
                      dl.mlp.down_proj)
        ):  # fmt: skip
            return f"layer {i}'s linears are not packed with skinny panels"
        norm1, norm2, qkv, o, gate_up, down = _parts(layer)
        if gate_up.bias is not None or down.bias is not None:
            return f"layer {i}'s MLP has biases"
        q_n, kv_n = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        h, inter = cfg.hidden_size, cfg.intermediate_size
        want = {qkv: (q_n + 2 * kv_n, h), o: (h, q_n), gate_up: (2 * inter, h), down: (h, inter)}
        if any((m.out_features, m.in_features) != shape for m, shape in want.items()):
            return f"layer {i}'s linear shapes do not fit the model config"
        tensors: list[torch.Tensor] = [norm1.weight, norm2.weight]
        tensors += [m.bias for m in (qkv, o) if m.bias is not None]
        if any(t.dtype != dtype or not t.is_contiguous() for t in tensors):
            return f"layer {i}'s norm weights or biases are not contiguous {dtype}"
        eps = norm1.eps if eps is None else eps
        if norm1.eps != eps or norm2.eps != eps:
            return "the layers' RMSNorm eps differ"
        for cache in kv_caches[i]:
            if (
                cache.dtype != dtype
                or cache.shape != first.shape
                or cache.stride() != first.stride()
                or cache.stride()[1:] != (first.shape[2] * first.shape[3], first.shape[3], 1)
            ):
                return f"layer {i}'s KV cache is not a {dtype} pool like layer 0's"
    norm = cast(RMSNorm, model.model.norm)
    if (
        type(norm) is not RMSNorm
        or norm.weight.dtype != dtype
        or not norm.weight.is_contiguous()
        or norm.eps != eps
    ):
        return "the final norm's dtype or eps differs from the layers'"
    return ""
