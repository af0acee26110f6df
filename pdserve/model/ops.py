"""Opaque operators: how a compiled model calls code that torch.compile must not trace into.

A :func:`torch.library.custom_op` checks on every call that its output aliases no input; that
check and the wrappers around it cost ~35 us per call on a CPU, ~5 ms of a SmolLM2 decode step
(150 calls: 4 linears and attention per layer, 30 layers). The operators here are declared with
the lower-level :class:`torch.library.Library` instead (~9 us per call, measured on an AMX Xeon,
one thread, against the plain oneDNN call), so the no-alias promise is the implementation's own:
every function given to :func:`opaque_op` must return a new tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

NAMESPACE = "pdserve"
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")


def opaque_op(
    name: str, schema: str, impl: Callable[..., torch.Tensor], fake: Callable[..., torch.Tensor]
) -> torch._ops.OpOverload:
    """Declare ``pdserve::<name><schema>`` (e.g. ``"(Tensor x, Tensor w) -> Tensor"``), run by
    ``impl`` on every device and traced by torch.compile through ``fake`` (shapes only). Returns
    the op's default overload. ``impl`` must return a fresh tensor (no view of an input). Raises
    RuntimeError if the name is already declared in this process.
    """
    _LIB.define(name + schema)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIB)
    op: torch._ops.OpOverload = getattr(torch.ops.pdserve, name).default
    return op
