"""Decode throughput of the DecodeEngine against ``transformers`` batched generate (issue 5).

For each dtype and batch size B, in one run on one machine:

* **engine**: B requests (random ``--prompt-len``-token prompts, greedy unless ``--temperature``,
  ``ignore_eos``; ``--compile`` compiles the decoder as ``pdserve serve`` does) are
  prefilled locally (unified mode), then ``--decode-steps`` decode steps are timed while all B
  sequences decode; step time is the median wall time of ``DecodeEngine.step()`` (scheduling,
  forward, sampling and event delivery included), tokens/s = B / step time.
  Every point is the best of ``--repeats`` runs (the machine may be shared).
* **transformers**: ``generate`` on the same weights (the same GGUF, dequantised by transformers)
  and the same prompts, greedy, with ``max_new_tokens`` = 1 and 1 + S; the per-step time is the
  difference divided by S (the prefill cancels out).
* **floor**: the time one decode step cannot beat on this machine, from two measured rates: bytes
  moved (every weight read once, plus the KV cache read at the mean context length) over the
  measured copy bandwidth, and matmul FLOPs (2 per weight per sequence, plus attention's
  ``4 * context * heads * head_dim`` per layer per sequence) over the measured matmul rate; the
  floor is the larger of the two (a roofline: Williams et al., CACM 2009). The rates and the
  formula are shared with the serving suite (:mod:`pdserve.bench.machine`,
  :func:`pdserve.bench.floors.decode_step_floor_ms`).

Usage::

    .venv/bin/python bench/decode_throughput.py                      # smollm2, fp32 + bf16
    .venv/bin/python bench/decode_throughput.py --dtypes bfloat16 --batch-sizes 1,8 --no-hf

Prints a markdown table (for docs/benchmarks.md); ``--json`` also writes the numbers.
``--profile-steps N`` also prints a ``torch.profiler`` table of N decode steps per point (where a
step's time goes)::

    .venv/bin/python bench/decode_throughput.py --dtypes bfloat16 --batch-sizes 16 --threads 1 \
        --prompt-len 256 --compile --no-hf --profile-steps 10
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decode_worker.engine import DecodeEngine  # noqa: E402
from decode_worker.request import (  # noqa: E402
    DecodeEvent,
    DecodeRequest,
    FinishedEvent,
    TokensEvent,
)
from pdserve.bench.floors import decode_step_floor_ms, model_cost  # noqa: E402
from pdserve.bench.machine import copy_bandwidth_gbs, matmul_gflops  # noqa: E402
from pdserve.config import CacheConfig, EngineConfig, LoadConfig, SchedulerConfig  # noqa: E402
from pdserve.engine.runner import ModelRunner  # noqa: E402
from pdserve.model.resolve import resolve_model  # noqa: E402
from pdserve.sampling_params import SamplingParams  # noqa: E402


@dataclass(frozen=True)
class Row:
    """One (dtype, batch) measurement. Times in ms, throughput in generated tokens/s."""

    dtype: str
    batch: int
    engine_step_ms: float
    engine_tok_s: float
    hf_step_ms: float | None
    hf_tok_s: float | None
    floor_ms: float
    floor_bound: str  # 'memory' | 'compute'


# ------------------------------------------------------------------------------ measurements
def engine_step_ms(
    runner: ModelRunner,
    prompts: list[list[int]],
    steps: int,
    config: EngineConfig,
    temperature: float = 0.0,
    profile_steps: int = 0,
) -> float:
    """Median wall ms of DecodeEngine.step() while all len(prompts) sequences decode.

    ``profile_steps`` > 0: after the timed steps, run that many more under ``torch.profiler`` and
    print its table of ops by self CPU time (ms per step = the total / ``profile_steps``). Work
    outside torch's ops (ctypes calls such as the eager LM head's skinny kernel, Python) shows
    only in the step's wall time, not in the table."""
    engine = DecodeEngine(config, runner=runner)
    first: set[str] = set()
    done: list[str] = []

    def sink(rid: str) -> Callable[[DecodeEvent], None]:
        def put(ev: DecodeEvent) -> None:
            if isinstance(ev, TokensEvent):
                first.add(rid)
            elif isinstance(ev, FinishedEvent):
                done.append(rid)

        return put

    sp = SamplingParams(
        temperature=temperature, max_tokens=steps + 2 + profile_steps, ignore_eos=True
    )
    for i, p in enumerate(prompts):
        engine.add_request(
            DecodeRequest(f"b{i}", tuple(p), sp, prefill_locally=True), sink(f"b{i}")
        )
    while len(first) < len(prompts):  # prefill (maybe several chunked steps) until token 1
        engine.step()
    engine.step()  # warm-up decode step
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        n = engine.step()
        times.append(time.perf_counter() - t0)
        assert n == len(prompts), f"expected a full batch of {len(prompts)}, got {n}"
    if profile_steps:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(profile_steps):
                engine.step()
        print(f"# profile of {profile_steps} decode steps, batch {len(prompts)}", flush=True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20), flush=True)
    engine.run_until_idle()
    assert len(done) == len(prompts)
    engine.check_integrity()
    return statistics.median(times) * 1e3


def hf_step_ms(model: torch.nn.Module, prompts: list[list[int]], steps: int) -> float:
    """Per-step ms of transformers greedy generate: (t(1 + steps) - t(1)) / steps."""
    ids = torch.tensor(prompts, dtype=torch.long)
    mask = torch.ones_like(ids)

    def gen(n: int) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(  # type: ignore[operator]
                ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip
        return time.perf_counter() - t0

    gen(2)  # warm-up
    return max(gen(1 + steps) - gen(1), 0.0) / steps * 1e3


def best_of(repeats: int, fn: Callable[..., float], *args: Any) -> float:
    """The smallest of ``repeats`` results of ``fn(*args)`` (other tenants of a shared machine
    only ever make a measurement slower)."""
    return min(fn(*args) for _ in range(max(1, repeats)))


def load_hf(model_name: str, dtype: torch.dtype) -> torch.nn.Module:
    """The same dense weights in a transformers model.

    A HF directory loads with ``from_pretrained``. A GGUF file is dequantised by pdserve's GGUF
    reader into HF-named tensors and loaded into a ``LlamaForCausalLM`` built from its metadata
    (transformers' own GGUF path here may keep weights quantised with float32 kernels, which
    would not be the same computation). Raises RuntimeError if a weight is left unloaded.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    resolved = resolve_model(model_name)
    if resolved.kind != "gguf":
        return AutoModelForCausalLM.from_pretrained(resolved.hf_dir, dtype=dtype).eval()
    from pdserve.model.gguf_file import GGUFCheckpoint

    ckpt = GGUFCheckpoint(resolved.path)
    mc = ckpt.model_config()
    hf_cfg = LlamaConfig(
        vocab_size=mc.vocab_size,
        hidden_size=mc.hidden_size,
        intermediate_size=mc.intermediate_size,
        num_hidden_layers=mc.num_hidden_layers,
        num_attention_heads=mc.num_attention_heads,
        num_key_value_heads=mc.num_key_value_heads,
        head_dim=mc.head_dim,
        max_position_embeddings=mc.max_position_embeddings,
        rms_norm_eps=mc.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": mc.rope_theta},
        tie_word_embeddings=mc.tie_word_embeddings,
    )
    model = LlamaForCausalLM(hf_cfg)
    missing, unexpected = model.load_state_dict(dict(ckpt.weights(mc)), strict=False)
    allowed = {"lm_head.weight"} if mc.tie_word_embeddings else set()
    if set(missing) - allowed or unexpected:
        raise RuntimeError(f"HF baseline weights: missing {missing}, unexpected {unexpected}")
    if mc.tie_word_embeddings:
        model.tie_weights()
    module: torch.nn.Module = model
    return module.to(dtype).eval()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batch-sizes", default="1,8,32,64")
    ap.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt")
    ap.add_argument("--decode-steps", type=int, default=24, help="timed decode steps")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--repeats", type=int, default=2, help="best of this many runs per point")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="engine sampling temperature (0 = greedy; 1 = what an OpenAI client gets by default)",
    )
    ap.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the engine's decoder, as `pdserve serve` does (no --enforce-eager)",
    )
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="after each point's timing, profile this many decode steps and print the table",
    )
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    bw = copy_bandwidth_gbs()
    print(f"# torch threads {torch.get_num_threads()}; copy bandwidth {bw:.1f} GB/s", flush=True)
    rows: list[Row] = []
    for dtype in args.dtypes.split(","):
        tdt = getattr(torch, dtype)
        rate = matmul_gflops(tdt)
        print(f"# {dtype}: matmul {rate:.0f} GFLOP/s", flush=True)
        max_len = args.prompt_len + args.decode_steps + args.profile_steps + 4
        blocks = max(batches) * (-(-max_len // 16)) + 8
        config = EngineConfig(
            load=LoadConfig(model=args.model, dtype=dtype, torch_compile=args.compile),
            cache=CacheConfig(num_blocks=blocks, enable_prefix_caching=False),
            scheduler=SchedulerConfig(
                max_num_seqs=max(batches),
                max_num_batched_tokens=max(2048, max(batches) * args.prompt_len),
            ),
        )
        runner = ModelRunner(config)
        cost = model_cost(runner.model_config, dtype)
        hf = None if args.no_hf else load_hf(args.model, tdt)
        g = torch.Generator().manual_seed(0)
        vocab = runner.model_config.vocab_size
        for b in batches:
            prompts = torch.randint(0, vocab, (b, args.prompt_len), generator=g).tolist()
            steps = args.decode_steps
            e_ms = best_of(
                args.repeats, engine_step_ms, runner, prompts, steps, config, args.temperature
            )
            if args.profile_steps:
                engine_step_ms(runner, prompts, steps, config, args.temperature, args.profile_steps)
            h_ms = None if hf is None else best_of(args.repeats, hf_step_ms, hf, prompts, steps)
            ctx = args.prompt_len + 1 + args.decode_steps / 2
            f_ms, bound = decode_step_floor_ms(cost, b, ctx, bw, rate)
            row = Row(
                dtype, b, e_ms, b / e_ms * 1e3, h_ms, b / h_ms * 1e3 if h_ms else None,
                f_ms, bound,
            )  # fmt: skip
            rows.append(row)
            print(row, flush=True)
    print()
    print("| dtype | batch | engine step ms | engine tok/s | transformers step ms | "
          "transformers tok/s | floor step ms (bound) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        hs = f"{r.hf_step_ms:.1f}" if r.hf_step_ms is not None else "-"
        ht = f"{r.hf_tok_s:.0f}" if r.hf_tok_s is not None else "-"
        print(f"| {r.dtype} | {r.batch} | {r.engine_step_ms:.1f} | {r.engine_tok_s:.0f} | {hs} | "
              f"{ht} | {r.floor_ms:.1f} ({r.floor_bound}) |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
