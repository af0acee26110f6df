"""What the host CPU can do, read once from ``/proc/cpuinfo`` (Linux); torch-free.

``--dtype auto`` uses it (DESIGN §2): bfloat16 only where the CPU computes bf16 natively *and*
faster than float32 (:func:`bf16_is_fast`), float32 elsewhere. Measured on this project's
machines (docs/benchmarks.md; 1024^3 matmul through torch/oneDNN, GFLOP/s on 2 cores):

- Intel Xeon with AMX (``amx_bf16``): bf16 500-580, fp32 140-200.
- AMD EPYC Zen 4 / Zen 5 with ``avx512_bf16``: bf16 ~900, fp32 ~210 (Zen 5, session 37).
- Intel Xeon with ``avx512_bf16`` but no AMX (family 6 model 207, AMX not exposed to the guest;
  session 38): bf16 217, fp32 343; served, bf16 is 0.7-0.8x fp32 for pdserve and 0.9x for vLLM.
- AMD EPYC with AVX2 only: bf16 is emulated, slower than fp32.
"""

from __future__ import annotations

import functools
from pathlib import Path

# /proc/cpuinfo flag names (Linux kernel spelling) of AMX's bf16 tile multiply (Intel Sapphire
# Rapids and later) and of AVX-512's bf16 dot product; the vendor id of AMD's CPUs
AMX_BF16_FLAG = "amx_bf16"
AVX512_BF16_FLAG = "avx512_bf16"
AMD_VENDOR_ID = "AuthenticAMD"


def parse_cpu_vendor(cpuinfo: str) -> str:
    """The ``vendor_id`` of a ``/proc/cpuinfo`` text's first processor ('' when none), e.g.
    'GenuineIntel' or 'AuthenticAMD'."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "vendor_id":
            return value.strip()
    return ""


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


@functools.cache
def cpu_vendor() -> str:
    """This machine's CPU vendor id ('' where ``/proc/cpuinfo`` cannot be read)."""
    try:
        return parse_cpu_vendor(Path("/proc/cpuinfo").read_text())
    except OSError:
        return ""


def bf16_is_fast(flags: frozenset[str] | None = None, vendor: str | None = None) -> bool:
    """True where bf16 matmuls beat fp32 ones on this CPU (or the given flags and vendor id), so
    ``--dtype auto`` picks bfloat16: with AMX (``amx_bf16``), or with ``avx512_bf16`` on an AMD
    CPU (``AuthenticAMD``, whose bf16 dot product doubles its fp32 rate). False on an Intel CPU
    with ``avx512_bf16`` but no AMX, where bf16 measured slower than fp32 (module docstring), and
    without native bf16."""
    flags = cpu_flags() if flags is None else flags
    vendor = cpu_vendor() if vendor is None else vendor
    if AMX_BF16_FLAG in flags:
        return True
    return AVX512_BF16_FLAG in flags and vendor == AMD_VENDOR_ID


def has_amx_bf16(flags: frozenset[str] | None = None) -> bool:
    """True when the CPU (or the given flag set) has AMX bf16 tile multiplies."""
    return AMX_BF16_FLAG in (cpu_flags() if flags is None else flags)
