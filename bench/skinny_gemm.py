"""Few-row linears: the skinny C kernel against oneDNN's packed weight, SmolLM2-135M shapes.

For each of the decoder's linear shapes (30 layers of q|k|v, o, gate|up and down, and the LM
head), times one call per layer through ``pdserve.model.cpu_linear`` twice, once with the layer's
skinny panels and once through oneDNN only (``PackedLinear(..., skinny=False)``), and prints the
best-of-rounds wall ms and weight GB/s of each, then the totals and their ratio. Every layer has
its own weight, as in the model, so the weights stream from DRAM as in a decode step::

    .venv/bin/python bench/skinny_gemm.py --rows 16 --threads 1
    .venv/bin/python bench/skinny_gemm.py --rows 256 --threads 2
    .venv/bin/python bench/skinny_gemm.py --rows 16 --dtype bfloat16
    .venv/bin/python bench/skinny_gemm.py --rows 8 --gguf-codes

``--gguf-codes`` (fp32): the weights are quantised to GGUF Q4_1 (the LM head to Q8_0, as in the
bundled SmolLM2 file) and dequantised by gguf-py, as pdserve's loader holds them; the layers then
get coded panels (``skinny_pack_codes``), timed against fp32 panels of the same weights
(``skinny_pack``) and oneDNN, the three interleaved round by round; outputs must be bit-equal
between the two kinds of panels.

Exits with status 2 where the kernel cannot run for the dtype (fp32: neither AVX-512F nor AVX2
with FMA; bf16: no AVX512_BF16; or no C compiler).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable

import torch

from pdserve.model.cpu_linear import (
    PackedLinear,
    panels_format,
    skinny_linear,
    skinny_pack,
    skinny_pack_codes,
    skinny_reason,
)

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


def best_each(calls: dict[str, list[Callable[[], object]]], rounds: int) -> dict[str, float]:
    """:func:`best_ms` of each set of calls, the sets interleaved round by round."""
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(rounds):
        for name, group in calls.items():
            best[name] = min(best[name], best_ms(group, 1))
    return best


def gguf_weight(n: int, k: int, qtype: str, gen: torch.Generator) -> torch.Tensor:
    """A random fp32 [n, k] weight quantised to GGUF ``qtype`` and dequantised by gguf-py."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    t = GGMLQuantizationType[qtype]
    x = (torch.randn(n, k, generator=gen) * 0.02).numpy()
    return torch.from_numpy(dequantize(quantize(x, t), t).copy())


def codes_main(args: argparse.Namespace) -> int:
    """--gguf-codes: coded panels against fp32 panels and oneDNN, the same GGUF-valued weights."""
    if skinny_pack_codes(gguf_weight(16, 32, "Q4_1", torch.Generator().manual_seed(0))) is None:
        print(
            "the kernel's weight codes are unavailable here (they need AVX-512F or AVX2 with FMA)",
            file=sys.stderr,
        )
        return 2
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(
        f"# rows {args.rows}, threads {args.threads}, fp32 GGUF-valued weights, best of {args.rounds}"
    )
    totals = {"codes": 0.0, "fp32 panels": 0.0, "oneDNN": 0.0}
    for name, ((n, k), per_model) in SHAPES.items():
        count = args.layers if per_model > 1 else per_model
        qtype = "Q8_0" if name == "lm_head" else "Q4_1"
        weights = [gguf_weight(n, k, qtype, gen) for _ in range(count)]
        x = torch.randn(args.rows, k, generator=gen)
        coded = [PackedLinear(w, None).skinny_weight for w in weights]
        assert all(c is not None and panels_format(c) >= 2 for c in coded)
        plain = [skinny_pack(w) for w in weights]
        onednn = [PackedLinear(w, None, skinny=False) for w in weights]
        calls: dict[str, list[Callable[[], object]]] = {
            "codes": [functools.partial(skinny_linear, x, c, n, None) for c in coded],
            "fp32 panels": [functools.partial(skinny_linear, x, p, n, None) for p in plain],
            "oneDNN": [functools.partial(lay, x) for lay in onednn],
        }
        a, b = calls["codes"][0](), calls["fp32 panels"][0]()
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), "codes changed a bit"
        best = best_each(calls, args.rounds)
        print(
            f"{name:13s} x{count:<2d} {qtype}  "
            + "  ".join(f"{v} {t:7.2f} ms" for v, t in best.items())
        )
        for v, t in best.items():
            totals[v] += t
    print(
        "total: "
        + ", ".join(f"{v} {t:.1f} ms" for v, t in totals.items())
        + f"; fp32 panels / codes = {totals['fp32 panels'] / totals['codes']:.2f}x"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=16, help="rows per call (a decode batch)")
    ap.add_argument("--threads", type=int, default=1, help="torch (and kernel) threads")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=30, help="decoder layers (SmolLM2: 30)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument(
        "--gguf-codes",
        action="store_true",
        help="fp32 GGUF-valued weights: coded panels against fp32 panels and oneDNN",
    )
    args = ap.parse_args(argv)
    if args.gguf_codes:
        if args.dtype != "float32":
            ap.error("--gguf-codes times fp32 weights")
        return codes_main(args)
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
        layers = [PackedLinear(w, None) for w in weights]  # random weights: fp32 panels
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
