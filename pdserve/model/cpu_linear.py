"""CPU inference transform: linear layers with weights pre-packed for oneDNN (MKL-DNN).

``F.linear`` on CPU hands the dense ``[out, in]`` weight to a GEMM that re-lays it out (or reads it
with a poor stride) on every call. oneDNN can instead reorder a weight once into its blocked
layout (``torch.ops.mkldnn._reorder_linear_weight``, what torch.compile's CPU "freezing" pass
emits) and then run ``torch.ops.mkldnn._linear_pointwise`` on it. On this project's AMD EPYC
(avx512_bf16, 1 thread, SmolLM2-135M shapes) that is 1.2-1.8x faster for the decode shapes
(``[1..64, 576] x [576, 960 | 3072 | 49152]``), in bf16 and fp32 alike, with the same results
(bf16 is bit-identical to ``F.linear``; fp32 differs by rounding, ~1e-6).

:func:`pack_linears` swaps every ``nn.Linear`` of a model for a :class:`PackedLinear`; it is applied
by the ModelRunner (inference only) and never by the loader, so a loaded model keeps plain dense
parameters (``state_dict`` for conversion, weight comparisons in tests). A weight oneDNN cannot
pack (fp16 without avx512_fp16, a non-CPU device, a torch built without MKL-DNN) keeps its dense
``nn.Linear``.

Skinny calls (a decode step's few rows) go elsewhere: oneDNN's kernels stream a weight at 5-8 GB/s
there, below what one core can pull. Where the CPU has AVX-512F or AVX2 with FMA (fp32), or
AVX512_BF16 (bf16), a :class:`PackedLinear` can also hold the weight in column panels for
``cpu_kernels/skinny_gemm.c`` and runs calls of :func:`skinny_rows` rows with it (SmolLM2-135M
fp32, the 30 layers' four linears plus the LM head at 16 rows, measured on an AMX Xeon, one
thread: 62.8 against 87.0 ms; two threads 31.0 against 48.5 ms; at 256 rows oneDNN is faster, 467
against 597 ms, so larger calls stay with oneDNN; on an AVX2-only Zen 1 EPYC, where 16 rows are
bound by the FMA rate rather than DRAM, 137.5 against 182.3 ms, and still 1.10x at 32 rows; bf16
in docs/benchmarks.md). Without AVX-512F the kernel runs fp32 calls of any size
(:func:`skinny_runs_large`: on a Zen 3 EPYC 1.19x oneDNN at 256 rows). The panels are a second
copy of the weight: the weights of a decoding worker take twice the memory (SmolLM2-135M: ~540 MB more in fp32 where
the weights are not GGUF codes, see below, ~270 MB in bf16; ``PDSERVE_CPU_SKINNY_GEMM=0`` turns
the kernel off). Results differ from oneDNN's by
rounding (fp32 ~1e-6 relative; bf16: a few outputs in 10^4 by one bf16 rounding step).

fp32 weights dequantised from a GGUF file (the bundled SmolLM2: Q4_1 layers, a Q8_0 embedding)
are integer codes times per-group scales; where the CPU has AVX-512F, or AVX2 with FMA, such a
weight's panels hold those codes instead (:func:`skinny_pack_codes`; SmolLM2: 112 MB instead of
538), rebuilt bit for bit in the kernel: the same results as fp32 panels, at 1.4-1.7x their speed
for 1 to 8 rows and about the same at 14-16 (SmolLM2-135M's decode GEMMs, Zen 5, one thread; on
a Zen 3 with AVX2 only 1.5-1.6x at 1 row, 1.1x at 8, 1.04x at 16, 1.02x at 256), with less of
the memory traffic that a decode step shares with a prefill on the other core
(``PDSERVE_CPU_WEIGHT_CODES=0`` keeps fp32 panels; docs/benchmarks.md, session 37).
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from pdserve import env
from pdserve.attention.cpu_build import load_library
from pdserve.cpu import cpu_flags, has_amx_bf16
from pdserve.huge_pages import empty_on_huge_pages
from pdserve.model.ops import opaque_op
from pdserve.model.registry import CausalLM

# Rows per call oneDNN tunes the packed layout for; any row count works with any layout, and on
# the measured shapes hints from 16 to 512 time the same within noise (1 is slower for fp32).
DEFAULT_BATCH_HINT = 64

SKINNY_SOURCE = Path(__file__).with_name("cpu_kernels") / "skinny_gemm.c"
# output columns per packed panel (the C kernel's PANEL)
SKINNY_PANEL = 16
_PAGE = 4096  # bytes: each panel of panels_on_huge_pages starts on a page of its own
# Rows up to which the skinny kernel runs a call (measured, fp32, SmolLM2-135M shapes, one thread:
# 1.38x oneDNN at 16 rows, 1.17x at 32, even at 64, 0.78x at 256).
SKINNY_MAX_ROWS = 32
# The row counts (inclusive) each dtype's kernel runs; the rest go to oneDNN. bf16 (measured with
# bench/skinny_gemm.py, SmolLM2-135M's 30 layers and LM head, one thread): on a Zen 4 EPYC
# (VDPBF16PS, no AMX) the kernel keeps only a block's own rows' accumulators (one compiled block per
# row count) and is 1.47x oneDNN at 1 row, 1.30x at 4, 1.40x at 12, 1.21x at 16, 1.15x at 24 and
# even at 32; on a Xeon with AMX, where oneDNN's bf16 GEMM runs on the tile unit, it is 1.35x at 1
# row, 1.13x at 4, 0.94x at 6, 0.75x at 8 and 0.41x at 16 (two threads: 1.16x at 4, 0.75x at 8).
SKINNY_ROWS = {torch.float32: (1, SKINNY_MAX_ROWS), torch.bfloat16: (1, SKINNY_MAX_ROWS)}
SKINNY_ROWS_AMX_BF16 = (1, 4)
# bf16 with the kernel's AMX path (2 to 16 rows on tiles, 1 row on VDPBF16PS; see skinny_amx)
SKINNY_ROWS_AMX_TILES = (1, 16)
# the C entry point and the CPU feature it needs, per weight dtype
_SKINNY_FUNCS = {
    torch.float32: ("pd_skinny_gemm_f32", "pd_skinny_available", "AVX-512F or AVX2 with FMA"),
    torch.bfloat16: ("pd_skinny_gemm_bf16", "pd_skinny_bf16_available", "AVX512_BF16"),
}


class PackedLinear(nn.Module):
    """``y = x @ weight.T + bias`` with ``weight`` held in oneDNN's blocked layout.

    ``weight`` [out, in] and ``bias`` [out] (or None) are dense CPU tensors of one dtype (fp32 or
    bf16); they are copied (the module does not alias them). ``skinny``: also hold panels for the
    skinny kernel (see the module docstring); None = wherever it applies (:func:`skinny_applies`),
    False = never, True = required (RuntimeError when it does not apply). An fp32 weight that
    is exactly GGUF-style codes gets coded panels (:func:`skinny_pack_codes`), else fp32 ones.
    Raises RuntimeError when oneDNN cannot pack this weight (see :func:`can_pack`).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        batch_hint: int = DEFAULT_BATCH_HINT,
        skinny: bool | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
            use_skinny = skinny_applies(weight) if skinny is None else skinny
            if use_skinny and not skinny_applies(weight):
                why = skinny_reason(weight.dtype) or "needs a 2-D CPU weight, K even for bf16"
                raise RuntimeError(f"skinny kernel unavailable for this weight: {why}")
            self.skinny_weight: torch.Tensor | None = None
            if use_skinny:
                coded = skinny_pack_codes(weight) if weight.dtype == torch.float32 else None
                self.skinny_weight = coded[0] if coded else skinny_pack(weight.detach())
        # an opaque MKL-DNN tensor, not a Parameter: nothing trains or serialises it
        self.packed_weight = packed
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] (weight dtype) -> [..., out_features]."""
        if torch.compiler.is_compiling():
            out: torch.Tensor = _packed_linear_op(
                x, self.packed_weight, self.skinny_weight, self.bias
            )
            return out
        return _packed_linear(x, self.packed_weight, self.skinny_weight, self.bias)

    def extra_repr(self) -> str:
        kind = "oneDNN"
        if self.skinny_weight is not None:
            kind += "+skinny" + {SK_Q4: "(4-bit codes)", SK_Q8: "(8-bit codes)"}.get(
                panels_format(self.skinny_weight), ""
            )
        return f"in_features={self.in_features}, out_features={self.out_features}, packed={kind}"


# Inductor lowers mkldnn._linear_pointwise only for weights it packed itself (frozen graph
# constants); a compiled decoder (pdserve/model/compile.py) reaches the same oneDNN call through
# this opaque op instead, with the weight as a graph input, so one graph serves every layer.
def _packed_linear(
    x: torch.Tensor,
    packed_weight: torch.Tensor,
    skinny_weight: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    # the panels and bias come from PackedLinear (contiguous, fitting): only x is checked
    if (
        skinny_weight is not None
        and x.dtype == _operand_dtype(skinny_weight)
        and x.is_cpu
        and x.shape[-1] == _panels_k(skinny_weight)
    ):
        rows = x.numel() // max(1, x.shape[-1])
        lo, hi = skinny_rows(x.dtype)
        if rows > hi and _sharing.on:
            y = _shared_run(x, skinny_weight, packed_weight.shape[0], bias)
            if y is not None:
                return y
        fn = _format_kernel(panels_format(skinny_weight))[0]
        if fn is not None and lo <= rows and (rows <= hi or skinny_runs_large(x.dtype)):
            return _skinny_run(fn, x, skinny_weight, packed_weight.shape[0], bias)
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")
    return out


def _packed_linear_fake(
    x: torch.Tensor,
    packed_weight: torch.Tensor,
    skinny_weight: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], packed_weight.shape[0]))


_packed_linear_op = opaque_op(
    "packed_linear",
    "(Tensor x, Tensor packed_weight, Tensor? skinny_weight, Tensor? bias) -> Tensor",
    _packed_linear,
    _packed_linear_fake,
)


_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
# x, rows, K, x row stride, panels, N, bias, y, y row stride, threads
_SKINNY_ARGTYPES: list[type[ctypes._SimpleCData[Any]]] = [
    _P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, _INT,
]  # fmt: skip


@functools.cache
def _skinny_kernel(dtype: torch.dtype) -> tuple[Callable[..., int] | None, str | None]:
    """The loaded kernel for ``dtype`` weights (fp32 or bf16) and None, or None and why it cannot
    run here."""
    if dtype not in _SKINNY_FUNCS:
        return None, f"no skinny kernel for {dtype} (fp32 and bf16 only)"
    name, available, feature = _SKINNY_FUNCS[dtype]
    kl = load_library(SKINNY_SOURCE)
    if kl.lib is None:
        return None, kl.reason
    if not getattr(kl.lib, available)():
        return None, f"the CPU (or the build: no -march=native) lacks {feature}"
    fn = getattr(kl.lib, name)
    fn.argtypes = _SKINNY_ARGTYPES
    fn.restype = ctypes.c_int
    return fn, None


@functools.cache
def _codes_kernel() -> Callable[..., int] | None:
    """The loaded ``pd_skinny_gemm`` (weight format first, then the fp32 entry's arguments), or
    None where the library cannot be built or lacks the coded formats (neither AVX-512F nor AVX2
    with FMA)."""
    kl = load_library(SKINNY_SOURCE)
    if kl.lib is None or not kl.lib.pd_skinny_codes_available():
        return None
    fn = kl.lib.pd_skinny_gemm
    fn.argtypes = [_INT, *_SKINNY_ARGTYPES]
    fn.restype = ctypes.c_int
    return cast(Callable[..., int], fn)


def _codes_built() -> bool:
    """Whether fp32 weights may get coded panels here (:func:`skinny_pack_codes`): the kernel's
    codes built (AVX-512F, or AVX2 with FMA), the skinny kernel on, and ``PDSERVE_CPU_WEIGHT_CODES`` not 0."""
    return (
        env.cpu_weight_codes()
        and skinny_reason(torch.float32) is None
        and _codes_kernel() is not None
    )


@functools.cache
def _format_kernel(fmt: int) -> tuple[Callable[..., int] | None, str | None]:
    """:func:`_skinny_kernel` by weight format (SK_*): the coded formats run ``pd_skinny_gemm``
    with the format bound as its first argument."""
    if fmt in (SK_F32, SK_BF16):
        return _skinny_kernel(torch.float32 if fmt == SK_F32 else torch.bfloat16)
    fn = _codes_kernel()
    if fn is None:
        return None, "the kernel's weight codes need AVX-512F or AVX2 with FMA"
    return functools.partial(fn, fmt), None


def _operand_dtype(panels: torch.Tensor) -> torch.dtype:
    """The dtype of x, bias and y for ``panels``: fp32 for coded panels, else the panels'."""
    return torch.float32 if panels.dtype == torch.uint8 else panels.dtype


def skinny_gemm() -> Callable[..., int]:
    """The loaded C entry point taking the weight format first (``pd_skinny_gemm``: SK_F32,
    SK_BF16, SK_Q4, SK_Q8, then ``pd_skinny_gemm_f32``'s arguments), for code that calls it from
    C (:mod:`pdserve.model.cpu_decode`). Raises RuntimeError when the library cannot be built
    here."""
    kl = load_library(SKINNY_SOURCE)
    if kl.lib is None:
        raise RuntimeError(f"skinny kernel unavailable: {kl.reason}")
    return cast(Callable[..., int], kl.lib.pd_skinny_gemm)


@functools.cache
def skinny_rows(dtype: torch.dtype) -> tuple[int, int]:
    """The row counts (inclusive bounds) for which a :class:`PackedLinear` of ``dtype`` runs a
    call with the skinny kernel on this CPU (fp32 or bf16): :data:`SKINNY_ROWS`, except bf16 on a
    CPU with ``amx_bf16``: where the kernel's own AMX path runs (:func:`skinny_amx`), up to 16
    rows (:data:`SKINNY_ROWS_AMX_TILES`), else :data:`SKINNY_ROWS_AMX_BF16` (oneDNN's AMX GEMM
    beats the VDPBF16PS blocks past 4 rows)."""
    if dtype == torch.bfloat16 and has_amx_bf16():
        return SKINNY_ROWS_AMX_TILES if skinny_amx() else SKINNY_ROWS_AMX_BF16
    return SKINNY_ROWS[dtype]


def skinny_runs_large(dtype: torch.dtype) -> bool:
    """Whether a :class:`PackedLinear` of ``dtype`` with panels also runs calls of more rows than
    :func:`skinny_rows` (a prefill's, a large decode batch's) with the skinny kernel here rather
    than oneDNN: fp32 on a CPU without AVX-512F, where the kernel's AVX2 blocks keep up with or
    beat oneDNN's fp32 GEMM at every row count measured (bench/skinny_gemm.py --gguf-codes,
    SmolLM2-135M's 30 layers and LM head, one thread: Zen 3 EPYC 1.25x at 64 rows, 1.19x at 256,
    1.17x at 1024; Zen 1 EPYC even at 256, 1980 against 1989 ms; docs/benchmarks.md). With
    AVX-512 oneDNN is the faster one there (0.78x at 256 rows on the AMX Xeon)."""
    return dtype == torch.float32 and "avx512f" not in cpu_flags()


@functools.cache
def skinny_amx() -> bool:
    """Whether the bf16 skinny kernel runs calls of 2 to 16 rows (K a multiple of 32) on AMX tiles
    here: the library built with AMX (``-march=native`` on a CPU with ``amx_bf16``) and the OS
    granting tile data. The panels are then the tile unit's B operand as they are; streamed from
    DRAM (SmolLM2's four decoder linears x 120 weights, 16 rows, one thread, a 2-core AMX Xeon)
    the AMX path pulls 12.1 GB/s where oneDNN pulls 9.5 (docs/benchmarks.md, session 16)."""
    kl = load_library(SKINNY_SOURCE)
    if kl.lib is None or not env.cpu_skinny_gemm():
        return False
    fn = kl.lib.pd_skinny_set_amx
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return bool(fn(1))


@functools.cache
def skinny_split() -> tuple[Callable[..., int], Callable[..., int], Callable[..., int]]:
    """The kernel's GEMM in two halves, for C code that shares one GEMM between threads
    (:mod:`pdserve.model.cpu_decode`): the loaded ``pd_skinny_prepare`` (x copied once),
    ``pd_skinny_panels`` (any range of 16-column panels from that copy) and
    ``pd_skinny_prep_bytes`` (the copy's size). Raises RuntimeError when the library cannot be
    built here."""
    kl = load_library(SKINNY_SOURCE)
    if kl.lib is None:
        raise RuntimeError(f"skinny kernel unavailable: {kl.reason}")
    return kl.lib.pd_skinny_prepare, kl.lib.pd_skinny_panels, kl.lib.pd_skinny_prep_bytes


def skinny_reason(dtype: torch.dtype = torch.float32) -> str | None:
    """Why the skinny kernel cannot run here for ``dtype`` weights (one line), or None when it
    can. Turned off by ``PDSERVE_CPU_SKINNY_GEMM=0`` (:func:`pdserve.env.cpu_skinny_gemm`)."""
    if not env.cpu_skinny_gemm():
        return f"turned off by {env.CPU_SKINNY_GEMM}"
    return _skinny_kernel(dtype)[1]


def skinny_applies(weight: torch.Tensor) -> bool:
    """True when ``weight`` gets skinny panels by default: a 2-D fp32 or bf16 CPU tensor (bf16:
    an even number of columns K) and the kernel for its dtype built and loaded here (fp32:
    AVX-512F, or AVX2 with FMA; bf16: AVX512_BF16; a C compiler; see
    :mod:`pdserve.attention.cpu_build`)."""
    return (
        weight.dim() == 2
        and weight.device.type == "cpu"
        and (
            weight.dtype == torch.float32
            or (weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0)
        )
        and skinny_reason(weight.dtype) is None
    )


def skinny_pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] -> the kernel's panels, zero rows padding N to a multiple of 16.

    fp32: [ceil(N / 16), K, 16], ``panels[p, k, j] = weight[16 p + j, k]``. bf16 (K even):
    [ceil(N / 16), K / 2, 16, 2], ``panels[p, kk, j, t] = weight[16 p + j, 2 kk + t]`` (the pairs
    VDPBF16PS multiplies). Contiguous. Raises ValueError for another dtype or an odd bf16 K.
    """
    n, k = weight.shape
    padded = F.pad(weight, (0, 0, 0, (-n) % SKINNY_PANEL))
    if weight.dtype == torch.float32:
        return padded.view(-1, SKINNY_PANEL, k).transpose(1, 2).contiguous()
    if weight.dtype == torch.bfloat16 and k % 2 == 0:
        return padded.view(-1, SKINNY_PANEL, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    raise ValueError(f"skinny_pack: fp32 [N, K] or bf16 [N, even K], got {weight.dtype} [{n}, {k}]")


# Weight formats of the skinny kernel (its SK_* codes): fp32 and bf16 panels, and fp32 weights held
# as codes (skinny_pack_codes)
SK_F32, SK_BF16, SK_Q4, SK_Q8 = 0, 1, 2, 3
# k steps per group of the coded formats, and a group's bytes per 16-column panel
CODE_GROUP = 32
_GROUP_BYTES = {
    SK_Q4: 2 * 64 + CODE_GROUP // 2 * SKINNY_PANEL,
    SK_Q8: 64 + CODE_GROUP * SKINNY_PANEL,
}
_FORMAT_OF_GROUP = {b: f for f, b in _GROUP_BYTES.items()}


def _exact_codes(
    blocks: torch.Tensor, lo: int, hi: int, scale: torch.Tensor, offset: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, exact): for each group of ``blocks`` [..., G] (fp32) with its ``scale`` and
    ``offset`` [...] (None: 0), the integer codes q in [lo, hi] nearest (w - offset) / scale,
    and whether q * scale + offset reproduces every weight of the group bit for bit (the product
    exact, the sum rounded once, as the kernel's multiply-add). A zero scale codes 0."""
    base = blocks if offset is None else blocks - offset.unsqueeze(-1)
    s = scale.unsqueeze(-1)
    q = torch.where(s == 0, torch.zeros_like(base), torch.round(base / s)).clamp_(lo, hi)
    q = torch.nan_to_num(q, nan=0.0)
    recon = q * s if offset is None else q * s + offset.unsqueeze(-1)
    exact = (recon.view(torch.int32) == blocks.view(torch.int32)).all(-1)
    return q, exact


def _fp16_scales(approx: torch.Tensor) -> list[torch.Tensor]:
    """Candidate scales for groups whose fp32 weights came from a GGUF quantisation (an fp16 scale
    per group): ``approx`` rounded to fp16, and its two fp16 neighbours (rounding in the
    dequantised sums can move the estimate across an fp16 step). A scale with an fp16 mantissa
    times a code of up to 8 bits is exact in fp32."""
    h = approx.clamp(0, 65504).to(torch.float16)
    bits = h.view(torch.int16)
    ups = (bits + 1).view(torch.float16)
    downs = torch.where(bits > 0, bits - 1, bits).view(torch.float16)
    return [t.to(torch.float32) for t in (h, ups, downs)]


def _solve_codes(
    w: torch.Tensor, fmt: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """(codes [N, K], scales [N, K / 32], offsets [N, K / 32] or None) reproducing ``w`` [N, K]
    (fp32, K a multiple of 32) exactly in format ``fmt``, or None when some group has no such
    coding. SK_Q4: w = q * d + m, q in [0, 15], m the group's minimum (GGUF Q4_1 dequantised:
    its smallest code is 0); SK_Q8: w = q * d, q in [-128, 127] (GGUF Q8_0, Q4_0 and Q5_0
    dequantised: their codes less 8 or 16)."""
    n, k = w.shape
    blocks = w.reshape(n, k // CODE_GROUP, CODE_GROUP)
    if not torch.isfinite(blocks).all():
        return None
    if fmt == SK_Q4:
        low = blocks.amin(-1)
        offset: torch.Tensor | None = low
        lo, hi = 0, 15
        estimates = [(blocks.amax(-1) - low) / 15]
    else:
        offset, lo, hi = None, -128, 127
        # the largest |code|: 127 (Q8_0), 8 (Q4_0: q - 8), 16 (Q5_0: q - 16)
        amax = blocks.abs().amax(-1)
        estimates = [amax / 127, amax / 8, amax / 16]
    q = scale = None
    done = torch.zeros(estimates[0].shape, dtype=torch.bool)
    for cand in (c for approx in estimates for c in _fp16_scales(approx)):
        cq, exact = _exact_codes(blocks, lo, hi, cand, offset)
        if q is None or scale is None:
            q, scale = cq, cand.clone()
        take = exact & ~done
        q[take], scale[take] = cq[take], cand[take]
        done |= exact
        if bool(done.all()):
            return q.reshape(n, k), scale, offset
    return None


def skinny_pack_codes(weight: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """fp32 ``weight`` [N, K] as the skinny kernel's coded panels, or None where no coding
    reproduces every weight exactly (or the kernel's codes are not built here: they need AVX-512F
    or AVX2 with FMA).

    A model dequantised from a GGUF file holds fp32 weights that are small integer codes times a
    per-group scale (plus an offset): Q4_1 gives ``d * q + m`` with 4-bit q, Q8_0 ``d * q`` with
    8-bit q, each over groups of 32 input features, d and m fp16 (GGUF spec; gguf-py's
    ``dequantize``; Q4_0 and Q5_0 are 8-bit codes here). Stored as those codes, a decode step's
    weight stream is 3/16 (4-bit codes, a scale and an offset: 384 bytes per 16 columns x 32 k
    against 2048) or 9/32 (8-bit) of the fp32 panels', and the kernel rebuilds each weight bit for
    bit (see ``panel_block_codes`` in ``cpu_kernels/skinny_gemm.c``), so results equal the fp32
    panels' exactly. The coding is found from the values alone (each group's minimum and range,
    or its largest magnitude, give m and d; every weight is then checked), so any weight that did
    not come from such a file keeps its fp32 panels. Other GGUF types (K-quants, Q5_1) are not
    coded: they keep fp32 panels.

    Returns (panels, format): uint8 [ceil(N / 16), K / 32, group bytes], format SK_Q4 (tried
    first) or SK_Q8; rows padding N to a multiple of 16 code zero. K must be a multiple of 32."""
    if (
        weight.dtype != torch.float32
        or weight.dim() != 2
        or weight.shape[1] % CODE_GROUP
        or not _codes_built()
    ):
        return None
    w = F.pad(weight.detach(), (0, 0, 0, (-weight.shape[0]) % SKINNY_PANEL)).contiguous()
    npan, k = w.shape[0] // SKINNY_PANEL, w.shape[1]
    groups = k // CODE_GROUP
    for fmt in (SK_Q4, SK_Q8):
        # a few rows first: a weight of another origin fails there, before a pass over all of it
        if _solve_codes(w[:SKINNY_PANEL], fmt) is None:
            continue
        solved = _solve_codes(w, fmt)
        if solved is None:
            continue
        q, scale, offset = solved

        def by_panel(t: torch.Tensor) -> torch.Tensor:
            # [Np, groups] fp32 -> [panels, groups, 64] bytes: the 16 columns' values of a group
            return (
                t.view(npan, SKINNY_PANEL, groups)
                .transpose(1, 2)
                .contiguous()
                .view(torch.uint8)
                .view(npan, groups, 64)
            )

        parts = [by_panel(scale)]
        if fmt == SK_Q4:
            assert offset is not None
            parts.append(by_panel(offset))
            c = q.to(torch.uint8).view(npan, SKINNY_PANEL, groups, CODE_GROUP // 2, 2)
            pairs = c[..., 0] | (c[..., 1] << 4)  # [panels, 16, groups, pairs]
            parts.append(pairs.permute(0, 2, 3, 1).reshape(npan, groups, -1))
        else:
            c = q.to(torch.int8).view(torch.uint8).view(npan, SKINNY_PANEL, groups, CODE_GROUP)
            parts.append(c.permute(0, 2, 3, 1).reshape(npan, groups, -1))
        return torch.cat(parts, dim=2).contiguous(), fmt
    return None


def panels_format(panels: torch.Tensor) -> int:
    """The weight format (SK_*) of panels made by :func:`skinny_pack` or
    :func:`skinny_pack_codes`."""
    if panels.dtype == torch.uint8:
        return _FORMAT_OF_GROUP[int(panels.shape[2])]
    return SK_F32 if panels.dtype == torch.float32 else SK_BF16


def _panels_k(panels: torch.Tensor) -> int:
    """K (input features) of panels made by :func:`skinny_pack` or :func:`skinny_pack_codes`."""
    if panels.dtype == torch.uint8:
        return int(panels.shape[1]) * CODE_GROUP
    return int(panels.shape[1]) * (int(panels.shape[3]) if panels.dim() == 4 else 1)


def skinny_linear(
    x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ W.T + bias`` with W packed by :func:`skinny_pack`.

    x: [..., K] CPU, of the panels' dtype (fp32 or bf16); panels: as :func:`skinny_pack` returns
    for a weight of ``out_features`` (or fewer) rows; bias: [out_features] of the same dtype, or
    None. Returns a new [..., out_features] tensor of that dtype (bf16: fp32 sums rounded once);
    the call runs on ``torch.get_num_threads()`` OpenMP threads. Any row count works (each 16 rows
    re-read the panels); it pays in :func:`skinny_rows`. Raises RuntimeError when the
    kernel is unavailable (:func:`skinny_reason`), ValueError when shapes or dtypes do not fit.
    """
    if panels.dtype == torch.uint8 and (
        panels.dim() != 3 or int(panels.shape[2]) not in _FORMAT_OF_GROUP
    ):
        raise ValueError(f"skinny_linear: uint8 panels {tuple(panels.shape)} are not coded panels")
    fmt = panels_format(panels)
    fn, why = _format_kernel(fmt)
    if fn is None:
        raise RuntimeError(f"skinny kernel unavailable: {why}")
    k = x.shape[-1]
    if not (x.is_cpu and panels.is_cpu and (bias is None or bias.is_cpu)):
        raise ValueError("skinny_linear: x, panels and bias must be CPU tensors")
    dtype = _operand_dtype(panels)
    want: tuple[int, ...] = (
        (k, SKINNY_PANEL)
        if fmt == SK_F32
        else (k // 2, SKINNY_PANEL, 2)
        if fmt == SK_BF16
        else (k // CODE_GROUP, _GROUP_BYTES[fmt])
    )
    if (
        x.dtype != dtype
        or panels.shape[1:] != want
        or _panels_k(panels) != k
        or panels.shape[0] * SKINNY_PANEL < out_features
        or not panels.is_contiguous()
    ):
        raise ValueError(
            f"skinny_linear: x [..., {k}] {x.dtype} and panels {tuple(panels.shape)} "
            f"{panels.dtype} must fit ({dtype} x), panels contiguous "
            f"[>= {-(-out_features // SKINNY_PANEL)}, {', '.join(map(str, want))}]"
        )
    if bias is not None and (
        bias.dtype != dtype or bias.shape != (out_features,) or not bias.is_contiguous()
    ):
        raise ValueError(
            f"skinny_linear: bias must be a contiguous {dtype} [{out_features}] tensor"
        )
    return _skinny_run(fn, x, panels, out_features, bias)


def _rows_and_output(x: torch.Tensor, out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., K] as [rows, K] with unit column stride (a view where it can be), and a new
    [rows, out_features] output of x's dtype: the C kernels' operands."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if k > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    return x2, torch.empty(x2.shape[0], out_features, dtype=x.dtype)


def _skinny_run(
    fn: Callable[..., int],
    x: torch.Tensor,
    panels: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """The kernel call itself, for arguments already known to fit (what :func:`skinny_linear`
    checks; a :class:`PackedLinear` builds its panels and bias so, and checks x per call).
    Raises MemoryError when the kernel cannot allocate its interleaved copy of x."""
    x2, y = _rows_and_output(x, out_features)
    k, rows = x2.shape[1], x2.shape[0]
    if rows:
        rc = fn(
            x2.data_ptr(), rows, k, x2.stride(0), panels.data_ptr(), out_features,
            None if bias is None else bias.data_ptr(), y.data_ptr(), out_features,
            torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:  # the kernel's copy of x could not be allocated
            raise MemoryError(f"skinny GEMM kernel failed ({rc}) for x {tuple(x2.shape)}")
    return y.view(*x.shape[:-1], out_features)


class _Sharing:
    """Whether this process's large matmuls go to the shared path (:func:`share_prefill_linears`)."""

    on = False


_sharing = _Sharing()
SHARED_SOURCE = Path(__file__).with_name("cpu_kernels") / "decode_layers.c"
# The helper's scheduling for a prefill worker's shared matmuls where PDSERVE_CPU_PREFILL_HELPER
# is auto and the CPU is one where they pay (prefill_helper_setting): SCHED_IDLE. A niceness trades
# the decode core's time for prefill at a poor rate (Zen 1 EPYC, a prefill's matmuls beside a
# process running decode-sized ones on the other core, alternated: niceness 5 prefill 1.09x
# faster, decode 0.93x; niceness 2: 1.13x and 0.78x; docs/benchmarks.md, session 26).
DEFAULT_PREFILL_HELPER = -1


@functools.cache
def _shared_entry() -> tuple[ctypes.CDLL, tuple[int, int, int]] | None:
    """The loaded ``decode_layers`` library (its ``pd_shared_linear`` typed) and the addresses of
    the skinny kernel's split entry points, or None where either cannot be built here."""
    kl = load_library(SHARED_SOURCE)
    if kl.lib is None:
        return None
    try:
        split = skinny_split()
    except RuntimeError:
        return None
    lib = kl.lib
    lib.pd_shared_linear.argtypes = [
        _INT, _P, _P, _P, _P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64,
    ]  # fmt: skip
    lib.pd_shared_linear.restype = _INT
    lib.pd_helper_set_nice.argtypes, lib.pd_helper_set_nice.restype = [_INT], None
    prepare, panels, prep_bytes = (
        int(ctypes.cast(f, ctypes.c_void_p).value or 0)  # type: ignore[arg-type]
        for f in split
    )
    return lib, (prepare, panels, prep_bytes)


def prefill_helper_setting(dtype: torch.dtype) -> int | None:
    """How a prefill worker of ``dtype`` weights shares its matmuls here: None (it does not), -1
    (with the helper at ``SCHED_IDLE``) or the helper's niceness (1-19).

    ``PDSERVE_CPU_PREFILL_HELPER`` decides (:func:`pdserve.env.cpu_prefill_helper`); ``auto``
    shares with the helper at ``SCHED_IDLE`` (:data:`DEFAULT_PREFILL_HELPER`) for fp32 on a CPU
    without AVX-512, where the skinny kernel's fp32 blocks run a prefill's matmuls as fast as
    oneDNN (Zen 1 EPYC, one thread, SmolLM2-135M's linears at 256 rows: 1980 against 1989 ms,
    docs/benchmarks.md), so sharing costs nothing when the other CPU is busy; on AVX-512 CPUs
    oneDNN is faster there (0.78x at 256 rows on the AMX Xeon). Never where the kernel cannot run
    (:func:`skinny_reason`) or the process may use only one CPU. Raises ValueError for a bad
    variable."""
    setting = env.cpu_prefill_helper()
    if (
        setting == "off"
        or dtype not in _SKINNY_FUNCS
        or skinny_reason(dtype) is not None
        or len(os.sched_getaffinity(0)) < 2
        or _shared_entry() is None
    ):
        return None
    if setting is None:
        return DEFAULT_PREFILL_HELPER if skinny_runs_large(dtype) else None
    return -1 if setting == "idle" else int(setting)


def share_prefill_linears(nice: int | None) -> bool:
    """Route this process's :class:`PackedLinear` calls of more rows than :func:`skinny_rows`
    (a prefill's) to ``pd_shared_linear`` in ``cpu_kernels/decode_layers.c``: the skinny kernel's
    panels, with the idle-core helper thread computing chunks beside the calling thread (the
    decode step's protocol: whatever the helper has not finished in time the caller takes back,
    so a call never waits on a preempted helper). ``nice``: the helper's scheduling, -1
    ``SCHED_IDLE`` (it runs only on a CPU nothing else wants), 1-19 a niceness (it competes for a
    busy CPU, getting about 1.25^-nice the share of a thread at 0), None: turn sharing off (and
    the helper back to ``SCHED_IDLE``). Only linears that hold panels share (``skinny`` in
    :func:`pack_linears`). Returns whether sharing is on (False where the library cannot be
    built)."""
    entry = _shared_entry()
    if entry is not None:
        entry[0].pd_helper_set_nice(-1 if nice is None else int(nice))
    _sharing.on = entry is not None and nice is not None
    return _sharing.on


def _shared_run(
    x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """``x @ W.T + bias`` through ``pd_shared_linear``, for arguments :func:`_packed_linear`
    checked; None when the helper is busy elsewhere (the caller runs oneDNN). Raises MemoryError
    when the kernel's buffers cannot grow."""
    entry = _shared_entry()
    if entry is None:
        return None
    lib, (prepare, run_panels, prep_bytes) = entry
    x2, y = _rows_and_output(x, out_features)
    k, rows = x2.shape[1], x2.shape[0]
    rc = lib.pd_shared_linear(
        panels_format(panels), prepare, run_panels, prep_bytes,
        x2.data_ptr(), rows, k, x2.stride(0), panels.data_ptr(), out_features,
        None if bias is None else bias.data_ptr(), y.data_ptr(), out_features,
    )  # fmt: skip
    if rc == 1 or rc == -1:  # the helper is busy, or the kernel does not take these shapes
        return None
    if rc != 0:
        raise MemoryError(f"shared GEMM failed ({rc}) for x {tuple(x2.shape)}")
    return y.view(*x.shape[:-1], out_features)


@functools.cache
def _onednn_packs(dtype: torch.dtype) -> bool:
    """Whether this torch build and CPU run a packed oneDNN linear in ``dtype`` (probed once)."""
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    try:
        probe = torch.zeros(8, 16, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(probe, 1)
        torch.ops.mkldnn._linear_pointwise(probe[:1], packed, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return True


def can_pack(weight: torch.Tensor) -> bool:
    """True when ``weight`` can become a :class:`PackedLinear` here: a 2-D CPU fp32/bf16 tensor,
    torch built with MKL-DNN, and oneDNN accepts the reorder (it refuses e.g. bf16 on CPUs without
    AVX-512)."""
    return weight.dim() == 2 and weight.device.type == "cpu" and _onednn_packs(weight.dtype)


def pack_linears(
    model: CausalLM, batch_hint: int = DEFAULT_BATCH_HINT, skinny: bool | None = None
) -> int:
    """Replace, in place, every ``nn.Linear`` of ``model`` whose weight :func:`can_pack` by a
    :class:`PackedLinear` with the same weight and bias. Returns the number replaced (0 when
    oneDNN is unavailable: the model is then unchanged). Call after the weights are loaded; the
    dense weights of replaced layers are released. ``skinny``: passed to every PackedLinear
    (None: skinny panels wherever they apply; False for a worker that never decodes).

    A model whose logits come from its input embedding (tied weights, ``lm_head is None``) gets a
    packed copy of the embedding matrix as its ``lm_head``: the embedding lookup needs the dense
    rows, so that is one extra ``vocab x hidden`` matrix in memory (56 MiB for SmolLM2-135M bf16).
    """
    if model.lm_head is None:
        weight = model.input_embeddings().weight
        if can_pack(weight):
            model.lm_head = PackedLinear(weight, None, batch_hint, skinny)
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear) and can_pack(child.weight)
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child.weight, child.bias, batch_hint, skinny))
    panels_on_huge_pages(model)
    return len(targets)


def panels_on_huge_pages(model: nn.Module) -> bool:
    """Move the skinny panels of every :class:`PackedLinear` in ``model`` into one mapping on
    transparent huge pages (:func:`~pdserve.huge_pages.empty_on_huge_pages`), each at a 4 KiB
    boundary. A decode step streams all of them (SmolLM2-135M bf16: 256 MiB, LM head included);
    on 4 KiB pages, their own small allocations, that stream needed a TLB entry every 4 KiB.
    Measured (session 24, ``bench/decode_throughput.py --dtypes bfloat16 --batch-sizes 16
    --prompt-len 320 --threads 1 --no-hf --compile --temperature 1``, alternated, 2-core AMX
    Xeon): one core 35.6-36.2 ms a step against 37.3-37.4, with the idle-core helper 20.9-22.4
    against 22.5-23.5 (docs/benchmarks.md). Returns whether huge pages were asked for (False
    when there are no panels, or the mapping is small or not on Linux: the panels then still
    move, to ``torch.empty`` memory). Raises MemoryError when the mapping cannot be made.
    Call before anything keeps a panel's address (the compiled model, :mod:`cpu_decode`)."""
    mods = [
        m for m in model.modules() if isinstance(m, PackedLinear) and m.skinny_weight is not None
    ]
    if not mods:
        return False
    panels = [cast(torch.Tensor, m.skinny_weight) for m in mods]
    sizes = [-(-p.numel() * p.element_size() // _PAGE) * _PAGE for p in panels]
    arena, huge = empty_on_huge_pages((sum(sizes),), torch.uint8)
    offset = 0
    with torch.no_grad():
        for m, p, size in zip(mods, panels, sizes, strict=True):
            view = arena[offset : offset + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
            view.copy_(p)
            m.skinny_weight = view
            offset += size
    return huge
