"""CPU decode attention: the ``cpu_paged`` kernel against ``torch_ref``, in one run, interleaved.

Two parts, both measured on this machine in the same process, alternating the two backends
round by round and keeping each one's best (the machine may be shared):

* **attention only**: a decode-only step's attention (``backend.forward`` of one layer: the new
  K/V written, then attention over each sequence's context) for batch x context x dtype x
  threads, SmolLM2-135M's shapes by default (9 query / 3 KV heads, head_dim 64, block size 16),
  blocks shuffled through the pool. Prints both times, the ratio, and the K/V bytes the kernel
  reads per second. Every configuration is first checked against torch_ref (relative error).
  Both run one layer's pool over and over, so its KV stays in the CPU's caches; the "cold"
  column times the kernel over a different pool each call (as many as it takes to hold 4x
  the last-level cache, at most ``--layers``), as a model's step reads each layer's KV from
  memory. ``--baseline-rev REV`` adds the kernel source of git revision REV (same entry point),
  built beside this one, as two more columns: its time in cache and cold.
* **--step**: a whole decode step of a model (default the bundled SmolLM2) at ``--step-batch``
  sequences after ``--prompt-len``-token prompts, one ModelRunner per backend: median and best
  step time, and the part of the step spent in attention (wall time inside
  ``backend.forward``, all layers).

Usage::

    .venv/bin/python bench/cpu_attention.py                       # attention table, ~2 min
    .venv/bin/python bench/cpu_attention.py --step --threads 1    # + the SmolLM2 decode step
    .venv/bin/python bench/cpu_attention.py --step --step-small-pages ...  # + KV pool on 4 KiB pages
    .venv/bin/python bench/cpu_attention.py --batch-sizes 16 --contexts 256 --dtypes bfloat16
    .venv/bin/python bench/cpu_attention.py --baseline-rev b063773 --threads 1  # old vs new

Exit status 1 when the kernel disagrees with torch_ref; 2 when it cannot be built here.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.attention import cpu_kernels  # noqa: E402
from pdserve.attention.base import AttentionBackend, get_backend  # noqa: E402
from pdserve.attention.cpu_build import load_library  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--heads", type=int, default=9, help="query heads")
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--threads", default="1,2", help="torch (and kernel) thread counts")
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--contexts", default="256,1024,2048", help="decode context lengths")
    p.add_argument("--repeats", type=int, default=15, help="interleaved rounds; best is kept")
    p.add_argument(
        "--layers", type=int, default=30, help="most pools the cold column cycles through"
    )
    p.add_argument(
        "--baseline-rev", help="also time the decode kernel of this git revision (e.g. HEAD~1)"
    )
    p.add_argument("--step", action="store_true", help="also time a whole model decode step")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--step-batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--step-dtype", default="bfloat16")
    p.add_argument(
        "--step-small-pages",
        action="store_true",
        help="with --step, also a cpu_paged runner whose KV pool is not on huge pages",
    )
    return p.parse_args(argv)


def best_of_interleaved(fns: list[Callable[[], object]], repeats: int, inner: int) -> list[float]:
    """Best seconds per call of each of ``fns``, alternating them round by round."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            best[i] = min(best[i], (time.perf_counter() - t0) / inner)
    return best


class DecodeLayer:
    """One layer's decode step for ``batch`` sequences of ``context`` tokens (the last one new)
    over a pool with shuffled blocks, runnable through any backend."""

    def __init__(self, args: argparse.Namespace, batch: int, context: int, dtype: torch.dtype):
        bs = args.block_size
        per_seq = -(-context // bs)
        num_blocks = batch * per_seq + 1
        perm = torch.randperm(num_blocks).tolist()
        self.tables = [perm[i * per_seq : (i + 1) * per_seq] for i in range(batch)]
        shape = (num_blocks, bs, args.kv_heads, args.head_dim)
        self.k_cache = torch.randn(shape).to(dtype)
        self.v_cache = torch.randn(shape).to(dtype)
        self.q = torch.randn(batch, args.heads, args.head_dim).to(dtype)
        self.k = torch.randn(batch, args.kv_heads, args.head_dim).to(dtype)
        self.v = torch.randn_like(self.k)
        self.batch, self.context, self.block_size = batch, context, bs
        self.scale = args.head_dim**-0.5

    def runner(self, backend: AttentionBackend[Any], layers: int = 1) -> Callable[[], torch.Tensor]:
        """One layer's attention; with ``layers`` > 1 each call uses the next of that many pools
        (the first is this layer's; the others hold copies of it), cycling."""
        meta = backend.build_metadata(
            [1] * self.batch, [self.context - 1] * self.batch, self.tables, self.block_size
        )
        pools = [(self.k_cache, self.v_cache)]
        pools += [(self.k_cache.clone(), self.v_cache.clone()) for _ in range(layers - 1)]
        turn = iter(range(1 << 62))

        def run() -> torch.Tensor:
            k_cache, v_cache = pools[next(turn) % len(pools)]
            return backend.forward(self.q, self.k, self.v, k_cache, v_cache, meta, self.scale)

        return run

    def cold_layers(self, most: int) -> int:
        """Pools to cycle through so their KV holds 4x the last-level cache (at most ``most``)."""
        pool = 2 * self.k_cache.numel() * self.k_cache.element_size()
        return max(2, min(most, -(-4 * last_level_cache_bytes() // pool)))

    def kv_bytes(self) -> int:
        """K and V bytes of every context token: what the step must read."""
        return 2 * self.batch * self.context * self.k[0].numel() * self.k.element_size()


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size (Linux sysfs), 32 MiB when it cannot be read."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        if text[:-1].isdigit() and text[-1] in "KM":
            sizes.append(int(text[:-1]) << (10 if text[-1] == "K" else 20))
    return max(sizes, default=32 << 20)


def library_at(rev: str) -> ctypes.CDLL:
    """The attention kernel library (decode and prefill entry points) built from its source at
    git revision ``rev`` (compiled into the kernel cache like the current one). Raises
    RuntimeError when it cannot be built."""
    # the whole pdserve/ tree of that revision, so the kernel's #include "..." files come along
    rel = cpu_kernels.SOURCE.relative_to(ROOT).as_posix()
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-baseline-"))
    archive = subprocess.run(["git", "archive", rev, "pdserve"], cwd=ROOT, capture_output=True)
    if archive.returncode != 0:
        raise RuntimeError(f"git archive {rev}: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive.stdout, check=True)
    kl = load_library(tmp / rel)
    if kl.lib is None:
        raise RuntimeError(f"the kernel at {rev} does not build: {kl.reason}")
    return kl.lib


def baseline_kernel(rev: str) -> Callable[..., int]:
    """The decode kernel's entry point at git revision ``rev`` (see :func:`library_at`)."""
    fn = library_at(rev).pd_paged_decode
    fn.argtypes, fn.restype = cpu_kernels._ARGTYPES, ctypes.c_int
    return fn


def with_kernel(fn: Callable[..., int], run: Callable[[], torch.Tensor]) -> Callable[[], object]:
    """``run`` with the decode kernel's entry point swapped for ``fn`` during the call."""

    def go() -> torch.Tensor:
        saved, cpu_kernels._decode_fn = cpu_kernels._decode_fn, fn
        try:
            return run()
        finally:
            cpu_kernels._decode_fn = saved

    return go


def attention_table(args: argparse.Namespace) -> bool:
    ref, paged = get_backend("torch_ref"), get_backend("cpu_paged")
    print(f"attention only: {args.heads}/{args.kv_heads} heads, head_dim {args.head_dim}, "
          f"block size {args.block_size}; best of {args.repeats} interleaved rounds")  # fmt: skip
    base = baseline_kernel(args.baseline_rev) if args.baseline_rev else None
    extra = f" {args.baseline_rev} ms | {args.baseline_rev} cold ms |" if base else ""
    print(
        "| dtype | threads | batch | context | torch_ref ms | cpu_paged ms | speed-up | GB/s "
        f"| cpu_paged cold ms | cold GB/s |{extra}"
    )
    print("|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if base else ""))
    ok = True
    for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
        for threads in [int(t) for t in args.threads.split(",")]:
            torch.set_num_threads(threads)
            for b in [int(x) for x in args.batch_sizes.split(",")]:
                for ctx in [int(x) for x in args.contexts.split(",")]:
                    layer = DecodeLayer(args, b, ctx, dtype)
                    run_ref, run_paged = layer.runner(ref), layer.runner(paged)
                    run_cold = layer.runner(paged, layer.cold_layers(args.layers))
                    runs: list[Callable[[], object]] = [run_ref, run_paged, run_cold]
                    if base is not None:
                        runs += [with_kernel(base, run_paged), with_kernel(base, run_cold)]
                    want = run_ref().float()
                    for name, run in zip(("cpu_paged", "baseline"), runs[1::2], strict=False):
                        got = run().float()  # type: ignore[union-attr]
                        err = float((got - want).norm() / want.norm())
                        if err > TOL[dtype]:
                            ok = False
                            print(f"FAIL {name} {dtype} b={b} ctx={ctx}: rel err {err:.2e}")
                    # ~ms of work per timed sample; at most 400 calls, so tiny shapes (where
                    # Python's per-call cost dominates) do not run for minutes
                    inner = max(1, min(400, int(2e6 // (b * ctx))))
                    t_ref, t_paged, t_cold, *t_base = best_of_interleaved(runs, args.repeats, inner)
                    gbs, cold_gbs = (layer.kv_bytes() / t / 1e9 for t in (t_paged, t_cold))
                    cells = "".join(f" {t * 1e3:.3f} |" for t in t_base)
                    print(f"| {str(dtype)[6:]} | {threads} | {b} | {ctx} | {t_ref * 1e3:.3f} | "
                          f"{t_paged * 1e3:.3f} | {t_ref / t_paged:.1f}x | {gbs:.1f} | "
                          f"{t_cold * 1e3:.3f} | {cold_gbs:.1f} |{cells}")  # fmt: skip
    return ok


class StepRunner:
    """A ModelRunner with ``backend`` after prefilling ``batch`` random prompts; ``step()``
    runs one decode step of every sequence and returns (step s, attention s)."""

    def __init__(self, args: argparse.Namespace, backend: str, huge_pages: bool = True) -> None:
        from unittest import mock

        from pdserve import huge_pages as huge_pages_mod
        from pdserve.config import CacheConfig, EngineConfig, LoadConfig
        from pdserve.engine.batch import ScheduledSeq
        from pdserve.engine.runner import ModelRunner
        from pdserve.sampling_params import SamplingParams

        load = LoadConfig(model=args.model, dtype=args.step_dtype, attention_backend=backend)
        cfg = EngineConfig(load=load, cache=CacheConfig(num_blocks=4096))
        small_pages = mock.patch.object(huge_pages_mod, "advise_huge_pages", return_value=False)
        with contextlib.nullcontext() if huge_pages else small_pages:  # 4 KiB: before session 14
            self.runner = ModelRunner(cfg)
        attn = self.runner.model.attn_backend
        assert attn.name == backend, attn.name
        self.attn_s = 0.0
        forward = attn.forward

        def timed(*a: Any) -> torch.Tensor:
            t0 = time.perf_counter()
            out = forward(*a)
            self.attn_s += time.perf_counter() - t0
            return out

        attn.forward = timed  # type: ignore[method-assign]
        self.make, self.params = ScheduledSeq, SamplingParams(temperature=0.0, max_tokens=10**6)
        gen = torch.Generator().manual_seed(0)
        bs, blocks = self.runner.block_size, 0
        self.seqs: list[dict[str, Any]] = []
        for i in range(args.step_batch):
            prompt = torch.randint(100, 40000, (args.prompt_len,), generator=gen).tolist()
            n = (args.prompt_len + 512) // bs + 1
            self.seqs.append(
                {"id": f"r{i}", "prompt": prompt, "table": list(range(blocks, blocks + n))}
            )
            blocks += n
        for s in self.seqs:
            (tok,) = self.runner.execute([self._sched(s, s["prompt"], 0)])
            assert tok is not None
            s["computed"], s["next"] = args.prompt_len, tok.token_id

    def _sched(self, s: dict[str, Any], ids: list[int], computed: int) -> Any:
        return self.make(s["id"], ids, computed, s["table"], True, self.params, s["prompt"])

    def step(self) -> tuple[float, float]:
        self.attn_s = 0.0
        batch = [self._sched(s, [s["next"]], s["computed"]) for s in self.seqs]
        t0 = time.perf_counter()
        toks = self.runner.execute(batch)
        wall = time.perf_counter() - t0
        for s, tok in zip(self.seqs, toks, strict=True):
            assert tok is not None
            s["computed"] += 1
            s["next"] = tok.token_id
        return wall, self.attn_s


def step_table(args: argparse.Namespace) -> None:
    print(f"\nwhole decode step: {args.model} {args.step_dtype}, batch {args.step_batch}, "
          f"prompts of {args.prompt_len} tokens, {torch.get_num_threads()} thread(s)")  # fmt: skip
    runners = {name: StepRunner(args, name) for name in ("torch_ref", "cpu_paged")}
    if args.step_small_pages:
        runners["cpu_paged, KV on 4 KiB pages"] = StepRunner(args, "cpu_paged", huge_pages=False)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in runners}
    for _ in range(2):
        for r in runners.values():
            r.step()
    for _ in range(args.repeats):
        for name, r in runners.items():
            times[name].append(r.step())
    print("| backend | median step ms | best step ms | attention ms (median) | attention share |")
    print("|---|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(t for t, _ in ts)
        attn = statistics.median(a for _, a in ts)
        print(f"| {name} | {med * 1e3:.1f} | {min(t for t, _ in ts) * 1e3:.1f} | "
              f"{attn * 1e3:.1f} | {attn / med:.0%} |")  # fmt: skip
    ref, paged = (statistics.median(t for t, _ in times[n]) for n in ("torch_ref", "cpu_paged"))
    print(f"step speed-up (median): {ref / paged:.2f}x")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    kl = cpu_kernels.load()
    if kl.lib is None:
        print(f"bench/cpu_attention.py: error: kernel unavailable: {kl.reason}", file=sys.stderr)
        return 2
    ok = attention_table(args)
    if args.step:
        torch.set_num_threads(int(args.threads.split(",")[0]))
        step_table(args)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
