"""What this machine can do, measured in the same run as a benchmark (the floors' denominators).

- **copy bandwidth** (GB/s = 1e9 B/s): a ``torch`` copy of a buffer far larger than the caches,
  bytes read + bytes written over the best time of a few repeats; the memory rate a step that
  streams its weights and KV cannot beat;
- **matmul rate** (GFLOP/s): square ``n x n`` products (``2 n^3`` FLOPs each) and the model's
  own linear layers (``[m, k] x [k, n]``, ``2 m k n`` FLOPs) at a decode batch and a prefill chunk,
  in the served dtype, best of a few repeats (for the linears, the better of ``F.linear`` and
  oneDNN's packed weight, which pdserve runs);
- **CPU**: model name, logical CPUs, and the ``/proc/cpuinfo`` flags that decide the dtype
  (``amx_bf16``, ``avx512_bf16``, ``avx512f``, ``avx2``), as ``lscpu`` prints them.

Each rate is measured with every torch thread and with one thread (what one worker pinned to
one core gets). Another tenant on a shared machine can only make a rate lower, so the best repeat
is kept, and the floors use the best rate measured in any of these ways (the machine can do at
least that). torch is imported inside the functions so the
rest of :mod:`pdserve.bench` stays light.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.cpu import cpu_flags

if TYPE_CHECKING:
    import torch

    from pdserve.config import ModelConfig

# /proc/cpuinfo flags worth recording beside a CPU benchmark (bf16 tiles and dot products, AVX-512, AVX2).
RECORDED_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2", "fma")


# Keep repeating a measurement for at least this long (s): on a shared machine a short window
# without other tenants is likelier to fall inside a longer one.
MIN_MEASURE_S = 0.25


def _best_seconds(fn: Callable[[], Any], reps: int, min_total_s: float = MIN_MEASURE_S) -> float:
    """Smallest wall time of ``fn`` over at least ``reps`` calls (after one warm-up call),
    repeating until ``min_total_s`` seconds were spent or ``20 * reps`` calls were made."""
    fn()
    best = float("inf")
    spent = 0.0
    calls = 0
    while calls < max(1, reps) or (spent < min_total_s and calls < 20 * max(1, reps)):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best = min(best, dt)
        spent += dt
        calls += 1
    return best


def copy_bandwidth_gbs(nbytes: int = 256 * 2**20, reps: int = 5) -> float:
    """Measured memory copy bandwidth in GB/s (1e9 B/s), counting bytes read plus written.

    ``nbytes``: size of the copied buffer (default 256 MiB, beyond any cache of this class of CPU).
    """
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * nbytes / _best_seconds(lambda: dst.copy_(src), reps) / 1e9


def matmul_gflops(dtype: torch.dtype, n: int = 1024, reps: int = 5) -> float:
    """Measured square-matmul rate in GFLOP/s (``2 n^3`` FLOPs per product), best of ``reps``."""
    import torch

    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    return 2 * n**3 / _best_seconds(lambda: a @ b, reps) / 1e9


def linear_gflops(dtype: torch.dtype, m: int, k: int, n: int, reps: int = 5) -> float:
    """Measured linear-layer rate in GFLOP/s: input ``[m, k]``, weight ``[n, k]``, ``2 m k n``
    FLOPs, the better of ``F.linear`` and oneDNN's packed weight (:class:`PackedLinear
    <pdserve.model.cpu_linear.PackedLinear>` without its skinny panels, where this torch build
    and CPU pack ``dtype``). Both count: torch's fp32 ``F.linear`` goes through MKL, which runs
    its AVX2 code on AMD CPUs (a Zen 5 EPYC core: 105-113 GFLOP/s at SmolLM2's prefill shapes)
    while oneDNN's packed fp32 weight reaches 250-271 there (session 35), and pdserve's prefill
    runs the packed one."""
    import torch
    import torch.nn.functional as F

    from pdserve.model.cpu_linear import PackedLinear, can_pack

    x = torch.randn(m, k).to(dtype)
    w = torch.randn(n, k).to(dtype)
    with torch.inference_mode():
        seconds = _best_seconds(lambda: F.linear(x, w), reps)
        if can_pack(w):
            packed = PackedLinear(w, None, batch_hint=m, skinny=False)
            seconds = min(seconds, _best_seconds(lambda: packed(x), reps))
    return 2 * m * k * n / seconds / 1e9


def model_linear_shapes(mc: ModelConfig) -> list[tuple[str, int, int]]:
    """(name, in_features k, out_features n) of one decoder layer's matmuls and the LM head."""
    h, q, kv = mc.hidden_size, mc.num_attention_heads * mc.head_dim, mc.num_key_value_heads
    return [
        ("qkv_proj", h, q + 2 * kv * mc.head_dim),
        ("o_proj", q, h),
        ("gate_up_proj", h, 2 * mc.intermediate_size),
        ("down_proj", mc.intermediate_size, h),
        ("lm_head", h, mc.vocab_size),
    ]


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` torch intra-op threads, then restore the previous count."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def cpu_description() -> dict[str, Any]:
    """CPU model name (``lscpu``, else /proc/cpuinfo), logical CPUs and the recorded flags."""
    name = ""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model name":
                name = value.strip()
                break
    except (OSError, subprocess.SubprocessError):
        pass
    if not name:
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    name = line.partition(":")[2].strip()
                    break
        except OSError:
            pass
    flags = cpu_flags()
    return {
        "model_name": name or "unknown",
        "logical_cpus": os.cpu_count() or 0,
        "flags": {f: f in flags for f in RECORDED_FLAGS},
    }


@dataclass(frozen=True)
class LinearRate:
    """Measured rate of one model matmul: ``m`` tokens x ``k`` -> ``n`` features, GFLOP/s."""

    name: str
    m: int
    k: int
    n: int
    threads: int
    gflops: float


@dataclass(frozen=True)
class MachineRates:
    """Rates measured in one run (see the module docstring). Rates in GFLOP/s and GB/s.

    ``matmul_gflops`` / ``copy_gbs`` map a torch thread count to the rate; ``threads`` is the
    all-thread count. :attr:`peak_gflops` / :attr:`peak_copy_gbs` are the rates the floors use.
    """

    dtype: str
    threads: int
    cpu: dict[str, Any]
    matmul_n: int
    matmul_gflops: dict[int, float]
    copy_gbs: dict[int, float]
    linears: list[LinearRate] = field(default_factory=list)
    torch_version: str = ""

    @property
    def peak_gflops(self) -> float:
        """The best matmul rate measured, square or model-shaped, any thread count (GFLOP/s)."""
        return max([*self.matmul_gflops.values(), *(r.gflops for r in self.linears)])

    @property
    def peak_copy_gbs(self) -> float:
        """The best copy bandwidth measured, any thread count (GB/s)."""
        return max(self.copy_gbs.values())

    def to_dict(self) -> dict[str, Any]:
        """JSON form (thread-count keys become strings)."""
        return {
            "dtype": self.dtype,
            "threads": self.threads,
            "cpu": self.cpu,
            "torch_version": self.torch_version,
            "matmul_n": self.matmul_n,
            "matmul_gflops": {str(k): v for k, v in self.matmul_gflops.items()},
            "copy_gbs": {str(k): v for k, v in self.copy_gbs.items()},
            "linears": [vars(r) for r in self.linears],
            "peak_gflops": self.peak_gflops,
            "peak_copy_gbs": self.peak_copy_gbs,
        }


def measure_machine(
    dtype: str,
    model: ModelConfig | None = None,
    matmul_n: int = 1024,
    token_counts: tuple[int, ...] = (16, 256),
    reps: int = 5,
    copy_bytes: int = 256 * 2**20,
) -> MachineRates:
    """Measure :class:`MachineRates` for ``dtype`` ('float32' | 'bfloat16' | ...).

    ``model``: also time its linear shapes (:func:`model_linear_shapes`) at each of
    ``token_counts`` rows (a decode batch, a prefill chunk). Raises AttributeError for an
    unknown dtype name.
    """
    import torch

    tdtype = getattr(torch, dtype)
    every = torch.get_num_threads()
    matmul: dict[int, float] = {}
    copy: dict[int, float] = {}
    linears: list[LinearRate] = []
    for threads in sorted({every, 1}, reverse=True):
        with torch_threads(threads):
            matmul[threads] = matmul_gflops(tdtype, matmul_n, reps)
            copy[threads] = copy_bandwidth_gbs(copy_bytes, reps)
            for name, k, n in model_linear_shapes(model) if model is not None else []:
                for m in token_counts:
                    rate = linear_gflops(tdtype, m, k, n, reps)
                    linears.append(LinearRate(name, m, k, n, threads, rate))
    return MachineRates(
        dtype=dtype,
        threads=every,
        cpu=cpu_description(),
        matmul_n=matmul_n,
        matmul_gflops=matmul,
        copy_gbs=copy,
        linears=linears,
        torch_version=str(torch.__version__),
    )
