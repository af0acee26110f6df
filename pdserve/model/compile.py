"""torch.compile of a model's decoder for CPU serving (inductor): the small ops between the
linears fused into a few C++ loops.

A decode step of a small model runs some fifty small elementwise kernels per layer around its
matmuls: RMSNorm's cast/square/mean/rsqrt/scale/cast, RoPE's swap/multiply/add on q and k,
SiLU-and-mul, the residual adds. Each costs a dispatcher round trip and a pass over memory, which
on CPU adds up to a large share of a step at small batch sizes. :func:`compile_model` runs the
model's :meth:`~pdserve.model.registry.CausalLM.decoder` through ``torch.compile`` (inductor),
which fuses each run of them into one generated loop, as vLLM's CPU backend does.

What stays outside the compiled code:

* attention: :func:`pdserve.model.paged_attention.paged_attention` becomes an opaque custom op
  call, so the backend (and its per-step metadata) is called eagerly, as it is uncompiled;
* the packed oneDNN linears (:mod:`pdserve.model.cpu_linear`) stay oneDNN calls (an opaque op);
* the RoPE table lookup, the logits and sampling (once per step, not per layer).

One graph serves every step: the token count (the first dimension of every input) is marked
*unbacked* dynamic, so no batch size, not even 1, gets its own specialised graph. Compiling it is
slow (tens of seconds to minutes on a small CPU, C++ kernels built by the system compiler), so
:func:`compile_model` compiles at once by running ``warmup``; later processes reuse inductor's
on-disk caches (FX graph and kernel caches under ``TORCHINDUCTOR_CACHE_DIR``, default
``/tmp/torchinductor_$USER``) and compile in a fraction of the time.

bfloat16: by default inductor keeps a fused chain of bf16 operations in float32 and rounds once;
``emulate_precision_casts`` makes it round where eager rounds instead, so compiled and eager
(and transformers) pick the same greedy tokens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from pdserve.model.registry import CausalLM

log = logging.getLogger(__name__)

# inductor options of the compiled decoder (torch.compile(options=...))
INDUCTOR_OPTIONS: dict[str, Any] = {"emulate_precision_casts": True}


def compile_model(model: CausalLM, warmup: Callable[[], object] | None = None) -> float:
    """From now on run ``model.decoder()`` compiled (in place: the module, its parameters and
    ``state_dict`` are unchanged; only its ``forward`` is replaced). ``warmup``: a callable that
    runs one forward of ``model`` (any token count), called once so the compile happens now and
    not in the first served step. Returns the seconds the warm-up took (0 without one).

    Raises RuntimeError (from torch) when the decoder cannot be compiled as one graph; the model is
    then left uncompiled.
    """
    module = model.decoder()
    eager_forward = module.forward
    compiled = torch.compile(eager_forward, fullgraph=True, dynamic=False, options=INDUCTOR_OPTIONS)

    def forward(*args: torch.Tensor) -> torch.Tensor:
        for t in args:
            # any token count, 1 included, runs the one graph (a backed dimension would
            # specialise 1); one symbol for all inputs, at least 1 (a step computes a token)
            torch._dynamo.decorators.mark_unbacked(t, 0, shape_id="num_tokens", min=1)
        out: torch.Tensor = compiled(*args)
        return out

    before = vars(module).get("forward")  # normally None: the class's forward runs
    module.forward = forward
    if warmup is None:
        return 0.0
    t0 = time.perf_counter()
    try:
        warmup()
    except Exception:
        if before is None:
            del module.forward
        else:
            module.forward = before
        raise
    seconds = time.perf_counter() - t0
    log.info("compiled the model's decoder in %.1f s (torch.compile, inductor)", seconds)
    return seconds
