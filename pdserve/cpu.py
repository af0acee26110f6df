"""What the host CPU can do, read once from ``/proc/cpuinfo`` (Linux); torch-free.

``--dtype auto`` uses it (DESIGN §2): bfloat16 only where the CPU computes bf16 natively
(``avx512_bf16`` or AMX's ``amx_bf16``), float32 elsewhere, because an AVX2-only CPU emulates bf16
matmuls and runs them slower than float32 (measured on this project's AVX2 machine).
"""

from __future__ import annotations

import functools
from pathlib import Path

# /proc/cpuinfo flag names (Linux kernel spelling) of native bf16 arithmetic.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
# ... and of AMX's bf16 tile multiply (Intel Sapphire Rapids and later)
AMX_BF16_FLAG = "amx_bf16"


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The flags of the first ``flags`` line of a ``/proc/cpuinfo`` text (empty when none)."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This machine's CPU flags; empty where ``/proc/cpuinfo`` cannot be read (non-Linux)."""
    try:
        return parse_cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return frozenset()


def has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    """True when the CPU (or the given flag set) computes bfloat16 natively."""
    return bool(NATIVE_BF16_FLAGS & (cpu_flags() if flags is None else flags))


def has_amx_bf16(flags: frozenset[str] | None = None) -> bool:
    """True when the CPU (or the given flag set) has AMX bf16 tile multiplies."""
    return AMX_BF16_FLAG in (cpu_flags() if flags is None else flags)
