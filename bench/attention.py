"""Triton paged-attention kernels on a GPU: checked against torch_ref, timed with CUDA events.

Shapes default to a 7B-class model (28 query / 4 KV heads, head_dim 128, bf16, block size 16).
In one run, on one device:

* **check**: each kernel (KV write, decode without and with split-K, extend after a cached
  prefix) against the ``torch_ref`` backend on the same pool; prints the relative error
  ``||out - ref|| / ||ref||`` (bound: 1e-2 in bf16/fp16, 1e-3 in fp32) and exits 1 if one fails.
* **copy bandwidth**: a device-to-device copy of a 1 GiB buffer (bytes read + written / time):
  the memory bandwidth a bandwidth-bound kernel can hope for on this device.
* **decode**: batch 1-256 x context 128-32k (skipping points whose KV exceeds ``--max-kv-gib``):
  median kernel time over ``--iters`` launches (CUDA events), achieved bandwidth = K/V bytes read
  (+ q and out) / time, and its fraction of the copy bandwidth; torch_ref's time beside it where
  the gathered copy fits.
* **extend**: prefill chunks of 512 / 2048 tokens after 0 / 4096 cached tokens, batch 1-8:
  time and attention TFLOP/s (4 * heads * head_dim per visible query-key pair).
* **KV write**: 256-8192 new tokens: time and bandwidth (bytes read + written).

Usage::

    .venv/bin/python bench/attention.py                  # on a CUDA machine; a few minutes
    .venv/bin/python bench/attention.py --json out.json  # also write the numbers
    .venv/bin/python bench/attention.py --interpret      # CPU: tiny check under Triton's interpreter

Without a CUDA device it refuses (exit 2) unless ``--interpret`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

TOL = {torch.float32: 1e-3, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--heads", type=int, default=28, help="query heads")
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--batch-sizes", default="1,16,64,256")
    p.add_argument("--contexts", default="128,1024,4096,32768", help="decode context lengths")
    p.add_argument("--max-kv-gib", type=float, default=8.0, help="skip larger decode points")
    p.add_argument("--iters", type=int, default=20, help="timed launches per point")
    p.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    p.add_argument(
        "--interpret", action="store_true", help="CPU: tiny correctness check, no timing"
    )
    return p.parse_args(argv)


class Pool:
    """A random paged KV pool for ``seqs`` = [(cached tokens, new tokens)], blocks shuffled, plus
    a query and new K/V; ``meta`` is torch_ref's step metadata, ``tm`` the triton backend's."""

    def __init__(self, args: argparse.Namespace, seqs: list[tuple[int, int]], dev: str) -> None:
        from pdserve.attention.base import get_backend
        from pdserve.attention.triton_paged import TritonMetadata

        dtype = getattr(torch, args.dtype)
        bs, hkv, d = args.block_size, args.kv_heads, args.head_dim
        need = [-(-(c + n) // bs) for c, n in seqs]
        num_blocks = sum(need) + 1
        perm = torch.randperm(num_blocks).tolist()
        tables, at = [], 0
        for nb in need:
            tables.append(perm[at : at + nb])
            at += nb
        tokens = sum(n for _, n in seqs)
        self.k_cache = torch.randn(num_blocks, bs, hkv, d, dtype=dtype, device=dev)
        self.v_cache = torch.randn_like(self.k_cache)
        self.q = torch.randn(tokens, args.heads, d, dtype=dtype, device=dev)
        self.k = torch.randn(tokens, hkv, d, dtype=dtype, device=dev)
        self.v = torch.randn_like(self.k)
        self.out = torch.empty_like(self.q)
        self.scale = d**-0.5
        qlens, computed = [n for _, n in seqs], [c for c, _ in seqs]
        self.meta = get_backend("torch_ref").build_metadata(qlens, computed, tables, bs, dev)
        self.tm = TritonMetadata.build(qlens, computed, tables, bs, dev)

    def kv_bytes(self) -> int:
        """K and V bytes of every context token (what a decode step must read)."""
        per_token = 2 * self.k_cache.shape[2] * self.k_cache.shape[3] * self.k.element_size()
        return int(self.tm.seq_lens.sum()) * per_token

    def decode(self, num_splits: int | None = None) -> None:
        from pdserve.attention.triton_kernels.decode import paged_decode_attention

        tm = self.tm
        paged_decode_attention(
            self.q, self.k_cache, self.v_cache, tm.block_tables, tm.seq_lens, tm.query_start_loc_i32,
            self.out, self.scale, tm.max_decode_seq_len, num_splits=num_splits,
        )  # fmt: skip

    def extend(self) -> None:
        from pdserve.attention.triton_kernels.extend import paged_extend_attention

        tm = self.tm
        paged_extend_attention(
            self.q, self.k_cache, self.v_cache, tm.block_tables, tm.seq_lens, tm.query_start_loc_i32,
            self.out, self.scale, tm.max_extend_query_len,
        )  # fmt: skip

    def write(self) -> None:
        from pdserve.attention.triton_kernels.kv_write import write_kv

        write_kv(self.k, self.v, self.k_cache, self.v_cache, self.meta.slot_mapping)

    def torch_ref(self) -> torch.Tensor:
        """torch_ref's output (it also writes the new K/V, as the kernels' step would)."""
        from pdserve.attention.base import get_backend

        backend = get_backend("torch_ref")
        return backend.forward(
            self.q, self.k, self.v, self.k_cache, self.v_cache, self.meta, self.scale
        )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def check(args: argparse.Namespace, dev: str, small: bool) -> bool:
    """Every kernel against torch_ref; prints one line each. True when all are within TOL."""
    tol = TOL[getattr(torch, args.dtype)]
    ctx = 40 if small else 4096
    long_ctx = 200 if small else 32768
    cases: list[tuple[str, list[tuple[int, int]], Callable[[Pool], None]]] = [
        ("decode", [(ctx - 1, 1), (ctx // 3, 1), (7, 1)], lambda p: p.decode()),
        ("decode split-K", [(long_ctx - 1, 1), (ctx, 1)], lambda p: p.decode(num_splits=4)),
        ("extend", [(ctx // 2, ctx // 4), (0, ctx // 3), (5, 1)], lambda p: p.extend()),
    ]
    ok = True
    for name, seqs, run in cases:
        pool = Pool(args, seqs, dev)
        ref = pool.torch_ref()
        pool.out.fill_(float("nan"))
        run(pool)
        err = rel_err(pool.out, ref)
        ok &= err < tol
        print(f"check {name:15s} rel err {err:.2e} (< {tol:g}) {'ok' if err < tol else 'FAIL'}")
    pool = Pool(args, [(3, ctx // 2), (0, 9)], dev)
    k_cache, v_cache = pool.k_cache.clone(), pool.v_cache.clone()
    pool.torch_ref()
    ref_k, ref_v = pool.k_cache, pool.v_cache
    pool.k_cache, pool.v_cache = k_cache, v_cache
    pool.write()
    same = torch.equal(pool.k_cache, ref_k) and torch.equal(pool.v_cache, ref_v)
    ok &= same
    print(f"check {'kv write':15s} {'identical pool' if same else 'FAIL: pools differ'}")
    return ok


def cuda_time_ms(fn: Callable[[], object], iters: int) -> float:
    """Median milliseconds of ``fn`` over ``iters`` launches, each timed with CUDA events."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth_gbs(iters: int) -> float:
    """Device-to-device copy of 1 GiB: (read + written) bytes / time, GB/s."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src), iters)
    return 2 * src.numel() / ms / 1e6


def run_gpu(args: argparse.Namespace) -> dict[str, Any]:
    dev = "cuda"
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "args": vars(args)}
    results["args"]["json"] = str(args.json)
    print(f"device: {results['device']}; {args.heads}/{args.kv_heads} heads, head_dim "
          f"{args.head_dim}, {args.dtype}, block size {args.block_size}")  # fmt: skip
    results["check_ok"] = check(args, dev, small=False)
    copy = copy_bandwidth_gbs(args.iters)
    results["copy_gbs"] = copy
    print(f"\ncopy bandwidth: {copy:.0f} GB/s (1 GiB device-to-device, read + write)\n")

    elem = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    per_token = 2 * args.kv_heads * args.head_dim * elem
    print("| decode batch | context | Triton ms | GB/s | of copy | torch_ref ms |")
    print("|---|---|---|---|---|---|")
    results["decode"] = []
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        for ctx in [int(x) for x in args.contexts.split(",")]:
            if b * ctx * per_token > args.max_kv_gib * 2**30:
                continue
            pool = Pool(args, [(ctx - 1, 1)] * b, dev)
            ms = cuda_time_ms(pool.decode, args.iters)
            moved = pool.kv_bytes() + 2 * pool.q.numel() * elem
            gbs = moved / ms / 1e6
            ref_ms = None
            if b * ctx <= 2**20:  # torch_ref gathers a contiguous copy of every context
                ref_ms = cuda_time_ms(pool.torch_ref, max(3, args.iters // 4))
            ref_s = f"{ref_ms:.3f}" if ref_ms is not None else "-"
            print(f"| {b} | {ctx} | {ms:.3f} | {gbs:.0f} | {gbs / copy:.0%} | {ref_s} |")
            results["decode"].append(
                {"batch": b, "context": ctx, "ms": ms, "gbs": gbs, "torch_ref_ms": ref_ms}
            )
            del pool
            torch.cuda.empty_cache()

    print("\n| extend batch | chunk | cached prefix | Triton ms | TFLOP/s |")
    print("|---|---|---|---|---|")
    results["extend"] = []
    for b in (1, 8):
        for chunk in (512, 2048):
            for prefix in (0, 4096):
                pool = Pool(args, [(prefix, chunk)] * b, dev)
                ms = cuda_time_ms(pool.extend, args.iters)
                pairs = b * (chunk * prefix + chunk * (chunk + 1) // 2)
                tflops = 4 * args.heads * args.head_dim * pairs / ms / 1e9
                print(f"| {b} | {chunk} | {prefix} | {ms:.3f} | {tflops:.1f} |")
                results["extend"].append(
                    {"batch": b, "chunk": chunk, "prefix": prefix, "ms": ms, "tflops": tflops}
                )

    print("\n| KV write tokens | Triton ms | GB/s | of copy |")
    print("|---|---|---|---|")
    results["kv_write"] = []
    for tokens in (256, 8192):
        pool = Pool(args, [(0, tokens)], dev)
        ms = cuda_time_ms(pool.write, args.iters)
        gbs = 2 * tokens * per_token / ms / 1e6
        print(f"| {tokens} | {ms:.4f} | {gbs:.0f} | {gbs / copy:.0%} |")
        results["kv_write"].append({"tokens": tokens, "ms": ms, "gbs": gbs})
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.interpret:
        # before any kernel module is imported: Triton decides at decoration time
        os.environ["TRITON_INTERPRET"] = "1"
        args.heads, args.kv_heads, args.head_dim, args.block_size = 6, 2, 32, 4
        ok = check(args, "cpu", small=True)
        return 0 if ok else 1
    if not torch.cuda.is_available():
        print(
            "bench/attention.py: error: no CUDA device; it times kernels with CUDA events. "
            "Run it on a GPU machine, or pass --interpret for a tiny CPU check of the kernels.",
            file=sys.stderr,
        )
        return 2
    results = run_gpu(args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if not results["check_ok"]:
        print("bench/attention.py: a kernel disagrees with torch_ref", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
