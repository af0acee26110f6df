"""The sampler's CPU kernel (``cpu_kernels/sampling.c``): the two-level race and the argmax read
the LM head's logits (fp32 or bf16) in place, one pass per row, instead of torch's fp32 copy,
block logsumexp and argmaxes (see the C file for the why and the numbers).

Both functions return None when the kernel cannot run here (no C compiler, a build failure,
``PDSERVE_CPU_SAMPLING_KERNEL=0``, a non-CPU tensor, a dtype other than fp32/bf16, or a row
layout it does not read), and the caller keeps its torch path; :func:`sampling_kernel_reason`
says why in one line.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pdserve import env
from pdserve.attention.cpu_build import load_library

SOURCE = Path(__file__).with_name("cpu_kernels") / "sampling.c"
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str | None]:
    kl = load_library(SOURCE)
    if kl.lib is None:
        return None, kl.reason
    # x, dtype, rows, vocab, ldx, temps, noise, ldn, block, out, threads
    kl.lib.pd_race.argtypes = [_P, _INT, _I64, _I64, _I64, _P, _P, _I64, _I64, _P, _INT]
    kl.lib.pd_race.restype = _INT
    # x, dtype, rows, cols, ldx, out, threads
    kl.lib.pd_argmax.argtypes = [_P, _INT, _I64, _I64, _I64, _P, _INT]
    kl.lib.pd_argmax.restype = _INT
    return kl.lib, None


def sampling_kernel_reason() -> str | None:
    """Why the kernel cannot run in this process (one line), or None when it can."""
    if not env.cpu_sampling_kernel():
        return f"turned off by {env.CPU_SAMPLING_KERNEL}"
    return _library()[1]


def kernel_can_read(x: torch.Tensor, cols: int) -> bool:
    """Whether the kernel runs here and reads ``x`` [rows, >= cols] as it is: a 2-D fp32 or
    bf16 CPU tensor with unit column stride."""
    return (
        x.device.type == "cpu"
        and x.dtype in _DTYPES
        and x.dim() == 2
        and x.shape[1] >= cols
        and (x.shape[1] == 1 or x.stride(1) == 1)
        and x.stride(0) >= 0
        and sampling_kernel_reason() is None
    )


def cpu_argmax(x: torch.Tensor, cols: int) -> torch.Tensor | None:
    """Per row of ``x`` [rows, >= cols] (fp32 or bf16, CPU, unit column stride), the first index
    of the maximum of its first ``cols`` entries (NaN counts as maximal, as in torch): int64
    [rows]. None when the kernel cannot read ``x`` (see the module docstring)."""
    if not kernel_can_read(x, cols):
        return None
    lib = _library()[0]
    assert lib is not None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    rc = lib.pd_argmax(
        x.data_ptr(),
        _DTYPES[x.dtype],
        x.shape[0],
        cols,
        x.stride(0),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out if rc == 0 else None


def cpu_race(
    x: torch.Tensor, cols: int, temperatures: list[float], noise: torch.Tensor, block: int
) -> torch.Tensor | None:
    """The two-level exponential race of :mod:`pdserve.sampling` over the first ``cols`` logits
    of each row of ``x`` [rows, >= cols] (fp32 or bf16, CPU, unit column stride), divided by the
    row's temperature (> 0): token ids int64 [rows].

    ``noise``: Gumbel noise fp32 [rows, ceil(cols / block) + block] (block keys, then the keys
    inside the chosen block); ``block``: tokens per block, a multiple of 16 up to 4096. Raises
    ValueError for a ``noise`` or ``temperatures`` of the wrong shape; None when the kernel
    cannot read ``x``.
    """
    rows = x.shape[0]
    nb = -(-cols // block)
    if len(temperatures) != rows or noise.shape != (rows, nb + block):
        raise ValueError(
            f"cpu_race: {rows} rows need {rows} temperatures and noise [{rows}, {nb + block}]"
            f", got {len(temperatures)} and {list(noise.shape)}"
        )
    if not kernel_can_read(x, cols) or block % 16 or not 16 <= block <= 4096:
        return None
    lib = _library()[0]
    assert lib is not None
    g = noise.to(torch.float32).contiguous()
    temps = torch.tensor(temperatures, dtype=torch.float32)
    out = torch.empty(rows, dtype=torch.int64)
    rc = lib.pd_race(
        x.data_ptr(),
        _DTYPES[x.dtype],
        rows,
        cols,
        x.stride(0),
        temps.data_ptr(),
        g.data_ptr(),
        g.stride(0),
        block,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out if rc == 0 else None
