"""Paged prefill attention kernel (``pd_paged_prefill``), alone, against another git revision's.

Times one layer's causal attention of prefill chunks with SmolLM2-135M's shapes (9 query / 3 KV
heads, head_dim 64, blocks of 16) on one thread: a prompt of ``--prompt-len`` tokens from
position 0, and a chunk of ``--chunk`` tokens after ``--cached`` tokens already in the pool
(chunked prefill, prefix-cache hit). With ``--baseline-rev REV`` the kernel built from REV's
source runs interleaved with the current one (best of ``--repeats`` rounds each), and both
outputs are compared with the definition in float64.

``--forward`` times whole prefill forwards instead (SmolLM2 compiled, ``--prompt-len`` tokens,
one thread, the model built as ``bench/prefill_thread_overlap.py`` builds it), the two kernels
swapped in one process, ``--repeats`` interleaved rounds of six forwards each.

    .venv/bin/python bench/prefill_attention.py --baseline-rev HEAD~1 [--forward]
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.attention import cpu_kernels  # noqa: E402
from pdserve.attention.cpu_kernels import PrefillBatch  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from cpu_attention import library_at  # noqa: E402


def baseline_prefill(rev: str) -> Callable[..., int]:
    """``pd_paged_prefill`` built from the kernel source at git revision ``rev``. Raises
    RuntimeError when it cannot be built."""
    fn = library_at(rev).pd_paged_prefill
    fn.argtypes, fn.restype = cpu_kernels._PREFILL_ARGTYPES, ctypes.c_int
    return fn


class swapped_prefill:  # noqa: N801 - a context manager, used like a function
    """Within the block, ``pd_paged_prefill`` calls go to ``fn`` (None: the current kernel)."""

    def __init__(self, fn: Callable[..., int] | None) -> None:
        self.fn, self.saved = fn, None

    def __enter__(self) -> None:
        if self.fn is not None:
            lib = cpu_kernels.load().lib
            self.saved, lib.pd_paged_prefill = lib.pd_paged_prefill, self.fn

    def __exit__(self, *exc: object) -> None:
        if self.saved is not None:
            cpu_kernels.load().lib.pd_paged_prefill = self.saved


class Case:
    """One layer's pool and one chunk: ``cached`` tokens already in the pool, then ``q_len``."""

    def __init__(self, cached: int, q_len: int, dtype: torch.dtype, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        heads, kv_heads, dim, bs = 9, 3, 64, 16
        n_blocks = -(-(cached + q_len) // bs)
        perm = torch.randperm(n_blocks + 8, generator=g)[:n_blocks]
        self.k = torch.randn(n_blocks + 8, bs, kv_heads, dim, generator=g).to(dtype)
        self.v = torch.randn(n_blocks + 8, bs, kv_heads, dim, generator=g).to(dtype)
        self.q = torch.randn(q_len, heads, dim, generator=g).to(dtype)
        self.table, self.cached, self.q_len, self.bs = perm, cached, q_len, bs
        self.batch = PrefillBatch.build([0], [q_len], [cached], [perm], bs)
        self.scale = dim**-0.5

    def run(self, fn: Callable[..., int] | None) -> torch.Tensor:
        out = torch.empty_like(self.q)
        with swapped_prefill(fn):
            cpu_kernels.paged_prefill_attention(
                self.q, self.k, self.v, self.batch, out, self.scale, 1
            )
        return out

    def error(self, out: torch.Tensor) -> float:
        n, c = self.q_len, self.cached
        k = self.k[self.table].flatten(0, 1)[: c + n].double().repeat_interleave(3, 1)
        v = self.v[self.table].flatten(0, 1)[: c + n].double().repeat_interleave(3, 1)
        s = torch.einsum("qhd,khd->hqk", self.q.double(), k) * self.scale
        vis = torch.arange(c + n)[None, :] <= (c + torch.arange(n))[:, None]
        ref = torch.einsum("hqk,khd->qhd", s.masked_fill(~vis, float("-inf")).softmax(-1), v)
        return float(((out.double() - ref).norm(dim=-1) / ref.norm(dim=-1)).max())


def best_ms(fn: Callable[[], object], inner: int) -> float:
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner * 1e3


def forward_table(args: argparse.Namespace, base: Callable[..., int] | None) -> None:
    """ms per whole prefill forward, current kernel (and ``base``), interleaved rounds."""
    from prefill_thread_overlap import build, parse

    runner, _, prefill = build(parse(["--dtype", args.dtypes.split(",")[0],
                                      "--prompt-len", str(args.prompt_len)]))  # fmt: skip
    kernels = {"current": None} | ({args.baseline_rev: base} if base else {})
    rounds: dict[str, list[float]] = {name: [] for name in kernels}
    for _ in range(args.repeats):
        for name, fn in kernels.items():
            with swapped_prefill(fn):
                runner.run(prefill)  # one untimed forward after the swap
                rounds[name].append(best_ms(lambda: runner.run(prefill), 6))
    for name, ms in rounds.items():
        print(f"| {name} | {args.prompt_len}-token prefill forward, ms per round | "
              + " / ".join(f"{x:.1f}" for x in ms) + " |", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--prompt-len", type=int, default=270)
    p.add_argument("--cached", type=int, default=256)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--baseline-rev", help="also time the kernel of this git revision")
    p.add_argument("--forward", action="store_true", help="time whole prefill forwards")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    base = baseline_prefill(args.baseline_rev) if args.baseline_rev else None
    if args.forward:
        forward_table(args, base)
        return 0
    head = "| dtype | chunk | ms a layer | error |"
    if base:
        head += f" {args.baseline_rev} ms | {args.baseline_rev} error |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        for cached, q_len in ((0, args.prompt_len), (args.cached, args.chunk)):
            case = Case(cached, q_len, dtype)
            fns = [lambda case=case: case.run(None)]
            if base:
                fns.append(lambda case=case: case.run(base))
            inner = 20
            best = [float("inf")] * len(fns)
            for _ in range(args.repeats):
                for i, fn in enumerate(fns):
                    best[i] = min(best[i], best_ms(fn, inner))
            row = (
                f"| {name} | {q_len} after {cached} | {best[0]:.3f} | {case.error(fns[0]()):.1e} |"
            )
            if base:
                row += f" {best[1]:.3f} | {case.error(fns[1]()):.1e} |"
            print(row, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
