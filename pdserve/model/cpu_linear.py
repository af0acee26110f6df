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
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from pdserve.model.ops import opaque_op
from pdserve.model.registry import CausalLM

# Rows per call oneDNN tunes the packed layout for; any row count works with any layout, and on
# the measured shapes hints from 16 to 512 time the same within noise (1 is slower for fp32).
DEFAULT_BATCH_HINT = 64


class PackedLinear(nn.Module):
    """``y = x @ weight.T + bias`` with ``weight`` held in oneDNN's blocked layout.

    ``weight`` [out, in] and ``bias`` [out] (or None) are dense CPU tensors of one dtype (fp32 or
    bf16); they are copied (the module does not alias them). Raises RuntimeError when oneDNN cannot
    pack this weight (see :func:`can_pack`).
    """

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, batch_hint: int = DEFAULT_BATCH_HINT
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
        # an opaque MKL-DNN tensor, not a Parameter: nothing trains or serialises it
        self.packed_weight = packed
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] (weight dtype) -> [..., out_features]."""
        if torch.compiler.is_compiling():
            out: torch.Tensor = _packed_linear_op(x, self.packed_weight, self.bias)
            return out
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


# Inductor lowers mkldnn._linear_pointwise only for weights it packed itself (frozen graph
# constants); a compiled decoder (pdserve/model/compile.py) reaches the same oneDNN call through
# this opaque op instead, with the weight as a graph input, so one graph serves every layer.
def _packed_linear(
    x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")
    return out


def _packed_linear_fake(
    x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], packed_weight.shape[0]))


_packed_linear_op = opaque_op(
    "packed_linear",
    "(Tensor x, Tensor packed_weight, Tensor? bias) -> Tensor",
    _packed_linear,
    _packed_linear_fake,
)


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


def pack_linears(model: CausalLM, batch_hint: int = DEFAULT_BATCH_HINT) -> int:
    """Replace, in place, every ``nn.Linear`` of ``model`` whose weight :func:`can_pack` by a
    :class:`PackedLinear` with the same weight and bias. Returns the number replaced (0 when
    oneDNN is unavailable: the model is then unchanged). Call after the weights are loaded; the
    dense weights of replaced layers are released.

    A model whose logits come from its input embedding (tied weights, ``lm_head is None``) gets a
    packed copy of the embedding matrix as its ``lm_head``: the embedding lookup needs the dense
    rows, so that is one extra ``vocab x hidden`` matrix in memory (56 MiB for SmolLM2-135M bf16).
    """
    if model.lm_head is None:
        weight = model.input_embeddings().weight
        if can_pack(weight):
            model.lm_head = PackedLinear(weight, None, batch_hint)
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear) and can_pack(child.weight)
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child.weight, child.bias, batch_hint))
    return len(targets)
