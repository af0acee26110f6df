"""Few-row linears: the skinny C kernel against oneDNN's packed weight, SmolLM2-135M shapes.

For each of the decoder's linear shapes (30 layers of q|k|v, o, gate|up and down, and the LM
head), times one call per layer through ``pdserve.model.cpu_linear`` twice, once with the layer's
skinny panels and once through oneDNN only (``PackedLinear(..., skinny=False)``), and prints the
best-of-rounds wall ms and weight GB/s of each, then the totals and their ratio. Every layer has
its own weight, as in the model, so the weights stream from DRAM as in a decode step::

    .venv/bin/python bench/skinny_gemm.py --rows 16 --threads 1
    .venv/bin/python bench/skinny_gemm.py --rows 256 --threads 2
    .venv/bin/python bench/skinny_gemm.py --rows 16 --dtype bfloat16

Exits with status 2 where the kernel cannot run for the dtype (fp32: no AVX-512F; bf16: no
AVX512_BF16; or no C compiler).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable

import torch

from pdserve.model.cpu_linear import PackedLinear, skinny_linear, skinny_reason

# (out, in) of SmolLM2-135M's linears and how many the model has of each
SHAPES = {
    "qkv_proj": ((960, 576), 30),
    "o_proj": ((576, 576), 30),
    "gate_up_proj": ((3072, 576), 30),
    "down_proj": ((576, 1536), 30),
    "lm_head": ((49152, 576), 1),
}


def best_ms(calls: list[Callable[[], object]], rounds: int) -> float:
    """Best wall ms over ``rounds`` of running every call once."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for call in calls:
            call()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=16, help="rows per call (a decode batch)")
    ap.add_argument("--threads", type=int, default=1, help="torch (and kernel) threads")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=30, help="decoder layers (SmolLM2: 30)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    why = skinny_reason(dtype)
    if why is not None:
        print(f"skinny kernel unavailable here: {why}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"# rows {args.rows}, threads {args.threads}, {args.dtype}, best of {args.rounds}")
    total_sk = total_dnn = 0.0
    for name, ((n, k), per_model) in SHAPES.items():
        count = args.layers if per_model > 1 else per_model
        weights = [(torch.randn(n, k, generator=gen) * 0.02).to(dtype) for _ in range(count)]
        x = torch.randn(args.rows, k, generator=gen).to(dtype)
        layers = [PackedLinear(w, None) for w in weights]
        onednn = [PackedLinear(w, None, skinny=False) for w in weights]
        sk_calls = [
            functools.partial(skinny_linear, x, lay.skinny_weight, n, None) for lay in layers
        ]
        dnn_calls = [functools.partial(lay, x) for lay in onednn]
        tol = 1e-4 if dtype == torch.float32 else 2e-2  # bf16: one rounding step
        torch.testing.assert_close(sk_calls[0](), dnn_calls[0](), atol=tol, rtol=tol)
        sk, dnn = best_ms(sk_calls, args.rounds), best_ms(dnn_calls, args.rounds)
        gb = n * k * weights[0].element_size() * count / 1e9
        print(
            f"{name:13s} x{count:<2d} skinny {sk:7.2f} ms ({gb / sk * 1e3:5.1f} GB/s)  "
            f"oneDNN {dnn:7.2f} ms ({gb / dnn * 1e3:5.1f} GB/s)"
        )
        total_sk, total_dnn = total_sk + sk, total_dnn + dnn
    print(
        f"total: skinny {total_sk:.1f} ms, oneDNN {total_dnn:.1f} ms = {total_dnn / total_sk:.2f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
